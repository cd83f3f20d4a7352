"""The single products of the Dense layers' passes as XLA runs them.

- `product`: a `dot_general` whose operands may be rounded to bfloat16,
  accumulating in float32.
- `kernel_gradient`: a kernel's gradient inputs^T @ output_grad, a
  product over the rows (tokens), in the orientation XLA:CPU runs fastest;
  with bfloat16 operands through YNNPACK, by a transposed copy that a C++
  kernel makes (`cpu_transpose`).
- `xla_compiler_options`: the per-program options that turn YNNPACK on for
  bfloat16 products and for the reductions beside the C++ kernels, and
  that give a CUDA GPU's products to cuBLAS;
  `bfloat16_dot_instructions`: whether bfloat16 products pay here.
- `add_to_every_example`: x + an array shared by the batch, whose gradient
  sums over the batch as a product, not a reduction YNNPACK would take.

`matmuls` (the Dense layers' `dot_general` and its backward pass) and
`gelu_matmul` (the MLP's two Dense layers and its GELU) are made of these.
"""

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build, cpu_transpose
from vit_jax.runtime import cpu_info, host

_OVER_ROWS = (((0,), (0,)), ((), ()))  # contract the first axes: a^T b

# The jaxlib releases whose YNNPACK ran bfloat16 products faster than their
# float32 (docs/performance.md, *bfloat16 products on a CPU* for 0.10,
# *Newer JAX releases* for 0.11 and 0.12), and whose YNNPACK reductions
# (*The Zen 5 a second time*) were measured.
_YNNPACK_RELEASES = ("0.10", "0.11", "0.12")


def xla_compiler_options(operand_dtype: Any) -> Optional[dict[str, str]]:
  """The per-program XLA options for vit_jax's train and eval steps (and
  the benchmarks') whose products take `operand_dtype`, for
  `jax.jit(..., compiler_options=...)`; None if there are none. On XLA:CPU
  (jaxlib 0.10-0.12), YNNPACK fusions that vit_jax turns off process-wide
  (`runtime.host.default_xla_flags`, as they slowed float32 steps):

  - for bfloat16 operands, YNNPACK for each dot on its own: its dots use the
    CPU's bfloat16 dot instructions (ViT-Ti's widths: 310-360 against 200
    GFLOP/s in float32 on an AVX512_BF16 core pair), where XLA's own
    (Eigen) widens them to float32;
  - where the C++ kernels run (`cpu_build.problem()` is None: they take the
    attention core, and the einsums' softmax is not in the program),
    YNNPACK's reductions: the Dense layers' bias gradients, which XLA sums
    over (batch, tokens) in windows of 32 rows padded from 197 to 224, in
    one pass (the train step 1.1-1.4% faster on a Zen 5).

  On an NVIDIA GPU, cuBLAS for every product rather than XLA's Triton GEMM
  fusions: ViT-L/16's bfloat16 forward pass 1.10x faster and its train
  step unchanged, on an H200 with jax 0.11.2 (docs/gpu.md, 2026-12-04).
  """
  if _nvidia_gpu():
    return dict(_NVIDIA_GPU_OPTIONS)
  if not _ynnpack_options_apply():
    return None
  fusions = [name for name, wanted in (
      ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", _bfloat16(operand_dtype)),
      ("LIBRARY_FUSION_TYPE_REDUCE", cpu_build.problem() is None)) if wanted]
  return ({"xla_cpu_experimental_ynn_fusion_type": ",".join(fusions)}
          if fusions else None)


@jax.custom_vjp
def add_to_every_example(x: jax.Array, shared: jax.Array) -> jax.Array:
  """x (B, ...) + shared (1, ...) of x's dtype, e.g. the position
  embedding.

  The same values and gradients as `x + shared`, but shared's gradient,
  the sum of x's over the batch, is a product with a vector of ones. Why:
  with YNNPACK's reductions on (`xla_compiler_options`), XLA:CPU hands that
  sum over the leading axis to YNNPACK, which takes ~25x XLA's own loop
  over it: ViT-Ti/16's position embedding at 16 images a core took 2.0 ms
  against XLA's 0.08, and 0.16 as this product, on a Zen 5 core. (Its sums
  over (batch, tokens), the biases' gradients, are 3-5x faster than XLA's.)
  """
  return _checked_add(x, shared)


