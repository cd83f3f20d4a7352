"""The attention core softmax(s Q K^T) V as a C++ kernel for XLA:CPU.

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
attention: on a CPU with AMX they run as AMX tile products (the
ViT-Ti/16 @224 train step with bfloat16 products took 9% less time), on
AMD's CPUs with AVX512_BF16 on its dot instruction (the kernel 24% less
on a Zen 4), elsewhere as float32 products of the rounded values
(docs/performance.md, *bfloat16 on an AMX CPU*, *The AVX-512 AMD EPYC
again*).

The kernel is built on first use for this machine's CPU (`cpu_build`).
Without a compiler, or if the build fails, `problem` says why and the model
takes its einsums ("auto") or raises ("cpu_kernel").

`self_attention` reads q, k and v where the projections' one matmul puts
them, (B, T, 3, heads, head_dim), adding their bias itself, and writes its
output where the output projection reads it, (B, T, heads, head_dim); the
projections' gradient goes back into their layout the same way, and the
bias's gradient is summed in the kernel. Why: the transposes to and from
(B, heads, T, head_dim), the bias's addition and its gradient's column
sums took 4-5% of a ViT-Ti/16 @224 train step as XLA's own fusions
(docs/performance.md, *The attention kernel in the projections'
layout*).
`query_attention` is the same core for queries projected on their own (the
last block's class token). Both are differentiable and shard over the
batch: under `jax.jit` with a batch-split mesh each device runs the kernel
on its own part, with no gathering (`cpu_build.batch_partitionable`).
"""

import functools
from typing import Any, NamedTuple, Optional

import jax
from jax.extend import core
import jax.numpy as jnp
import numpy as np

from vit_jax.kernels import cpu_build, cpu_gemm

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


class _Kernels(NamedTuple):
  """A family's primitives: the forward pass for inference (outputs only),
  for training (outputs and probabilities), and the gradient."""
  inference: core.Primitive
  training: core.Primitive
  gradient: core.Primitive


def _shapes(*avals):
  return [(aval.shape, aval.dtype) for aval in avals]


def _outputs(operands) -> tuple:
  """The output's (shape, dtype) for a family's operands (the last one
  the bias): (B, Tq, H, D)."""
  first = operands[0]
  shape = first.shape if first.ndim == 4 else (
      first.shape[:2] + first.shape[3:])  # packed (B, T, 3, H, D)
  return shape, first.dtype


def _probabilities(operands) -> tuple:
  """The probabilities' (shape, dtype): (B, H, Tq, padded keys)."""
  batch, query_tokens, heads = _outputs(operands)[0][:3]
  key_tokens = operands[-2].shape[1]
  return (batch, heads, query_tokens, padded_keys(key_tokens)), jnp.float32


def _family(name: str, num_operands: int, suffix: str) -> _Kernels:
  """The primitives of handlers VitAttention<name>...<suffix> ("" float32,
  "Bf16" bfloat16 operands): operands (the projections, then their bias
  (B, 3, H, D)), then the probabilities and the output's gradient for the
  gradient, whose results are the operands' gradients (the bias's per
  batch element). Each batch element is independent: one batch axis."""
  def training(*operands):
    return [_outputs(operands), _probabilities(operands)]

  def gradient(*operands_probabilities_and_output_grad):
    return _shapes(*operands_probabilities_and_output_grad[:num_operands])

  return _Kernels(
      cpu_build.batch_partitionable(
          f"VitAttention{name}ForInference{suffix}",
          lambda *operands: [_outputs(operands)], 1),
      cpu_build.batch_partitionable(
          f"VitAttention{name}ForTraining{suffix}", training, 1),
      cpu_build.batch_partitionable(
          f"VitAttention{name}Backward{suffix}", gradient, 1))


# (packed, split) families: float32 products, and bfloat16 operands.
_FLOAT32 = (_family("Packed", 2, ""), _family("Split", 3, ""))
_BFLOAT16 = (_family("Packed", 2, "Bf16"), _family("Split", 3, "Bf16"))


