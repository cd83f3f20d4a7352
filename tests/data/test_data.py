"""Data: raw-file readers, TFDS, the input pipeline and augmentation."""

import gzip
import io
import os
import tarfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import config as config_lib
from vit_jax.data import augment, datasets, input_pipeline, order, raw_files
from vit_jax.runtime import sharding


def _idx_bytes(array: np.ndarray) -> bytes:
  header = bytes([0, 0, 0x08, array.ndim])
  header += b"".join(int(n).to_bytes(4, "big") for n in array.shape)
  return header + array.astype(np.uint8).tobytes()


def _write_idx_dataset(directory, num_train, num_test, seed=0):
  rng = np.random.default_rng(seed)
  arrays = {}
  for split, count in (("train", num_train), ("test", num_test)):
    images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, count, dtype=np.uint8)
    image_stem, label_stem = raw_files.IDX_FILES[split]
    with gzip.open(os.path.join(directory, image_stem + ".gz"), "wb",
                   compresslevel=1) as f:
      f.write(_idx_bytes(images))
    with open(os.path.join(directory, label_stem), "wb") as f:  # plain file
      f.write(_idx_bytes(labels))
    arrays[split] = (images, labels)
  return arrays


def test_idx_round_trip_and_truncation(tmp_path):
  images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  np.testing.assert_array_equal(
      raw_files.parse_idx(_idx_bytes(images), "x"), images)
  with pytest.raises(raw_files.DatasetFormatError, match="truncated"):
    raw_files.parse_idx(_idx_bytes(images)[:-1], "x")
  with pytest.raises(raw_files.DatasetFormatError, match="not an IDX file"):
    raw_files.parse_idx(b"PK\x03\x04junk", "x")


def test_load_raw_mnist_layout(tmp_path):
  arrays = _write_idx_dataset(tmp_path, 60_000, 10_000)
  dataset = datasets.load_raw("mnist", str(tmp_path))
  chex.assert_shape(dataset.train_images, (60_000, 28, 28, 1))
  chex.assert_shape(dataset.test_labels, (10_000,))
  np.testing.assert_array_equal(dataset.test_images[..., 0],
                                arrays["test"][0])
  np.testing.assert_array_equal(dataset.train_labels, arrays["train"][1])
  assert dataset.flip is False  # digits are not mirrored


def test_load_raw_rejects_short_dataset(tmp_path):
  _write_idx_dataset(tmp_path, 600, 100)
  with pytest.raises(raw_files.DatasetFormatError, match="has 600 images"):
    datasets.load_raw("fashion_mnist", str(tmp_path))


def test_load_raw_cifar10_binary_archive(tmp_path):
  rng = np.random.default_rng(0)
  # Channel-major records: label byte, then 1024 R, 1024 G, 1024 B bytes.
  chw = rng.integers(0, 256, (60_000, 3, 32, 32), dtype=np.uint8)
  labels = rng.integers(0, 10, 60_000, dtype=np.uint8)
  records = np.concatenate([labels[:, None], chw.reshape(60_000, -1)], 1)
  archive = tmp_path / "cifar-10-binary.tar.gz"
  with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for index, name in enumerate(names):
      data = records[index * 10_000:(index + 1) * 10_000].tobytes()
      info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  dataset = datasets.load_raw("cifar10", str(tmp_path))
  chex.assert_shape(dataset.train_images, (50_000, 32, 32, 3))
  np.testing.assert_array_equal(dataset.train_images[7],
                                chw[7].transpose(1, 2, 0))
  np.testing.assert_array_equal(dataset.test_labels, labels[50_000:])
  assert dataset.class_names[0] == "airplane"


def test_load_raw_cifar100_extracted_folder(tmp_path):
  folder = tmp_path / "cifar-100-binary"
  folder.mkdir()
  rng = np.random.default_rng(1)
  for name, count in (("train.bin", 50_000), ("test.bin", 10_000)):
    labels = np.stack([rng.integers(0, 20, count), rng.integers(0, 100, count)],
                      1).astype(np.uint8)
    pixels = rng.integers(0, 256, (count, 3072), dtype=np.uint8)
    (folder / name).write_bytes(np.concatenate([labels, pixels], 1).tobytes())
  (folder / "fine_label_names.txt").write_text(
      "\n".join(f"name{i}" for i in range(100)) + "\n")
  dataset = datasets.load_raw("cifar100", str(tmp_path))
  chex.assert_shape(dataset.test_images, (10_000, 32, 32, 3))
  np.testing.assert_array_equal(dataset.test_labels, labels[:, 1])
  assert dataset.class_names[42] == "name42"
  assert dataset.num_classes == 100


