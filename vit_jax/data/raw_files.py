"""Readers for the standard raw files of MNIST-style and CIFAR datasets.

* IDX files (MNIST, Fashion-MNIST): `train-images-idx3-ubyte[.gz]` etc.
* CIFAR's binary version: `cifar-10-binary.tar.gz`, `cifar-100-binary.tar.gz`
  or their extracted folders.

Everything is parsed with numpy from bytes; nothing is unpickled and nothing
is extracted to disk. Corrupt or truncated files raise DatasetFormatError
naming the file.
"""

import gzip
import os
import tarfile
from typing import Optional

import numpy as np

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR_ARCHIVES = {"cifar10": "cifar-10-binary.tar.gz",
                  "cifar100": "cifar-100-binary.tar.gz"}
CIFAR_MEMBERS = {
    "cifar10": {"train": [f"data_batch_{i}.bin" for i in range(1, 6)],
                "test": ["test_batch.bin"]},
    "cifar100": {"train": ["train.bin"], "test": ["test.bin"]},
}


class DatasetFormatError(ValueError):
  """A dataset file is corrupt, truncated or of the wrong kind."""


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


def read_idx_split(directory: str, split: str
                   ) -> Optional[tuple[np.ndarray, np.ndarray]]:
  """(N, H, W, 1) uint8 images and (N,) int32 labels, or None if absent."""
  image_stem, label_stem = IDX_FILES[split]
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


def read_cifar_files(directory: str, name: str) -> Optional[dict[str, bytes]]:
  """The needed CIFAR files' bytes, from the archive or an extracted folder.

  Returns None when neither is in `directory`.
  """
  wanted = set(sum(CIFAR_MEMBERS[name].values(), [])) | {
      "fine_label_names.txt"}
  archive = os.path.join(directory, CIFAR_ARCHIVES[name])
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
    if os.path.exists(os.path.join(folder, CIFAR_MEMBERS[name]["test"][0])):
      files = {}
      for member in wanted:
        path = os.path.join(folder, member)
        if os.path.exists(path):
          with open(path, "rb") as f:
            files[member] = f.read()
      return files
  return None


def cifar_split(files: dict[str, bytes], name: str, split: str
                ) -> tuple[np.ndarray, np.ndarray]:
  """One split of CIFAR-10/100 from `read_cifar_files` output."""
  parts = []
  for member in CIFAR_MEMBERS[name][split]:
    if member not in files:
      raise DatasetFormatError(f"The {name} files lack {member}.")
    parts.append(parse_cifar_records(files[member],
                                     2 if name == "cifar100" else 1, member))
  return (np.concatenate([p[0] for p in parts]),
          np.concatenate([p[1] for p in parts]))
