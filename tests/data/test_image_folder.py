"""Image folders: scanning, decoding every kind of file, bad data."""

import io
import os

import numpy as np
import pytest
from PIL import Image

from vit_jax.data import image_decode, image_folder, raw_files


def _save(image: Image.Image, path: str, **kwargs) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  image.save(path, **kwargs)
  return path


def _colour(rgb, size=(40, 30)) -> Image.Image:
  return Image.new("RGB", size, rgb)


def test_scan_sorts_classes_and_labels_files(tmp_path):
  for split in ("train", "val"):
    for name, count in (("zebra", 2), ("apple", 3)):
      for i in range(count):
        _save(_colour((i, 0, 0)), str(tmp_path / split / name / f"{i}.png"))
  (tmp_path / "train" / "apple" / "notes.txt").write_text("not an image")
  folder = image_folder.scan(str(tmp_path))
  assert folder.class_names == ("apple", "zebra")
  assert len(folder.train) == 5 and folder.test_source == "val/"
  assert list(folder.train.labels) == [0, 0, 0, 1, 1]
  assert all(p.endswith(".png") for p in folder.train.paths)


def test_holdout_is_deterministic_disjoint_and_per_class(tmp_path):
  for name in ("a", "b"):
    for i in range(20):
      _save(_colour((i, 0, 0)), str(tmp_path / "train" / name / f"{i}.png"))
  first = image_folder.scan(str(tmp_path), holdout_fraction=0.25, seed=3)
  again = image_folder.scan(str(tmp_path), holdout_fraction=0.25, seed=3)
  other = image_folder.scan(str(tmp_path), holdout_fraction=0.25, seed=4)
  assert first.test.paths == again.test.paths
  assert first.test.paths != other.test.paths
  assert not set(first.test.paths) & set(first.train.paths)
  assert len(first.test) == 10 and len(first.train) == 30
  assert np.bincount(first.test.labels).tolist() == [5, 5]
  assert "held out 25%" in first.test_source


@pytest.mark.parametrize("layout, message", [
    ({"train/a/x.png": True, "train/b/readme.txt": False}, "holds no images"),
    ({"train/a/x.png": True, "test/b/x.png": True}, "differ from those"),
    ({"train/loose.png": True}, "no class folders"),
])
def test_scan_errors_name_the_problem(tmp_path, layout, message):
  for relative, is_image in layout.items():
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if is_image:
      _colour((1, 2, 3)).save(path)
    else:
      path.write_text("text")
  with pytest.raises(raw_files.DatasetFormatError, match=message):
    image_folder.scan(str(tmp_path))


def test_missing_folder_says_what_to_give(tmp_path):
  with pytest.raises(FileNotFoundError, match="train/<class>"):
    image_folder.scan(str(tmp_path / "nope"))


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
  buffer = io.BytesIO()
  image.save(buffer, fmt, **kwargs)
  return buffer.getvalue()


