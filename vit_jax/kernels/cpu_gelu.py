"""The MLP's tanh-approximate GELU on XLA:CPU as a C++ kernel.

Why: with the Dense products in oneDNN (`cpu_gemm`), the GELU between the
MLP's two products, its recomputation and its gradient in the backward
pass are XLA loop fusions of their own, with a rational tanh; in a
ViT-Ti/16 @224 train step on an Intel Xeon they and the MLP's biases took
~100 ms, 8.5% of the step (docs/performance.md). The kernel
(`csrc/gelu_cpu.cc`) computes gelu(h) = h / (1 + exp(-2u)) in register-wide
vectors, with the CPU's reciprocal estimate where there is one, and, in
the backward pass, the activations (which the second product's weight
gradient reads) and the GELU's gradient in one pass over its input.

`matmuls.gelu_dot_general` calls it for float32 inputs on a CPU under
differentiation (training), on (G, rows, mlp_dim) groups of rows (those of
the oneDNN products where they run). Without differentiation XLA's GELU
runs instead: it then fuses with the bias add before it into one pass,
which this kernel cannot join.
"""

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build, cpu_gemm

_FORWARD = cpu_build.batch_partitionable(
    "VitGelu", lambda h: [(h.shape, h.dtype)], 1)
_BACKWARD = cpu_build.batch_partitionable(
    "VitGeluBackward", lambda h, da: [(h.shape, h.dtype)] * 2, 1)


def _check(*arrays: jax.Array) -> None:
  if any(a.ndim < 2 or a.dtype != jnp.float32 or a.shape != arrays[0].shape
         for a in arrays):
    raise ValueError(
        "the GELU kernel takes float32 arrays of one shape with a leading "
        f"group axis, got {[f'{a.dtype}{list(a.shape)}' for a in arrays]}")


def gelu(h: jax.Array) -> jax.Array:
  """jax.nn.gelu(h, approximate=True) for h (G, ...), float32; not
  differentiable itself (`gelu_dot_general` differentiates it)."""
  _check(h)
  (activations,) = _FORWARD.bind(h, tasks=cpu_gemm.tasks_per_device())
  return activations


def gelu_and_gradient(h: jax.Array, activations_grad: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
  """(gelu(h), activations_grad * gelu'(h)) for h (G, ...), float32."""
  _check(h, activations_grad)
  activations, h_grad = _BACKWARD.bind(h, activations_grad,
                                       tasks=cpu_gemm.tasks_per_device())
  return activations, h_grad