def _families(operand_dtype: Any) -> tuple[_Kernels, _Kernels]:
  """(packed, split) primitives: float32 products, or bfloat16 operands
  with float32 sums."""
  if operand_dtype is None:
    return _FLOAT32
  if jnp.dtype(operand_dtype) != jnp.bfloat16:
    raise ValueError(f"the attention kernel's products take bfloat16 "
                     f"operands or float32 ones, not {operand_dtype}")
  return _BFLOAT16


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _core(kernels: _Kernels, scale: float, bias: jax.Array,
          *projections: jax.Array) -> jax.Array:
  (output,) = kernels.inference.bind(
      *projections, _per_batch(bias, projections), **_attributes(scale))
  return output


def _attributes(scale: float) -> dict:
  """The handlers' attributes: the logits' scale, and the threads a call's
  pairs run on, the device's cores (with a device per core, vit_jax's
  default, one: a helper thread would take the other device's core)."""
  return dict(scale=np.float32(scale), threads=cpu_gemm.tasks_per_device())


def _per_batch(bias: jax.Array, projections) -> jax.Array:
  """bias (3, H, D) once per batch element, (B, 3, H, D): every operand of
  the kernel has the batch axis, which the partitioner splits."""
  return jnp.broadcast_to(bias, (projections[0].shape[0], *bias.shape))


def _core_forward(kernels, scale, bias, *projections):
  operands = (*projections, _per_batch(bias, projections))
  output, probabilities = kernels.training.bind(*operands,
                                                **_attributes(scale))
  return output, (operands, probabilities)


def _core_backward(kernels, scale, residuals, output_grad):
  operands, probabilities = residuals
  *projection_grads, bias_grad = kernels.gradient.bind(
      *operands, probabilities, output_grad, **_attributes(scale))
  return (jnp.sum(bias_grad, axis=0), *projection_grads)


_core.defvjp(_core_forward, _core_backward)


def _check(scale: float, bias: jax.Array, heads_dims: tuple) -> float:
  if not scale > 0:
    raise ValueError(f"the attention kernel's scale must be positive, not "
                     f"{scale}")
  if bias.shape != (3, *heads_dims):
    raise ValueError(f"the attention kernel's bias must be (3, heads, "
                     f"head_dim) = {(3, *heads_dims)}, not {bias.shape}")
  return float(scale)


def self_attention(projections: jax.Array, bias: jax.Array, scale: float,
                   operand_dtype: Any = None) -> jax.Array:
  """softmax(scale q k^T) v per batch element and head, float32 on CPU,
  where q, k and v are the projections plus their bias.

  projections: (B, T, 3, H, D), the query, key and value projections of
  each token as one matmul lays them out, without their bias; bias
  (3, H, D), the query's, key's and value's. Returns (B, T, H, D), as the
  output projection reads it. The kernel reads and writes those layouts
  (the projections' gradient too, as one (B, T, 3, H, D) array), adds the
  bias as it copies a pair's rows out and sums the bias's gradient as it
  writes them back: no transposes, bias addition or column sums around
  it. With operand_dtype bfloat16 every product of the forward and
  backward passes (two and four) reads its operands rounded to bfloat16
  and sums in float32, as the model's bfloat16 products do; the softmax
  and its gradient stay float32. On a CPU with AMX the products run as AMX
  tile products, on AMD's with AVX512_BF16 on its dot instruction. Needs
  `problem(...)` to be None.
  """
  packed, _ = _families(operand_dtype)
  return _core(packed, _check(scale, bias, projections.shape[3:]), bias,
               projections)


def query_attention(query: jax.Array, keys_values: jax.Array,
                    bias: jax.Array, scale: float,
                    operand_dtype: Any = None) -> jax.Array:
  """`self_attention` for queries of their own: query (B, Tq, H, D) (e.g.
  the class token's alone), keys_values (B, Tk, 2, H, D), both without
  their bias; bias (3, H, D) as there. Returns (B, Tq, H, D)."""
  _, split = _families(operand_dtype)
  return _core(split, _check(scale, bias, query.shape[2:]), bias, query,
               keys_values)
