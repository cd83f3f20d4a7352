"""The Dense layers' products on XLA:CPU through oneDNN's sgemm.

Why: XLA:CPU runs a float32 dot as an Eigen tensor contraction, which packs
its operands before the inner kernel; for a Dense layer's weight gradient
x^T.dy, whose operands are read across their rows, the packing is strided,
and in a ViT-Ti/16 @224 train step that product ran at 72-83 GFLOP/s
against 104-115 for x.W on the same core. oneDNN's sgemm, called on each
device's rows, ran x^T.dy at 143-168 GFLOP/s alone on one core of an Intel
Xeon (Eigen 100-143) and x.W at 164-170 (Eigen 140-144); with all three
products of every encoder Dense layer here, the train step took 7-8% less
time there (ViT-Ti/16 @224 and vit_tiny_cifar; docs/performance.md, *The
Dense products through oneDNN*).

With bfloat16 operands (`config.model.matmul_dtype`) the products go
through oneDNN's gemm_bf16bf16f32 (float32 results) on CPUs with AVX512_BF16
and no AMX: on one core of a Zen 4 it ran ViT-B/16's products at 201-212
GFLOP/s against 120-167 for YNNPACK, which XLA:CPU runs them in otherwise,
and ViT-Ti's at 168-200 against 147-171 (docs/performance.md, *Wider
models, and bfloat16 products through oneDNN*). Where AMX is, YNNPACK uses
it and stays (887 GFLOP/s at 2048^3 on a Xeon); oneDNN's gemm API does not.

oneDNN comes from the `onednn-cpu-gomp` wheel (a dependency of vit_jax on
x86-64 Linux), loaded on first use; its gemms are handed to the C++
handlers in `csrc/gemm_cpu.cc` (built with the other kernels, `cpu_build`).
Each product's arrays carry a leading axis of G groups of rows (see
`matmuls.per_token`): under a batch-split mesh each device multiplies its
own rows, and the weight gradient's sum over the groups is the all-reduce
the gradient needs anyway. A product may take several kernels side by side
(attention's query, key and value: `matmuls.side_by_side_matmul`), read
where they lie, and write their gradients apart.
"""

import ctypes
import functools
import importlib.metadata
import logging
import os
import platform
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build, helper_threads, xla_products
from vit_jax.runtime import cpu_info

DISTRIBUTION = "onednn-cpu-gomp"
LIBRARY = "libdnnl.so.3"
# Where another oneDNN 3 library is to be used instead of the wheel's.
LIBRARY_VARIABLE = "VIT_JAX_ONEDNN_LIBRARY"