def _gradient(width=64, height=48) -> Image.Image:
  y, x = np.mgrid[0:height, 0:width]
  return Image.fromarray(np.stack(
      [x * 255 // width, y * 255 // height, (x + y) % 256], -1
  ).astype(np.uint8))


@pytest.mark.parametrize("fmt, mode", [
    ("JPEG", "RGB"), ("PNG", "RGB"), ("PNG", "L"), ("PNG", "P"),
    ("PNG", "RGBA"), ("WEBP", "RGB"), ("BMP", "RGB"), ("GIF", "P"),
    ("JPEG", "CMYK"), ("TIFF", "RGB"),
])
@pytest.mark.parametrize("channels", [1, 3])
def test_every_format_and_mode_decodes_to_the_model_shape(fmt, mode,
                                                          channels):
  data = _encode(_gradient().convert(mode), fmt)
  image = image_decode.decode(data, f"x.{fmt.lower()}", size=24,
                              channels=channels)
  assert image.shape == (24, 24, channels) and image.dtype == np.uint8
  source = _gradient().convert(mode).convert("RGB")  # what the file shows
  reference = image_decode.decode(_encode(source, "PNG"), "ref.png",
                                  size=24, channels=channels)
  # Lossy formats and palettes change pixels a little, never the picture.
  assert np.abs(image.astype(int) - reference).mean() < 25


def test_alpha_is_composited_on_white_and_16_bit_is_scaled():
  rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent red
  assert (image_decode.decode_whole(_encode(rgba, "PNG"), "a.png", 3)
          == 255).all()
  deep = Image.fromarray(np.full((8, 8), 65535, np.uint16))
  assert (image_decode.decode_whole(_encode(deep, "PNG"), "d.png", 1)
          == 255).all()


def test_gif_first_frame():
  frames = [Image.new("P", (8, 8), colour) for colour in (10, 200)]
  data = io.BytesIO()
  frames[0].save(data, "GIF", save_all=True, append_images=frames[1:])
  first = image_decode.decode_whole(data.getvalue(), "a.gif", 1)
  assert first.shape == (8, 8, 1)
  assert np.unique(first).size == 1
  expected = np.asarray(frames[0].convert("L"))[0, 0]
  assert first[0, 0, 0] == expected


def test_exif_orientation_is_honoured():
  # Wide image, left half black; orientation 6 = rotate 90 degrees clockwise
  # to display: the black half ends up on top.
  pixels = np.full((20, 40, 3), 255, np.uint8)
  pixels[:, :20] = 0
  exif = Image.Exif()
  exif[0x0112] = 6
  data = _encode(Image.fromarray(pixels), "JPEG", exif=exif, quality=95)
  whole = image_decode.decode_whole(data, "r.jpg", 3)
  assert whole.shape == (40, 20, 3)
  assert whole[:15].mean() < 30 and whole[25:].mean() > 225
  cropped = image_decode.decode(data, "r.jpg", size=10, channels=3)
  assert cropped[:3].mean() < 60 and cropped[-3:].mean() > 200


def test_reduced_jpeg_decoding_matches_full_decoding():
  image = _gradient(512, 384)
  data = _encode(image, "JPEG", quality=90)
  fast = image_decode.decode(data, "a.jpg", size=64, channels=3,
                             crop_fraction=0.875)
  full = Image.open(io.BytesIO(data)).convert("RGB")
  box = image_decode.center_box(512, 384, 0.875)
  slow = np.asarray(full.resize((64, 64), Image.BILINEAR, box=box))
  assert np.abs(fast.astype(int) - slow).mean() < 3


def test_small_images_are_upscaled():
  data = _encode(_gradient(6, 5), "PNG")
  assert image_decode.decode(data, "s.png", size=32,
                             channels=3).shape == (32, 32, 3)


def test_inception_crop_stays_inside_and_varies():
  rng = np.random.default_rng(0)
  boxes = [image_decode.inception_box(rng, 500, 375, 0.08) for _ in range(200)]
  boxes = np.asarray(boxes)
  assert (boxes[:, :2] >= 0).all()
  assert (boxes[:, 2] <= 500 + 1e-9).all() and (boxes[:, 3] <= 375 + 1e-9).all()
  areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
  assert areas.min() < 0.2 * 500 * 375 < 0.8 * 500 * 375 < areas.max()


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"this is a text file", "not a readable image"),
])
def test_bad_files_raise_naming_the_file(data, message):
  with pytest.raises(image_decode.BadImageError, match=message) as info:
    image_decode.decode(data, "/photos/cat/bad.jpg", size=8, channels=3)
  assert "/photos/cat/bad.jpg" in str(info.value)


def test_truncated_jpeg_raises_naming_the_file():
  data = _encode(_gradient(256, 256), "JPEG")[:400]
  with pytest.raises(image_decode.BadImageError, match="trunc.jpg"):
    image_decode.decode(data, "trunc.jpg", size=32, channels=3)
