"""The sum of the squares of many arrays in a few C++ kernel calls on
XLA:CPU: the square of the gradients' global norm (`optim.global_norm`),
which clipping and the train step's metrics read.

Why: XLA:CPU reduces each array in a fusion of its own, ~200 for a ViT's
gradients, which compiled ~2.5 s slower in a vit_tiny_cifar train step than
one reduction over the gradients concatenated (`optim.global_norm`'s XLA
path). But that concatenation copies every gradient first, and XLA squared
the copy into another array before reducing it: three passes over the
gradients' memory where one suffices, 3.7 ms of a 35 ms vit_tiny_cifar
train step at batch 1 on a 2-core AMD EPYC (Zen 4). The kernel
(`csrc/sum_of_squares_cpu.cc`) reads each gradient once, a few leaves to a
call, and sums in the same order whatever the threads.

Arrays must be float32 and whole on every device (replicated), as
`cpu_adamw`'s; `optim.global_norm` takes XLA's path elsewhere.
"""

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.kernels import cpu_build, cpu_gemm

# Leaves per custom call, as cpu_adamw.LEAVES_PER_CALL (XLA's passes slowed
# over one call with hundreds of operands).
LEAVES_PER_CALL = 32


def sum_of_squares(leaves: Sequence[jax.Array],
                   tasks: Optional[int] = None) -> jax.Array:
  """sum(x ** 2) over every element of every array in `leaves` (float32,
  any shapes), a float32 scalar. tasks: XLA threads to spread the work
  over (default: the cores of a device)."""
  if any(leaf.dtype != jnp.float32 for leaf in leaves):
    raise ValueError(
        "the sum-of-squares kernel takes float32 arrays, got "
        f"{sorted({jnp.dtype(leaf.dtype).name for leaf in leaves})}")
  leaves = [leaf for leaf in leaves if leaf.size]
  if not leaves:
    return jnp.zeros((), jnp.float32)
  problem = cpu_build.load()
  if problem:
    raise RuntimeError(f"the sum-of-squares kernel cannot run: {problem}")
  call = jax.ffi.ffi_call("VitSumOfSquares",
                          jax.ShapeDtypeStruct((), jnp.float32))
  tasks = np.int64(tasks or cpu_gemm.tasks_per_device())
  parts = [call(*leaves[start:start + LEAVES_PER_CALL], tasks=tasks)
           for start in range(0, len(leaves), LEAVES_PER_CALL)]
  return sum(parts[1:], parts[0])