def test_cifar100_records_take_fine_label():
  images = np.arange(2 * 3072, dtype=np.uint64).astype(np.uint8).reshape(2, -1)
  records = np.concatenate([[[3, 71], [5, 99]], images], 1).astype(np.uint8)
  parsed_images, labels = raw_files.parse_cifar_records(records.tobytes(), 2,
                                                       "t")
  np.testing.assert_array_equal(labels, [71, 99])
  chex.assert_shape(parsed_images, (2, 32, 32, 3))
  with pytest.raises(raw_files.DatasetFormatError, match="truncated"):
    raw_files.parse_cifar_records(records.tobytes()[:-5], 2, "t")


def test_real_fashion_mnist(fashion_mnist_dir):
  dataset = datasets.load_raw("fashion_mnist", fashion_mnist_dir)
  chex.assert_shape(dataset.train_images, (60_000, 28, 28, 1))
  chex.assert_shape(dataset.test_images, (10_000, 28, 28, 1))
  assert np.bincount(dataset.test_labels).tolist() == [1000] * 10
  assert dataset.class_names[9] == "Ankle boot"
  mean, std = dataset.channel_stats()
  np.testing.assert_allclose(mean, [72.94], atol=0.1)  # 0.2860 * 255
  np.testing.assert_allclose(std, [90.02], atol=0.1)  # 0.3530 * 255


def test_missing_dataset_says_what_was_tried_and_how_to_fix(tmp_path):
  config = config_lib.base_config()
  config.dataset = "cifar10"
  config.raw_data_dir = str(tmp_path / "nothing_here")
  config.data_dir = str(tmp_path / "tfds")
  config.tfds_download = False
  with pytest.raises(datasets.DatasetUnavailableError) as error:
    datasets.load(config)
  message = str(error.value)
  assert "nothing_here: not found" in message
  assert "TFDS" in message
  assert "--config.raw_data_dir=DIR" in message
  assert "cifar-10-binary.tar.gz" in message
  assert "--config.dataset=synthetic" in message


