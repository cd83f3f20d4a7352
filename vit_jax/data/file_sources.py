"""Folder and TFDS datasets: opened, then streamed or held in memory.

`config.dataset` is a folder (image_folder.py) or any TFDS image-
classification name (tfds_source.py); the four small named datasets keep
their own in-memory loaders (datasets.py). Both kinds are decoded at the
training resolution, config.image_size (224 if unset), with
config.channels channels (3 if unset: grayscale, palette, RGBA, CMYK and
16-bit images are converted).

Streamed or in memory (`config.data_pipeline`):
  "stream"  decoded by grain's worker processes as training goes
            (streaming.py); memory does not grow with the dataset;
  "memory"  every image decoded once here (the whole image, its central
            square, resized to image_size) and held as uint8 arrays, the
            fast path of the small datasets; crops then happen on device;
  "auto"    memory when the decoded dataset is at most
            config.in_memory_max_mib (images x image_size^2 x channels
            bytes, known from the file count before decoding anything),
            else stream.
"""

import ml_collections
import numpy as np

from vit_jax.data import datasets, examples, image_folder, streaming
from vit_jax.data import tfds_source
from vit_jax.training import metric_writer

PIPELINES = ("auto", "memory", "stream")
DEFAULT_IMAGE_SIZE = 224


def image_shape(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
  """(S, S, C) a folder or TFDS dataset is decoded at, known from config."""
  size = config.image_size or DEFAULT_IMAGE_SIZE
  return (size, size, config.channels or 3)


def open_dataset(config: ml_collections.ConfigDict):
  """The dataset config.dataset names: a streaming.StreamingDataset, or a
  datasets.Dataset held in memory (see the module docstring)."""
  size, _, channels = image_shape(config)
  name = config.dataset
  if image_folder.looks_like_folder(name):
    folder = image_folder.scan(name, config.holdout_fraction, config.seed)
    train = examples.FolderExamples(folder.train.paths, folder.train.labels)
    test = examples.FolderExamples(folder.test.paths, folder.test.labels)
    class_names = list(folder.class_names)
    source = f"the folder {folder.root} (test: {folder.test_source})"
    name = folder.root.rstrip("/").rsplit("/", 1)[-1]
  else:
    opened = tfds_source.open_tfds(name, config.data_dir, config.manual_dir,
                                   download=config.tfds_download)
    train = examples.TfdsExamples(opened.train, opened.image_key,
                                  opened.label_key, "train")
    test = examples.TfdsExamples(opened.test, opened.image_key,
                                 opened.label_key, opened.test_split)
    class_names = list(opened.class_names)
    source = f"TFDS {name} in {opened.data_dir} (test: {opened.test_split})"
  if config.max_train_examples:
    train = examples.Subset(train, config.max_train_examples)
  if config.max_eval_examples:
    test = examples.Subset(test, config.max_eval_examples)
  crop_fraction = config.eval_crop_fraction or (
      0.875 if config.random_resized_crop else 1.0)
  stream = streaming.StreamingDataset(
      name=name, train=train, test=test, num_classes=len(class_names),
      class_names=class_names,
      flip=True if config.random_flip is None else config.random_flip,
      source=source, image_size=size, channels=channels,
      random_crop=config.random_resized_crop,
      min_area=config.min_crop_area, eval_crop_fraction=crop_fraction,
      skip_bad=config.skip_bad_images,
      workers=(streaming.default_workers() if config.data_workers is None
               else config.data_workers))
  if _in_memory(config, len(train) + len(test), size, channels):
    return _materialize(stream)
  return stream


def _in_memory(config, num_images: int, size: int, channels: int) -> bool:
  if config.data_pipeline != "auto":
    return config.data_pipeline == "memory"
  mib = num_images * size * size * channels / 2**20
  return mib <= config.in_memory_max_mib


def _decode_split(element, count: int) -> tuple[np.ndarray, np.ndarray]:
  items = [element(i) for i in range(count)]
  streaming.raise_errors({"error": [item["error"] for item in items]})
  kept = [item for item in items if item["valid"]]
  if len(kept) < count:
    metric_writer.log(f"Skipped {count - len(kept)} unreadable image(s) "
                      "(skip_bad_images=True).")
  return (np.stack([item["image"] for item in kept]),
          np.asarray([item["label"] for item in kept], np.int32))


def _materialize(stream: streaming.StreamingDataset) -> datasets.Dataset:
  """Every image of `stream` decoded once (the whole image's central square
  at the training size), as an in-memory datasets.Dataset."""
  whole = examples.Transform(stream.image_size, stream.channels,
                             random_crop=False)
  splits = []
  for split in (stream.train, stream.test):
    element = examples.EvalElement(split, whole, 1, 1, 0,
                                   stream.skip_bad)
    splits.append(_decode_split(element, len(split)))
  return datasets.Dataset(stream.name, *splits[0], *splits[1],
                          stream.num_classes, stream.class_names,
                          stream.flip, source=stream.source + ", in memory")


def num_classes(config: ml_collections.ConfigDict) -> int:
  """The class count of a folder or TFDS dataset, read without decoding."""
  if image_folder.looks_like_folder(config.dataset):
    return len(image_folder.scan(config.dataset, config.holdout_fraction,
                                 config.seed).class_names)
  return len(tfds_source.open_tfds(config.dataset, config.data_dir,
                                   config.manual_dir, False).class_names)
