"""LayerNorm on XLA:CPU as a C++ kernel, forward and backward.

Why: XLA:CPU computes a LayerNorm as several fusions, rewriting each row
sum into a reduce-window and a reduce, and its backward pass as more of
them; in a ViT-Ti/16 @224 train step on an Intel Xeon its LayerNorms took
83 ms against PyTorch's 39 (docs/performance.md). The kernel
(`csrc/layer_norm_cpu.cc`) reads each row once or twice while it sits in
the core's cache: the mean and variance, then the normalised row; the
backward pass the two row means it needs, then the input's gradient,
summing the scale's and bias's gradients per block of rows.

The arrays carry a leading axis of G groups of rows, as the oneDNN
products' do (`matmuls.per_token`): under a batch-split mesh each device
normalises its own rows, and the parameter gradients' sum over the groups
is the all-reduce the gradient needs anyway.
"""

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.kernels import cpu_build, cpu_gemm, helper_threads, matmuls

# The encoder blocks' LayerNorm implementations (`VisionTransformer`'s
# layer_norm_implementation): "auto" resolves to one of the others.
IMPLEMENTATIONS = ("auto", "cpu_kernel", "xla")


def resolve_implementation(requested: str, dtype: Any, device: Any = None
                           ) -> str:
  """"cpu_kernel" or "xla" for LayerNorms computing in `dtype` on `device`
  (default: JAX's first). "auto" takes the kernel for float32 on a CPU
  where the kernels build, Flax's LayerNorm (XLA's fusions) elsewhere;
  "cpu_kernel" raises where it cannot run."""
  def problem():
    if jnp.dtype(dtype) != jnp.float32:
      return (f"it computes in float32, and this model in "
              f"{jnp.dtype(dtype).name}")
    return cpu_build.problem(device)

  return cpu_build.choose_implementation(
      "layer_norm_implementation", requested, IMPLEMENTATIONS, problem,
      "the kernel", "Flax's LayerNorm")


_FORWARD = cpu_build.batch_partitionable(
    "VitLayerNormForward",
    lambda x, scale, bias: [(x.shape, x.dtype), (x.shape[:2], x.dtype),
                            (x.shape[:2], x.dtype)], 1)
_BACKWARD = cpu_build.batch_partitionable(
    "VitLayerNormBackward",
    lambda x, scale, *_: [(x.shape, x.dtype), (scale.shape, x.dtype),
                          (scale.shape, x.dtype)], 1)


def _check(x: jax.Array, scale: jax.Array, bias: jax.Array) -> None:
  if (x.ndim != 3 or scale.shape != x.shape[2:] or bias.shape != x.shape[2:]
      or any(a.dtype != jnp.float32 for a in (x, scale, bias))):
    raise ValueError(
        "layer_norm takes x (G, rows, D), scale and bias (D,), float32; got "
        f"{[f'{a.dtype}{list(a.shape)}' for a in (x, scale, bias)]}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array,
               epsilon: float) -> jax.Array:
  """(x - mean) / sqrt(var + epsilon) * scale + bias over x's last axis:
  x (G, R, D), scale and bias (D,) -> (G, R, D), float32.

  Undifferentiated (inference), a small x runs in fewer tasks
  (`cpu_gemm.tasks_for_elements`). A train step's LayerNorms keep the
  device's tasks: with one task a batch-1 step measured 1-1.5% slower in
  three runs of four, within the host's noise, and no faster."""
  return _normalise(x, scale, bias, epsilon,
                    cpu_gemm.tasks_for_elements(x.size))[0]


def _normalise(x, scale, bias, epsilon, tasks):
  _check(x, scale, bias)
  groups = x.shape[0]
  return _FORWARD.bind(
      x, cpu_build.per_group(scale, groups), cpu_build.per_group(bias, groups),
      epsilon=np.float32(epsilon), tasks=tasks,
      helpers=helper_threads.helpers_allowed())


@helper_threads.on_xla_threads
def _layer_norm_forward(x, scale, bias, epsilon):
  y, mean, rstd = _normalise(x, scale, bias, epsilon,
                             cpu_gemm.tasks_per_device())
  return y, (x, scale, mean, rstd)


def _layer_norm_backward(epsilon, residuals, output_grad):
  del epsilon  # rstd holds it
  x, scale, mean, rstd = residuals
  x_grad, scale_grads, bias_grads = _BACKWARD.bind(
      x, cpu_build.per_group(scale, x.shape[0]), mean, rstd, output_grad,
      tasks=cpu_gemm.tasks_per_device())
  return x_grad, scale_grads.sum(axis=0), bias_grads.sum(axis=0)


layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


class LayerNorm(nn.Module):
  """`flax.linen.LayerNorm` over the last axis of float32 rows x (R, D), or
  (G, R, D) in groups (`matmuls.per_token`), run by the C++ kernel: the
  same parameters ("scale", "bias", (D,)) and values up to float rounding
  (the variance by two passes over the row, where Flax takes E[x^2] -
  E[x]^2). Rows without groups are split into `matmuls.row_groups`."""
  epsilon: float = 1e-6
  param_dtype: Optional[jnp.dtype] = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (features,),
                       self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (features,),
                      self.param_dtype)
    grouped = (x if x.ndim == 3 else
               x.reshape(matmuls.row_groups(x.shape[0]), -1, features))
    y = layer_norm(grouped, scale.astype(x.dtype), bias.astype(x.dtype),
                   self.epsilon)
    return y.reshape(x.shape)
