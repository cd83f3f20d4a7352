r"""Writes an in-memory dataset out as an image folder (ImageFolder layout).

  python -m vit_jax.data.export_folder --dataset=fashion_mnist \
      --output=/tmp/fashion_mnist_folder [--format=png] [--max_per_split=N]

Gives OUTPUT/train/<class>/<index>.png and OUTPUT/test/<class>/..., the
layout `--config.dataset=OUTPUT` trains on: a way to try the folder path on
real data offline, and to look at a dataset's images. Class folder names
are the class names made safe for file systems ("T-shirt/top" becomes
"T-shirt_top"); they sort in the same order as the original labels only if
the names do, so compare accuracies, not label indices, across the two.
"""

import os
import re

from absl import app, flags
import numpy as np
from PIL import Image

from vit_jax import config as config_lib
from vit_jax.data import datasets

_DATASET = flags.DEFINE_string("dataset", "fashion_mnist",
                               "mnist, fashion_mnist, cifar10 or cifar100.")
_OUTPUT = flags.DEFINE_string("output", None, "Folder to write.")
_FORMAT = flags.DEFINE_enum("format", "png", ["png", "jpg", "webp"],
                            "Image file format (JPEG at quality 95).")
_MAX = flags.DEFINE_integer("max_per_split", None,
                            "Write at most this many images per split.")
_RAW_DIR = flags.DEFINE_string("raw_data_dir", None,
                               "Where the raw files are, as config's.")


def safe_name(name: str) -> str:
  """A class name as a folder name: path separators and oddities -> '_'."""
  return re.sub(r"[^\w.+-]+", "_", name).strip("._") or "class"


def write_split(images: np.ndarray, labels: np.ndarray,
                class_names: list[str], folder: str, fmt: str) -> int:
  """Writes (N, H, W, C) uint8 images under folder/<class>/; returns N."""
  names = [safe_name(n) for n in class_names]
  for name in set(names):
    os.makedirs(os.path.join(folder, name), exist_ok=True)
  options = {"quality": 95} if fmt == "jpg" else {}
  for index, (image, label) in enumerate(zip(images, labels)):
    pixels = image[:, :, 0] if image.shape[-1] == 1 else image
    Image.fromarray(pixels).save(
        os.path.join(folder, names[label], f"{index:06d}.{fmt}"), **options)
  return len(images)


def main(argv):
  del argv
  if not _OUTPUT.value:
    raise app.UsageError("--output=FOLDER is required.")
  config = config_lib.base_config()
  config.dataset = _DATASET.value
  config.raw_data_dir = _RAW_DIR.value
  config.max_train_examples = _MAX.value
  config.max_eval_examples = _MAX.value
  dataset = datasets.load(config)
  for split, images, labels in (
      ("train", dataset.train_images, dataset.train_labels),
      ("test", dataset.test_images, dataset.test_labels)):
    count = write_split(images, labels, dataset.class_names,
                        os.path.join(_OUTPUT.value, split), _FORMAT.value)
    print(f"{split}: {count} images in {os.path.join(_OUTPUT.value, split)}")


if __name__ == "__main__":
  app.run(main)