def test_tfds_data_source_path(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  # mock_data replaces download_and_prepare with a no-op and the array_record
  # reader with random examples of the dataset's real features.
  with tfds.testing.mock_data(num_examples=24,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    dataset = datasets.load_tfds("cifar10", str(tmp_path), None,
                                 download=True)
  chex.assert_shape(dataset.train_images, (24, 32, 32, 3))
  assert dataset.train_images.dtype == np.uint8
  assert dataset.train_labels.max() < 10
  assert len(dataset.class_names) == 10


def test_synthetic_is_deterministic_and_class_dependent():
  a = datasets.make_synthetic(64, 16, 8, 3, 4, seed=1)
  b = datasets.make_synthetic(64, 16, 8, 3, 4, seed=1)
  np.testing.assert_array_equal(a.train_images, b.train_images)
  class_means = [a.train_images[a.train_labels == k].mean() for k in range(4)]
  assert np.ptp(class_means) > 5


# --------------------------------------------------------------- pipeline
def test_train_order_is_a_permutation_per_epoch_and_a_function_of_step():
  steps_per_epoch = 10
  epoch = np.concatenate([
      order.train_batch_indices(105, 10, seed=3, step=s)
      for s in range(steps_per_epoch)])
  assert len(set(epoch.tolist())) == 100  # 5 left over, none repeated
  next_epoch = order.train_batch_indices(105, 10, seed=3, step=10)
  assert not np.array_equal(next_epoch, epoch[:10])
  np.testing.assert_array_equal(
      order.train_batch_indices(105, 10, seed=3, step=13),
      order.train_batch_indices(105, 10, seed=3, step=13))


def test_train_batches_resume_at_any_step():
  mesh = sharding.make_mesh()
  images = np.arange(40, dtype=np.uint8).reshape(40, 1, 1, 1)
  labels = np.arange(40, dtype=np.int32)
  full = input_pipeline.train_batches(images, labels, 8, 0, 0, mesh)
  from_three = input_pipeline.train_batches(images, labels, 8, 0, 3, mesh)
  expected = [next(full) for _ in range(6)][3:]
  for want in expected:
    got = next(from_three)
    np.testing.assert_array_equal(got[1], want[1])
    assert got[0].sharding.spec == sharding.batch_sharded(mesh).spec


def test_eval_batches_cover_each_example_once():
  mesh = sharding.make_mesh()
  images = np.zeros((37, 2, 2, 1), np.uint8)
  labels = np.arange(37, dtype=np.int32)
  seen, total_mask = [], 0.0
  for batch_images, batch_labels, mask in input_pipeline.eval_batches(
      images, labels, 16, mesh):
    chex.assert_shape(batch_images, (16, 2, 2, 1))
    seen.extend(np.asarray(batch_labels)[np.asarray(mask) > 0].tolist())
    total_mask += float(mask.sum())
  assert seen == list(range(37))
  assert total_mask == 37


# ----------------------------------------------------------- augmentation
def test_random_crop_takes_a_window_of_the_padded_image():
  images = jnp.asarray(np.random.default_rng(0).integers(
      1, 255, (16, 8, 8, 3)), jnp.uint8)
  cropped = augment.random_crop(images, jax.random.PRNGKey(0), padding=2)
  chex.assert_shape(cropped, images.shape)
  padded = np.pad(np.asarray(images), ((0, 0), (2, 2), (2, 2), (0, 0)))
  offsets = set()
  for i in range(16):
    matches = [(y, x) for y in range(5) for x in range(5)
               if np.array_equal(padded[i, y:y + 8, x:x + 8],
                                 np.asarray(cropped[i]))]
    assert matches, f"image {i} is not a window of its padded original"
    offsets.add(matches[0])
  assert len(offsets) > 4  # per-image offsets, not one for the batch
  chex.assert_trees_all_equal(
      augment.random_crop(images, jax.random.PRNGKey(0), padding=0), images)


def test_random_flip_mirrors_about_half():
  images = jnp.broadcast_to(jnp.arange(4, dtype=jnp.uint8)[None, None, :,
                                                           None],
                            (1000, 2, 4, 1))
  flipped = augment.random_flip(images, jax.random.PRNGKey(0))
  is_flipped = np.asarray(flipped[:, 0, 0, 0] == 3)
  assert 400 < is_flipped.sum() < 600
  np.testing.assert_array_equal(flipped[is_flipped][0, 0, :, 0], [3, 2, 1, 0])


def test_normalize_standardises_per_channel():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (64, 4, 4, 3)).astype(np.uint8)
  pixels = images.reshape(-1, 3).astype(np.float64)
  out = augment.normalize(jnp.asarray(images), pixels.mean(0), pixels.std(0))
  chex.assert_type(out, jnp.float32)
  np.testing.assert_allclose(np.asarray(out).reshape(-1, 3).mean(0), 0,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(out).reshape(-1, 3).std(0), 1,
                             atol=1e-4)


def _ramps(batch, size):
  """Channel 0 = column index, channel 1 = row index (float32)."""
  columns = np.broadcast_to(np.arange(size, dtype=np.float32), (size, size))
  return jnp.asarray(np.broadcast_to(np.stack([columns, columns.T], -1),
                                     (batch, size, size, 2)))


def test_random_resized_crop_whole_image_is_a_bilinear_resize():
  """Full area, square box: output pixel i samples input (i + 0.5)/2 - 0.5."""
  out = augment.random_resized_crop(_ramps(2, 8), jax.random.PRNGKey(0), 16,
                                    min_area=1.0, aspect_ratios=(1.0, 1.0))
  chex.assert_shape(out, (2, 16, 16, 2))
  expected = (np.arange(16) + 0.5) / 2 - 0.5
  np.testing.assert_allclose(out[0, 5, 1:-1, 0], expected[1:-1], atol=1e-5)
  np.testing.assert_allclose(out[1, 1:-1, 3, 1], expected[1:-1], atol=1e-5)


def test_random_resized_crop_box_statistics():
  size, out_size, batch = 64, 32, 512
  out = np.asarray(augment.random_resized_crop(
      _ramps(batch, size), jax.random.PRNGKey(1), out_size, min_area=0.05))
  # The crop's extent along each axis, read off the ramps.
  width = np.ptp(out[:, 0, :, 0], axis=1) * out_size / (out_size - 1)
  height = np.ptp(out[:, :, 0, 1], axis=1) * out_size / (out_size - 1)
  area = width * height / size**2
  assert area.min() > 0.03 and area.max() <= 1.0 + 1e-3
  # Uniform in [0.05, 1] has mean 0.525; clipping to the image lowers it.
  assert 0.42 < area.mean() < 0.56
  aspect = width / height
  assert aspect.min() > 0.6 and aspect.max() < 1.6
  assert np.all(out >= -1e-4) and np.all(out <= size - 1 + 1e-4)
  assert len(np.unique(np.round(width, 2))) > batch // 2  # per-image boxes


def test_train_preprocess_resized_crop_and_eval_resize():
  images = jnp.full((4, 32, 32, 3), 200, jnp.uint8)
  mean, std = np.full(3, 100.0), np.full(3, 50.0)
  train_out = augment.train_preprocess(
      images, jax.random.PRNGKey(0), mean=mean, std=std, crop_padding=0,
      flip=True, image_size=48, resized_crop=True)
  eval_out = augment.eval_preprocess(images, mean=mean, std=std,
                                     image_size=48)
  for out in (train_out, eval_out):
    chex.assert_shape(out, (4, 48, 48, 3))
    np.testing.assert_allclose(out, 2.0, rtol=1e-5)  # constant stays
