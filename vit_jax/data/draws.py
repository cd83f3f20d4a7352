"""Random numbers for on-device augmentation, many from one draw.

On a CPU, JAX lowers each random draw (`jax.random.uniform`, `normal`,
`bernoulli`, `split`; `randint` is two) to a loop of threefry rounds,
which XLA compiles into kernels of its own, and a rejection sampler such
as `jax.random.gamma` adds a loop of its own. Every train step with
augmentation compiles them all. So the augmentations take their numbers
per image from one `uniforms` draw and turn them into what they need with
the functions here, which are plain arithmetic.
"""

import jax
import jax.numpy as jnp
import numpy as np

_TINY = np.finfo(np.float32).tiny


def uniforms(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform float32 numbers on [tiny, 1): never 0, so that their logs and
  inverse CDFs stay finite."""
  return jax.random.uniform(key, shape, minval=_TINY)


def standard_normal(u: jax.Array) -> jax.Array:
  """N(0, 1) numbers from uniforms on (0, 1), by the inverse CDF (as
  `jax.random.normal` makes them)."""
  above_minus_one = np.nextafter(np.float32(-1), np.float32(0))
  return np.sqrt(2.0).astype(np.float32) * jax.lax.erf_inv(
      jnp.maximum(2 * u - 1, above_minus_one))


def integers(u: jax.Array, count: int) -> jax.Array:
  """Uniform int32 numbers in [0, count) from uniforms on [0, 1)."""
  return jnp.minimum((u * count).astype(jnp.int32), count - 1)


def signs(u: jax.Array) -> jax.Array:
  """+1 or -1, each with probability 1/2, from uniforms on [0, 1)."""
  return jnp.where(u < 0.5, 1.0, -1.0)
