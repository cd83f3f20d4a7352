"""The paper's Figure 7: position-embedding similarity, attention distance."""

import itertools

import jax.numpy as jnp
import numpy as np

from vit_jax.inspection import figure7
from vit_jax.model import options


def test_similarity_matches_a_brute_force_cosine():
  rng = np.random.default_rng(0)
  embeddings = rng.normal(size=(6, 5))
  similarity = figure7.position_embedding_similarity(embeddings, (2, 3))
  assert similarity.shape == (2, 3, 2, 3)
  for (a, b) in itertools.product(range(6), repeat=2):
    x, y = embeddings[a], embeddings[b]
    expected = x @ y / np.linalg.norm(x) / np.linalg.norm(y)
    np.testing.assert_allclose(similarity[a // 3, a % 3, b // 3, b % 3],
                               expected, rtol=1e-6)


def test_sincos_embeddings_are_most_similar_to_their_neighbours():
  grid = (6, 6)
  embeddings = np.asarray(options.sincos_2d_posemb(*grid, 64)[0])
  similarity = figure7.position_embedding_similarity(embeddings, grid)
  centre = similarity[2, 3]
  assert np.isclose(centre[2, 3], 1.0)
  assert centre[2, 4] > centre[2, 5] > centre[5, 0]  # falls with distance
  np.testing.assert_allclose(similarity, similarity.transpose(2, 3, 0, 1),
                             atol=1e-6)


def test_patch_distances_in_pixels():
  distances = figure7.patch_distances((2, 2), patch_size=16)
  np.testing.assert_allclose(distances[0], [0, 16, 16, 16 * np.sqrt(2)])


def _weights(patch_attention, prefix=1):
  """One layer, one image, one head: prefix tokens then the patches."""
  size = patch_attention.shape[0] + prefix
  full = np.zeros((size, size))
  full[prefix:, prefix:] = patch_attention
  full[prefix:, :prefix] = 0.5  # class-token attention is left out
  return [jnp.asarray(full[None, None])]


def test_attention_distance_of_known_patterns():
  grid, patch = (3, 3), 8
  distances = figure7.patch_distances(grid, patch)
  to_self = figure7.mean_attention_distance(_weights(np.eye(9)), grid, patch,
                                            num_prefix_tokens=1)
  uniform = figure7.mean_attention_distance(
      _weights(np.full((9, 9), 1 / 9)), grid, patch, num_prefix_tokens=1)
  to_corner = np.zeros((9, 9))
  to_corner[:, 0] = 1
  corner = figure7.mean_attention_distance(_weights(to_corner, prefix=0),
                                           grid, patch, num_prefix_tokens=0)
  assert to_self.shape == (1, 1) and np.isclose(to_self[0, 0], 0)
  np.testing.assert_allclose(uniform[0, 0], distances.mean(), rtol=1e-5)
  np.testing.assert_allclose(corner[0, 0], distances[:, 0].mean(), rtol=1e-5)
