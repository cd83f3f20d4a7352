"""The Dense layers' matmuls, with backward passes written for XLA:CPU.

Each function here is a `dot_general` for `flax.linen.Dense` or
`DenseGeneral` (`nn.Dense(..., dot_general=dense_dot_general)`): the same
values and gradients as `jax.lax.dot_general`, up to float rounding, with
a backward pass that

- computes the kernel's gradient, a product over the rows (tokens), in the
  orientation XLA:CPU runs fastest (`kernel_gradient`), and
- for `gelu_dot_general`, keeps only the GELU's input and recomputes the
  GELU in the backward pass.

They take the matmuls Flax's layers make: the inputs' last axes contracted
with the kernel's first axes, no batch axes. Other dimension numbers get
`jax.lax.dot_general` itself.

With `operand_dtype` (bfloat16) every product of the layer, forward and
backward, reads its two operands rounded to that dtype and accumulates
and returns float32 (the inputs' dtype): what CPUs with bfloat16 dot
instructions (AVX512_BF16, AMX) run at two to three times their float32
rate, through YNNPACK, which `xla_compiler_options` turns on for such
programs; the weight gradient reaches YNNPACK through a transposed copy
made by a C++ kernel (`_ynnpack_kernel_gradient`).

With `implementation="onednn"` (float32 products on a CPU, which
`resolve_implementation` picks for "auto") the layer's three products run
through oneDNN's sgemm (`cpu_gemm`), on rows in groups (`per_token`).
`gelu_dot_general`'s tanh-approximate GELU of float32 inputs runs in a C++
kernel on a CPU (`cpu_gelu`), whichever the products.
"""

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.kernels import cpu_build, cpu_gelu, cpu_gemm, cpu_transpose
from vit_jax.runtime import host

_OVER_ROWS = (((0,), (0,)), ((), ()))  # contract the first axes: a^T b

# The Dense products' implementations (`VisionTransformer`'s
# matmul_implementation): "auto" resolves to one of the others.
IMPLEMENTATIONS = ("auto", "onednn", "xla")


def resolve_implementation(requested: str, dtype: Any,
                           operand_dtype: Any = None,
                           device: Any = None) -> str:
  """The Dense products' implementation, "onednn" or "xla", for products
  computing in `dtype` with `operand_dtype` (None or bfloat16) on `device`
  (default: JAX's first). "auto" takes oneDNN's sgemm (`cpu_gemm`) for
  float32 products on a CPU where it loads, XLA's dots elsewhere;
  "onednn" raises where it cannot run."""
  return cpu_build.choose_implementation(
      "matmul_implementation", requested, IMPLEMENTATIONS,
      lambda: _onednn_problem(dtype, operand_dtype, device), "oneDNN",
      "XLA's products")


def _onednn_problem(dtype: Any, operand_dtype: Any, device: Any
                    ) -> Optional[str]:
  """Why oneDNN's products cannot run these, or None if they can."""
  if operand_dtype is not None:
    return (f"it computes float32 products, and these have "
            f"{jnp.dtype(operand_dtype).name} operands")
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


# The jaxlib releases whose YNNPACK ran bfloat16 products faster than their
# float32 (docs/performance.md, *bfloat16 products on a CPU* for 0.10,
# *Newer JAX releases* for 0.11 and 0.12).
_YNNPACK_DOT_RELEASES = ("0.10", "0.11", "0.12")


