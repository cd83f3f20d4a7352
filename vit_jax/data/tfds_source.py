"""Any TFDS image-classification dataset, read by index without TensorFlow.

The builder's info names the splits, the number of classes, the class names
and which features are the image and the label (its `supervised_keys`, else
the only Image and ClassLabel features). The prepared ArrayRecord files are
read through `builder.as_data_source`, a random-access sequence of decoded
examples that the input pipeline's workers index directly.
"""

import dataclasses
from typing import Any, Optional, Sequence

from vit_jax.data import raw_files

TRAIN_SPLITS = ("train",)
TEST_SPLITS = ("test", "validation", "val")
# Datasets TFDS cannot download: the user fetches the archives by hand.
MANUAL_DATASETS = {
    "imagenet2012": "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar "
                    "(from image-net.org, after registering)",
    "imagenet2012_subset": "the ImageNet archives, as for imagenet2012",
}


@dataclasses.dataclass(frozen=True)
class TfdsDataset:
  """A prepared TFDS dataset: its sources and what its info says."""
  name: str
  data_dir: str
  train: Sequence[Any]  # random-access: source[i] is a dict of numpy arrays
  test: Sequence[Any]
  test_split: str
  image_key: str
  label_key: str
  class_names: tuple[str, ...]
  image_shape: tuple[Optional[int], ...]  # (H, W, C); None where it varies


def _feature_keys(info) -> tuple[str, str]:
  """(image key, label key) of a classification dataset, or a clear error."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  features = info.features
  if info.supervised_keys and len(info.supervised_keys) >= 2:
    image_key, label_key = info.supervised_keys[:2]
  else:
    images = [k for k, f in features.items()
              if isinstance(f, tfds.features.Image)]
    labels = [k for k, f in features.items()
              if isinstance(f, tfds.features.ClassLabel)]
    if len(images) != 1 or len(labels) != 1:
      raise raw_files.DatasetFormatError(
          f"TFDS {info.name}: expected one image and one class-label "
          f"feature, found features {dict(features.items())}. vit_jax "
          "trains image classifiers only.")
    image_key, label_key = images[0], labels[0]
  if not isinstance(features[image_key], tfds.features.Image):
    raise raw_files.DatasetFormatError(
        f"TFDS {info.name}: feature {image_key!r} is "
        f"{type(features[image_key]).__name__}, not an image; vit_jax "
        "trains on image datasets.")
  if not isinstance(features[label_key], tfds.features.ClassLabel):
    raise raw_files.DatasetFormatError(
        f"TFDS {info.name}: feature {label_key!r} is "
        f"{type(features[label_key]).__name__}, not a class label.")
  return image_key, label_key


def _pick_split(info, names: Sequence[str], role: str) -> str:
  for name in names:
    if name in info.splits:
      return name
  raise raw_files.DatasetFormatError(
      f"TFDS {info.name} has splits {sorted(info.splits)}; none is a {role} "
      f"split ({', '.join(names)}).")


def check_name(name: str) -> None:
  """Raises DatasetFormatError unless TFDS knows `name` (no data read)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    tfds.builder_cls(name.split(":")[0].split("/")[0])
  except tfds.core.registered.DatasetNotFoundError as e:
    raise raw_files.DatasetFormatError(
        f"config.dataset={name!r} is neither a folder nor a TFDS dataset "
        f"({str(e).splitlines()[0][:200]}). Give a folder of images "
        "(root/train/<class>/...), or a name from the TFDS catalogue "
        "(imagenette, oxford_iiit_pet, food101, imagenet2012, ...).") from e


def open_tfds(name: str, data_dir: Optional[str], manual_dir: Optional[str],
              download: bool) -> TfdsDataset:
  """Opens TFDS dataset `name`, preparing it first if allowed; raises an
  error naming the problem and the fix when it does not exist, is not
  prepared, or is not an image-classification dataset."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  check_name(name)
  builder = tfds.builder(name, data_dir=data_dir)
  info = builder.info  # from the builder's code: known before preparing
  image_key, label_key = _feature_keys(info)
  if not builder.is_prepared():
    if not download:
      raise FileNotFoundError(
          f"TFDS {name} is not prepared in {builder.data_dir}. Prepare it "
          "(pip install '.[prepare]', then run once with "
          "--config.tfds_download=True on a machine with network), or point "
          "--config.data_dir at a data_dir where it is."
          + _manual_hint(name))
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
  info = builder.info  # the splits are known once prepared
  train_split = _pick_split(info, TRAIN_SPLITS, "training")
  test_split = _pick_split(info, TEST_SPLITS, "test")
  sources = builder.as_data_source(split=[train_split, test_split])
  return TfdsDataset(
      name=name, data_dir=str(builder.data_dir), train=sources[0],
      test=sources[1], test_split=test_split, image_key=image_key,
      label_key=label_key,
      class_names=tuple(info.features[label_key].names),
      image_shape=tuple(info.features[image_key].shape))


def _manual_hint(name: str) -> str:
  if name not in MANUAL_DATASETS:
    return ""
  return (f" {name} cannot be downloaded automatically: put "
          f"{MANUAL_DATASETS[name]} in --config.manual_dir (default "
          "<data_dir>/downloads/manual) before preparing it.")
