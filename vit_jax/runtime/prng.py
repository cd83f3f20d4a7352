"""Random keys whose draws XLA:CPU compiles to less code.

JAX's threefry2x32 draws `shape` random bits from a counter per element,
an iota of `shape`. XLA:CPU emits that fusion (and each of the threefry
rounds' fusions) as a loop nest with one loop per dimension, which LLVM
then unrolls and vectorises dimension by dimension: a (12, 2, 64) draw
became 440 KB of optimised LLVM IR and a (64, 32, 32, 3) one 450 KB,
against ~100 KB for the same count of bits as one dimension. Drawn flat and
reshaped, the bits are the same, bit for bit (the counter is the row-major
index either way), and the `vit_tiny_cifar` train step, with its
augmentations' and drop-path's draws, compiled 0.7-0.8 s sooner and its
initialisation 0.3 s (docs/performance.md, *Compile time*, *Random draws
as one dimension*).

`flat_draws(key)` turns a raw uint32[2] key (as `jax.random.PRNGKey`
makes, and as the train state and its checkpoints hold) into a typed key
of `flat_threefry()`: threefry2x32's seed, split and fold-in, its random bits
drawn flat. Every key split or folded from it, and every draw from those
(jax.random's, flax's initialisers and `make_rng`), then takes the flat
path, with the values a raw key gives.
"""

import functools
import math

import jax
from jax.extend import random as jax_random


def _flat_random_bits(key: jax.Array, bit_width: int,
                      shape: tuple[int, ...]) -> jax.Array:
  """threefry2x32's random bits of `shape`, drawn as one dimension."""
  bits = jax_random.threefry_prng_impl.random_bits
  return bits(key, bit_width, (math.prod(shape),)).reshape(shape)


@functools.cache
def flat_threefry():
  """The PRNG implementation: threefry2x32, its bits drawn flat. Defined
  on first use (defining one registers it with JAX)."""
  threefry = jax_random.threefry_prng_impl
  return jax_random.define_prng_impl(
      key_shape=threefry.key_shape, seed=threefry.seed, split=threefry.split,
      random_bits=_flat_random_bits, fold_in=threefry.fold_in,
      name="threefry2x32_flat", tag="fry_flat")


def flat_draws(raw_key: jax.Array) -> jax.Array:
  """A raw threefry key uint32[..., 2] -> a typed key of `flat_threefry()`
  with the same data: its draws have the same values, and compile
  faster."""
  return jax.random.wrap_key_data(raw_key, impl=flat_threefry())
