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
import gzip
import os
import tarfile
from typing import Optional, Sequence

import ml_collections
import numpy as np


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  num_classes: int
  image_shape: tuple[int, int, int]
  num_train: int
  num_test: int
  flip: bool  # whether horizontal flips keep the label (not for digits)
  system_dirs: tuple[str, ...] = ()


SPECS = {
    "mnist": DatasetSpec(10, (28, 28, 1), 60_000, 10_000, flip=False,
                         system_dirs=("/usr/share/datasets/mnist",)),
    "fashion_mnist": DatasetSpec(
        10, (28, 28, 1), 60_000, 10_000, flip=True,
        system_dirs=("/usr/share/datasets/fashion-mnist",)),
    "cifar10": DatasetSpec(10, (32, 32, 3), 50_000, 10_000, flip=True),
    "cifar100": DatasetSpec(100, (32, 32, 3), 50_000, 10_000, flip=True),
}

CLASS_NAMES = {
    "mnist": [str(digit) for digit in range(10)],
    "fashion_mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                      "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                "horse", "ship", "truck"],
}

_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_CIFAR_ARCHIVES = {"cifar10": "cifar-10-binary.tar.gz",
                   "cifar100": "cifar-100-binary.tar.gz"}
_CIFAR_MEMBERS = {
    "cifar10": {"train": [f"data_batch_{i}.bin" for i in range(1, 6)],
                "test": ["test_batch.bin"]},
    "cifar100": {"train": ["train.bin"], "test": ["test.bin"]},
}


class DatasetUnavailableError(RuntimeError):
  """The dataset could not be loaded; the message lists attempts and fixes."""


