"""Datasets too big for memory, streamed from files through grain.

    element position p  --(examples.TrainElement, in a worker)-->  decoded
    image at the training resolution  --batch-->  uint8 batch  --here-->
    global jax.Array on the mesh, `prefetch` steps ahead

grain (`grain.MapDataset`) runs the per-example work in worker processes
(`config.data_workers`; 0 decodes in this process). The stream is indexed
by position, and every element is a pure function of (seed, position)
(examples.py), so a run resumed at step s reads exactly the batches an
uninterrupted run would have read, with no iterator state to checkpoint,
and the result does not depend on the number of workers. Each process
decodes only its own rows of every global batch.

Random-resized crops happen in the workers, on the full-size file; the
colour augmentation, RandAugment and Mixup/CutMix stay on device
(augment.py), as for in-memory data.
"""

import collections
import dataclasses
from typing import Any, Iterator, Optional

import jax
import numpy as np
from absl import flags as absl_flags

from vit_jax.data import examples as examples_lib
from vit_jax.data import image_decode
from vit_jax.runtime import cpu_info
from vit_jax.runtime import sharding
from vit_jax.training import metric_writer

# Training images sampled for the "dataset" normalisation's statistics.
_STATS_SAMPLE = 512


def default_workers() -> int:
  """Half the cores this process may use (the other half runs the step),
  at least 1, at most 16."""
  return max(1, min(16, cpu_info.cpu_cores() // 2))


@dataclasses.dataclass
class StreamingDataset:
  """A dataset read from files as it trains; the interface of
  datasets.Dataset (train_batches, eval_batches, test_examples, ...)."""
  name: str
  train: Any  # examples.FolderExamples or examples.TfdsExamples
  test: Any
  num_classes: int
  class_names: list[str]
  flip: bool
  source: str
  image_size: int
  channels: int
  random_crop: bool  # Inception crop in the workers (else the whole image)
  min_area: float = 0.05
  eval_crop_fraction: float = 0.875
  skip_bad: bool = False
  workers: int = 1
  crops_on_host = True  # the trainer turns the on-device crop off

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return (self.image_size, self.image_size, self.channels)

  @property
  def num_train(self) -> int:
    return len(self.train)

  @property
  def num_test(self) -> int:
    return len(self.test)

  def _transform(self, train: bool) -> examples_lib.Transform:
    return examples_lib.Transform(
        self.image_size, self.channels, random_crop=train and self.random_crop,
        min_area=self.min_area,
        crop_fraction=1.0 if train else self.eval_crop_fraction)

  def _stream(self, element_fn, start: int, stop: int, per_process: int):
    import grain  # pylint: disable=g-import-not-at-top  # 1.7 s; only here
    if not absl_flags.FLAGS.is_parsed():
      # grain's workers read its absl flags; a program that parses none
      # (a notebook, pytest, a script of one's own) takes their defaults.
      absl_flags.FLAGS.mark_as_parsed()
    dataset = (grain.MapDataset.range(start, stop).map(element_fn)
               .batch(per_process, drop_remainder=True))
    # Threads within a worker would only fight over its GIL.
    iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0))
    # Batches travel through the workers' pipe, not shared memory: grain
    # frees shared memory lazily, and a run's last prefetched batches were
    # reported as "leaked shared_memory objects" at exit. The copy is cheap
    # beside a CPU step (a 224 px batch of 256 is 38 MB); on a fast
    # accelerator it is a cost to measure before relying on it.
    iterable = grain.experimental.WithOptionsIterDataset(
        iterable, grain.experimental.DatasetOptions(min_shm_size=2**62))
    if self.workers > 0:
      iterable = iterable.mp_prefetch(
          grain.MultiprocessingOptions(num_workers=self.workers,
                                       per_worker_buffer_size=2),
          worker_init_fn=examples_lib.init_worker)
    return iter(iterable)

  def train_batches(self, batch_size: int, seed: int, start_step: int,
                    mesh: jax.sharding.Mesh, prefetch: int = 2
                    ) -> Iterator[tuple[jax.Array, jax.Array]]:
    """Yields (images, labels) global batches for steps start_step, +1, ..."""
    per_process = batch_size // jax.process_count()
    element = examples_lib.TrainElement(
        self.train, self._transform(train=True), batch_size, per_process,
        jax.process_index(), seed, self.skip_bad)
    batches = self._stream(element, start_step * per_process, 2**62,
                           per_process)
    skipped = SkipCounter(self.num_train // batch_size)
    queue = collections.deque()
    step = start_step
    try:
      while True:
        while len(queue) <= prefetch:
          batch = next(batches)
          raise_errors(batch)
          skipped.add(step, batch["bad"])
          queue.append((sharding.to_global_batch(mesh, batch["image"]),
                        sharding.to_global_batch(mesh, batch["label"])))
          step += 1
        yield queue.popleft()
    finally:
      _close(batches)

  def eval_batches(self, batch_size: int, mesh: jax.sharding.Mesh
                   ) -> Iterator[tuple[jax.Array, jax.Array, jax.Array]]:
    """Yields (images, labels, mask) covering every test example once."""
    per_process = batch_size // jax.process_count()
    num_batches = -(-self.num_test // batch_size)
    element = examples_lib.EvalElement(
        self.test, self._transform(train=False), batch_size, per_process,
        jax.process_index(), self.skip_bad)
    batches = self._stream(element, 0, num_batches * per_process, per_process)
    bad = []
    try:
      for batch in batches:
        raise_errors(batch)
        bad.extend(name for name in batch["bad"] if name)
        yield tuple(sharding.to_global_batch(mesh, batch[key]) for key in
                    ("image", "label")) + (sharding.to_global_batch(
                        mesh, batch["valid"].astype(np.float32)),)
    finally:
      _close(batches)
    if bad:
      metric_writer.log(f"Evaluation skipped {len(bad)} unreadable test "
                        f"image(s): {_first_lines(bad)}")

  def test_examples(self, indices) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) of the test examples `indices`, as evaluated."""
    element = examples_lib.EvalElement(
        self.test, self._transform(train=False), 1, 1, 0,
        skip_bad=False)
    items = [element(int(i)) for i in indices]
    raise_errors({"error": [item["error"] for item in items]})
    return (np.stack([item["image"] for item in items]),
            np.asarray([item["label"] for item in items], np.int32))

  def channel_stats(self) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (0-255) of up to 512 training images spread
    evenly over the split, decoded as for evaluation."""
    count = min(_STATS_SAMPLE, self.num_train)
    indices = np.linspace(0, self.num_train - 1, count).astype(int)
    transform = self._transform(train=False)
    pixels = []
    for index in indices:
      try:
        data, _, name = self.train.read(int(index))
        pixels.append(transform(data, name, None).reshape(-1, self.channels))
      except image_decode.BadImageError:
        if not self.skip_bad:
          raise
    pixels = np.concatenate(pixels).astype(np.float64)
    return (pixels.mean(0).astype(np.float32),
            np.maximum(pixels.std(0), 1.0).astype(np.float32))


class SkipCounter:
  """Counts the files a training stream skipped; reports each epoch's."""

  def __init__(self, steps_per_epoch: int):
    self.steps_per_epoch = max(1, steps_per_epoch)
    self.names: list[str] = []

  def add(self, step: int, bad_column: np.ndarray) -> None:
    for entry in bad_column:
      if entry:
        self.names.extend(str(entry).split("\n"))
    if (step + 1) % self.steps_per_epoch == 0 and self.names:
      epoch = (step + 1) // self.steps_per_epoch
      metric_writer.log(
          f"Epoch {epoch}: skipped {len(self.names)} unreadable training "
          f"image(s) (skip_bad_images=True): {_first_lines(self.names)}")
      self.names = []


def _first_lines(names: list[str], count: int = 3) -> str:
  shown = "; ".join(names[:count])
  return shown + (f"; and {len(names) - count} more" if len(names) > count
                  else "")


def raise_errors(batch: dict) -> None:
  """Raises the first decoding error in batch["error"], with the fix."""
  errors = [str(e) for e in batch["error"] if e]
  if errors:
    raise image_decode.BadImageError(
        f"{errors[0]} Remove or replace the file, or set "
        "--config.skip_bad_images=True to skip unreadable images (they are "
        "counted and reported each epoch).")


def _close(iterator: Optional[Any]) -> None:
  close = getattr(iterator, "close", None)
  if close is not None:
    close()
