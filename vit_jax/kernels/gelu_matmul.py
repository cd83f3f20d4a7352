"""The MLP's two products with the GELU between them, in one function
(`mlp`) whose backward pass recomputes the GELU.

On a CPU the tanh-approximate GELU of float32 inputs runs in a C++ kernel
(`cpu_gelu`), with the first product's bias, in training and inference.
The products are `matmuls`'.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.kernels import (cpu_build, cpu_gelu, cpu_gemm, helper_threads,
                             matmuls, xla_products)


def _dense_numbers(inputs: jax.Array):
  """Contract inputs' last axis with a kernel's first, as nn.Dense does."""
  return (((inputs.ndim - 1,), (0,)), ((), ()))


def _takes_gelu_kernel(hidden, approximate, implementation) -> bool:
  """Whether the GELU runs in the C++ kernel (`cpu_gelu`): the tanh
  approximation of float32 inputs, on a CPU where the kernels build (as
  they do wherever the products run in oneDNN)."""
  if not (approximate and hidden.dtype == jnp.float32):
    return False
  return implementation == "onednn" or cpu_build.problem() is None


def _gelu(hidden, bias, approximate, operand_dtype, implementation):
  """gelu(hidden + bias), bias along hidden's last axis; from the C++
  kernel rounded to operand_dtype (bfloat16) if given, as the product
  reads it."""
  if _takes_gelu_kernel(hidden, approximate, implementation):
    grouped = matmuls.grouped_rows(hidden, 1)
    return cpu_gelu.gelu(grouped, bias.reshape(-1),
                         operand_dtype or hidden.dtype).reshape(hidden.shape)
  return nn.gelu(hidden + bias, approximate=approximate)


def _layers(inputs, kernel0, bias0, kernel1, approximate, operand_dtype,
            implementation):
  """(gelu(inputs @ kernel0 + bias0) @ kernel1, the hidden layer inputs @
  kernel0), in the layers' scopes as nn.Dense's (profiles name the
  products so)."""
  with jax.named_scope("Dense_0"):
    hidden = matmuls.dot(inputs, kernel0, _dense_numbers(inputs), None, None,
                         operand_dtype, implementation)
  with jax.named_scope("Dense_1"):
    activations = _gelu(hidden, bias0, approximate, operand_dtype,
                        implementation)
    output = matmuls.dot(activations, kernel1, _dense_numbers(activations),
                         None, None, operand_dtype, implementation)
  return output, hidden


def _mlp_without_gradient(inputs, kernel0, bias0, kernel1, approximate,
                          operand_dtype, implementation):
  """Without differentiation (inference) the GELU is training's too: the
  kernel's one pass adds the bias and (for bfloat16 products) rounds, as
  XLA's fusion of the three does, and ran faster at the race's batches
  (ViT-Ti/16 @224 inference 1.094 times as fast with bfloat16 products,
  1.017 in float32, on a Zen 5; docs/performance.md, *The Zen 5 an eighth
  time*)."""
  return _layers(inputs, kernel0, bias0, kernel1, approximate,
                 operand_dtype, implementation)[0]


_mlp = jax.custom_vjp(_mlp_without_gradient, nondiff_argnums=(4, 5, 6))


@helper_threads.on_xla_threads
def _mlp_forward(inputs, kernel0, bias0, kernel1, approximate, operand_dtype,
                 implementation):
  output, hidden = _layers(inputs, kernel0, bias0, kernel1, approximate,
                           operand_dtype, implementation)
  return output, (inputs, kernel0, hidden, bias0, kernel1)


@helper_threads.on_xla_threads
def _mlp_backward(approximate, operand_dtype, implementation, residuals,
                  output_grad):
  inputs, kernel0, hidden, bias0, kernel1 = residuals
  with jax.named_scope("Dense_1"):
    hidden_grad, bias0_grad, kernel1_grad = _second_layer_backward(
        hidden, bias0, kernel1, output_grad, approximate, operand_dtype,
        implementation)
  with jax.named_scope("Dense_0"):
    inputs_grad, kernel0_grad = matmuls.matmul_gradients(
        inputs, kernel0, hidden_grad, 1, None, operand_dtype, implementation)
  return inputs_grad, kernel0_grad, bias0_grad, kernel1_grad


def _second_layer_backward(hidden, bias, kernel, output_grad, approximate,
                           operand_dtype, implementation):
  """(hidden's gradient, the bias's, the kernel's) of gelu(hidden + bias)
  @ kernel, the GELU recomputed from hidden."""
  if _takes_gelu_kernel(hidden, approximate, implementation):
    return _gelu_kernel_backward(hidden, bias, kernel, output_grad,
                                 operand_dtype, implementation)
  activations, gelu_vjp = jax.vjp(
      lambda h, b: nn.gelu(h + b, approximate=approximate),
      matmuls.tie_to_gradient(hidden, output_grad), bias)
  activations_grad, kernel_grad = matmuls.matmul_gradients(
      activations, kernel, output_grad, 1, None, operand_dtype,
      implementation)
  hidden_grad, bias_grad = gelu_vjp(activations_grad)
  return hidden_grad, bias_grad, kernel_grad


def _gelu_kernel_backward(hidden, bias, kernel, output_grad, operand_dtype,
                          implementation):
  """The second product's and the GELU's backward pass with the GELU in the
  C++ kernel: the activations' gradient first, then one pass over the
  hidden layer gives the activations (for the kernel's gradient), the
  hidden layer's gradient and the bias's. Returns (hidden's gradient, the
  bias's, the kernel's); with oneDNN's bfloat16 products the first comes
  rounded to bfloat16, as both of the first product's gradients read it."""
  grouped = matmuls.grouped_rows(hidden, 1)
  depth = grouped.shape[2]
  onednn = implementation == "onednn"
  if onednn:
    output_grad = output_grad.astype(hidden.dtype).reshape(
        grouped.shape[:2] + (kernel.shape[1],))
    activations_grad = cpu_gemm.rows_times_transposed(
        output_grad, kernel.astype(hidden.dtype), operand_dtype)
  else:
    output_grad = output_grad.reshape(-1, kernel.shape[1])
    activations_grad = xla_products.product(
        output_grad.astype(kernel.dtype), kernel,
        (((1,), (1,)), ((), ())), None, operand_dtype)
  # Rounded to bfloat16 as the kernel writes them where the weight
  # gradient's product would round them (a pass of XLA's less).
  activations_dtype = ((operand_dtype or hidden.dtype) if onednn else
                       xla_products.kernel_gradient_inputs_dtype(
                           (output_grad.shape[0], depth), output_grad.shape,
                           operand_dtype))
  gradient_dtype = (operand_dtype or hidden.dtype) if onednn else hidden.dtype
  activations, hidden_grad, bias_grad = cpu_gelu.gelu_and_gradient(
      grouped, bias.reshape(-1),
      activations_grad.reshape(grouped.shape).astype(hidden.dtype),
      activations_dtype, gradient_dtype)
  kernel_grad = (cpu_gemm.rows_transposed_times(activations, output_grad,
                                               operand_dtype)
                 if onednn else
                 xla_products.kernel_gradient(
                     activations.reshape(-1, depth), output_grad, None,
                     operand_dtype))
  return (hidden_grad.reshape(hidden.shape),
          bias_grad.reshape(bias.shape).astype(bias.dtype),
          kernel_grad.reshape(kernel.shape).astype(kernel.dtype))


_mlp.defvjp(_mlp_forward, _mlp_backward)


def mlp(inputs: jax.Array, kernel0: jax.Array, bias0: jax.Array,
        kernel1: jax.Array, approximate: bool = True, operand_dtype=None,
        implementation: str = "xla") -> jax.Array:
  """gelu(inputs @ kernel0 + bias0) @ kernel1: inputs (..., D), kernel0
  (D, M), bias0 (M,), kernel1 (M, N) -> (..., N), all of one dtype; the
  second layer's bias is the caller's to add. Products as
  `matmuls.dense_dot_general`'s (operands rounded to operand_dtype if
  given; in oneDNN with implementation "onednn").

  The same values and gradients as the two Dense layers and the GELU
  written out, but one backward pass for the three, which keeps only the
  inputs and the hidden layer and recomputes the GELU from the latter.
  Why: autodiff keeps the GELU's output and its tanh for the backward pass,
  two more (B*T, mlp_dim) arrays per block; in a vit_tiny_cifar train step
  (batch 128) they were a third of XLA's scratch memory (1,617 -> 1,087 MB
  without them). The recomputation is one elementwise pass over the hidden
  layer per block, and the C++ kernel (`cpu_gelu`) adds the bias and sums
  its gradient in its passes. One pass for both layers lets the kernel
  hand the first layer's products its input's gradient rounded to
  bfloat16, which crossing from one layer's backward pass to the other's
  kept in float32 (a gradient takes its value's dtype), for XLA to round.
  """
  return _mlp(inputs, kernel0, bias0, kernel1, approximate, operand_dtype,
              implementation)