def _checked_add(x, shared):
  if shared.shape[:1] != (1,) or shared.dtype != x.dtype:
    raise ValueError(f"add_to_every_example adds shared (1, ...) of x's "
                     f"dtype to x (B, ...), got x {x.dtype}{list(x.shape)} "
                     f"and shared {shared.dtype}{list(shared.shape)}")
  return x + shared


def _add_to_every_example_forward(x, shared):
  return _checked_add(x, shared), None


def _add_to_every_example_backward(_, output_grad):
  ones = jnp.ones(output_grad.shape[:1], output_grad.dtype)
  # HIGHEST: an exact float32 sum on GPUs and TPUs too.
  shared_grad = jnp.tensordot(ones, output_grad, axes=1,
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
  return output_grad, shared_grad[None].astype(output_grad.dtype)


add_to_every_example.defvjp(_add_to_every_example_forward,
                            _add_to_every_example_backward)


# XLA:GPU's Triton GEMM fusions (a product with its elementwise neighbours,
# tiled by Triton) ran ViT-L/16's forward products slower than cuBLAS.
_NVIDIA_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def _nvidia_gpu() -> bool:
  """Whether JAX's default devices are NVIDIA GPUs (CUDA), where
  `_NVIDIA_GPU_OPTIONS` were measured; not ROCm's."""
  return (jax.default_backend() == "gpu"
          and jax.devices()[0].device_kind.startswith("NVIDIA"))


def _ynnpack_options_apply() -> bool:
  """Whether this is XLA:CPU on a jaxlib whose YNNPACK options we measured."""
  return (jax.default_backend() == "cpu"
          and host.jaxlib_release() in _YNNPACK_RELEASES)


def _bfloat16(operand_dtype: Any) -> bool:
  return (operand_dtype is not None
          and jnp.dtype(operand_dtype) == jnp.bfloat16)


# /proc/cpuinfo's flags for bfloat16 dot instructions, and their names:
# x86's AMX-BF16 and AVX512_BF16, Arm's BF16 extension (BFDOT, BFMMLA).
_BFLOAT16_DOTS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512_BF16",
                  "bf16": "BF16"}


def bfloat16_dot_instructions() -> tuple[str, ...]:
  """The bfloat16 dot instructions of this host's CPU by name (x86's
  AVX512_BF16 and AMX-BF16, Arm's BF16; from /proc/cpuinfo), () if none:
  bfloat16 operands need them to be faster than float32 ones. Measured on
  x86 only (docs/performance.md, *bfloat16 products on a CPU*)."""
  flags = cpu_info.cpu_features()[1]
  return tuple(name for flag, name in _BFLOAT16_DOTS.items() if flag in flags)


