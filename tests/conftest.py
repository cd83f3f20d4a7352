"""Test set-up: 8 simulated CPU devices, so sharded code paths run everywhere,
and a compilation cache shared by every test.

LLVM optimises XLA's own fusions at level 1 here (XLA's default is 3): the
suite compiles hundreds of small programs, and two trainer tests took 24 s
against 32 s so (2026-11-29). The products and vit_jax's kernels are
libraries, compiled already; the programs' HLO, and so what the tests
check, is the same. And XLA emits those fusions with its older elemental
emitters rather than its MLIR fusion emitters (which main.py's programs
use): at level 1 the small programs compile ~25% faster so (a tiny ViT's
init 2.4 -> 1.7 s, its gradient 2.2 -> 1.6 s; the model and attention tests
247 -> 187 s on 2026-12-01's AVX2-only AMD EPYC), where at level 3 a
ViT-Ti/16 train step took 8.4 s against 4.9 and stepped 1.4% slower, so
users keep XLA's default (and jaxlib 0.12 has only the fusion emitters).
Subprocesses that set XLA_FLAGS themselves compile as users do.

XLA reads the flag when JAX initialises its backend, so it is set before any
test module imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=1")
# Each trainer run jits its steps afresh, and most tests train the same
# small model: JAX's persistent cache (keyed by the program, the JAX version
# and the flags) compiles each program once for this process, its xdist
# siblings and the scripts the tests start. In .pytest_cache, so a clean
# checkout starts empty and a user's own cache is left alone.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ".pytest_cache", "xla"))

import pytest  # noqa: E402

from vit_jax.runtime import host  # noqa: E402

# The XLA:CPU flags main.py applies, so tests run the programs users run.
host.default_xla_flags()
# jaxlib 0.12 has only the fusion emitters (an unknown flag aborts the
# process); 0.11's were not measured.
if host.jaxlib_release() == "0.10":
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.fixture
def fashion_mnist_dir():
  """The Debian Fashion-MNIST files; skips (with the fix) when absent."""
  if not os.path.exists(os.path.join(FASHION_MNIST_DIR,
                                     "t10k-labels-idx1-ubyte.gz")):
    pytest.skip("Fashion-MNIST files absent: apt-get install "
                "dataset-fashion-mnist")
  return FASHION_MNIST_DIR
