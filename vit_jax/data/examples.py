"""Per-example work of the streaming pipeline: read, decode, crop.

Everything here runs in the input pipeline's worker processes (grain
spawns them and unpickles these objects there), so this module imports no
JAX. An element is a dict of numpy values:

    image (S, S, C) uint8   label () int32   valid () bool   bad: str

`bad` names a file that could not be decoded ("" if none). A worker never
raises for a bad file: with skip_bad the element is replaced (train) or
masked out (eval), otherwise `error` carries the message and the main
process raises it (streaming.py), so the user sees one clear error rather
than a worker's traceback.
"""

import dataclasses
import os
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np
from PIL import Image

from vit_jax.data import image_decode, order

# How many further examples a training element tries when skipping bad files.
_MAX_SUBSTITUTES = 16


def init_worker(worker_index: int, worker_count: int) -> None:
  """Set-up of each decoding worker process (grain's worker_init_fn).

  * The lowest CPU priority (Linux SCHED_IDLE, else nice 19): the worker
    then decodes in the gaps the train step leaves (its serial parts,
    dispatch) instead of stalling the step's threads, each of which the
    others wait for.
  * It exits when the training process is gone: a run killed with SIGKILL
    runs no clean-up, and its workers would otherwise live on, orphaned,
    holding their memory.
  """
  del worker_index, worker_count
  try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
  except (AttributeError, OSError):
    os.nice(19)
  threading.Thread(target=_exit_with_parent, args=(os.getppid(),),
                   daemon=True).start()


def _exit_with_parent(parent: int, poll_seconds: float = 1.0) -> None:
  while os.getppid() == parent:
    time.sleep(poll_seconds)
  os._exit(0)  # pylint: disable=protected-access


@dataclasses.dataclass(frozen=True)
class FolderExamples:
  """Image files and their labels: example i is (file bytes, label, path)."""
  paths: Sequence[str]
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.paths)

  def read(self, index: int) -> tuple[Any, int, str]:
    path = self.paths[index]
    try:
      with open(path, "rb") as f:
        return f.read(), int(self.labels[index]), path
    except OSError as e:
      raise image_decode.BadImageError(f"{path}: cannot read ({e}).") from e


@dataclasses.dataclass(frozen=True)
class TfdsExamples:
  """A TFDS data source: example i is (decoded array, label, a name)."""
  source: Sequence[Any]
  image_key: str
  label_key: str
  split: str

  def __len__(self) -> int:
    return len(self.source)

  def read(self, index: int) -> tuple[Any, int, str]:
    example = self.source[index]
    return (example[self.image_key], int(example[self.label_key]),
            f"{self.split}[{index}]")


class Subset:
  """`count` examples of `examples` (config.max_*_examples), drawn
  uniformly with a fixed generator and kept in their order: a folder lists
  its files class by class, so its first `count` would be a few classes."""

  def __init__(self, examples: Any, count: int):
    self.examples = examples
    total = len(examples)
    self.indices = (np.arange(total) if count >= total else np.sort(
        np.random.default_rng(0x5B5E7).permutation(total)[:count]))

  def __len__(self) -> int:
    return len(self.indices)

  def read(self, index: int) -> tuple[Any, int, str]:
    return self.examples.read(int(self.indices[index]))


@dataclasses.dataclass(frozen=True)
class Transform:
  """Decoding to (size, size, channels): an Inception crop for training
  (`min_area`), else the centre `crop_fraction` of the shorter side."""
  size: int
  channels: int
  random_crop: bool
  min_area: float = 0.05
  crop_fraction: float = 1.0

  def __call__(self, data: Any, name: str,
               rng: Optional[np.random.Generator]) -> np.ndarray:
    if isinstance(data, np.ndarray):  # TFDS: already decoded
      return self._from_array(data, rng)
    return image_decode.decode(
        data, name, size=self.size, channels=self.channels,
        rng=rng if self.random_crop else None, min_area=self.min_area,
        crop_fraction=self.crop_fraction)

  def blank(self) -> np.ndarray:
    """A black image of the output shape: padding, or a failed decode."""
    return np.zeros((self.size, self.size, self.channels), np.uint8)

  def _from_array(self, array: np.ndarray, rng) -> np.ndarray:
    if array.ndim == 2:
      array = array[:, :, None]
    if array.shape[-1] != self.channels:
      array = (np.repeat(array, self.channels, axis=-1)
               if array.shape[-1] == 1 else
               np.asarray(Image.fromarray(array[..., :3]).convert("L"))[
                   ..., None])
    height, width = array.shape[:2]
    box = (image_decode.inception_box(rng, width, height, self.min_area)
           if self.random_crop else
           image_decode.center_box(width, height, self.crop_fraction))
    image = Image.fromarray(array if self.channels == 3 else array[:, :, 0])
    image = image.resize((self.size, self.size), Image.BILINEAR, box=box)
    return np.asarray(image, np.uint8).reshape(
        self.size, self.size, self.channels)


def _element(image, label, valid, bad="", error=""):
  return {"image": image, "label": np.int32(label), "valid": np.bool_(valid),
          "bad": bad, "error": error}


@dataclasses.dataclass(frozen=True)
class TrainElement:
  """Element `position` of the training stream: row position % per_process
  of this process's block of step position // per_process's global batch,
  in the order of order.train_batch_indices, cropped with a generator
  seeded by (seed, step, row), so every element is a pure function of
  (seed, position) whatever the worker count."""
  examples: Any
  transform: Transform
  global_batch: int
  per_process: int
  process_index: int
  seed: int
  skip_bad: bool

  def __call__(self, position: int) -> dict:
    step, row = divmod(int(position), self.per_process)
    row += self.process_index * self.per_process
    index = int(order.train_batch_indices(
        len(self.examples), self.global_batch, self.seed, step)[row])
    rng = np.random.default_rng([self.seed, step, row, 0x5EED])
    bad = []
    for attempt in range(_MAX_SUBSTITUTES):
      # A bad file is replaced by the next example: deterministic, and the
      # batch keeps its size.
      candidate = (index + attempt) % len(self.examples)
      try:
        data, label, name = self.examples.read(candidate)
        image = self.transform(data, name, rng)
        return _element(image, label, True, bad="\n".join(bad))
      except image_decode.BadImageError as e:
        if not self.skip_bad:
          return _element(self.transform.blank(), 0, False, error=str(e))
        bad.append(str(e))
    message = (f"{_MAX_SUBSTITUTES} consecutive examples from {index} are "
               "unreadable; is this folder images at all?")
    return _element(self.transform.blank(), 0, False, bad="\n".join(bad),
                    error=message)



@dataclasses.dataclass(frozen=True)
class EvalElement:
  """Element `position` of one pass over the test split, padded to whole
  global batches: this process's rows of each; padding and (with skip_bad)
  unreadable files have valid=False."""
  examples: Any
  transform: Transform
  global_batch: int
  per_process: int
  process_index: int
  skip_bad: bool

  def __call__(self, position: int) -> dict:
    batch, row = divmod(int(position), self.per_process)
    index = (batch * self.global_batch + self.process_index * self.per_process
             + row)
    blank = self.transform.blank()
    if index >= len(self.examples):
      return _element(blank, 0, False)
    try:
      data, label, name = self.examples.read(index)
      return _element(self.transform(data, name, None), label, True)
    except image_decode.BadImageError as e:
      if self.skip_bad:
        return _element(blank, 0, False, bad=str(e))
      return _element(blank, 0, False, error=str(e))
