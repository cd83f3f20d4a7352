"""The attention core softmax(Q K^T) V as a C++ kernel for XLA:CPU.

Why: on XLA:CPU the core's batched products (head_dim 64, T = 197) ran at
less than half the rate of the model's dense layers, and the core took 21%
of a ViT-Ti/16 @224 train step for 15% of its FLOPs
(docs/throughput_runs.md, runs 17-19); with this kernel the step is ~10%
faster (docs/performance.md, *The attention core as a C++ kernel*).
`csrc/attention_cpu.cc` computes the forward pass and the gradient one
(batch, head) pair at a time, with its operands in L2, register-blocked
products and a vectorised softmax, and keeps the probabilities for the
backward pass as the einsums do.

With the model's bfloat16 products (`config.model.matmul_dtype`) the
kernel's products round their operands to bfloat16 too
(`csrc/attention_bf16_cpu.cc`), as PyTorch's CPU autocast does for its
attention: on a CPU with AMX they run as AMX tile products, and the
ViT-Ti/16 @224 train step with bfloat16 products took 9% less time
(docs/performance.md, *bfloat16 on an AMX CPU*).

The kernel is built on first use for this machine's CPU (`cpu_build`).
Without a compiler, or if the build fails, `problem` says why and the model
takes its einsums ("auto") or raises ("cpu_kernel").

`attention_core` is differentiable and shards over batch and heads: under
`jax.jit` with a batch-split mesh each device runs the kernel on its own
part, with no gathering (`cpu_build.batch_partitionable`).
"""

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build

LANES = 16  # the kernel's vector width in floats: head_dim must divide by it


def problem(dtype: Any, head_dim: int, device: Any = None) -> Optional[str]:
  """Why the kernel cannot run this attention on `device` (default: JAX's
  first device), or None if it can. Builds the kernel on first use."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "cpu":  # said first, before the model's settings
    return cpu_build.problem(device)
  if jnp.dtype(dtype) != jnp.float32:
    return (f"it computes in float32, and the model computes in "
            f"{jnp.dtype(dtype).name} (config.model.dtype)")
  if head_dim % LANES:
    return (f"it needs head_dim (hidden_size / num_heads) a multiple of "
            f"{LANES}, and it is {head_dim}")
  return cpu_build.problem(device)


def padded_keys(num_keys: int) -> int:
  """The kernel's probabilities rows: num_keys rounded up to whole
  vectors."""
  return -(-num_keys // LANES) * LANES


def _same(*avals):
  return [(aval.shape, aval.dtype) for aval in avals]


def _training_results(query, key, value):
  """The training forward pass's output and probabilities."""
  del value
  return [(query.shape, query.dtype),
          (query.shape[:3] + (padded_keys(key.shape[2]),), query.dtype)]


def _primitives(suffix: str) -> tuple:
  """(inference, training, gradient) primitives of the kernel's handlers
  named with suffix ("" float32, "Bf16" bfloat16 operands). Each (batch,
  head) pair is independent: two batch axes."""
  return (
      cpu_build.batch_partitionable(
          f"VitAttentionForwardForInference{suffix}",
          lambda query, key, value: _same(query), 2),
      cpu_build.batch_partitionable(
          f"VitAttentionForwardForTraining{suffix}", _training_results, 2),
      cpu_build.batch_partitionable(
          f"VitAttentionBackward{suffix}",
          lambda query, key, value, *_: _same(query, key, value), 2))


_FLOAT32, _BFLOAT16 = _primitives(""), _primitives("Bf16")


def _kernels(operand_dtype: Any):
  """(inference, training, gradient) primitives: float32 products, or
  bfloat16 operands with float32 sums."""
  if operand_dtype is None:
    return _FLOAT32
  if jnp.dtype(operand_dtype) != jnp.bfloat16:
    raise ValueError(f"the attention kernel's products take bfloat16 "
                     f"operands or float32 ones, not {operand_dtype}")
  return _BFLOAT16


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention_core(query: jax.Array, key: jax.Array, value: jax.Array,
                   operand_dtype: Any = None) -> jax.Array:
  """softmax(query key^T) value over the last two axes, float32 on CPU.

  query (B, heads, Tq, head_dim), already scaled by 1/sqrt(head_dim); key
  and value (B, heads, Tk, head_dim). Returns (B, heads, Tq, head_dim).
  With operand_dtype bfloat16 every product of the forward and backward
  passes (two and four) reads its operands rounded to bfloat16 and sums
  in float32, as the model's bfloat16 products do; the softmax and its
  gradient stay float32. On a CPU with AMX the products run as AMX tile
  products. Needs `problem(...)` to be None.
  """
  inference, _, _ = _kernels(operand_dtype)
  (output,) = inference.bind(query, key, value)
  return output


def _core_forward(query, key, value, operand_dtype):
  _, training, _ = _kernels(operand_dtype)
  output, probabilities = training.bind(query, key, value)
  return output, (query, key, value, probabilities)


def _core_backward(operand_dtype, residuals, output_grad):
  _, _, gradient = _kernels(operand_dtype)
  return tuple(gradient.bind(*residuals, output_grad))


attention_core.defvjp(_core_forward, _core_backward)
