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

oneDNN comes from the `onednn-cpu-gomp` wheel (a dependency of vit_jax on
x86-64 Linux), loaded on first use; its sgemm is handed to the C++
handlers in `csrc/gemm_cpu.cc` (built with the other kernels, `cpu_build`).
Each product's arrays carry a leading axis of G groups of rows (see
`matmuls.per_token`): under a batch-split mesh each device multiplies its
own rows, and the weight gradient's sum over the groups is the all-reduce
the gradient needs anyway.
"""

import ctypes
import functools
import importlib.metadata
import logging
import os
import platform
from typing import Any, Optional

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_build
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
    cpu_build.library().VitSetSgemm(
        ctypes.cast(onednn.dnnl_sgemm, ctypes.c_void_p),
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
    return (f"vit_jax takes oneDNN from its x86-64 wheel; this is a "
            f"{platform.machine()} CPU (set {LIBRARY_VARIABLE} to a "
            "libdnnl.so.3 built for it)")
  return load()


def tasks_per_device() -> int:
  """The parts each product is split into: the cores each CPU device has
  (1 with a device per core, vit_jax's default; all of them for one
  device)."""
  return max(1, cpu_info.cpu_cores() // max(1, jax.local_device_count("cpu")))


_ROWS_TIMES = cpu_build.batch_partitionable(
    "VitGemm", lambda a, b: [(a.shape[:2] + b.shape[2:], a.dtype)], 1)
_ROWS_TIMES_TRANSPOSED = cpu_build.batch_partitionable(
    "VitGemmTransposedRight",
    lambda a, b: [(a.shape[:2] + b.shape[1:2], a.dtype)], 1)
_OVER_ROWS = cpu_build.batch_partitionable(
    "VitGemmOverRows", lambda a, b: [((a.shape[0], a.shape[2], b.shape[2]),
                                      a.dtype)], 1)


def _check(name: str, grouped: tuple, kernel: Optional[jax.Array] = None
           ) -> None:
  """Raises naming the operands unless `grouped` are (G, rows, columns)
  float32 arrays and `kernel` (if given) a (K, N) float32 one."""
  arrays = (*grouped, *(() if kernel is None else (kernel,)))
  ranks = (3,) * len(grouped) + (() if kernel is None else (2,))
  if any(a.ndim != rank or a.dtype != jnp.float32
         for a, rank in zip(arrays, ranks)):
    raise ValueError(
        f"{name} takes (G, rows, columns) float32 arrays"
        + (" and a (K, N) float32 kernel" if kernel is not None else "")
        + f", got {[f'{a.dtype}{list(a.shape)}' for a in arrays]}")


def rows_times(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x @ kernel per group: x (G, M, K), kernel (K, N) -> (G, M, N)."""
  _check("rows_times", (x,), kernel)
  (result,) = _ROWS_TIMES.bind(x, cpu_build.per_group(kernel, x.shape[0]),
                               tasks=tasks_per_device())
  return result


def rows_times_transposed(output_grad: jax.Array, kernel: jax.Array
                          ) -> jax.Array:
  """output_grad @ kernel^T per group: (G, M, N), kernel (K, N) -> (G, M,
  K)."""
  _check("rows_times_transposed", (output_grad,), kernel)
  (result,) = _ROWS_TIMES_TRANSPOSED.bind(
      output_grad, cpu_build.per_group(kernel, output_grad.shape[0]),
      tasks=tasks_per_device())
  return result


def rows_transposed_times(x: jax.Array, output_grad: jax.Array
                          ) -> jax.Array:
  """x^T @ output_grad summed over the groups: x (G, R, K), output_grad
  (G, R, N) -> (K, N)."""
  _check("rows_transposed_times", (x, output_grad))
  (partial,) = _OVER_ROWS.bind(x, output_grad, tasks=tasks_per_device())
  return partial.sum(axis=0)
