"""Streamed folder and TFDS datasets: order, resume, coverage, bad files."""

import os

import jax
import ml_collections
import numpy as np
import pytest
from PIL import Image

from vit_jax import config as config_lib
from vit_jax.data import datasets, file_sources, image_decode, streaming
from vit_jax.runtime import sharding

CLASSES = ("circle", "square", "stripes")


def _pattern(label: int, index: int, size: int) -> np.ndarray:
  """A recognisable class pattern with per-image variation."""
  rng = np.random.default_rng([label, index])
  y, x = np.mgrid[0:size, 0:size] / size
  shape = [((x - .5) ** 2 + (y - .5) ** 2 < .1),
           (abs(x - .5) < .3) & (abs(y - .5) < .3),
           (np.floor(x * 6) % 2 == 0)][label]
  base = np.where(shape, 220, 30) + rng.normal(0, 15, (size, size))
  colour = np.stack([base, base * (0.5 + label / 4), 255 - base], -1)
  return np.clip(colour, 0, 255).astype(np.uint8)


def write_folder(root, per_class=(8, 4), sizes=((40, 30), (24, 36))):
  """root/train and root/test with CLASSES, JPEG and PNG of two sizes."""
  for split, count in zip(("train", "test"), per_class):
    for label, name in enumerate(CLASSES):
      os.makedirs(os.path.join(root, split, name), exist_ok=True)
      for i in range(count):
        width, height = sizes[i % len(sizes)]
        image = Image.fromarray(_pattern(label, i, 48)).resize(
            (width, height))
        ext = "jpg" if i % 2 else "png"
        image.save(os.path.join(root, split, name, f"{i:03d}.{ext}"))
  return str(root)


def _config(root, **overrides) -> ml_collections.ConfigDict:
  config = config_lib.base_config("ViT-Ti/4")
  config.unlock()
  config.update(dict(dataset=root, image_size=16, batch_size=8,
                     eval_batch_size=8, data_pipeline="stream",
                     data_workers=0, random_resized_crop=True, crop_padding=0))
  config.update(overrides)
  config_lib.validate_config(config)
  return config


def _take(dataset, start_step, count, batch_size=8, seed=0):
  mesh = sharding.make_mesh()
  batches = dataset.train_batches(batch_size, seed, start_step, mesh)
  taken = [jax.device_get(next(batches)) for _ in range(count)]
  batches.close()
  return taken


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return write_folder(tmp_path_factory.mktemp("folder"))


def test_open_folder_streams_at_the_training_size(folder):
  dataset = datasets.load(_config(folder))
  assert isinstance(dataset, streaming.StreamingDataset)
  assert dataset.class_names == list(CLASSES)
  assert (dataset.num_train, dataset.num_test) == (24, 12)
  images, labels = _take(dataset, 0, 1)[0]
  assert images.shape == (8, 16, 16, 3) and images.dtype == np.uint8
  assert labels.dtype == np.int32 and set(labels) <= {0, 1, 2}


def test_order_is_a_function_of_seed_and_step_not_of_workers(folder):
  dataset = datasets.load(_config(folder))
  straight = _take(dataset, 0, 6)
  resumed = _take(dataset, 3, 3)
  for (a_images, a_labels), (b_images, b_labels) in zip(straight[3:], resumed):
    np.testing.assert_array_equal(a_images, b_images)
    np.testing.assert_array_equal(a_labels, b_labels)
  dataset.workers = 2  # worker processes: the same elements
  with_workers = _take(dataset, 2, 2)
  for a, b in zip(straight[2:4], with_workers):
    np.testing.assert_array_equal(a[0], b[0])
  # An epoch (3 steps of 8) visits every training example once.
  labels = np.concatenate([batch[1] for batch in straight[:3]])
  assert np.bincount(labels).tolist() == [8, 8, 8]
  # Random crops differ between epochs.
  assert not np.array_equal(straight[0][0], straight[3][0])


def test_order_matches_the_in_memory_pipeline(folder):
  streamed = datasets.load(_config(folder))
  in_memory = datasets.load(_config(folder, data_pipeline="memory",
                                    random_resized_crop=False))
  assert isinstance(in_memory, datasets.Dataset)
  for (_, stream_labels), (_, memory_labels) in zip(
      _take(streamed, 0, 4), _take(in_memory, 0, 4)):
    np.testing.assert_array_equal(stream_labels, memory_labels)


def test_eval_covers_every_example_once(folder):
  dataset = datasets.load(_config(folder))
  mesh = sharding.make_mesh()
  labels, masks, images = [], [], []
  for batch_images, batch_labels, mask in dataset.eval_batches(8, mesh):
    images.append(jax.device_get(batch_images))
    labels.append(jax.device_get(batch_labels))
    masks.append(jax.device_get(mask))
  mask = np.concatenate(masks)
  assert mask.sum() == 12 and len(mask) == 16
  assert np.bincount(np.concatenate(labels)[mask > 0]).tolist() == [4, 4, 4]
  expected, _ = dataset.test_examples(range(12))
  np.testing.assert_array_equal(np.concatenate(images)[:12], expected)


