"""The MLP's second Dense layer with the GELU before it, in one
`dot_general` (`gelu_dot_general`) whose backward pass recomputes the GELU.

On a CPU the tanh-approximate GELU of float32 inputs runs in a C++ kernel
(`cpu_gelu`) in training; inference keeps XLA's, which fuses with the bias
add. The products are `matmuls`'.
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.kernels import (cpu_build, cpu_gelu, cpu_gemm, matmuls,
                             xla_products)


def _takes_gelu_kernel(inputs, kernel, dimension_numbers, approximate,
                       implementation) -> bool:
  """Whether the GELU runs in the C++ kernel (`cpu_gelu`): the tanh
  approximation of float32 inputs, on a CPU where the kernels build (as
  they do wherever the products run in oneDNN)."""
  if not (approximate and inputs.dtype == jnp.float32
          and matmuls.is_dense_matmul(inputs, kernel, dimension_numbers)):
    return False
  return implementation == "onednn" or cpu_build.problem() is None


def _gelu(inputs, bias, kernel, dimension_numbers, approximate,
          operand_dtype, implementation):
  """gelu(inputs + bias), bias along inputs' last axis; from the C++
  kernel rounded to operand_dtype (bfloat16) if given, as the product
  reads it."""
  if _takes_gelu_kernel(inputs, kernel, dimension_numbers, approximate,
                        implementation):
    grouped = matmuls.grouped_rows(inputs, len(dimension_numbers[0][0]))
    return cpu_gelu.gelu(grouped, bias.reshape(-1),
                         operand_dtype or inputs.dtype).reshape(inputs.shape)
  return nn.gelu(inputs + bias, approximate=approximate)


def _gelu_then_dot(inputs, bias, kernel, dimension_numbers, precision,
                   preferred_element_type, approximate, operand_dtype=None,
                   implementation="xla"):
  """Without differentiation (inference), XLA's GELU: it fuses with the
  bias add (and the rounding of bfloat16 products after) into one pass
  over the activations, where the C++ kernel is a pass of its own
  (ViT-Ti/16 @224 inference: 36-42 against 89-108 ms a step for the
  GELUs and MLP biases; docs/performance.md)."""
  return matmuls.dot(nn.gelu(inputs + bias, approximate=approximate),
                     kernel, dimension_numbers, precision,
                     preferred_element_type, operand_dtype, implementation)


_gelu_dot = jax.custom_vjp(_gelu_then_dot,
                           nondiff_argnums=(3, 4, 5, 6, 7, 8))


def _gelu_dot_forward(inputs, bias, kernel, dimension_numbers, precision,
                      preferred_element_type, approximate, operand_dtype,
                      implementation):
  # In training, the pre-activations are written for the backward pass
  # anyway: the kernel's pass then costs no more than XLA's (step_ab:
  # 1.002-1.010 with XLA's GELU here), and takes the bias add with it.
  activations = _gelu(inputs, bias, kernel, dimension_numbers, approximate,
                      operand_dtype, implementation)
  return matmuls.dot(activations, kernel, dimension_numbers, precision,
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
        matmuls.tie_to_gradient(inputs, output_grad), bias)
    activations_grad, kernel_grad = matmuls.matmul_gradients(
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
  grouped = matmuls.grouped_rows(inputs, num_contracted)
  depth = grouped.shape[2]
  kernel_2d = kernel.reshape(depth, -1)
  onednn = implementation == "onednn"
  if onednn:
    output_grad = output_grad.astype(inputs.dtype).reshape(
        grouped.shape[:2] + (kernel_2d.shape[1],))
    activations_grad = cpu_gemm.rows_times_transposed(
        output_grad, kernel_2d.astype(inputs.dtype), operand_dtype)
  else:
    output_grad = output_grad.reshape(-1, kernel_2d.shape[1])
    activations_grad = xla_products.product(
        output_grad.astype(kernel.dtype), kernel_2d,
        (((1,), (1,)), ((), ())), precision, operand_dtype)
  # Rounded to bfloat16 as the kernel writes them where the weight
  # gradient's product would round them (a pass of XLA's less).
  activations_dtype = ((operand_dtype or inputs.dtype) if onednn else
                       xla_products.kernel_gradient_inputs_dtype(
                           (output_grad.shape[0], depth), output_grad.shape,
                           operand_dtype))
  activations, inputs_grad, bias_grad = cpu_gelu.gelu_and_gradient(
      grouped, bias.reshape(-1),
      activations_grad.reshape(grouped.shape).astype(inputs.dtype),
      activations_dtype)
  kernel_grad = (cpu_gemm.rows_transposed_times(activations, output_grad,
                                               operand_dtype)
                 if onednn else
                 xla_products.kernel_gradient(
                     activations.reshape(-1, depth), output_grad, precision,
                     operand_dtype))
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
                if matmuls.is_dense_matmul(inputs, kernel, dimension_numbers)
                else _gelu_then_dot)
    return gelu_dot(inputs, input_bias.astype(inputs.dtype), kernel,
                    dimension_numbers, precision, preferred_element_type,
                    approximate, operand_dtype, implementation)
  return dot_general
