"""Whole datasets as in-memory uint8 arrays, from raw files, TFDS or noise.

Small-image datasets fit in memory, so they are loaded once as
(N, H, W, C) uint8 images and (N,) int32 labels; batching and augmentation
happen later (input_pipeline.py, augment.py).

Sources, in the order `data_source="auto"` tries them:
  1. raw files: the IDX files of MNIST / Fashion-MNIST (`.gz` or not) and
     CIFAR's binary version (`cifar-10-binary.tar.gz`,
     `cifar-100-binary.tar.gz`, or their extracted folders), read with numpy
     from `raw_data_dir` or a known system path (Debian's
     `dataset-fashion-mnist` installs /usr/share/datasets/fashion-mnist);
  2. tensorflow-datasets, read through `tfds.data_source` (array_record, no
     TensorFlow needed), preparing the dataset first when allowed.
"""

import dataclasses
from typing import Iterator, Optional, Sequence

import jax
import ml_collections
import numpy as np

from vit_jax.data import input_pipeline, raw_files


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  num_classes: int
  image_shape: tuple[int, int, int]
  num_train: int
  num_test: int
  flip: bool  # whether horizontal flips keep the label (not for digits)
  raw_format: str  # "idx" (MNIST-style files) or "cifar" (binary records)
  system_dirs: tuple[str, ...] = ()


SPECS = {
    "mnist": DatasetSpec(10, (28, 28, 1), 60_000, 10_000, flip=False,
                         raw_format="idx",
                         system_dirs=("/usr/share/datasets/mnist",)),
    "fashion_mnist": DatasetSpec(
        10, (28, 28, 1), 60_000, 10_000, flip=True, raw_format="idx",
        system_dirs=("/usr/share/datasets/fashion-mnist",)),
    "cifar10": DatasetSpec(10, (32, 32, 3), 50_000, 10_000, flip=True,
                           raw_format="cifar"),
    "cifar100": DatasetSpec(100, (32, 32, 3), 50_000, 10_000, flip=True,
                            raw_format="cifar"),
}

CLASS_NAMES = {
    "mnist": [str(digit) for digit in range(10)],
    "fashion_mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                      "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                "horse", "ship", "truck"],
}


class DatasetUnavailableError(RuntimeError):
  """The dataset could not be loaded; the message lists attempts and fixes."""


@dataclasses.dataclass
class Dataset:
  """A dataset held in memory. Images (N, H, W, C) uint8, labels (N,) int32."""
  name: str
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int
  class_names: list[str]
  flip: bool
  source: str  # where it was read from, for the log

  crops_on_host = False  # every crop is the train step's, on device

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return self.train_images.shape[1:]

  @property
  def num_train(self) -> int:
    return len(self.train_images)

  @property
  def num_test(self) -> int:
    return len(self.test_images)

  def train_batches(self, batch_size: int, seed: int, start_step: int,
                    mesh: jax.sharding.Mesh
                    ) -> Iterator[tuple[jax.Array, jax.Array]]:
    """(images, labels) global batches for steps start_step, +1, ..."""
    return input_pipeline.train_batches(
        self.train_images, self.train_labels, batch_size, seed, start_step,
        mesh)

  def eval_batches(self, batch_size: int, mesh: jax.sharding.Mesh
                   ) -> Iterator[tuple[jax.Array, jax.Array, jax.Array]]:
    """(images, labels, mask) covering every test example once."""
    return input_pipeline.eval_batches(self.test_images, self.test_labels,
                                       batch_size, mesh)

  def test_examples(self, indices) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) of the test examples `indices`."""
    indices = np.asarray(indices, np.int64)
    return self.test_images[indices], self.test_labels[indices]

  def channel_stats(self) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of the training images, in [0, 255] units."""
    # From a 256-bin histogram per channel: exact, and no float copy of the
    # whole dataset (1.2 GB for CIFAR-10 in float64).
    pixels = self.train_images.reshape(-1, self.train_images.shape[-1])
    values = np.arange(256, dtype=np.float64)
    counts = np.stack([np.bincount(pixels[:, c], minlength=256)
                       for c in range(pixels.shape[1])]).astype(np.float64)
    total = counts.sum(axis=1)
    mean = counts @ values / total
    std = np.sqrt(counts @ np.square(values) / total - np.square(mean))
    # A constant channel must not divide by zero (inf/NaN inputs).
    return mean.astype(np.float32), np.maximum(std, 1.0).astype(np.float32)


# ----------------------------------------------------------------- raw files
def load_raw(name: str, directory: str) -> Optional[Dataset]:
  """Reads the standard raw files of `name` from `directory`, None if absent."""
  spec = SPECS[name]
  class_names = CLASS_NAMES.get(name)
  if spec.raw_format == "idx":
    train, test = (raw_files.read_idx_split(directory, s)
                   for s in ("train", "test"))
    if train is None or test is None:
      return None
  else:
    files = raw_files.read_cifar_files(directory, name)
    if files is None:
      return None
    train, test = (raw_files.cifar_split(files, name, s)
                   for s in ("train", "test"))
    if name == "cifar100" and "fine_label_names.txt" in files:
      class_names = files["fine_label_names.txt"].decode().split()
  for split, (images, labels), expected in (("train", train, spec.num_train),
                                            ("test", test, spec.num_test)):
    if images.shape[1:] != spec.image_shape or len(images) != expected:
      raise raw_files.DatasetFormatError(
          f"{directory}: the {split} split of {name} has {len(images)} images "
          f"of shape {images.shape[1:]}; expected {expected} of shape "
          f"{spec.image_shape}. Files are missing, truncated or of another "
          "dataset.")
    if labels.min() < 0 or labels.max() >= spec.num_classes:
      raise raw_files.DatasetFormatError(
          f"{directory}: {split} labels of {name} span {labels.min()}.."
          f"{labels.max()}, outside 0..{spec.num_classes - 1}.")
  return Dataset(name, *train, *test, spec.num_classes,
                 class_names or [str(i) for i in range(spec.num_classes)],
                 spec.flip, source=f"raw files in {directory}")