def test_auto_holds_small_data_in_memory_and_streams_big(folder):
  small = datasets.load(_config(folder, data_pipeline="auto"))
  big = datasets.load(_config(folder, data_pipeline="auto",
                              in_memory_max_mib=0))
  assert isinstance(small, datasets.Dataset)
  assert small.train_images.shape == (24, 16, 16, 3)
  assert isinstance(big, streaming.StreamingDataset)


def test_channel_stats_of_a_stream_match_the_decoded_images(folder):
  dataset = datasets.load(_config(folder, random_resized_crop=False))
  mean, std = dataset.channel_stats()
  memory = datasets.load(_config(folder, data_pipeline="memory",
                                 random_resized_crop=False))
  expected_mean, _ = memory.channel_stats()
  np.testing.assert_allclose(mean, expected_mean, atol=1.0)
  assert mean.shape == std.shape == (3,) and (std >= 1).all()


def test_grayscale_model_gets_one_channel(folder):
  dataset = datasets.load(_config(folder, channels=1))
  assert _take(dataset, 0, 1)[0][0].shape == (8, 16, 16, 1)
  assert config_lib.image_shape_of(_config(folder, channels=1)) == (16, 16, 1)


@pytest.fixture
def corrupt_folder(tmp_path):
  root = write_folder(tmp_path / "data")
  bad = os.path.join(root, "train", "square", "001.jpg")
  with open(bad, "r+b") as f:  # keep the header, cut the data
    f.truncate(200)
  with open(os.path.join(root, "train", "circle", "zero.png"), "wb"):
    pass
  return root


def test_a_corrupt_file_is_an_error_naming_it(corrupt_folder):
  dataset = datasets.load(_config(corrupt_folder))
  with pytest.raises(image_decode.BadImageError,
                     match="skip_bad_images") as info:
    _take(dataset, 0, 5)
  assert "001.jpg" in str(info.value) or "zero.png" in str(info.value)


def test_skip_bad_images_replaces_counts_and_reports(corrupt_folder, capsys):
  dataset = datasets.load(_config(corrupt_folder, skip_bad_images=True))
  batches = _take(dataset, 0, 7)  # two epochs of 3 steps, and one more
  assert all(images.shape == (8, 16, 16, 3) for images, _ in batches)
  out = capsys.readouterr().out
  assert "Epoch 1: skipped" in out and "Epoch 2: skipped" in out
  assert "zero.png" in out


def test_tfds_dataset_streams_without_tensorflow(tmp_path, monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  # The mock knows no splits until prepared; a prepared one lists them.
  monkeypatch.setattr(tfds.core.DatasetInfo, "splits", property(
      lambda self: {"train": None, "validation": None, "test": None}))
  with tfds.testing.mock_data(num_examples=10,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    # mock_data makes download_and_prepare a no-op and the data source
    # random examples of the dataset's real features.
    config = _config("oxford_flowers102", data_dir=str(tmp_path))
    dataset = datasets.load(config)
    assert isinstance(dataset, streaming.StreamingDataset)
    assert dataset.num_classes == 102 and len(dataset.class_names) == 102
    images, labels = _take(dataset, 0, 1)[0]
    assert images.shape == (8, 16, 16, 3)
    assert ((0 <= labels) & (labels < 102)).all()


@pytest.mark.parametrize("name, message", [
    ("no_such_dataset_xyz", "neither a folder nor a TFDS dataset"),
    ("glue", "image"),
])
def test_tfds_names_that_cannot_work_fail_clearly(tmp_path, name, message):
  pytest.importorskip("tensorflow_datasets")
  config = _config("cifar10", data_dir=str(tmp_path), tfds_download=False)
  config.dataset = name
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    file_sources.open_dataset(config)


def test_max_examples_of_a_folder_sample_every_class(folder):
  dataset = datasets.load(_config(folder, max_train_examples=12,
                                  max_eval_examples=6))
  assert (dataset.num_train, dataset.num_test) == (12, 6)
  labels = [dataset.train.read(i)[1] for i in range(12)]
  assert set(labels) == {0, 1, 2}  # not the first class's files only
  again = datasets.load(_config(folder, max_train_examples=12))
  assert [again.train.read(i)[2] for i in range(12)] == [
      dataset.train.read(i)[2] for i in range(12)]


@pytest.mark.parametrize("cores,workers", [(1, 1), (2, 1), (8, 4), (64, 16)])
def test_default_decode_workers_are_half_the_usable_cores(monkeypatch, cores,
                                                          workers):
  """Half the cores vit_jax may use (a container's CPU quota counted), at
  least 1, at most 16."""
  from vit_jax.runtime import cpu_info  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(cpu_info, "cpu_cores", lambda: cores)
  assert streaming.default_workers() == workers