def library_path() -> Optional[str]:
  """oneDNN's shared library: $VIT_JAX_ONEDNN_LIBRARY, else the one the
  onednn-cpu-gomp wheel installed; None if neither is there."""
  if os.environ.get(LIBRARY_VARIABLE):
    return os.environ[LIBRARY_VARIABLE]
  try:
    distribution = importlib.metadata.distribution(DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError:
    return None
  for file in distribution.files or ():
    if file.name == LIBRARY:
      return os.path.normpath(distribution.locate_file(file))
  return None


@functools.cache
def load() -> Optional[str]:
  """Loads oneDNN and hands its sgemm to the kernels, once per process; the
  problem, or None when the products can run."""
  kernels_problem = cpu_build.load()
  if kernels_problem:
    return kernels_problem
  path = library_path()
  if path is None:
    return (f"oneDNN is not installed: pip install '{DISTRIBUTION}' (x86-64 "
            f"Linux), or set {LIBRARY_VARIABLE} to a libdnnl.so.3")
  try:
    # Global, so that the OpenMP runtime it links is the one found below.
    onednn = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    openmp = ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
    cpu_build.library().VitSetGemm(
        ctypes.cast(onednn.dnnl_sgemm, ctypes.c_void_p),
        ctypes.cast(onednn.dnnl_gemm_bf16bf16f32, ctypes.c_void_p),
        ctypes.cast(openmp.omp_set_num_threads, ctypes.c_void_p))
  except (OSError, AttributeError) as error:
    logging.warning("vit_jax: oneDNN could not be loaded from %s, XLA's own "
                    "products run instead: %s", path, error)
    return f"oneDNN could not be loaded from {path}: {error}"
  return None


def problem(device: Any = None) -> Optional[str]:
  """Why the oneDNN products cannot run on `device` (default: JAX's first
  device), or None if they can. Loads oneDNN on first use."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "cpu":
    return f"they run on CPUs, and this device is {device.platform!r}"
  if (platform.machine().lower() not in ("x86_64", "amd64")
      and not os.environ.get(LIBRARY_VARIABLE)):
    return (f"vit_jax takes oneDNN from its x86-64 wheel, and this CPU is "
            f"{platform.machine()} (set {LIBRARY_VARIABLE} to a "
            "libdnnl.so.3 built for it)")
  return load()


# oneDNN's cap on the instructions it uses (its documented variable), and
# the caps that leave its bfloat16 gemm the AVX512_BF16 instructions. A
# lower cap stands for a CPU without them, where bfloat16 operands take
# XLA's products: below AVX512_CORE oneDNN's bfloat16 gemm reports
# "unimplemented" (ONEDNN_MAX_CPU_ISA=AVX2, as benchmarks/throughput.py
# --max_isa=avx2 sets it), at AVX512_CORE it emulates the instructions.
ISA_CAP_VARIABLE = "ONEDNN_MAX_CPU_ISA"
_CAPS_WITH_BFLOAT16 = frozenset((
    "", "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16",
    "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16"))


def bfloat16_problem() -> Optional[str]:
  """Why bfloat16 operands should not take oneDNN's products on this CPU
  (it lacks AVX512_BF16, or has AMX, which YNNPACK uses and oneDNN's gemm
  does not, or oneDNN is capped below AVX512_BF16), or None."""
  instructions = xla_products.bfloat16_dot_instructions()
  if "AMX-BF16" in instructions:
    return "this CPU has AMX, which XLA's YNNPACK products use"
  if "AVX512_BF16" not in instructions:
    return ("this CPU has no AVX512_BF16 instructions for oneDNN's "
            "bfloat16 gemm")
  cap = os.environ.get(ISA_CAP_VARIABLE, "")
  if cap.upper() not in _CAPS_WITH_BFLOAT16:
    return (f"{ISA_CAP_VARIABLE}={cap} holds oneDNN below the AVX512_BF16 "
            "instructions of its bfloat16 gemm")
  return None


def tasks_per_device() -> int:
  """The parts each product is split into: the cores each CPU device has
  (1 with a device per core, vit_jax's default; all of them for one
  device)."""
  return max(1, cpu_info.cpu_cores() // max(1, jax.local_device_count("cpu")))


# The fewest elements a task of the LayerNorm kernel takes at inference:
# handing a task to another thread and waiting for it costs a few
# microseconds, about what a core takes to normalise this many floats
# (measured with XLA's threads, before the spinning helpers of
# csrc/helper_threads.h, which make the hand-off cheaper). On
# a 2-core Zen 5 one task for the (65, 192) LayerNorms of a batch-1
# `vit_tiny_cifar` forward pass made it 2-7% faster with bfloat16 products
# (level in float32); two tasks stayed faster at ViT-Ti/16's (197, 192)
# (docs/performance.md, *The Zen 5 a seventh time*). The optimizer kernels
# size their tasks the same way in C++ (`kElementsPerTask`,
# csrc/parallel_tasks.h); LayerNorm's is chosen here because only its
# undifferentiated call takes it.
MIN_ELEMENTS_PER_TASK = 1 << 14


def tasks_for_elements(elements: int) -> int:
  """`tasks_per_device()`, but no more tasks than a device's share of
  `elements` (an array's, split over the CPU devices) fills with
  MIN_ELEMENTS_PER_TASK each; at least one."""
  per_device = elements // max(1, jax.local_device_count("cpu"))
  return max(1, min(tasks_per_device(), per_device // MIN_ELEMENTS_PER_TASK))


def _primitives(suffix: str) -> tuple:
  """The three products' primitives for operands of one dtype (target
  names end in `suffix`); the results are float32 either way. The first
  two take their kernels side by side as operands after the first; the
  third has a result per kernel, `widths` wide."""
  def times(a, *kernels):
    return [(a.shape[:2] + (sum(b.shape[2] for b in kernels),), jnp.float32)]

  def times_transposed(a, *kernels):
    return [(a.shape[:2] + kernels[0].shape[1:2], jnp.float32)]

  def over_rows(a, b, *, widths):
    return [((a.shape[0], a.shape[2], width), jnp.float32)
            for width in widths]
  return (cpu_build.batch_partitionable(f"VitGemm{suffix}", times, 1),
          cpu_build.batch_partitionable(
              f"VitGemmTransposedRight{suffix}", times_transposed, 1),
          cpu_build.batch_partitionable(
              f"VitGemmOverRows{suffix}", over_rows, 1,
              static=("widths",)))


# (x.W, dy.W^T, x^T.dy) by operand dtype.
_PRIMITIVES = {jnp.dtype(jnp.float32): _primitives(""),
               jnp.dtype(jnp.bfloat16): _primitives("Bf16")}

Kernels = Union[jax.Array, Sequence[jax.Array]]


def _operands(name: str, grouped: tuple, kernels: Sequence[jax.Array],
              operand_dtype: Any) -> tuple:
  """(the operands rounded to operand_dtype if given, the primitives for
  them); raises naming the operands unless `grouped` are (G, rows,
  columns) arrays and `kernels` (K, n_i) ones, float32 (or bfloat16 where
  operand_dtype is)."""
  dtype = jnp.dtype(operand_dtype or jnp.float32)
  if dtype not in _PRIMITIVES:
    raise ValueError(f"{name} rounds its operands to bfloat16 or not at "
                     f"all, not to {dtype.name}")
  arrays = (*grouped, *kernels)
  ranks = (3,) * len(grouped) + (2,) * len(kernels)
  dtypes = {jnp.dtype(jnp.float32), dtype}
  if any(a.ndim != rank or a.dtype not in dtypes
         for a, rank in zip(arrays, ranks)) or len(
             {kernel.shape[0] for kernel in kernels}) > 1:
    what = " or ".join(sorted(allowed.name for allowed in dtypes))
    raise ValueError(
        f"{name} takes (G, rows, columns) {what} arrays"
        + (f" and (K, n) {what} kernels of one K" if kernels else "")
        + f", got {[f'{a.dtype}{list(a.shape)}' for a in arrays]}")
  return tuple(a.astype(dtype) for a in arrays), _PRIMITIVES[dtype]


def _as_list(kernels: Kernels) -> list[jax.Array]:
  return [kernels] if hasattr(kernels, "ndim") else list(kernels)


def rows_times(x: jax.Array, kernels: Kernels, operand_dtype: Any = None
               ) -> jax.Array:
  """x @ kernel per group: x (G, M, K), kernel (K, N) -> (G, M, N) float32,
  the operands rounded to operand_dtype (bfloat16) if given. Kernels (K,
  n_i) given as a sequence are read side by side, as their concatenation
  (K, sum n_i), and never joined in memory."""
  kernels = _as_list(kernels)
  (x, *kernels), (times, _, _) = _operands("rows_times", (x,), kernels,
                                           operand_dtype)
  (result,) = times.bind(
      x, *(cpu_build.per_group(kernel, x.shape[0]) for kernel in kernels),
      tasks=tasks_per_device(), helpers=helper_threads.helpers_allowed())
  return result


def rows_times_transposed(output_grad: jax.Array, kernels: Kernels,
                          operand_dtype: Any = None) -> jax.Array:
  """output_grad @ kernel^T per group: (G, M, N), kernel (K, N) -> (G, M,
  K) float32, the operands rounded to operand_dtype if given; kernels (K,
  n_i) as a sequence read side by side as in `rows_times`."""
  kernels = _as_list(kernels)
  (output_grad, *kernels), (_, times_transposed, _) = _operands(
      "rows_times_transposed", (output_grad,), kernels, operand_dtype)
  (result,) = times_transposed.bind(
      output_grad,
      *(cpu_build.per_group(kernel, output_grad.shape[0])
        for kernel in kernels),
      tasks=tasks_per_device(), helpers=helper_threads.helpers_allowed())
  return result


def rows_transposed_times(x: jax.Array, output_grad: jax.Array,
                          operand_dtype: Any = None,
                          widths: Optional[Sequence[int]] = None
                          ) -> Union[jax.Array, list[jax.Array]]:
  """x^T @ output_grad summed over the groups: x (G, R, K), output_grad
  (G, R, N) -> (K, N) float32, the operands rounded to operand_dtype if
  given. With `widths` (adding up to N), a list of (K, width) arrays
  instead: output_grad's columns in that order, each product written
  apart (the gradients of kernels read side by side)."""
  (x, output_grad), (_, _, over_rows) = _operands(
      "rows_transposed_times", (x, output_grad), (), operand_dtype)
  split = widths is not None
  widths = tuple(widths) if split else (output_grad.shape[2],)
  if sum(widths) != output_grad.shape[2]:
    raise ValueError(f"rows_transposed_times: widths {widths} do not add "
                     f"up to output_grad's {output_grad.shape[2]} columns")
  partials = over_rows.bind(x, output_grad, tasks=tasks_per_device(),
                            helpers=helper_threads.helpers_allowed(),
                            widths=widths)
  sums = [partial.sum(axis=0) for partial in partials]
  return sums if split else sums[0]