class DatasetFormatError(ValueError):
  """A dataset file is corrupt, truncated or of the wrong kind."""


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

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return self.train_images.shape[1:]

  def channel_stats(self) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of the training images, in [0, 255] units."""
    pixels = self.train_images.reshape(-1, self.train_images.shape[-1])
    mean = pixels.mean(axis=0, dtype=np.float64)
    std = np.sqrt(np.mean(np.square(pixels, dtype=np.float64), axis=0) -
                  np.square(mean))
    # A constant channel must not divide by zero (inf/NaN inputs).
    return mean.astype(np.float32), np.maximum(std, 1.0).astype(np.float32)


# ----------------------------------------------------------------- raw files
def _read_maybe_gz(directory: str, stem: str) -> Optional[bytes]:
  for name, opener in ((stem + ".gz", gzip.open), (stem, open)):
    path = os.path.join(directory, name)
    if os.path.exists(path):
      try:
        with opener(path, "rb") as f:
          return f.read()
      except (OSError, EOFError) as e:
        raise DatasetFormatError(f"Cannot read {path}: {e}. The file is "
                                 "corrupt or truncated; download it again.")
  return None


def parse_idx(data: bytes, source: str) -> np.ndarray:
  """Parses an IDX file of unsigned bytes (the MNIST format) into an array."""
  if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
    raise DatasetFormatError(f"{source} is not an IDX file of unsigned bytes.")
  ndim = data[3]
  header = 4 + 4 * ndim
  shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big")
                for i in range(ndim))
  if len(data) != header + int(np.prod(shape)):
    raise DatasetFormatError(
        f"{source} holds {len(data) - header} bytes of data but its header "
        f"announces shape {shape}: the file is truncated or corrupt.")
  return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def _load_idx_split(directory: str, split: str
                    ) -> Optional[tuple[np.ndarray, np.ndarray]]:
  image_stem, label_stem = _IDX_FILES[split]
  image_bytes = _read_maybe_gz(directory, image_stem)
  label_bytes = _read_maybe_gz(directory, label_stem)
  if image_bytes is None or label_bytes is None:
    return None
  images = parse_idx(image_bytes, os.path.join(directory, image_stem))
  labels = parse_idx(label_bytes, os.path.join(directory, label_stem))
  if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
    raise DatasetFormatError(
        f"{directory}: {image_stem} has shape {images.shape} and {label_stem} "
        f"has shape {labels.shape}; expected (N, H, W) images and N labels.")
  return images[..., None], labels.astype(np.int32)


def parse_cifar_records(data: bytes, num_label_bytes: int, source: str
                        ) -> tuple[np.ndarray, np.ndarray]:
  """CIFAR binary records -> (N, 32, 32, 3) uint8, (N,) int32 (last label)."""
  record = num_label_bytes + 3 * 32 * 32
  if not data or len(data) % record:
    raise DatasetFormatError(
        f"{source} has {len(data)} bytes, not a whole number of "
        f"{record}-byte CIFAR records: the file is truncated or corrupt.")
  rows = np.frombuffer(data, np.uint8).reshape(-1, record)
  labels = rows[:, num_label_bytes - 1].astype(np.int32)  # CIFAR-100: fine
  images = rows[:, num_label_bytes:].reshape(-1, 3, 32, 32)
  return np.ascontiguousarray(images.transpose(0, 2, 3, 1)), labels


def _read_cifar_files(directory: str, name: str) -> Optional[dict[str, bytes]]:
  """The needed CIFAR files' bytes, from the archive or an extracted folder.

  Returns None when neither is in `directory`.
  """
  wanted = set(sum(_CIFAR_MEMBERS[name].values(), [])) | {
      "fine_label_names.txt"}
  archive = os.path.join(directory, _CIFAR_ARCHIVES[name])
  if os.path.exists(archive):
    try:
      with tarfile.open(archive, "r:gz") as tar:
        # Member contents are read in memory; nothing is extracted to disk.
        return {os.path.basename(m.name): tar.extractfile(m).read()
                for m in tar.getmembers()
                if m.isfile() and os.path.basename(m.name) in wanted}
    except (tarfile.TarError, OSError, EOFError) as e:
      raise DatasetFormatError(f"Cannot read {archive}: {e}. The archive is "
                               "corrupt or truncated; download it again.")
  for folder in (directory, os.path.join(directory, "cifar-10-batches-bin"),
                 os.path.join(directory, "cifar-100-binary")):
    if os.path.exists(os.path.join(folder, _CIFAR_MEMBERS[name]["test"][0])):
      files = {}
      for member in wanted:
        path = os.path.join(folder, member)
        if os.path.exists(path):
          with open(path, "rb") as f:
            files[member] = f.read()
      return files
  return None


def _load_cifar_split(files: dict[str, bytes], name: str, split: str
                      ) -> tuple[np.ndarray, np.ndarray]:
  parts = []
  for member in _CIFAR_MEMBERS[name][split]:
    if member not in files:
      raise DatasetFormatError(f"The {name} files lack {member}.")
    parts.append(parse_cifar_records(files[member],
                                     2 if name == "cifar100" else 1, member))
  return (np.concatenate([p[0] for p in parts]),
          np.concatenate([p[1] for p in parts]))


def load_raw(name: str, directory: str) -> Optional[Dataset]:
  """Reads the standard raw files of `name` from `directory`, None if absent."""
  spec = SPECS[name]
  class_names = CLASS_NAMES.get(name)
  if name in ("mnist", "fashion_mnist"):
    train, test = (_load_idx_split(directory, s) for s in ("train", "test"))
    if train is None or test is None:
      return None
  else:
    files = _read_cifar_files(directory, name)
    if files is None:
      return None
    train, test = (_load_cifar_split(files, name, s)
                   for s in ("train", "test"))
    if name == "cifar100" and "fine_label_names.txt" in files:
      class_names = files["fine_label_names.txt"].decode().split()
  for split, (images, labels), expected in (("train", train, spec.num_train),
                                            ("test", test, spec.num_test)):
    if images.shape[1:] != spec.image_shape or len(images) != expected:
      raise DatasetFormatError(
          f"{directory}: the {split} split of {name} has {len(images)} images "
          f"of shape {images.shape[1:]}; expected {expected} of shape "
          f"{spec.image_shape}. Files are missing, truncated or of another "
          "dataset.")
    if labels.min() < 0 or labels.max() >= spec.num_classes:
      raise DatasetFormatError(
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
  else:
    dataset = _load_named(config)
  if config.max_train_examples:
    dataset.train_images = dataset.train_images[:config.max_train_examples]
    dataset.train_labels = dataset.train_labels[:config.max_train_examples]
  if config.max_eval_examples:
    dataset.test_images = dataset.test_images[:config.max_eval_examples]
    dataset.test_labels = dataset.test_labels[:config.max_eval_examples]
  return dataset


def _load_named(config: ml_collections.ConfigDict) -> Dataset:
  name, source = config.dataset, config.data_source
  if name not in SPECS:
    raise ValueError(f"config.dataset={name!r} is not supported; choose one "
                     f"of {sorted(SPECS) + ['synthetic']}.")
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
  if name in ("mnist", "fashion_mnist"):
    files = ", ".join(f"{stem}.gz" for pair in _IDX_FILES.values()
                      for stem in pair)
  else:
    files = _CIFAR_ARCHIVES[name]
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
