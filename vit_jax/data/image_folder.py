"""An image folder in the ImageNet / torchvision `ImageFolder` layout.

    root/train/<class>/*.jpg     root/test/<class>/*.png   (or val/, validation/)

Class names are the sorted folder names of the training split; label i is
the i-th of them. A root without a test split gets a deterministic held-out
split: `holdout_fraction` of each class's files (sorted by name, then
shuffled with the seed), so the same root and seed always hold out the same
files. Only file names are read here; decoding is image_decode.py's.
"""

import dataclasses
import os
from typing import Optional

import numpy as np

from vit_jax.data import raw_files

# Extensions PIL decodes that hold photos; other files are not images.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif",
                    ".tif", ".tiff")
TRAIN_SPLITS = ("train",)
TEST_SPLITS = ("test", "val", "validation")


@dataclasses.dataclass(frozen=True)
class FileList:
  """The files of one split and their labels (int32, class indices)."""
  paths: tuple[str, ...]
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.paths)


@dataclasses.dataclass(frozen=True)
class ImageFolder:
  """A scanned folder: both splits and the class names."""
  root: str
  class_names: tuple[str, ...]
  train: FileList
  test: FileList
  test_source: str  # "test/", "val/", ... or "held out 10% of train/"


def looks_like_folder(name: str) -> bool:
  """Whether config.dataset names a folder rather than a dataset."""
  return os.sep in name or name.startswith((".", "~")) or os.path.isdir(name)


def _split_dir(root: str, names: tuple[str, ...]) -> Optional[str]:
  for name in names:
    path = os.path.join(root, name)
    if os.path.isdir(path):
      return path
  return None


def _class_dirs(split_dir: str) -> list[str]:
  return sorted(entry.name for entry in os.scandir(split_dir)
                if entry.is_dir() and not entry.name.startswith("."))


def _image_files(class_dir: str) -> list[str]:
  """Sorted image files below class_dir (sub-folders included)."""
  found = []
  for parent, dirs, files in os.walk(class_dir, followlinks=True):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    found.extend(os.path.join(parent, f) for f in files
                 if f.lower().endswith(IMAGE_EXTENSIONS)
                 and not f.startswith("."))
  return sorted(found)


def _scan_split(split_dir: str, class_names: tuple[str, ...]) -> FileList:
  paths, labels = [], []
  for label, name in enumerate(class_names):
    files = _image_files(os.path.join(split_dir, name))
    if not files:
      raise raw_files.DatasetFormatError(
          f"{os.path.join(split_dir, name)} holds no images (looked for "
          f"{', '.join(IMAGE_EXTENSIONS)}). Put the class's images there "
          "or remove the empty folder.")
    paths.extend(files)
    labels.extend([label] * len(files))
  return FileList(tuple(paths), np.asarray(labels, np.int32))


def _hold_out(files: FileList, fraction: float, seed: int, num_classes: int
              ) -> tuple[FileList, FileList]:
  """(train, held-out) with `fraction` of each class held out (at least 1)."""
  rng = np.random.default_rng([seed, 0x401D])
  keep, held = [], []
  for label in range(num_classes):
    members = np.flatnonzero(files.labels == label)
    if len(members) < 2:
      raise raw_files.DatasetFormatError(
          f"Class {label} has {len(members)} image(s): too few to hold some "
          "out for testing. Add images or a test/ folder.")
    members = rng.permutation(members)
    count = min(len(members) - 1, max(1, round(fraction * len(members))))
    held.extend(members[:count])
    keep.extend(members[count:])

  def subset(indices):
    indices = np.sort(np.asarray(indices))
    return FileList(tuple(files.paths[i] for i in indices),
                    files.labels[indices])

  return subset(keep), subset(held)


def scan(root: str, holdout_fraction: float = 0.1, seed: int = 0
         ) -> ImageFolder:
  """Scans `root`; raises DatasetFormatError naming what is wrong and the fix.

  root/train/<class>/ must exist (or root/<class>/ directly, which is then
  all training data); the test split is root/test, val or validation, else
  `holdout_fraction` of the training files.
  """
  root = os.path.abspath(os.path.expanduser(root))
  if not os.path.isdir(root):
    raise FileNotFoundError(
        f"config.dataset={root!r}: no such folder. Give a folder holding "
        "train/<class>/ images (and test/<class>/ or val/<class>/), or a "
        "dataset name.")
  train_dir = _split_dir(root, TRAIN_SPLITS) or root
  class_names = tuple(_class_dirs(train_dir))
  if not class_names:
    raise raw_files.DatasetFormatError(
        f"{train_dir} has no class folders: expected {root}/train/<class>/"
        "<image files> (one folder per class, named after it).")
  train = _scan_split(train_dir, class_names)
  test_dir = _split_dir(root, TEST_SPLITS) if train_dir != root else None
  if test_dir is None:
    if not 0.0 < holdout_fraction < 1.0:
      raise ValueError(
          f"{root} has no test/, val/ or validation/ folder and "
          f"config.holdout_fraction={holdout_fraction} holds nothing out; "
          "set it in (0, 1) or add a test split.")
    train, test = _hold_out(train, holdout_fraction, seed, len(class_names))
    return ImageFolder(root, class_names, train, test,
                       f"held out {holdout_fraction:.0%} of "
                       f"{os.path.basename(train_dir) or root}/")
  test_classes = tuple(_class_dirs(test_dir))
  if test_classes != class_names:
    only_train = sorted(set(class_names) - set(test_classes))
    only_test = sorted(set(test_classes) - set(class_names))
    raise raw_files.DatasetFormatError(
        f"The classes of {test_dir} differ from those of {train_dir}: only "
        f"in training {only_train[:5]}, only in test {only_test[:5]}. Both "
        "splits need the same class folders.")
  return ImageFolder(root, class_names, train,
                     _scan_split(test_dir, class_names),
                     os.path.basename(test_dir) + "/")
