"""Test set-up: 8 simulated CPU devices, so sharded code paths run everywhere.

XLA reads the flag when JAX initialises its backend, so it is set before any
test module imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import pytest  # noqa: E402

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.fixture
def fashion_mnist_dir():
  """The Debian Fashion-MNIST files; skips (with the fix) when absent."""
  if not os.path.exists(os.path.join(FASHION_MNIST_DIR,
                                     "t10k-labels-idx1-ubyte.gz")):
    pytest.skip("Fashion-MNIST files absent: apt-get install "
                "dataset-fashion-mnist")
  return FASHION_MNIST_DIR
