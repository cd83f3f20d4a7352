"""AdamW's update of every parameter in a few C++ kernel calls on XLA:CPU.

Why: `optim.adamw`, like `optax.adamw`, updates each parameter array on
its own, and XLA makes three fusions of each (the two moments, and the
update with the parameter's add): 456 of a ViT-Ti step's 867 for its 152
arrays, which XLA partitions, optimises, compiles and schedules one by
one. On a 2-core AMD EPYC (Zen 3) the vit_tiny_cifar train step on a
device per core compiled in 5.6-6.3 s with them against 3.4 s with plain
SGD (docs/performance.md, *An AVX2-only AMD EPYC, and AdamW in one
kernel*). The kernel (`csrc/adamw_cpu.cc`) updates the leaves a few to a
call, with the moments in place, and takes clipping's scale of the
gradients (`optim.clip_by_global_norm_into`), so that no fusion per leaf
is left but the parameter's add: that step compiled in 4.1-4.9 s.

The arithmetic is optim.adamw's, in its order; the CPU's fused
multiply-adds may round a last bit differently from XLA's (the tests
compare against float64 and against the XLA path). Parameters must be
float32 and whole on every device (replicated): under FSDP, where each
device holds a slice, `optim.make_optimizer` takes XLA's path.
"""

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.kernels import cpu_build, cpu_gemm

IMPLEMENTATIONS = ("auto", "cpu_kernel", "xla")
# Leaves per custom call: XLA's fusion pass took 0.7 s of the compile over
# one call with all 600 operands of a ViT-Ti's 152 leaves, and nothing
# measurable over calls of 8 (the kernel's own work does not change).
LEAVES_PER_CALL = 8


def resolve_implementation(requested: str, leaves: Sequence[Any],
                           device: Any = None) -> str:
  """"cpu_kernel" or "xla" for updating `leaves` (arrays or tracers) on
  `device` (default: JAX's first). "auto" takes the kernel for float32
  leaves on a CPU where the kernels build, XLA's fusions elsewhere;
  "cpu_kernel" raises where it cannot run."""
  def problem():
    dtypes = sorted({jnp.dtype(leaf.dtype).name for leaf in leaves})
    if dtypes not in ([], ["float32"]):
      return f"it updates float32 parameters, and these are {dtypes}"
    return cpu_build.problem(device)

  return cpu_build.choose_implementation(
      "optimizer_implementation", requested, IMPLEMENTATIONS, problem,
      "the kernel", "XLA's fusions")


def update(grads: Sequence[jax.Array], mus: Sequence[jax.Array],
           nus: Sequence[jax.Array], params: Sequence[jax.Array],
           decayed: Sequence[bool], correction1: jax.Array,
           correction2: jax.Array, step_size: jax.Array,
           grad_scale: Any = 1.0, *, b1: float, b2: float, eps: float,
           weight_decay: float, apply: bool = False,
           tasks: Optional[int] = None
           ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
  """(updates, first moments, second moments) of AdamW for L leaves; with
  `apply`, (params + updates, first moments, second moments).

  grads, mus, nus, params: L float32 arrays each, leaf i's four of one
  shape; decayed: L flags (weight decay for leaf i); correction1,
  correction2: the bias corrections 1 - b1^t and 1 - b2^t; step_size: minus
  the learning rate; grad_scale: what the gradients are multiplied by
  first (clipping's factor; scalars). The moments' results alias their
  operands (donated ones are updated in place), and so do the parameters'
  with `apply`: the update is added in the same pass over memory, where
  optax.apply_updates is a fusion per leaf reading them again. tasks: XLA
  threads to spread the leaves over (default: the cores of a device).
  """
  leaves = len(params)
  if not (len(grads) == len(mus) == len(nus) == leaves == len(decayed)):
    raise ValueError("the AdamW kernel takes as many gradients, moments, "
                     "parameters and decay flags as there are leaves")
  for arrays in zip(grads, mus, nus, params):
    if any(a.dtype != jnp.float32 or a.shape != arrays[0].shape
           for a in arrays):
      raise ValueError(
          "the AdamW kernel takes float32 gradients, moments and parameters "
          "of one shape per leaf, got "
          f"{[f'{a.dtype}{list(a.shape)}' for a in arrays]}")
  if not leaves:
    return [], [], []
  problem = cpu_build.load()
  if problem:
    raise RuntimeError(f"the AdamW kernel cannot run: {problem}")
  scalars = jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in
                       (correction1, correction2, step_size, grad_scale)])
  attributes = dict(
      b1=np.float32(b1), one_minus_b1=np.float32(1 - b1), b2=np.float32(b2),
      one_minus_b2=np.float32(1 - b2), eps=np.float32(eps),
      weight_decay=np.float32(weight_decay), apply=bool(apply),
      tasks=np.int64(tasks or cpu_gemm.tasks_per_device()))
  results = ([], [], [])
  for start in range(0, leaves, LEAVES_PER_CALL):
    part = slice(start, start + LEAVES_PER_CALL)
    for result, leaf_results in zip(results, _call(
        scalars, grads[part], mus[part], nus[part], params[part],
        np.asarray(decayed[part], np.int64), attributes)):
      result.extend(leaf_results)
  return results


def _call(scalars: jax.Array, grads, mus, nus, params, decayed: np.ndarray,
          attributes: dict) -> tuple[list, list, list]:
  """One VitAdamW call for a few leaves: updates (or the parameters
  updated), mus, nus."""
  leaves = len(params)
  shapes = [jax.ShapeDtypeStruct(p.shape, jnp.float32) for p in params] * 3
  # Operands: scalars, then gradients, mus, nus, params; results: updates,
  # mus, nus, the moments written over their operands (the train step's,
  # donated), and the parameters too where they are the results. Not the
  # gradients: other kernels' results, which XLA then copied to let them
  # be overwritten (~200 copies in a ViT-Ti step).
  aliases = {1 + leaves + i: leaves + i for i in range(2 * leaves)}
  if attributes["apply"]:
    aliases.update({1 + 3 * leaves + i: i for i in range(leaves)})
  call = jax.ffi.ffi_call("VitAdamW", shapes, input_output_aliases=aliases)
  results = call(scalars, *grads, *mus, *nus, *params, decayed=decayed,
                 **attributes)
  return (results[:leaves], results[leaves:2 * leaves],
          results[2 * leaves:])