def xla_compiler_options(operand_dtype: Any) -> Optional[dict[str, str]]:
  """The per-program XLA options that run the products of `operand_dtype`
  fast, for `jax.jit(..., compiler_options=...)`; None if there are none.

  bfloat16 on XLA:CPU (jaxlib 0.10-0.12): YNNPACK for each dot on its own. Why
  per program: vit_jax turns YNNPACK off process-wide
  (`runtime.host.default_xla_flags`), as it slows float32 steps; for
  bfloat16 operands with float32 accumulation its dots use the CPU's
  bfloat16 dot instructions (ViT-Ti's widths: 310-360 against 200
  GFLOP/s in float32 on an AVX512_BF16 core pair), where XLA's own
  (Eigen) widens them to float32.
  """
  if (operand_dtype is None or jnp.dtype(operand_dtype) != jnp.bfloat16
      or jax.default_backend() != "cpu"
      or host.jaxlib_release() not in _YNNPACK_DOT_RELEASES):
    return None
  return {"xla_cpu_experimental_ynn_fusion_type":
          "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def cpu_has_bfloat16_dots() -> bool:
  """Whether this host's CPU has bfloat16 dot instructions (x86's
  AVX512_BF16 or AMX-BF16, from /proc/cpuinfo), which bfloat16 operands
  need to be faster than float32 ones."""
  return bool(host.cpu_features()[1] & {"avx512_bf16", "amx_bf16"})


def _product(a: jax.Array, b: jax.Array, dimension_numbers, precision,
             operand_dtype) -> jax.Array:
  """lax.dot_general(a, b), with both operands rounded to operand_dtype
  (if given) and the result accumulated in a's dtype."""
  if operand_dtype is None:
    return jax.lax.dot_general(a, b.astype(a.dtype), dimension_numbers,
                               precision=precision)
  return jax.lax.dot_general(a.astype(operand_dtype), b.astype(operand_dtype),
                             dimension_numbers, precision=precision,
                             preferred_element_type=a.dtype)


def kernel_gradient(inputs: jax.Array, output_grad: jax.Array,
                    precision=None, operand_dtype=None) -> jax.Array:
  """inputs^T @ output_grad: (K, N) from inputs (R, K), output_grad (R, N).

  Why not one way for all shapes: XLA:CPU runs this product as an Eigen
  contraction that packs one operand with strided reads, the one whose
  columns become the result's rows. Making those rows the narrower side
  packs the narrower operand: at R = 3152 on one core (K, N) = (192, 768)
  took 9.0 ms this way and 11.5 ms the other, (192, 576) 6.8 against
  7.7 ms. JAX's own transpose of a matmul computes output_grad^T @ inputs
  and transposes it, whatever the shapes, and on a device per core XLA
  kept that orientation: the ViT-Ti/16 @224 train step ran 1.4-2.4%
  faster with this one. (Where the result must be row-major, e.g. a jitted
  function's output, XLA turns a transposed product round itself.)
  With bfloat16 operands where YNNPACK runs them, `_ynnpack_kernel_gradient`;
  otherwise `xla_kernel_gradient`.
  """
  output_grad = output_grad.astype(inputs.dtype)
  if _takes_ynnpack_kernel_gradient(inputs, operand_dtype):
    return _ynnpack_kernel_gradient(inputs, output_grad, precision)
  return xla_kernel_gradient(inputs, output_grad, precision, operand_dtype)


def xla_kernel_gradient(inputs: jax.Array, output_grad: jax.Array,
                        precision=None, operand_dtype=None) -> jax.Array:
  """inputs^T @ output_grad as one XLA product, the narrower side as its
  rows (`kernel_gradient` says why). XLA:CPU runs it in Eigen: bfloat16
  operands are rounded, then widened to float32."""
  output_grad = output_grad.astype(inputs.dtype)
  if inputs.shape[1] <= output_grad.shape[1]:
    return _product(inputs, output_grad, _OVER_ROWS, precision,
                    operand_dtype)
  return _product(output_grad, inputs, _OVER_ROWS, precision,
                  operand_dtype).T


def _takes_ynnpack_kernel_gradient(inputs: jax.Array, operand_dtype) -> bool:
  """Whether `_ynnpack_kernel_gradient` runs this product: bfloat16
  operands of float32 inputs, on a CPU whose XLA runs them in YNNPACK,
  with the transpose kernel built."""
  return (inputs.dtype == jnp.float32
          and xla_compiler_options(operand_dtype) is not None
          and cpu_build.problem() is None)


def _ynnpack_kernel_gradient(inputs: jax.Array, output_grad: jax.Array,
                             precision) -> jax.Array:
  """inputs^T @ output_grad (float32) from bfloat16 operands, as a product
  YNNPACK takes: one operand transposed by `cpu_transpose`, the narrower
  where it can be (the wider would cost more to copy), contracted over its
  last axis.

  The rows go in G groups, one per device where the rows divide so, as a
  batch axis of the product that is then summed: under a batch-split mesh
  each device transposes and multiplies its own rows, and the sum over G
  is the all-reduce that the gradient needs anyway. Before this, XLA
  widened the product to float32 (docs/performance.md, *bfloat16 on an
  AMX CPU*).
  """
  rows = inputs.shape[0]
  groups = math.gcd(rows, jax.device_count())
  # Transposing dy where it is the narrower makes the product the result's
  # transpose. With one group nothing stands between that product and its
  # transpose, and XLA folds the transpose into it, contracting the left
  # operand over its first axis again: YNNPACK refuses that, and XLA:CPU's
  # own dot has no bfloat16 kernel ("Unsupported element type for
  # DotThunk": every one-device run). With several groups, their sum (the
  # all-reduce under a split batch) stands between.
  flip = groups > 1 and inputs.shape[1] > output_grad.shape[1]
  left, right = (output_grad, inputs) if flip else (inputs, output_grad)
  left_t = cpu_transpose.transpose_to_bfloat16(
      left.reshape(groups, rows // groups, left.shape[1]))
  right = right.reshape(groups, rows // groups, right.shape[1])
  partial = jax.lax.dot_general(
      left_t, right.astype(jnp.bfloat16), (((2,), (1,)), ((0,), (0,))),
      precision=precision, preferred_element_type=jnp.float32)
  result = partial.sum(axis=0)
  return result.T if flip else result


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


def _grouped_rows(x: jax.Array, num_contracted: int) -> jax.Array:
  """x (..., *K) as (G, M, prod(K)): its first axis as the groups if it has
  two or more leading axes (`per_token`'s grouping), else its rows in
  `row_groups` groups."""
  leading = x.shape[:x.ndim - num_contracted]
  depth = int(np.prod(x.shape[x.ndim - num_contracted:]))
  groups = (leading[0] if len(leading) >= 2
            else row_groups(int(np.prod(leading))))
  return x.reshape(groups, -1, depth)


def _is_dense_matmul(inputs, kernel, dimension_numbers) -> bool:
  """Whether dimension_numbers contract inputs' last axes with kernel's
  first ones in order, without batch axes: the products Dense and
  DenseGeneral (over trailing axes) make."""
  (input_axes, kernel_axes), (input_batch, kernel_batch) = dimension_numbers
  num = len(input_axes)
  return (not input_batch and not kernel_batch and num == len(kernel_axes)
          and tuple(input_axes) == tuple(range(inputs.ndim - num, inputs.ndim))
          and tuple(kernel_axes) == tuple(range(num)))


def _matmul_backward(inputs, kernel, output_grad, num_contracted, precision,
                     operand_dtype, implementation):
  """(inputs' gradient, kernel's gradient) of the matmul of inputs
  (..., *K) and kernel (*K, *N), len(K) = num_contracted, given
  output_grad (..., *N)."""
  depth = int(np.prod(kernel.shape[:num_contracted]))
  width = int(np.prod(kernel.shape[num_contracted:]))
  if implementation == "onednn":
    grouped = _grouped_rows(inputs, num_contracted)
    output_grad = output_grad.astype(inputs.dtype).reshape(
        grouped.shape[:2] + (width,))
    kernel_2d = kernel.reshape(depth, width).astype(inputs.dtype)
    inputs_grad = cpu_gemm.rows_times_transposed(output_grad, kernel_2d)
    kernel_grad = cpu_gemm.rows_transposed_times(grouped, output_grad)
    return (inputs_grad.reshape(inputs.shape),
            kernel_grad.reshape(kernel.shape).astype(kernel.dtype))
  output_grad = output_grad.reshape(-1, width)
  inputs_grad = _product(
      output_grad.astype(kernel.dtype), kernel.reshape(depth, width),
      (((1,), (1,)), ((), ())), precision, operand_dtype)
  kernel_grad = kernel_gradient(inputs.reshape(-1, depth), output_grad,
                                precision, operand_dtype)
  return (inputs_grad.reshape(inputs.shape).astype(inputs.dtype),
          kernel_grad.reshape(kernel.shape).astype(kernel.dtype))


def _dot(inputs, kernel, dimension_numbers, precision,
         preferred_element_type, operand_dtype=None, implementation="xla"):
  if (implementation == "onednn"
      and _is_dense_matmul(inputs, kernel, dimension_numbers)):
    num = len(dimension_numbers[0][0])
    kernel_2d = kernel.reshape(int(np.prod(kernel.shape[:num])), -1)
    product = cpu_gemm.rows_times(_grouped_rows(inputs, num),
                                  kernel_2d.astype(inputs.dtype))
    return product.reshape(inputs.shape[:inputs.ndim - num]
                           + kernel.shape[num:])
  if operand_dtype is not None:
    return _product(inputs, kernel, dimension_numbers, precision,
                    operand_dtype).astype(preferred_element_type
                                          or inputs.dtype)
  return jax.lax.dot_general(inputs, kernel, dimension_numbers,
                             precision=precision,
                             preferred_element_type=preferred_element_type)


_matmul = jax.custom_vjp(_dot, nondiff_argnums=(2, 3, 4, 5, 6))


def _matmul_forward(inputs, kernel, dimension_numbers, precision,
                    preferred_element_type, operand_dtype, implementation):
  return (_dot(inputs, kernel, dimension_numbers, precision,
               preferred_element_type, operand_dtype, implementation),
          (inputs, kernel))


def _matmul_backward_rule(dimension_numbers, precision, preferred_element_type,
                          operand_dtype, implementation, residuals,
                          output_grad):
  del preferred_element_type
  inputs, kernel = residuals
  return _matmul_backward(inputs, kernel, output_grad,
                          len(dimension_numbers[0][0]), precision,
                          operand_dtype, implementation)


_matmul.defvjp(_matmul_forward, _matmul_backward_rule)


def dense_dot_general(inputs: jax.Array, kernel: jax.Array,
                      dimension_numbers, precision=None,
                      preferred_element_type=None, operand_dtype=None,
                      implementation: str = "xla") -> jax.Array:
  """`jax.lax.dot_general` for Dense layers, whose backward pass computes
  the kernel's gradient with `kernel_gradient`; with operand_dtype, every
  product's operands rounded to it; with implementation "onednn" (as
  `resolve_implementation` resolves it), the products in oneDNN (module
  docstring). Bind operand_dtype and implementation with functools.partial
  for `nn.Dense(dot_general=...)`."""
  matmul = (_matmul if _is_dense_matmul(inputs, kernel, dimension_numbers)
            else _dot)
  return matmul(inputs, kernel, dimension_numbers, precision,
                preferred_element_type, operand_dtype, implementation)


def _takes_gelu_kernel(inputs, kernel, dimension_numbers, approximate,
                       implementation) -> bool:
  """Whether the GELU runs in the C++ kernel (`cpu_gelu`): the tanh
  approximation of float32 inputs, on a CPU where the kernels build (as
  they do wherever the products run in oneDNN)."""
  if not (approximate and inputs.dtype == jnp.float32
          and _is_dense_matmul(inputs, kernel, dimension_numbers)):
    return False
  return implementation == "onednn" or cpu_build.problem() is None


def _gelu(inputs, bias, kernel, dimension_numbers, approximate,
          implementation):
  """gelu(inputs + bias), bias along inputs' last axis."""
  if _takes_gelu_kernel(inputs, kernel, dimension_numbers, approximate,
                        implementation):
    grouped = _grouped_rows(inputs, len(dimension_numbers[0][0]))
    return cpu_gelu.gelu(grouped, bias.reshape(-1)).reshape(inputs.shape)
  return nn.gelu(inputs + bias, approximate=approximate)


def _gelu_then_dot(inputs, bias, kernel, dimension_numbers, precision,
                   preferred_element_type, approximate, operand_dtype=None,
                   implementation="xla"):
  """Without differentiation (inference), XLA's GELU: it fuses with the
  bias add (and the rounding of bfloat16 products after) into one pass
  over the activations, where the C++ kernel is a pass of its own
  (ViT-Ti/16 @224 inference: 36-42 against 89-108 ms a step for the
  GELUs and MLP biases; docs/performance.md)."""
  return _dot(nn.gelu(inputs + bias, approximate=approximate), kernel,
              dimension_numbers, precision, preferred_element_type,
              operand_dtype, implementation)


_gelu_dot = jax.custom_vjp(_gelu_then_dot,
                           nondiff_argnums=(3, 4, 5, 6, 7, 8))


def _gelu_dot_forward(inputs, bias, kernel, dimension_numbers, precision,
                      preferred_element_type, approximate, operand_dtype,
                      implementation):
  # In training, the pre-activations are written for the backward pass
  # anyway: the kernel's pass then costs no more than XLA's (step_ab:
  # 1.002-1.010 with XLA's GELU here), and takes the bias add with it.
  return _dot(_gelu(inputs, bias, kernel, dimension_numbers, approximate,
                    implementation), kernel, dimension_numbers, precision,
              preferred_element_type, operand_dtype,
              implementation), (inputs, bias, kernel)


def _gelu_dot_backward(dimension_numbers, precision, preferred_element_type,
                       approximate, operand_dtype, implementation, residuals,
                       output_grad):
  del preferred_element_type
  inputs, bias, kernel = residuals
  num_contracted = len(dimension_numbers[0][0])
  if not _takes_gelu_kernel(inputs, kernel, dimension_numbers, approximate,
                            implementation):
    activations, gelu_vjp = jax.vjp(
        lambda x, b: nn.gelu(x + b, approximate=approximate),
        tie_to_gradient(inputs, output_grad), bias)
    activations_grad, kernel_grad = _matmul_backward(
        activations, kernel, output_grad, num_contracted, precision,
        operand_dtype, implementation)
    inputs_grad, bias_grad = gelu_vjp(activations_grad)
    return inputs_grad, bias_grad, kernel_grad
  return _gelu_kernel_backward(inputs, bias, kernel, output_grad,
                               num_contracted, precision, operand_dtype,
                               implementation)


def _gelu_kernel_backward(inputs, bias, kernel, output_grad, num_contracted,
                          precision, operand_dtype, implementation):
  """`_gelu_dot_backward` with the GELU in the C++ kernel: the activations'
  gradient first, then one pass over the inputs gives the activations
  (for the kernel's gradient), the inputs' gradient and the bias's."""
  grouped = _grouped_rows(inputs, num_contracted)
  depth = grouped.shape[2]
  kernel_2d = kernel.reshape(depth, -1)
  onednn = implementation == "onednn"
  if onednn:
    output_grad = output_grad.astype(inputs.dtype).reshape(
        grouped.shape[:2] + (kernel_2d.shape[1],))
    activations_grad = cpu_gemm.rows_times_transposed(
        output_grad, kernel_2d.astype(inputs.dtype))
  else:
    output_grad = output_grad.reshape(-1, kernel_2d.shape[1])
    activations_grad = _product(output_grad.astype(kernel.dtype), kernel_2d,
                                (((1,), (1,)), ((), ())), precision,
                                operand_dtype)
  activations, inputs_grad, bias_grad = cpu_gelu.gelu_and_gradient(
      grouped, bias.reshape(-1),
      activations_grad.reshape(grouped.shape).astype(inputs.dtype))
  kernel_grad = (cpu_gemm.rows_transposed_times(activations, output_grad)
                 if onednn else
                 kernel_gradient(activations.reshape(-1, depth), output_grad,
                                 precision, operand_dtype))
  return (inputs_grad.reshape(inputs.shape),
          bias_grad.reshape(bias.shape).astype(bias.dtype),
          kernel_grad.reshape(kernel.shape).astype(kernel.dtype))


_gelu_dot.defvjp(_gelu_dot_forward, _gelu_dot_backward)


def gelu_dot_general(input_bias: jax.Array, approximate: bool = True,
                     operand_dtype=None, implementation: str = "xla"
                     ) -> Callable[..., jax.Array]:
  """A `dot_general` for `nn.Dense` that applies GELU to its input plus
  input_bias (the previous Dense layer's bias, which that layer then does
  not add itself: `model.blocks.DenseBiasDeferred`) first.

  dot_general(x, kernel, ...) = lax.dot_general(gelu(x + input_bias),
  kernel, ...), the same values and gradients (input_bias's included), but
  the backward pass keeps only x and recomputes gelu(x + input_bias) and
  its derivative from it. Why: autodiff keeps the GELU's output and its
  tanh for the backward pass, two more (B*T, mlp_dim) arrays per block; in
  a vit_tiny_cifar train step (batch 128) they were a third of XLA's
  scratch memory (1,617 -> 1,087 MB without them). The recomputation is
  one elementwise pass over x per block, and the C++ kernel (`cpu_gelu`)
  adds the bias and sums its gradient in its passes.
  """
  def dot_general(inputs, kernel, dimension_numbers, precision=None,
                  preferred_element_type=None):
    gelu_dot = (_gelu_dot
                if _is_dense_matmul(inputs, kernel, dimension_numbers)
                else _gelu_then_dot)
    return gelu_dot(inputs, input_bias.astype(inputs.dtype), kernel,
                    dimension_numbers, precision, preferred_element_type,
                    approximate, operand_dtype, implementation)
  return dot_general
