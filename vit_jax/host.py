"""Process settings that make training on a CPU host faster.

Each applies only where the user has not made the choice already, and each is
documented in the README ("Speed on a CPU"):

* Transparent huge pages for large allocations. XLA:CPU allocates a step's
  scratch memory (gigabytes for a ViT) afresh each step; with 4 KiB pages
  that is ~600,000 page faults per vit_tiny_cifar train step, a fifth of the
  step's time. glibc maps large blocks with huge pages when started with
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1; the tunable is read only at process
  start, so `reexec_with_huge_pages` restarts the process once with it.
* XLA:CPU flags (`default_xla_flags`), added to XLA_FLAGS on import of
  vit_jax unless XLA_FLAGS already names them: jaxlib 0.10 fuses softmax
  and the attention-weighted sum into one YNNPACK call that runs at
  ~9 GFLOP/s; without YNNPACK fusions ViT-Ti/16 inference at 224 px runs
  1.6x faster (training unchanged). CPU-only flags: GPU/TPU ignore them.
* A persistent XLA compilation cache in the user's cache directory, so a
  rerun or a resume skips the seconds of compiling the train step.
"""

import os
import platform
import sys
from typing import Optional

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
# Set in the environment to keep the process as it was started.
NO_REEXEC_VARIABLE = "VIT_JAX_NO_REEXEC"


def reexec_with_huge_pages() -> None:
  """Restarts this Python process with huge pages for malloc, if useful.

  Does nothing off Linux/glibc, when GLIBC_TUNABLES is already set (the
  user's own choice wins, including an empty value), or when
  VIT_JAX_NO_REEXEC is set. Call it first thing in a script, before threads
  exist: os.execve replaces the process (same pid, same arguments and
  interpreter options) and never returns when it restarts.
  """
  if (sys.platform != "linux" or "GLIBC_TUNABLES" in os.environ
      or os.environ.get(NO_REEXEC_VARIABLE)
      or platform.libc_ver()[0] != "glibc"):
    return
  env = dict(os.environ, GLIBC_TUNABLES=HUGE_PAGES_TUNABLE)
  env[NO_REEXEC_VARIABLE] = "1"  # never loop, whatever glibc does with it
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)


# Flags tied to the jaxlib minor release they were measured on (an unknown
# flag in XLA_FLAGS aborts the process, so never guess for another one).
_XLA_CPU_FLAGS = {"0.10": ("--xla_cpu_experimental_ynn_fusion_type=",)}


def default_xla_flags() -> list[str]:
  """Adds the measured XLA:CPU flags to XLA_FLAGS, unless the user set them.

  Takes effect only if JAX's CPU backend has not started yet (it reads
  XLA_FLAGS once). Returns the flags added.
  """
  try:
    from jaxlib import version  # pylint: disable=import-outside-toplevel
  except ImportError:
    return []
  flags = _XLA_CPU_FLAGS.get(".".join(version.__version__.split(".")[:2]), ())
  current = os.environ.get("XLA_FLAGS", "")
  added = [flag for flag in flags if flag.split("=")[0] not in current]
  if added:
    os.environ["XLA_FLAGS"] = " ".join([current] + added).strip()
  return added


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
