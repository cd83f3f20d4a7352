"""Process settings that make training on a CPU host faster.

Each applies only where the user has not made the choice already, and each is
documented in docs/performance.md ("Speed on a CPU"):

* A malloc that keeps freed memory (`reexec_with_fast_malloc`). XLA:CPU
  allocates a step's scratch memory (gigabytes for a ViT) afresh each step,
  and glibc hands blocks that large back to the kernel when they are freed,
  so every step faults them in again. With 4 KiB pages that is ~600,000
  page faults per vit_tiny_cifar train step; GLIBC_TUNABLES=
  glibc.malloc.hugetlb=1 (transparent huge pages) makes it ~1,100. On a VM
  that returns freed guest memory to its host (virtio-balloon free page
  reporting) each of those still costs ~1 ms. tcmalloc, where installed
  (Debian: libtcmalloc-minimal4), keeps the memory and reuses it: no faults
  at all. Both are read only at process start, so the process restarts
  once with them.
* XLA:CPU flags (`default_xla_flags`), added to XLA_FLAGS by an explicit
  call (main.py and the benchmarks make it; importing vit_jax does not)
  unless XLA_FLAGS already names them: jaxlib 0.10 fuses softmax
  and the attention-weighted sum into one YNNPACK call that runs at
  ~9 GFLOP/s; without YNNPACK fusions ViT-Ti/16 inference at 224 px runs
  1.6x faster (training unchanged), and on jaxlib 0.11 and 0.12 still
  4-9% faster. On an Intel CPU with AVX-512, XLA's own kernels (GELU,
  LayerNorm, biases, ...) use 512-bit vectors where XLA's default is 256:
  GELU's fusions 20-50% faster, the ViT-Ti/16 @224 train step 1.7-1.8%,
  on a Xeon with AMX; on an AMD EPYC with AVX-512 the same
  flag made the step 1.2% slower, so it is not set there. CPU-only flags:
  GPU/TPU ignore them.
* The CPU as several devices (`split_cpu_into_devices`, `config.cpu_devices`),
  a device per core with the batch split over them: their independent
  chains of kernels keep the cores busy where one device's small kernels,
  each split between threads, left them idle (ViT-Mini/7 on
  Fashion-MNIST: a 1.2-1.5x faster train step on 2 cores; vit_tiny_cifar:
  1.27-1.37x). Opt-in: it changes the devices JAX shows.
* A persistent XLA compilation cache in the user's cache directory, so a
  rerun or a resume skips the seconds of compiling the train step.
"""

import ctypes.util
import logging
import os
import platform
import re
import sys
from typing import Mapping, Optional, Sequence

from vit_jax.runtime import cpu_info

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
# gperftools' tcmalloc without the heap profiler; its soname is what
# LD_PRELOAD takes (the dynamic linker finds it in the library path).
TCMALLOC_LIBRARY = "tcmalloc_minimal"
# Set in the environment to keep the process as it was started.
NO_REEXEC_VARIABLE = "VIT_JAX_NO_REEXEC"


def fast_malloc_environment(environ: Mapping[str, str],
                            tcmalloc: Optional[str]) -> dict[str, str]:
  """The variables `reexec_with_fast_malloc` adds to `environ`.

  GLIBC_TUNABLES (huge pages for glibc's large blocks) and LD_PRELOAD
  (`tcmalloc`, the library's soname or path, if installed: None if not),
  each only if `environ` does not set it already; an empty value is the
  user's choice too.
  """
  added = {}
  if "GLIBC_TUNABLES" not in environ:
    added["GLIBC_TUNABLES"] = HUGE_PAGES_TUNABLE
  if tcmalloc and "LD_PRELOAD" not in environ:
    added["LD_PRELOAD"] = tcmalloc
  return added


def find_tcmalloc() -> Optional[str]:
  """tcmalloc's soname if the dynamic linker can load it, else None."""
  return ctypes.util.find_library(TCMALLOC_LIBRARY)


def reexec_with_fast_malloc() -> None:
  """Restarts this Python process with a faster malloc, if that is useful.

  Adds `fast_malloc_environment`'s variables: glibc's huge pages, and
  tcmalloc when it is installed. Does nothing off Linux/glibc, when the
  user set both variables already (an empty value counts: LD_PRELOAD= keeps
  glibc's malloc), or when VIT_JAX_NO_REEXEC is set. Call it first thing
  in a script, before threads exist: os.execve replaces the process (same
  pid, same arguments and interpreter options) and never returns when it
  restarts.
  """
  if (sys.platform != "linux" or os.environ.get(NO_REEXEC_VARIABLE)
      or platform.libc_ver()[0] != "glibc"):
    return
  added = fast_malloc_environment(os.environ, find_tcmalloc())
  if not added:
    return
  env = dict(os.environ, **added)
  env[NO_REEXEC_VARIABLE] = "1"  # never loop, whatever the loader does
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)


# Flags tied to the jaxlib minor releases they were measured on (an unknown
# flag in XLA_FLAGS aborts the process, so never guess for another one).
# Without YNNPACK's fusions, on 0.11 and 0.12 as on 0.10, inference ran 4-9%
# faster and training 0-5% (docs/performance.md, *Newer JAX releases*).
_NO_YNNPACK_FUSIONS = ("--xla_cpu_experimental_ynn_fusion_type=",)
_XLA_CPU_FLAGS = {"0.10": _NO_YNNPACK_FUSIONS, "0.11": _NO_YNNPACK_FUSIONS,
                  "0.12": _NO_YNNPACK_FUSIONS}


