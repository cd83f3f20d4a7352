"""Keys whose draws are computed as one dimension (vit_jax/runtime/prng.py):
the values of JAX's threefry keys, bit for bit, in less generated code."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.runtime import prng

RAW_KEY = jax.random.PRNGKey(7)

# What the trainer's keys go through: each augmentation's and initialiser's
# kind of draw, and the splits and folds between them.
DRAWS = {
    "uniform": lambda key: jax.random.uniform(key, (3, 5, 7)),
    "normal of an image batch": lambda key: jax.random.normal(
        key, (4, 8, 8, 3)),
    "bernoulli": lambda key: jax.random.bernoulli(key, 0.3, (6, 1, 1, 1)),
    "truncated normal": lambda key: jax.random.truncated_normal(
        key, -2.0, 2.0, (4, 4, 3, 16)),
    "randint": lambda key: jax.random.randint(key, (5, 4), 0, 10),
    "permutation": lambda key: jax.random.permutation(key, 10),
    "scalar": lambda key: jax.random.uniform(key, ()),
    "split, then normal": lambda key: jax.random.normal(
        jax.random.split(key, 3)[1], (2, 3)),
    "fold_in, then uniform": lambda key: jax.random.uniform(
        jax.random.fold_in(key, 5), (6, 7)),
    "split into a grid of keys": lambda key: jax.random.key_data(
        jax.random.split(jax.random.fold_in(key, 2), (2, 3)))
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else
    jax.random.split(jax.random.fold_in(key, 2), 6).reshape(2, 3, 2),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_flat_draws_equal_threefry_bit_for_bit(name):
  draw = jax.jit(DRAWS[name])
  expected = draw(RAW_KEY)
  actual = draw(prng.flat_draws(RAW_KEY))
  assert actual.shape == expected.shape and actual.dtype == expected.dtype
  np.testing.assert_array_equal(actual, expected)


def test_flax_initialisers_draw_the_same_params():
  model = nn.Sequential([nn.Conv(8, (3, 3)), nn.Dense(5)])
  images = jnp.ones((1, 6, 6, 3))
  expected = model.init(RAW_KEY, images)
  actual = model.init(prng.flat_draws(RAW_KEY), images)
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, e)


def test_the_key_keeps_its_data():
  key = prng.flat_draws(RAW_KEY)
  assert str(jax.random.key_impl(key)) == "fry_flat"  # the tag
  np.testing.assert_array_equal(jax.random.key_data(key), RAW_KEY)
  batch = prng.flat_draws(jnp.stack([RAW_KEY, RAW_KEY + 1]))
  assert batch.shape == (2,)


def _threefry_fusion_shapes(key: jax.Array) -> list[str]:
  """The shapes of the uint32 fusions XLA compiles for a (12, 2, 64) draw
  of random bits: threefry's rounds, then the bits' final xor."""
  compiled = jax.jit(lambda key: jax.random.bits(key, (12, 2, 64))).lower(
      key).compile()
  return re.findall(r"= u32\[([\d,]*)\]\S* fusion\(", compiled.as_text())


def test_a_multidimensional_draw_is_computed_flat():
  """What the key is for: threefry's rounds run on one dimension of 1536
  counters; only the last xor, fused with the reshape, has the draw's
  shape. (Drawn with a raw key, XLA:CPU runs every round on (12, 2, 64),
  and LLVM emits ~4x the code; if a JAX release stops doing that, the
  second assertion says prng.py can go.)"""
  flat = _threefry_fusion_shapes(prng.flat_draws(RAW_KEY))
  assert flat.count("1536") >= 4 and flat.count("12,2,64") <= 1, flat
  shaped = _threefry_fusion_shapes(RAW_KEY)
  assert shaped.count("12,2,64") >= 4, shaped
