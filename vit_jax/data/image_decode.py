"""Decoding image files and the geometric crops, on the host (PIL).

These run in the input pipeline's worker processes (streaming.py): each
image is decoded, cropped and resized straight to the training resolution,
so only (S, S, C) uint8 arrays travel on. The crop box is chosen on the
file's full size first, so a JPEG can be decoded at 1/2, 1/4 or 1/8 scale
(libjpeg's DCT scaling, `Image.draft`) whenever the box still has at least
`size` pixels across at that scale: for a 500x375 photo cropped to 224 px
that skips most of the decoding work.
"""

import io
import math
import warnings
from typing import Optional

import numpy as np
from PIL import Image, ImageOps

# Photos are big; a 40-megapixel JPEG is not a decompression bomb.
Image.MAX_IMAGE_PIXELS = 300_000_000


class BadImageError(ValueError):
  """A file that is not a readable image; the message names it."""


def _open(data: bytes, name: str) -> Image.Image:
  if not data:
    raise BadImageError(f"{name}: the file is empty (0 bytes).")
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # PIL's EXIF and palette chatter
      image = Image.open(io.BytesIO(data))
      image.seek(0)  # first frame of a GIF / animated WebP
  except Exception as e:  # PIL raises several types for bad data
    raise BadImageError(f"{name}: not a readable image ({e}).") from e
  return image


def _to_mode(image: Image.Image, channels: int) -> Image.Image:
  """`image` as "L" (channels=1) or "RGB" (3): palette, alpha, CMYK and
  16-bit images converted; alpha composited on white."""
  if image.mode in ("I;16", "I;16B", "I;16L", "I"):
    pixels = np.asarray(image, np.float64)
    scale = 255.0 / 65535.0 if pixels.max(initial=0) > 255 else 1.0
    image = Image.fromarray(np.clip(pixels * scale, 0, 255).astype(np.uint8))
  if image.mode == "P":
    image = image.convert("RGBA")
  if image.mode in ("RGBA", "LA", "PA"):
    background = Image.new("RGBA", image.size, (255, 255, 255, 255))
    image = Image.alpha_composite(background, image.convert("RGBA"))
  return image.convert("L" if channels == 1 else "RGB")


def _as_array(image: Image.Image, channels: int) -> np.ndarray:
  array = np.asarray(image, np.uint8)
  if channels == 1:
    return array[:, :, None]
  return array


def inception_box(rng: np.random.Generator, width: int, height: int,
                  min_area: float, ratios=(3 / 4, 4 / 3)
                  ) -> tuple[float, float, float, float]:
  """A random (left, top, right, bottom) box: area a uniform fraction in
  [min_area, 1] of the image's, aspect log-uniform in `ratios`, clipped to
  the image (as augment.random_resized_crop does on device)."""
  area = rng.uniform(min_area, 1.0) * width * height
  aspect = math.exp(rng.uniform(math.log(ratios[0]), math.log(ratios[1])))
  crop_w = min(max(math.sqrt(area * aspect), 1.0), width)
  crop_h = min(max(math.sqrt(area / aspect), 1.0), height)
  left = rng.uniform() * (width - crop_w)
  top = rng.uniform() * (height - crop_h)
  return left, top, left + crop_w, top + crop_h


def center_box(width: int, height: int, crop_fraction: float
               ) -> tuple[float, float, float, float]:
  """The central square of side crop_fraction x the shorter side: "resize
  the shorter side to size / crop_fraction, then centre-crop size"."""
  side = min(width, height) * crop_fraction
  left, top = (width - side) / 2, (height - side) / 2
  return left, top, left + side, top + side


def _decode_box(image: Image.Image, box, size: int, channels: int
                ) -> Image.Image:
  """Decodes only as much as `box` needs at `size` px, converts the mode,
  returns the box resized to (size, size)."""
  width, height = image.size
  if image.format == "JPEG":
    # The smallest DCT scale that keeps the box >= size pixels across.
    scale = min(box[2] - box[0], box[3] - box[1]) / size
    if scale >= 2:
      image.draft(image.mode, (math.ceil(width / scale),
                               math.ceil(height / scale)))
  image = _to_mode(image, channels)  # before resizing: palettes, alpha
  sx, sy = image.size[0] / width, image.size[1] / height
  box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
  return image.resize((size, size), Image.BILINEAR, box=box)


def decode(data: bytes, name: str, *, size: int, channels: int,
           rng: Optional[np.random.Generator] = None,
           min_area: float = 0.05, crop_fraction: float = 1.0) -> np.ndarray:
  """Decodes `data` (the bytes of file `name`) to a (size, size, channels)
  uint8 array.

  With `rng`: an Inception crop (random box, see inception_box). Without:
  the central crop of `crop_fraction` of the shorter side (eval). EXIF
  orientation is applied first; images smaller than `size` are upscaled.
  Raises BadImageError for anything that is not a readable image.
  """
  image = _open(data, name)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      width, height = image.size
      orientation = image.getexif().get(0x0112, 1)
      if orientation in (5, 6, 7, 8):  # rotated a quarter turn
        width, height = height, width
      box = (inception_box(rng, width, height, min_area) if rng is not None
             else center_box(width, height, crop_fraction))
      if orientation != 1:
        # Rare enough to decode whole: rotate first, then crop.
        image = ImageOps.exif_transpose(_to_mode(image, channels))
        image = image.resize((size, size), Image.BILINEAR, box=box)
      else:
        image = _decode_box(image, box, size, channels)
      return _as_array(image, channels)
  except BadImageError:
    raise
  except Exception as e:  # truncated data shows up only while decoding
    raise BadImageError(f"{name}: cannot decode the image ({e}).") from e


def decode_whole(data: bytes, name: str, channels: int) -> np.ndarray:
  """The whole image at its own size, (H, W, channels) uint8."""
  image = _open(data, name)
  try:
    image = ImageOps.exif_transpose(_to_mode(image, channels))
    return _as_array(image, channels)
  except Exception as e:
    raise BadImageError(f"{name}: cannot decode the image ({e}).") from e