# 512-bit vectors for XLA's generated kernels: measured faster on an Intel
# Xeon with AVX-512 (two 512-bit FMA units a core), slower on an AMD EPYC's
# (docs/performance.md, *XLA's kernels at 512-bit vectors*).
_WIDE_VECTORS = ("--xla_cpu_prefer_vector_width=512",)


def _capped_below_avx512(xla_flags: str) -> bool:
  """Whether xla_flags cap XLA:CPU's instruction set below AVX-512
  (`--xla_cpu_max_isa=AVX2`, as `benchmarks/throughput.py --max_isa=avx2`
  sets to stand in for an AVX2-only CPU, which would not get 512-bit
  vectors either)."""
  caps = re.findall(r"--xla_cpu_max_isa=(\w+)", xla_flags)
  return bool(caps) and not caps[-1].upper().startswith(("AVX512", "AMX"))


def _flags_for_this_cpu(xla_flags: str) -> tuple[str, ...]:
  vendor, flags = cpu_info.cpu_features()
  return _WIDE_VECTORS if (vendor == "GenuineIntel" and "avx512f" in flags
                           and not _capped_below_avx512(xla_flags)) else ()


def jaxlib_release() -> Optional[str]:
  """The installed jaxlib's minor release, e.g. "0.10"; None without one.
  Imports jaxlib's version module only, not JAX's backend."""
  try:
    from jaxlib import version  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return ".".join(version.__version__.split(".")[:2])


def default_xla_flags() -> list[str]:
  """Adds the measured XLA:CPU flags to XLA_FLAGS, unless the user set them.

  Takes effect only if JAX's CPU backend has not started yet (it reads
  XLA_FLAGS once). Returns the flags added.
  """
  release = jaxlib_release()
  current = os.environ.get("XLA_FLAGS", "")
  flags = _XLA_CPU_FLAGS.get(release, ())
  if release in _XLA_CPU_FLAGS:
    flags += _flags_for_this_cpu(current)
  added = [flag for flag in flags if flag.split("=")[0] not in current]
  if added:
    os.environ["XLA_FLAGS"] = " ".join([current] + added).strip()
  return added


CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_EIGEN_THREADS_FLAG = "--xla_cpu_multi_thread_eigen"


def _jax_backend_started() -> bool:
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return xla_bridge.backends_are_initialized()


def per_core_device_count(batch_sizes: Sequence[int] = (),
                          cores: Optional[int] = None) -> int:
  """A device per core (`cores`, default: this process's), or the most
  devices below that which split every one of `batch_sizes` evenly."""
  cores = cores or cpu_info.cpu_cores()
  return max(count for count in range(1, cores + 1)
             if all(size % count == 0 for size in batch_sizes))


def split_cpu_into_devices(count: int, batch_sizes: Sequence[int] = ()
                           ) -> int:
  """Makes JAX's CPU backend `count` devices.

  The trainer then splits each batch over them (data parallelism over
  cores). The devices share the host's thread pool (XLA:CPU still splits a
  large matmul between its threads), so what pays is independent chains of
  kernels filling the cores, not devices pinned to cores. count=-1
  takes one device per core this process may run on, or fewer if that
  would not split the `batch_sizes` evenly (`per_core_device_count`); 0
  and 1 leave the CPU as one multi-threaded device. Takes effect only
  before JAX's backend starts (it reads XLA_FLAGS once), and never
  overrides a device count the user put in XLA_FLAGS. GPU and TPU backends
  ignore it.

  Returns the CPU device count JAX will have if this call decided it, else 0.
  """
  if count < -1:
    raise ValueError(f"config.cpu_devices={count} must be >= -1 (-1: one "
                     "device per core; 0: one multi-threaded device).")
  if count == -1:
    count = per_core_device_count(batch_sizes)
  if count <= 1:
    return 0
  current = os.environ.get("XLA_FLAGS", "")
  wanted = [f"{CPU_DEVICE_COUNT_FLAG}={count}", f"{_EIGEN_THREADS_FLAG}=false"]
  if CPU_DEVICE_COUNT_FLAG in current:
    # Set before: by the user (their choice wins) or by an earlier call.
    return count if wanted[0] in current.split() else 0
  if _jax_backend_started():
    import jax  # pylint: disable=import-outside-toplevel
    if jax.default_backend() == "cpu":
      logging.warning(
          "config.cpu_devices asks for %d CPU devices, but JAX had already "
          "started; call vit_jax.runtime.host.split_cpu_into_devices "
          "before any JAX computation (main.py does).", count)
    return 0
  added = [flag for flag in wanted if flag.split("=")[0] not in current]
  os.environ["XLA_FLAGS"] = " ".join([current] + added).strip()
  return count


def default_cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "vit_jax", "xla")


def enable_compilation_cache(path: Optional[str] = None) -> Optional[str]:
  """Turns on JAX's persistent compilation cache unless already configured.

  Returns the directory in use, or None when the user configured the cache
  (JAX_COMPILATION_CACHE_DIR or jax.config) themselves.
  """
  import jax  # pylint: disable=import-outside-toplevel
  if (os.environ.get("JAX_COMPILATION_CACHE_DIR")
      or jax.config.jax_compilation_cache_dir):
    return None
  path = path or default_cache_dir()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None  # a read-only home: compile every time rather than fail
  jax.config.update("jax_compilation_cache_dir", path)
  return path
