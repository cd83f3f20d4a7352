"""The paper's Figure 7, for any trained model: what the ViT learned about
space.

* Centre: **position-embedding similarity.** The cosine similarity of each
  patch's position embedding with every other patch's, drawn on the patch
  grid: a trained ViT learns 2-D structure (nearby patches, the same row
  and the same column look alike) from 1-D embeddings it was given no
  geometry for.
* Right: **mean attention distance.** For each head of each layer, the
  distance in pixels between a query patch and the patches it attends to,
  weighted by the attention, averaged over queries and images: the ViT
  analogue of a receptive field. Low layers mix local heads (a few
  patches) and global ones; deep layers attend globally.

Pure functions of arrays; plots.figure7_* draw them and
`python main.py --mode=figure7` runs both on a trained workdir.
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.model import options


def patch_position_embeddings(params: dict, model, grid: tuple[int, int]
                              ) -> np.ndarray:
  """(h*w, D) position embeddings of the patches (class token's dropped):
  the learned ones from `params`, or the fixed sin-cos ones."""
  if model.posemb == "sincos2d":
    return np.asarray(options.sincos_2d_posemb(*grid, model.hidden_size)[0])
  table = np.asarray(params["Transformer"]["posembed_input"]["pos_embedding"]
                     [0], np.float32)
  num_patches = grid[0] * grid[1]
  if len(table) not in (num_patches, num_patches + 1):
    raise ValueError(f"The position embedding has {len(table)} rows; a "
                     f"{grid[0]}x{grid[1]} grid needs {num_patches} (+1 "
                     "with a class token).")
  return table[len(table) - num_patches:]


def position_embedding_similarity(embeddings: np.ndarray,
                                  grid: tuple[int, int]) -> np.ndarray:
  """Cosine similarity of every patch's embedding with every other's.

  embeddings: (h*w, D) in raster order. Returns (h, w, h, w): [i, j] is
  the map of patch (i, j)'s similarity to each patch of the grid.
  """
  unit = embeddings / np.maximum(
      np.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
  return (unit @ unit.T).reshape(*grid, *grid)


def patch_distances(grid: tuple[int, int], patch_size: int) -> np.ndarray:
  """(h*w, h*w) Euclidean distances in pixels between patch centres."""
  rows, columns = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]),
                              indexing="ij")
  centres = np.stack([rows.ravel(), columns.ravel()], -1) * patch_size
  return np.linalg.norm(centres[:, None] - centres[None], axis=-1)


def mean_attention_distance(weights: Sequence[jax.Array],
                            grid: tuple[int, int], patch_size: int,
                            num_prefix_tokens: int) -> np.ndarray:
  """(layers, heads) mean attention distance in pixels.

  weights: per layer (B, heads, T, T) attention probabilities (T = prefix
  + h*w tokens). Patch-to-patch attention only, renormalised over the
  patches (the class token has no position on the image); averaged over
  query patches and images.
  """
  distance = jnp.asarray(patch_distances(grid, patch_size), jnp.float32)
  result = []
  for layer in weights:
    patches = layer[:, :, num_prefix_tokens:, num_prefix_tokens:]
    patches = patches / jnp.maximum(patches.sum(-1, keepdims=True), 1e-12)
    per_query = (patches * distance).sum(-1)  # (B, heads, queries)
    result.append(per_query.mean(axis=(0, 2)))
  return np.asarray(jnp.stack(result))
