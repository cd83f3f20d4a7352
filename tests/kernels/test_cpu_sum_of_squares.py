"""The gradients' sum of squares as a C++ kernel (`cpu_sum_of_squares`):
its value against float64 over leaves of every size, the same bits however
many threads split it, and `optim.global_norm` through it against XLA's
path and optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vit_jax.kernels import cpu_build, cpu_sum_of_squares
from vit_jax.training import optim

from helpers import split_kernel_calls  # pylint: disable=wrong-import-order

pytestmark = pytest.mark.skipif(
    cpu_build.problem() is not None,
    reason=f"the C++ kernels cannot run: {cpu_build.problem()}")

# Sizes around the kernel's vectors (16 floats at most), its four sums of
# them, and its chunks of 2^15 floats: whole ones, tails, several chunks.
SHAPES = [(1,), (15,), (16,), (17,), (64,), (65,), (3, 7), (0, 4),
          (32768,), (32769,), (2, 40000), (192, 768), (7, 11, 13)]


def _leaves(seed: int, shapes, scale: float = 1.0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=shape) * scale).astype(np.float32)
          for shape in shapes]


def _float64_sum(leaves) -> float:
  return float(sum(np.sum(np.square(leaf.astype(np.float64)))
                   for leaf in leaves))


@pytest.mark.parametrize("tasks", [1, 2, 3])
def test_values_match_a_float64_reference(tasks):
  leaves = _leaves(0, SHAPES)
  got = jax.jit(lambda xs: cpu_sum_of_squares.sum_of_squares(
      xs, tasks=tasks))(leaves)
  assert got.shape == () and got.dtype == jnp.float32
  # Float32 sums of at most 2^15 / 16 / 4 squares each, then float64: a
  # few float32 roundings of the total, not the ~sqrt(n) of one long sum.
  np.testing.assert_allclose(float(got), _float64_sum(leaves), rtol=4e-7)


def test_every_leaf_counts_once_across_calls():
  """More leaves than one call takes: each leaf's square sum is a distinct
  power of two, so a leaf dropped or read twice changes the total."""
  count = 2 * cpu_sum_of_squares.LEAVES_PER_CALL + 3
  leaves = [np.full((5,), np.sqrt(2.0 ** i / 5), np.float32)
            for i in range(count)]
  expected = _float64_sum(leaves)
  got = jax.jit(cpu_sum_of_squares.sum_of_squares)(leaves)
  np.testing.assert_allclose(float(got), expected, rtol=1e-6)
  for i in (0, cpu_sum_of_squares.LEAVES_PER_CALL, count - 1):
    without = leaves[:i] + leaves[i + 1:]
    assert abs(float(jax.jit(cpu_sum_of_squares.sum_of_squares)(without))
               - (expected - 2.0 ** i / 5 * 5)) < 1e-6 * expected


def test_the_sum_does_not_depend_on_the_threads(monkeypatch):
  """The chunks' sums are added in one order: the same bits on 1, 2 or 3
  threads (XLA's own reduction may differ in its last bits)."""
  leaves = _leaves(1, SHAPES, scale=1e-3)
  results = []
  for tasks in (1, 2, 3):
    split_kernel_calls(monkeypatch, tasks)
    results.append(np.asarray(jax.jit(
        cpu_sum_of_squares.sum_of_squares)(leaves)))
  assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("implementation", ["cpu_kernel", "xla"])
def test_global_norm_through_it_is_optaxs(implementation):
  tree = {"a": _leaves(2, SHAPES[:6]), "b": {"kernel": _leaves(3, [(96, 5)])}}
  norm = jax.jit(lambda t: optim.global_norm(
      t, implementation=implementation))(tree)
  np.testing.assert_allclose(norm, optax.global_norm(tree), rtol=1e-6)
  np.testing.assert_allclose(norm, np.sqrt(_float64_sum(
      jax.tree.leaves(tree))), rtol=1e-6)
  hlo = jax.jit(lambda t: optim.global_norm(
      t, implementation=implementation)).lower(tree).as_text()
  assert ("VitSumOfSquares" in hlo) == (implementation == "cpu_kernel")


def test_auto_takes_the_kernel_for_float32_only():
  f32 = [jnp.ones((4, 4)), jnp.ones((3,))]
  assert "VitSumOfSquares" in jax.jit(optim.global_norm).lower(
      f32).as_text()
  mixed = [jnp.ones((4, 4)), jnp.ones((3,), jnp.bfloat16)]
  assert "VitSumOfSquares" not in jax.jit(optim.global_norm).lower(
      mixed).as_text()
  np.testing.assert_allclose(jax.jit(optim.global_norm)(mixed),
                             optax.global_norm(mixed), rtol=1e-6)


def test_operands_are_checked_and_named():
  with pytest.raises(ValueError, match="float32 arrays, got.*bfloat16"):
    cpu_sum_of_squares.sum_of_squares([jnp.ones((3,), jnp.bfloat16)])
  assert float(cpu_sum_of_squares.sum_of_squares([])) == 0.0
  assert float(cpu_sum_of_squares.sum_of_squares([jnp.ones((0, 3))])) == 0.0
