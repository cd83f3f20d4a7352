"""The bfloat16 transpose kernel and the weight gradient that uses it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from vit_jax.kernels import cpu_build, cpu_transpose, xla_products
from vit_jax.runtime import sharding

pytestmark = pytest.mark.skipif(
    cpu_build.problem() is not None,
    reason=f"the C++ transpose kernel cannot run: {cpu_build.problem()}")


def _bits(x) -> np.ndarray:
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


@pytest.mark.parametrize("shape", [(1, 3152, 192), (2, 70, 40), (3, 37, 50),
                                   (2, 16, 1)])
def test_transpose_equals_xlas_transpose_and_rounding_bit_for_bit(shape):
  """Every group's matrix transposed and rounded as XLA rounds f32 to bf16
  (nearest, ties to even): whole 32 x 16 blocks, rows and columns beyond
  them, odd row counts (no blocks), one column; ties,
  infinities, -0 and the smallest normals included."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape).astype(np.float32)
  specials = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -0.0, np.inf, -np.inf,
                       np.finfo(np.float32).tiny, 3.4e38, 1e-42],
                      np.float32)  # two ties, one rounding up to inf
  flat = x.reshape(-1)
  flat[:len(specials)] = specials[:flat.size]
  result = jax.jit(cpu_transpose.transpose_to_bfloat16)(x)
  expected = jnp.swapaxes(jnp.asarray(x), 1, 2).astype(jnp.bfloat16)
  assert result.shape == expected.shape and result.dtype == jnp.bfloat16
  np.testing.assert_array_equal(_bits(result), _bits(expected))


def test_nan_stays_nan_and_wrong_input_is_named():
  x = np.full((1, 2, 3), np.nan, np.float32)
  assert np.isnan(np.asarray(cpu_transpose.transpose_to_bfloat16(x),
                             np.float32)).all()
  with pytest.raises(ValueError, match=r"\(G, M, K\) float32 .*float32\[4, 4\]"):
    cpu_transpose.transpose_to_bfloat16(jnp.ones((4, 4)))


def test_under_a_batch_split_mesh_each_device_transposes_its_own_rows():
  mesh = sharding.make_mesh()
  count = mesh.devices.size
  x = jax.device_put(
      np.random.default_rng(1).normal(size=(count, 24, 40)).astype(np.float32),
      NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES)))
  transpose = jax.jit(cpu_transpose.transpose_to_bfloat16)
  program = transpose.lower(x).compile().as_text()
  assert "all-gather" not in program and "VitTransposeToBfloat16" in program
  result = transpose(x)
  assert len(result.sharding.device_set) == count  # still split
  assert {shard.data.shape for shard in result.addressable_shards} == {
      (1, 40, 24)}
  np.testing.assert_array_equal(
      _bits(result), _bits(jnp.swapaxes(x, 1, 2).astype(jnp.bfloat16)))


def _rounded(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


@pytest.mark.parametrize("depth,width", [(48, 80), (80, 48)])
def test_bfloat16_kernel_gradient_goes_to_ynnpack_in_either_orientation(
    depth, width):
  """x^T dy with bfloat16 operands: the transposed operand comes from the
  kernel, YNNPACK runs the product (where XLA has it), and the result is
  the float64 product of the rounded operands to float32 accumulation, on
  one device and with the rows split over the mesh."""
  options = xla_products.xla_compiler_options(jnp.bfloat16)
  if options is None:
    pytest.skip(f"XLA runs no bfloat16 products in YNNPACK here "
                f"(jaxlib {jax.lib.__version__})")
  rng = np.random.default_rng(2)
  x = rng.normal(size=(96, depth)).astype(np.float32)
  dy = rng.normal(size=(96, width)).astype(np.float32)
  gradient = jax.jit(lambda x, dy: xla_products.kernel_gradient(
      x, dy, operand_dtype=jnp.bfloat16), compiler_options=options)
  program = gradient.lower(x, dy).compile().as_text()
  assert "VitTransposeToBfloat16" in program and "__ynn_fusion" in program
  entry = program[program.index("ENTRY"):]
  assert " dot(" not in entry, entry  # no product left to Eigen
  expected = _rounded(x).T @ _rounded(dy)
  np.testing.assert_allclose(gradient(x, dy), expected, rtol=2e-5, atol=2e-4)

  mesh = sharding.make_mesh()
  rows = NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES))
  split = gradient(jax.device_put(x, rows), jax.device_put(dy, rows))
  np.testing.assert_allclose(split, expected, rtol=2e-5, atol=2e-4)


def test_float32_kernel_gradient_keeps_xlas_product():
  """Only bfloat16 operands take the kernel: float32 ones keep Eigen's
  product, without a transpose."""
  x, dy = jnp.ones((64, 32)), jnp.ones((64, 48))
  program = jax.jit(xla_products.kernel_gradient).lower(x, dy).as_text()
  assert "VitTransposeToBfloat16" not in program
