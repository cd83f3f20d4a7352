"""Image preprocessing that runs on device, inside the jitted steps.

Batches travel to the device as uint8 (4x less traffic than float32) and are
augmented and normalised there, where XLA fuses it into the step; a 2-core
host never has to touch a float pixel.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.data import draws, mixing, randaugment


def random_crop(images: jax.Array, key: jax.Array, padding: int) -> jax.Array:
  """Zero-pads by `padding` and takes a random crop of the original size.

  images: (B, H, W, C), any dtype. Each image gets its own offset.
  """
  if padding <= 0:
    return images
  batch, height, width, channels = images.shape
  padded = jnp.pad(images, ((0, 0), (padding, padding), (padding, padding),
                            (0, 0)))
  offsets = draws.integers(draws.uniforms(key, (batch, 2)), 2 * padding + 1)

  def crop(image, offset):
    return jax.lax.dynamic_slice(image, (offset[0], offset[1], 0),
                                 (height, width, channels))

  return jax.vmap(crop)(padded, offsets)


def random_resized_crop(images: jax.Array, key: jax.Array, size: int,
                        min_area: float = 0.05,
                        aspect_ratios: tuple[float, float] = (3 / 4, 4 / 3)
                        ) -> jax.Array:
  """Inception-style crop: a random box, resized to (size, size). float32.

  Each image gets a box covering a uniform fraction in [min_area, 1] of its
  area with a log-uniform aspect ratio (clipped to the image rather than
  resampled), resized bilinearly with antialiasing. min_area=0.05 is the
  official ViT fine-tuning setting (timm uses 0.08). (B, H, W, C) input.
  """
  batch, height, width, channels = images.shape
  area, log_aspect, top, left = draws.uniforms(key, (4, batch))  # one draw
  area = (min_area + (1.0 - min_area) * area) * height * width
  low, high = np.log(aspect_ratios[0]), np.log(aspect_ratios[1])
  aspect = jnp.exp(low + (high - low) * log_aspect)
  crop_height = jnp.clip(jnp.sqrt(area / aspect), 1.0, height)
  crop_width = jnp.clip(jnp.sqrt(area * aspect), 1.0, width)
  top = top * (height - crop_height)
  left = left * (width - crop_width)

  def crop(image, top, left, crop_height, crop_width):
    scale = jnp.stack([size / crop_height, size / crop_width])
    return jax.image.scale_and_translate(
        image.astype(jnp.float32), (size, size, channels), (0, 1), scale,
        -jnp.stack([top, left]) * scale, "linear", antialias=True)

  return jax.vmap(crop)(images, top, left, crop_height, crop_width)


def random_flip(images: jax.Array, key: jax.Array) -> jax.Array:
  """Mirrors each image left-right with probability 1/2. (B, H, W, C)."""
  flip = jax.random.bernoulli(key, 0.5, (images.shape[0], 1, 1, 1))
  return jnp.where(flip, images[:, :, ::-1], images)


def mirror_averaged(logits_fn: Callable[[jax.Array], jax.Array],
                    images: jax.Array) -> jax.Array:
  """Mean of `logits_fn` over each image and its left-right mirror image.

  Test-time augmentation for classes that look alike mirrored (garments,
  animals; not digits or text). images (B, H, W, C) -> logits (B, K); costs
  two forward passes.
  """
  return (logits_fn(images) + logits_fn(images[:, :, ::-1])) / 2


def normalize(images: jax.Array, mean: np.ndarray, std: np.ndarray,
              dtype=jnp.float32) -> jax.Array:
  """uint8 (B, H, W, C) -> `dtype`, per channel (x - mean) / std."""
  mean = jnp.asarray(mean, jnp.float32)
  std = jnp.asarray(std, jnp.float32)
  return ((images.astype(jnp.float32) - mean) / std).astype(dtype)


# Per-channel pixel mean and std (0-255 scale) of the fixed normalisations.
FIXED_STATS = {
    # [-1, 1], as the official and big_vision checkpoints were trained.
    "inception": ((127.5,) * 3, (127.5,) * 3),
    # ImageNet statistics, as torchvision and timm models were trained.
    "imagenet": ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375)),
}
NORMALIZATIONS = ("dataset",) + tuple(FIXED_STATS)


def pixel_stats(normalization: str, dataset) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel (mean, std) for `normalization`; "dataset" measures the
  training split of `dataset` (a datasets.Dataset)."""
  if normalization == "dataset":
    return dataset.channel_stats()
  return tuple(np.array(x, np.float32) for x in FIXED_STATS[normalization])


def resize(images: jax.Array, image_size) -> jax.Array:
  """Bilinear resize of (B, H, W, C) to (B, S, S, C) float32; None: as is."""
  if image_size is None or images.shape[1:3] == (image_size, image_size):
    return images
  batch, _, _, channels = images.shape
  return jax.image.resize(images.astype(jnp.float32),
                          (batch, image_size, image_size, channels),
                          "bilinear")


def eval_preprocess(images: jax.Array, *, mean: np.ndarray, std: np.ndarray,
                    image_size=None) -> jax.Array:
  """Resizes (if image_size) and normalises an eval batch."""
  return normalize(resize(images, image_size), mean, std)


AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment")


def train_preprocess(images: jax.Array, key: jax.Array, *, mean: np.ndarray,
                     std: np.ndarray, crop_padding: int, flip: bool,
                     image_size=None, resized_crop: bool = False,
                     min_crop_area: float = 0.05, auto_augment: str = "none",
                     randaugment_num_ops: int = 2,
                     randaugment_magnitude: float = 9.0,
                     erase_probability: float = 0.0) -> jax.Array:
  """Augments and normalises a uint8 training batch. (B, H, W, C) -> float32.

  Crop (with padding, or random-resized to image_size), flip, RandAugment
  or TrivialAugment, resize, normalise, random erasing.
  """
  crop_key, flip_key, auto_key, erase_key = jax.random.split(key, 4)
  if resized_crop:
    images = random_resized_crop(images, crop_key,
                                 image_size or images.shape[1],
                                 min_area=min_crop_area)
  else:
    images = random_crop(images, crop_key, crop_padding)
  if flip:
    images = random_flip(images, flip_key)
  if auto_augment == "randaugment":
    images = randaugment.rand_augment(
        images.astype(jnp.float32), auto_key, randaugment_num_ops,
        randaugment_magnitude / 10)
  elif auto_augment == "trivialaugment":
    images = randaugment.trivial_augment(images.astype(jnp.float32),
                                         auto_key)
  images = eval_preprocess(images, mean=mean, std=std, image_size=image_size)
  return mixing.random_erasing(images, erase_key, erase_probability)
