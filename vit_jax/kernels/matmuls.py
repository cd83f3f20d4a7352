"""The Dense layers' matmuls, with backward passes written for XLA:CPU.

`dense_dot_general` is a `dot_general` for `flax.linen.Dense` or
`DenseGeneral` (`nn.Dense(..., dot_general=dense_dot_general)`): the same
values and gradients as `jax.lax.dot_general`, up to float rounding, with
a backward pass that computes the kernel's gradient, a product over the
rows (tokens), in the orientation XLA:CPU runs fastest
(`xla_products.kernel_gradient`). It takes the matmuls Flax's layers make:
the inputs' last axes contracted with the kernel's first axes, no batch
axes. Other dimension numbers get `jax.lax.dot_general` itself.

With `operand_dtype` (bfloat16) every product of the layer, forward and
backward, reads its two operands rounded to that dtype and accumulates
and returns float32 (the inputs' dtype): what CPUs with bfloat16 dot
instructions (AVX512_BF16, AMX) run at two to three times their float32
rate, through YNNPACK, which `xla_products.xla_compiler_options` turns on
for such programs.

With `implementation="onednn"` (which `resolve_implementation` picks for
"auto" on a CPU: float32 products, and bfloat16 operands where the CPU has
AVX512_BF16 and no AMX) the layer's three products run through oneDNN's
gemms (`cpu_gemm`), on rows in groups (`per_token`).

The MLP's second Dense, with the GELU before it, is `gelu_matmul`'s, made
of this module's `dot` and `matmul_gradients`. Attention's query, key and
value, one product of the same tokens, take oneDNN's gemms with their
three kernels side by side (`side_by_side_matmul`).
"""

import functools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.kernels import cpu_build, cpu_gemm, helper_threads, xla_products

# The Dense products' implementations (`VisionTransformer`'s
# matmul_implementation): "auto" resolves to one of the others.
IMPLEMENTATIONS = ("auto", "onednn", "xla")


def resolve_implementation(requested: str, dtype: Any,
                           operand_dtype: Any = None,
                           device: Any = None) -> str:
  """The Dense products' implementation, "onednn" or "xla", for products
  computing in `dtype` with `operand_dtype` (None or bfloat16) on `device`
  (default: JAX's first). "auto" takes oneDNN's gemms (`cpu_gemm`) for
  float32 products on a CPU where it loads, and for bfloat16 operands
  where `cpu_gemm.bfloat16_problem` finds none, XLA's dots elsewhere;
  "onednn" raises where it cannot run."""
  return cpu_build.choose_implementation(
      "matmul_implementation", requested, IMPLEMENTATIONS,
      lambda: _onednn_problem(dtype, operand_dtype, device), "oneDNN",
      "XLA's products")


def _onednn_problem(dtype: Any, operand_dtype: Any, device: Any
                    ) -> Optional[str]:
  """Why oneDNN's products cannot run these, or None if they can."""
  if operand_dtype is not None:
    if jnp.dtype(operand_dtype) != jnp.bfloat16:
      return (f"it takes float32 or bfloat16 operands, and these have "
              f"{jnp.dtype(operand_dtype).name} ones")
    if problem := cpu_gemm.bfloat16_problem():
      return f"bfloat16 operands take XLA's products here: {problem}"
  if jnp.dtype(dtype) != jnp.float32:
    return (f"it computes float32 products, and these compute in "
            f"{jnp.dtype(dtype).name}")
  return cpu_gemm.problem(device)


def tie_to_gradient(x: jax.Array, output_grad: jax.Array) -> jax.Array:
  """x's values, but computable only once the backward pass has reached
  output_grad: x + 0 * (output_grad's first element in each row). Both
  have the same leading (batch or token) axis.

  Why: a recomputation in a custom backward pass is the same expression as
  the forward pass's original; XLA merges the two (common subexpressions)
  and keeps the original alive from the forward pass, which is what the
  recomputation was to avoid. XLA:CPU drops optimization barriers, so only
  a data dependence keeps them apart. One element per row, not one in all:
  rows stay on the device that holds them when the batch is split.
  """
  rest = output_grad.ndim - 1
  first = output_grad[(slice(None),) + (slice(0, 1),) * rest]
  first = first.reshape((x.shape[0],) + (1,) * (x.ndim - 1))
  return x + (first * 0).astype(x.dtype)


