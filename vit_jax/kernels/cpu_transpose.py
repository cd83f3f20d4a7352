"""x^T rounded to bfloat16, as a C++ kernel that XLA cannot fold away.

Why: a Dense layer's weight gradient x^T dy contracts both operands over
their first (row) axis. YNNPACK, which runs XLA:CPU's bfloat16 products on
the CPU's bfloat16 dot instructions (`xla_products.xla_compiler_options`), takes
only products whose left operand is contracted over its last axis, so XLA
widened that product to float32 and ran it in Eigen: on an AMX CPU at 85
GFLOP/s, against 300-370 for the layer's two other products in bfloat16
(docs/performance.md, *bfloat16 on an AMX CPU*). Given x^T made by a
transpose, XLA's simplifier folds the transpose back into the product's
dimension numbers, whatever elementwise work is put between them; a custom
call's result it cannot fold, so this kernel's x^T reaches YNNPACK as the
canonical left operand.

`transpose_to_bfloat16` works on (G, M, K) arrays, G groups of rows: under
a batch-split mesh each device transposes its own rows
(`cpu_build.batch_partitionable`).
"""

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build

_transpose = cpu_build.batch_partitionable(
    "VitTransposeToBfloat16",
    lambda x: [((x.shape[0], x.shape[2], x.shape[1]), jnp.bfloat16)], 1)


def transpose_to_bfloat16(x: jax.Array) -> jax.Array:
  """(G, M, K) float32 -> (G, K, M) bfloat16: each group's matrix
  transposed, rounded to nearest even as `x.astype(jnp.bfloat16)` rounds.
  Needs `cpu_build.problem()` to be None. Not differentiable (the backward
  passes that call it are themselves derivatives)."""
  if x.ndim != 3 or x.dtype != jnp.float32:
    raise ValueError(f"transpose_to_bfloat16 takes a (G, M, K) float32 "
                     f"array, got {x.dtype}{list(x.shape)}")
  (result,) = _transpose.bind(x)
  return result
