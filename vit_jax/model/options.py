"""Options beyond the paper, for training on small data, which the model
composes in: stochastic depth (`drop_path`), fixed 2-D sin-cos position
embeddings (`sincos_2d_posemb`), patch dropout (`kept_patches`,
`patches`) and Shifted Patch Tokenization (`embed_shifted_patches`). The
model's docstring (`vit.VisionTransformer`) says what each option does;
Locality Self-Attention lives in `self_attention.MultiHeadSelfAttention`,
where its two lines act.
"""

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any


class ViTInputError(ValueError):
  """An input the model cannot take; the message says what to change."""


def drop_path(module: nn.Module, x: jax.Array, rate: float | jax.Array,
              deterministic: bool,
              uniform: Optional[jax.Array] = None) -> jax.Array:
  """Stochastic depth: zeroes the whole residual branch x (B, ...) of each
  example with probability `rate`, scaling the kept ones by 1 / (1 - rate).
  An example is kept where its `uniform` (B,) draw in [0, 1) is below
  1 - rate; without `uniform`, it is drawn from the "dropout" RNG stream."""
  # rate is a traced scalar when drop path is on (the block runner takes
  # the per-layer rates as arguments, so all blocks share one trace).
  if deterministic or (isinstance(rate, (int, float)) and rate == 0.0):
    return x
  if uniform is None:
    uniform = jax.random.uniform(module.make_rng("dropout"), (x.shape[0],))
  keep = (uniform < 1.0 - rate).reshape((x.shape[0],) + (1,) * (x.ndim - 1))
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def sincos_2d_posemb(grid_h: int, grid_w: int, hidden_size: int,
                     temperature: float = 10_000.0) -> jax.Array:
  """Fixed 2-D sine-cosine position embedding, (1, grid_h * grid_w, D).

  A quarter of the channels each hold sin and cos of the column and of the
  row at geometrically spaced frequencies (as in MoCo v3 and big_vision's
  small-data ViTs). hidden_size must be divisible by 4.
  """
  if hidden_size % 4:
    raise ViTInputError(f"posemb='sincos2d' needs hidden_size divisible by "
                        f"4, got {hidden_size}.")
  quarter = hidden_size // 4
  frequencies = 1.0 / temperature ** (jnp.arange(quarter) / quarter)
  rows, cols = jnp.meshgrid(jnp.arange(grid_h), jnp.arange(grid_w),
                            indexing="ij")
  x = cols.reshape(-1, 1) * frequencies
  y = rows.reshape(-1, 1) * frequencies
  table = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)],
                          axis=1)
  return table[None].astype(jnp.float32)


def num_kept_patches(num_patches: int, patch_dropout_rate: float) -> int:
  """How many of an image's patches a training step keeps (at least 1)."""
  return max(1, round(num_patches * (1.0 - patch_dropout_rate)))


def kept_patches(key: jax.Array, batch: int, num_patches: int,
                 patch_dropout_rate: float) -> jax.Array:
  """Patch dropout's choice: (B, K) indices into the grid's N patches,
  K = num_kept_patches, each image its own random subset, ascending (grid
  order)."""
  num_kept = num_kept_patches(num_patches, patch_dropout_rate)
  scores = jax.random.uniform(key, (batch, num_patches))
  return jnp.sort(jnp.argsort(scores, axis=1)[:, :num_kept], axis=1)


def patches(images: jax.Array, patch_size: int,
            patch_indices: Optional[jax.Array]) -> jax.Array:
  """(B, H, W, C) -> (B, N, P, P, C) in grid order, or (B, K, P, P, C):
  the patches patch_indices (B, K)."""
  batch, height, width, channels = images.shape
  p = patch_size
  x = images.reshape(batch, height // p, p, width // p, p,
                     channels).transpose(0, 1, 3, 2, 4, 5)
  x = x.reshape(batch, -1, p, p, channels)
  if patch_indices is not None:
    x = jnp.take_along_axis(x, patch_indices[:, :, None, None, None], axis=1)
  return x


def embed_shifted_patches(images: jax.Array,
                          patch_indices: Optional[jax.Array], *,
                          patch_size: int, hidden_size: int, epsilon: float,
                          dtype: Dtype, param_dtype: Dtype) -> jax.Array:
  """Shifted Patch Tokenization: (B, H, W, C) -> (B, N, D), or (B, K, D)
  for the patches patch_indices (B, K). Call it inside a module's compact
  method: its parameters (`embedding_norm`, `embedding`) are that
  module's.

  Stacks the images and 4 diagonal shifts by half a patch (zero fill),
  layer-normalises each patch of the stack (its P * P * 5C values) and maps
  it linearly to D, with a kernel laid out like the Conv's (P, P, 5C, D).
  """
  _, height, width, _ = images.shape
  shift = patch_size // 2
  padded = jnp.pad(images, ((0, 0), (shift, shift), (shift, shift), (0, 0)))
  # The window at (dy, dx) of the padded image is the image moved by
  # (shift - dy, shift - dx): down-right, down-left, up-right, up-left.
  shifted = [padded[:, dy:dy + height, dx:dx + width]
             for dy in (0, 2 * shift) for dx in (0, 2 * shift)]
  x = patches(jnp.concatenate([images] + shifted, axis=-1), patch_size,
              patch_indices)  # (B, N or K, P, P, 5C)
  patch_axes = (2, 3, 4)
  x = nn.LayerNorm(reduction_axes=patch_axes, feature_axes=patch_axes,
                   epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                   name="embedding_norm")(x)
  # A matmul over the patch axes rather than a strided Conv: 5% faster
  # per train step on XLA:CPU for the ViT-Mini/7 Fashion-MNIST config.
  return nn.DenseGeneral(hidden_size, axis=patch_axes, dtype=dtype,
                         param_dtype=param_dtype, name="embedding")(x)
