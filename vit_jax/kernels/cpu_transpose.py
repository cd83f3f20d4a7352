"""x^T as a C++ kernel that XLA cannot fold away, in float32 or bfloat16.

Why: a Dense layer's weight gradient x^T dy contracts both operands over
their first (row) axis, and XLA:CPU's libraries run that form slower than
a plain product of a (K, R) matrix by an (R, N) one:

* YNNPACK, which runs bfloat16 products on the CPU's bfloat16 dot
  instructions (`matmuls.xla_compiler_options`), takes only products whose
  left operand is contracted over its last axis, so XLA widened the
  weight gradient to float32 and ran it in Eigen: on an AMX CPU at 85
  GFLOP/s, against 300-370 for the layer's two other products.
* Eigen packs an operand with strided reads: on one core of that CPU its
  float32 x^T dy ran at 90-127 GFLOP/s at ViT-Ti's widths, the same
  product with x^T given at 149-158.

Given x^T made by a transpose, XLA's simplifier folds the transpose back
into the product's dimension numbers, whatever elementwise work is put
between them (docs/performance.md, *bfloat16 on an AMX CPU*); a custom
call's result it cannot fold.

`transpose` works on (G, M, K) arrays, G groups of rows: under a
batch-split mesh each device transposes its own rows
(`cpu_build.batch_partitionable`).
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build


def _transposed(dtype):
  return lambda x: [((x.shape[0], x.shape[2], x.shape[1]), dtype)]


_TRANSPOSES = {
    jnp.dtype(jnp.float32): cpu_build.batch_partitionable(
        "VitTransposeFloat32", _transposed(jnp.float32), 1),
    jnp.dtype(jnp.bfloat16): cpu_build.batch_partitionable(
        "VitTransposeToBfloat16", _transposed(jnp.bfloat16), 1),
}


def problem(device=None) -> Optional[str]:
  """Why the kernels cannot run on `device` (default: JAX's first device),
  or None if they can. Builds the CPU kernels on first use."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "cpu":
    return f"it runs on CPUs, and this device is {device.platform!r}"
  return cpu_build.load()


def transpose(x: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
  """(G, M, K) float32 -> (G, K, M) `dtype` (float32 or bfloat16): each
  group's matrix transposed, and for bfloat16 rounded to nearest even as
  `x.astype(jnp.bfloat16)` rounds. Needs `problem()` to be None. Not
  differentiable (the backward passes that call it are themselves
  derivatives)."""
  if x.ndim != 3 or x.dtype != jnp.float32:
    raise ValueError(f"transpose takes a (G, M, K) float32 array, got "
                     f"{x.dtype}{list(x.shape)}")
  if jnp.dtype(dtype) not in _TRANSPOSES:
    raise ValueError(f"transpose writes float32 or bfloat16, not "
                     f"{jnp.dtype(dtype).name}")
  (result,) = _TRANSPOSES[jnp.dtype(dtype)].bind(x)
  return result
