"""The MLP's tanh-approximate GELU on XLA:CPU as a C++ kernel, with the
first product's bias.

Why: with the Dense products in oneDNN (`cpu_gemm`), the GELU between the
MLP's two products, its recomputation and its gradient in the backward
pass are XLA loop fusions of their own, with a rational tanh; in a
ViT-Ti/16 @224 train step on an Intel Xeon they and the MLP's biases took
~100 ms, 8.5% of the step (docs/performance.md). The kernel
(`csrc/gelu_cpu.cc`) computes gelu(h + b) = x / (1 + exp(-2u)) in
register-wide vectors, with the CPU's reciprocal estimate where there is
one, and, in the backward pass, the activations (which the second
product's weight gradient reads), the GELU's gradient and the bias's
gradient (its column sums) in one pass over its input. The bias is the
first product's: added and differentiated here, it costs no pass of its
own over the (rows, mlp_dim) activations (an add in the forward pass and a
column sum in the backward pass, ~23 ms of a ViT-Ti/16 @224 train step
as XLA's fusions).

`gelu_matmul.mlp` calls it for float32 inputs on a CPU, in training and
inference, on (G, rows, mlp_dim) groups of rows (those of the oneDNN
products where they run). With bfloat16 products the kernel returns
the activations rounded to bfloat16 (`activations_dtype`), which is all
the products read of them: rounded by XLA, they were a pass of their own.
Where oneDNN's bfloat16 products take the first product's gradients as
well, the backward kernel rounds the GELU's input's gradient too
(`gradient_dtype`), which XLA rounded in a pass of its own (4.7 ms of a
346 ms ViT-Ti/16 @224 bfloat16 train step on a Zen 5).
"""

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build, cpu_gemm, helper_threads

_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


def _forward_primitive(suffix: str, activations_dtype: jnp.dtype):
  return cpu_build.batch_partitionable(
      f"VitGelu{suffix}", lambda h, bias: [(h.shape, activations_dtype)], 1)


def _backward_primitive(name: str, activations_dtype: jnp.dtype,
                        gradient_dtype: jnp.dtype):
  return cpu_build.batch_partitionable(
      name, lambda h, bias, da: [(h.shape, activations_dtype),
                                 (h.shape, gradient_dtype),
                                 (bias.shape, bias.dtype)], 1)


# The forward kernels by the activations' dtype, and the backward ones by
# (activations' dtype, the input's gradient's dtype).
_FORWARD = {_F32: _forward_primitive("", _F32),
            _BF16: _forward_primitive("Bf16", _BF16)}
_BACKWARD = {(_F32, _F32): _backward_primitive("VitGeluBackward", _F32, _F32),
             (_BF16, _F32): _backward_primitive("VitGeluBackwardBf16", _BF16,
                                                _F32),
             (_BF16, _BF16): _backward_primitive("VitGeluBackwardRounded",
                                                 _BF16, _BF16)}


def _check(h: jax.Array, bias: jax.Array, *others: jax.Array) -> None:
  if (any(a.dtype != jnp.float32 for a in (h, bias, *others))
      or h.ndim < 2 or bias.ndim != 1 or h.shape[-1] != bias.shape[0]
      or any(a.shape != h.shape for a in others)):
    raise ValueError(
        "the GELU kernel takes float32 h (G, ..., n) with a leading group "
        "axis, its bias (n,) and arrays of h's shape, got "
        f"{[f'{a.dtype}{list(a.shape)}' for a in (h, bias, *others)]}")


def _forward(activations_dtype):
  dtype = jnp.dtype(activations_dtype)
  if dtype not in _FORWARD:
    raise ValueError(f"the GELU kernel returns float32 or bfloat16 "
                     f"activations, not {dtype.name}")
  return _FORWARD[dtype]


def _backward(activations_dtype, gradient_dtype):
  dtypes = (jnp.dtype(activations_dtype), jnp.dtype(gradient_dtype))
  if dtypes not in _BACKWARD:
    raise ValueError(
        f"the GELU kernel's backward pass returns activations and the "
        f"input's gradient in float32 or bfloat16 (bfloat16 activations for "
        f"a bfloat16 gradient), not {dtypes[0].name} and {dtypes[1].name}")
  return _BACKWARD[dtypes]


def gelu(h: jax.Array, bias: jax.Array,
         activations_dtype=jnp.float32) -> jax.Array:
  """jax.nn.gelu(h + bias, approximate=True) for h (G, ..., n) and bias
  (n,), float32, returned in activations_dtype (float32 or bfloat16,
  rounded to nearest even); not differentiable itself
  (`gelu_matmul.mlp` differentiates it)."""
  _check(h, bias)
  (activations,) = _forward(activations_dtype).bind(
      h, cpu_build.per_group(bias, h.shape[0]),
      tasks=cpu_gemm.tasks_per_device(),
      helpers=helper_threads.helpers_allowed())
  return activations


def gelu_and_gradient(h: jax.Array, bias: jax.Array,
                      activations_grad: jax.Array,
                      activations_dtype=jnp.float32,
                      gradient_dtype=jnp.float32
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(gelu(h + bias) in activations_dtype, activations_grad * gelu'(h +
  bias) in gradient_dtype, bias's gradient (n,)) for h (G, ..., n),
  float32: the bias's gradient is the second's sum over all but the last
  axis, before any rounding. A bfloat16 gradient comes with bfloat16
  activations (the bfloat16 products' backward pass)."""
  _check(h, bias, activations_grad)
  activations, h_grad, bias_grad = _backward(
      activations_dtype, gradient_dtype).bind(
          h, cpu_build.per_group(bias, h.shape[0]), activations_grad,
          tasks=cpu_gemm.tasks_per_device())
  return activations, h_grad, jnp.sum(bias_grad, axis=0)