# ---------------------------------------------------------------------- TFDS
def load_tfds(name: str, data_dir: Optional[str], manual_dir: Optional[str],
              download: bool) -> Dataset:
  """Reads a TFDS dataset into memory through `tfds.data_source`."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder(name, data_dir=data_dir)
  if not builder.is_prepared():
    if not download:
      raise FileNotFoundError(f"{name} is not prepared in {builder.data_dir}")
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
  spec = SPECS[name]
  arrays = {}
  for split in ("train", "test"):
    source = builder.as_data_source(split=split)
    images = np.empty((len(source),) + spec.image_shape, np.uint8)
    labels = np.empty((len(source),), np.int32)
    for index in range(len(source)):  # decoding dominates; reads are cheap
      example = source[index]
      images[index] = example["image"]
      labels[index] = example["label"]
    arrays[split] = (images, labels)
  class_names = builder.info.features["label"].names
  return Dataset(name, *arrays["train"], *arrays["test"], spec.num_classes,
                 list(class_names), spec.flip,
                 source=f"TFDS {name} in {builder.data_dir}")


# ----------------------------------------------------------------- synthetic
def make_synthetic(num_train: int, num_eval: int, image_size: int,
                   channels: int, num_classes: int, seed: int = 0) -> Dataset:
  """Learnable noise: each class is a fixed random pattern plus noise."""
  rng = np.random.default_rng(seed)
  templates = rng.uniform(0, 255, (num_classes, image_size, image_size,
                                   channels))

  def draw(count):
    labels = rng.integers(0, num_classes, count).astype(np.int32)
    noise = rng.normal(0, 40, (count, image_size, image_size, channels))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    return images, labels

  return Dataset("synthetic", *draw(num_train), *draw(num_eval), num_classes,
                 [f"class_{i}" for i in range(num_classes)], flip=False,
                 source="synthetic")


# ------------------------------------------------------------------- entry
def load(config: ml_collections.ConfigDict) -> Dataset:
  """Loads `config.dataset` from the configured sources, or explains why not."""
  name = config.dataset
  if name == "synthetic":
    s = config.synthetic
    dataset = make_synthetic(s.num_train, s.num_eval, s.image_size,
                             s.channels, s.num_classes, seed=config.seed)
  elif name in SPECS:
    dataset = _load_named(config)
  else:
    # Imported here: grain and PIL are needed only for these datasets.
    from vit_jax.data import file_sources  # pylint: disable=g-import-not-at-top
    return file_sources.open_dataset(config)  # max_*_examples applied
  if config.max_train_examples:
    dataset.train_images = dataset.train_images[:config.max_train_examples]
    dataset.train_labels = dataset.train_labels[:config.max_train_examples]
  if config.max_eval_examples:
    dataset.test_images = dataset.test_images[:config.max_eval_examples]
    dataset.test_labels = dataset.test_labels[:config.max_eval_examples]
  return dataset


def _load_named(config: ml_collections.ConfigDict) -> Dataset:
  name, source = config.dataset, config.data_source
  if source not in ("auto", "raw", "tfds"):
    raise ValueError(f"config.data_source={source!r}; choose auto, raw or "
                     "tfds.")
  tried = []
  if source in ("auto", "raw"):
    directories = ([config.raw_data_dir] if config.raw_data_dir else
                   list(SPECS[name].system_dirs))
    for directory in directories:
      dataset = load_raw(name, directory)
      if dataset is not None:
        return dataset
      tried.append(f"raw files in {directory}: not found")
    if not directories:
      tried.append("raw files: no --config.raw_data_dir given")
  if source in ("auto", "tfds"):
    try:
      return load_tfds(name, config.data_dir, config.manual_dir,
                       download=config.tfds_download)
    except Exception as e:  # pylint: disable=broad-except
      first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
      tried.append(f"TFDS (data_dir={config.data_dir or 'default'}): "
                   f"{type(e).__name__}: {first_line[:300]}")
  raise DatasetUnavailableError(_unavailable_message(name, tried))


def _unavailable_message(name: str, tried: Sequence[str]) -> str:
  if SPECS[name].raw_format == "idx":
    files = ", ".join(f"{stem}.gz" for pair in raw_files.IDX_FILES.values()
                      for stem in pair)
  else:
    files = raw_files.CIFAR_ARCHIVES[name]
  return "\n".join(
      [f"Could not load dataset {name!r}. Tried:"] +
      [f"  - {attempt}" for attempt in tried] + [
          "Fix it with one of:",
          f"  --config.raw_data_dir=DIR   a folder holding {files}",
          "  --config.data_dir=DIR       a TFDS data_dir where the dataset is "
          "prepared (on a machine with network: pip install '.[prepare]' "
          "lets TFDS download and prepare it)",
          "  --config.dataset=synthetic  generated data, for smoke tests",
      ] + (["  apt-get install dataset-fashion-mnist   (Debian: installs "
            "the raw files in /usr/share/datasets/fashion-mnist)"]
           if name == "fashion_mnist" else []))