def per_token(layer, x: jax.Array, grouped: bool = False) -> jax.Array:
  """layer applied to x (B, T, ...) as one (B*T, ...) matrix of tokens, or
  with grouped=True as (G, B*T/G, ...), G = `row_groups(B)`.

  The same values as layer(x) for a token-wise layer (LayerNorm, Dense, MLP).
  Why: the gradients of its biases and LayerNorm scales are then sums over
  one axis of B*T rows. Over (B, T), XLA:CPU sums in 32 x 32 windows and
  pads T (65 tokens to 96), 2-5x slower: a 768-wide bias gradient of
  vit_tiny_cifar took 9 ms that way and 1.8 ms this way. Grouped for the
  oneDNN products, which take each device's rows as a group: every
  product, bias gradient and LayerNorm of the block then reads the same
  array, where rows reshaped into groups between them made XLA compute
  their producers twice, once per shape.
  """
  batch, num_tokens = x.shape[:2]
  if grouped:
    groups = row_groups(batch)
    y = layer(x.reshape(groups, batch * num_tokens // groups, *x.shape[2:]))
    return y.reshape(batch, num_tokens, *y.shape[2:])
  y = layer(x.reshape(batch * num_tokens, *x.shape[2:]))
  return y.reshape(batch, num_tokens, *y.shape[1:])


def row_groups(rows: int) -> int:
  """Groups of rows for the oneDNN products: one per device where the rows
  divide so (as a batch split over the devices does)."""
  return math.gcd(rows, jax.device_count())


def grouped_rows(x: jax.Array, num_contracted: int) -> jax.Array:
  """x (..., *K) as (G, M, prod(K)): its first axis as the groups if it has
  two or more leading axes (`per_token`'s grouping), else its rows in
  `row_groups` groups."""
  leading = x.shape[:x.ndim - num_contracted]
  depth = int(np.prod(x.shape[x.ndim - num_contracted:]))
  groups = (leading[0] if len(leading) >= 2
            else row_groups(int(np.prod(leading))))
  return x.reshape(groups, -1, depth)


def is_dense_matmul(inputs, kernel, dimension_numbers) -> bool:
  """Whether dimension_numbers contract inputs' last axes with kernel's
  first ones in order, without batch axes: the products Dense and
  DenseGeneral (over trailing axes) make."""
  (input_axes, kernel_axes), (input_batch, kernel_batch) = dimension_numbers
  num = len(input_axes)
  return (not input_batch and not kernel_batch and num == len(kernel_axes)
          and tuple(input_axes) == tuple(range(inputs.ndim - num, inputs.ndim))
          and tuple(kernel_axes) == tuple(range(num)))


def matmul_gradients(inputs, kernel, output_grad, num_contracted, precision,
                     operand_dtype, implementation):
  """(inputs' gradient, kernel's gradient) of the matmul of inputs
  (..., *K) and kernel (*K, *N), len(K) = num_contracted, given
  output_grad (..., *N) (in operand_dtype already, or float32)."""
  depth = int(np.prod(kernel.shape[:num_contracted]))
  width = int(np.prod(kernel.shape[num_contracted:]))
  if implementation == "onednn":
    grouped = grouped_rows(inputs, num_contracted)
    if output_grad.dtype != operand_dtype:  # else rounded as the gemms read it
      output_grad = output_grad.astype(inputs.dtype)
    output_grad = output_grad.reshape(grouped.shape[:2] + (width,))
    kernel_2d = kernel.reshape(depth, width).astype(inputs.dtype)
    inputs_grad = cpu_gemm.rows_times_transposed(output_grad, kernel_2d,
                                                 operand_dtype)
    kernel_grad = cpu_gemm.rows_transposed_times(grouped, output_grad,
                                                 operand_dtype)
    return (inputs_grad.reshape(inputs.shape).astype(inputs.dtype),
            kernel_grad.reshape(kernel.shape).astype(kernel.dtype))
  output_grad = output_grad.reshape(-1, width)
  inputs_grad = xla_products.product(
      output_grad.astype(kernel.dtype), kernel.reshape(depth, width),
      (((1,), (1,)), ((), ())), precision, operand_dtype)
  kernel_grad = xla_products.kernel_gradient(
      inputs.reshape(-1, depth), output_grad, precision, operand_dtype)
  return (inputs_grad.reshape(inputs.shape).astype(inputs.dtype),
          kernel_grad.reshape(kernel.shape).astype(kernel.dtype))


def dot(inputs, kernel, dimension_numbers, precision,
        preferred_element_type, operand_dtype=None, implementation="xla"):
  """`jax.lax.dot_general(inputs, kernel, ...)` without a backward pass of
  its own: in oneDNN for Dense products with implementation "onednn",
  with operands rounded to operand_dtype if given (inputs may come rounded
  already: the result is then in the kernel's dtype)."""
  if (implementation == "onednn"
      and is_dense_matmul(inputs, kernel, dimension_numbers)):
    num = len(dimension_numbers[0][0])
    # Rounded before the reshape: a kernel stored in operand_dtype
    # (`model.inference`) and promoted to the inputs' dtype by flax then
    # meets its round trip's other half, which XLA removes.
    kernel_2d = kernel.astype(operand_dtype or inputs.dtype).reshape(
        int(np.prod(kernel.shape[:num])), -1)
    product = cpu_gemm.rows_times(grouped_rows(inputs, num), kernel_2d,
                                  operand_dtype)
    return product.reshape(inputs.shape[:inputs.ndim - num]
                           + kernel.shape[num:])
  if operand_dtype is not None:
    return xla_products.product(
        inputs, kernel, dimension_numbers, precision, operand_dtype,
        preferred_element_type or jnp.promote_types(inputs.dtype,
                                                    kernel.dtype))
  return jax.lax.dot_general(inputs, kernel, dimension_numbers,
                             precision=precision,
                             preferred_element_type=preferred_element_type)


_matmul = jax.custom_vjp(dot, nondiff_argnums=(2, 3, 4, 5, 6))


@helper_threads.on_xla_threads
def _matmul_forward(inputs, kernel, dimension_numbers, precision,
                    preferred_element_type, operand_dtype, implementation):
  return (dot(inputs, kernel, dimension_numbers, precision,
              preferred_element_type, operand_dtype, implementation),
          (inputs, kernel))


@helper_threads.on_xla_threads
def _matmul_backward_rule(dimension_numbers, precision, preferred_element_type,
                          operand_dtype, implementation, residuals,
                          output_grad):
  del preferred_element_type
  inputs, kernel = residuals
  return matmul_gradients(inputs, kernel, output_grad,
                          len(dimension_numbers[0][0]), precision,
                          operand_dtype, implementation)


_matmul.defvjp(_matmul_forward, _matmul_backward_rule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _side_by_side(operand_dtype, inputs, *kernels):
  return cpu_gemm.rows_times(inputs, kernels, operand_dtype)


@helper_threads.on_xla_threads
def _side_by_side_forward(operand_dtype, inputs, *kernels):
  return _side_by_side(operand_dtype, inputs, *kernels), (inputs, kernels)


@helper_threads.on_xla_threads
def _side_by_side_backward(operand_dtype, residuals, output_grad):
  inputs, kernels = residuals
  if output_grad.dtype != operand_dtype:  # else rounded as the gemms read it
    output_grad = output_grad.astype(inputs.dtype)
  inputs_grad = cpu_gemm.rows_times_transposed(
      output_grad, [kernel.astype(inputs.dtype) for kernel in kernels],
      operand_dtype)
  kernel_grads = cpu_gemm.rows_transposed_times(
      inputs, output_grad, operand_dtype,
      widths=[kernel.shape[1] for kernel in kernels])
  return (inputs_grad.astype(inputs.dtype),
          *(grad.astype(kernel.dtype)
            for grad, kernel in zip(kernel_grads, kernels)))


_side_by_side.defvjp(_side_by_side_forward, _side_by_side_backward)


def side_by_side_matmul(inputs: jax.Array, kernels: Sequence[jax.Array],
                        operand_dtype: Any = None) -> jax.Array:
  """inputs (G, M, K) @ the (K, n_i) kernels side by side -> (G, M, sum
  n_i) float32, through oneDNN's gemms, the operands rounded to
  operand_dtype if given: the product with the kernels' concatenation,
  which is never made, and the kernels' gradients written apart.

  Why: attention's query, key and value are one product of the same
  tokens (self_attention.py); joined, XLA:CPU copied the kernels together
  for it and their gradient apart after it, 1.5 ms of a batch-1
  `vit_tiny_cifar` float32 train step's 14 on a Zen 5; without, that step
  is 8-9% faster and the forward pass 19% (docs/performance.md, *The Zen 5
  a ninth time*)."""
  return _side_by_side(operand_dtype, inputs, *kernels)


def dense_dot_general(inputs: jax.Array, kernel: jax.Array,
                      dimension_numbers, precision=None,
                      preferred_element_type=None, operand_dtype=None,
                      implementation: str = "xla") -> jax.Array:
  """`jax.lax.dot_general` for Dense layers, whose backward pass computes
  the kernel's gradient with `xla_products.kernel_gradient`; with
  operand_dtype, every product's operands rounded to it; with
  implementation "onednn" (as `resolve_implementation` resolves it), the
  products in oneDNN (module docstring). Bind operand_dtype and
  implementation with functools.partial for `nn.Dense(dot_general=...)`."""
  matmul = (_matmul if is_dense_matmul(inputs, kernel, dimension_numbers)
            else dot)
  return matmul(inputs, kernel, dimension_numbers, precision,
                preferred_element_type, operand_dtype, implementation)