def product(a: jax.Array, b: jax.Array, dimension_numbers, precision,
            operand_dtype, result_dtype=None) -> jax.Array:
  """lax.dot_general(a, b), with both operands rounded to operand_dtype
  (if given) and the result accumulated in result_dtype (default: a's
  dtype)."""
  if operand_dtype is None:
    return jax.lax.dot_general(a, b.astype(a.dtype), dimension_numbers,
                               precision=precision)
  return jax.lax.dot_general(a.astype(operand_dtype), b.astype(operand_dtype),
                             dimension_numbers, precision=precision,
                             preferred_element_type=result_dtype or a.dtype)


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
  With bfloat16 operands where YNNPACK runs them, `_ynnpack_kernel_gradient`
  (whose inputs may come rounded to bfloat16 already where
  `kernel_gradient_inputs_dtype` says so); otherwise `xla_kernel_gradient`.
  """
  if _takes_ynnpack_kernel_gradient(inputs, output_grad, operand_dtype):
    return _ynnpack_kernel_gradient(inputs, output_grad.astype(jnp.float32),
                                    precision)
  return xla_kernel_gradient(inputs, output_grad, precision, operand_dtype)


def kernel_gradient_inputs_dtype(inputs_shape: tuple[int, int],
                                 output_grad_shape: tuple[int, int],
                                 operand_dtype) -> Any:
  """The dtype `kernel_gradient` best takes its inputs (R, K) in, given
  output_grad (R, N): bfloat16 where its YNNPACK product reads them
  unchanged but rounded (several row groups, K > N: output_grad is the
  operand transposed), so that their producer can round them as it writes
  them; float32 otherwise."""
  if (_ynnpack_runs(operand_dtype)
      and _transposes_output_grad(inputs_shape, output_grad_shape)):
    return jnp.bfloat16
  return jnp.float32


def xla_kernel_gradient(inputs: jax.Array, output_grad: jax.Array,
                        precision=None, operand_dtype=None) -> jax.Array:
  """inputs^T @ output_grad as one XLA product, the narrower side as its
  rows (`kernel_gradient` says why). XLA:CPU runs it in Eigen: bfloat16
  operands are rounded, then widened to float32."""
  output_grad = output_grad.astype(inputs.dtype)
  if inputs.shape[1] <= output_grad.shape[1]:
    return product(inputs, output_grad, _OVER_ROWS, precision,
                   operand_dtype)
  return product(output_grad, inputs, _OVER_ROWS, precision,
                 operand_dtype).T


def _ynnpack_runs(operand_dtype) -> bool:
  """Whether products of operand_dtype run in YNNPACK here, with the
  transpose kernel built."""
  return (_bfloat16(operand_dtype) and _ynnpack_options_apply()
          and cpu_build.problem() is None)


def _row_groups(rows: int) -> int:
  """The groups `_ynnpack_kernel_gradient` takes the rows in: one per
  device where the rows divide so."""
  return math.gcd(rows, jax.device_count())


def _transposes_output_grad(inputs_shape, output_grad_shape) -> bool:
  """Whether `_ynnpack_kernel_gradient` transposes output_grad (and reads
  inputs as they are): the rows in several groups, output_grad narrower."""
  return (_row_groups(inputs_shape[0]) > 1
          and inputs_shape[1] > output_grad_shape[1])


def _takes_ynnpack_kernel_gradient(inputs: jax.Array, output_grad: jax.Array,
                                   operand_dtype) -> bool:
  """Whether `_ynnpack_kernel_gradient` runs this product: bfloat16
  operands on a CPU whose XLA runs them in YNNPACK, of float32 inputs, or
  of bfloat16 ones where it reads them unchanged."""
  if not _ynnpack_runs(operand_dtype):
    return False
  return (inputs.dtype == jnp.float32
          or (inputs.dtype == jnp.bfloat16
              and _transposes_output_grad(inputs.shape, output_grad.shape)))


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
  groups = _row_groups(rows)
  # Transposing dy where it is the narrower makes the product the result's
  # transpose. With one group nothing stands between that product and its
  # transpose, and XLA folds the transpose into it, contracting the left
  # operand over its first axis again: YNNPACK refuses that, and XLA:CPU's
  # own dot has no bfloat16 kernel ("Unsupported element type for
  # DotThunk": every one-device run). With several groups, their sum (the
  # all-reduce under a split batch) stands between.
  flip = _transposes_output_grad(inputs.shape, output_grad.shape)
  left, right = (output_grad, inputs) if flip else (inputs, output_grad)
  left_t = cpu_transpose.transpose_to_bfloat16(
      left.reshape(groups, rows // groups, left.shape[1]))
  right = right.reshape(groups, rows // groups, right.shape[1])
  partial = jax.lax.dot_general(
      left_t, right.astype(jnp.bfloat16), (((2,), (1,)), ((0,), (0,))),
      precision=precision, preferred_element_type=jnp.float32)
  result = partial.sum(axis=0)
  return result.T if flip else result
