"""The transpose kernels and the weight gradients that use them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from vit_jax.kernels import cpu_transpose, matmuls
from vit_jax.runtime import sharding

pytestmark = pytest.mark.skipif(
    cpu_transpose.problem() is not None,
    reason=f"the C++ transpose kernels cannot run: {cpu_transpose.problem()}")

DTYPES = [jnp.float32, jnp.bfloat16]


def _bits(x) -> np.ndarray:
  unsigned = jnp.uint32 if x.dtype == jnp.float32 else jnp.uint16
  return np.asarray(jax.lax.bitcast_convert_type(x, unsigned))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3152, 192), (2, 70, 40), (3, 37, 50),
                                   (2, 16, 1)])
def test_transpose_equals_xlas_transpose_and_rounding_bit_for_bit(shape,
                                                                  dtype):
  """Every group's matrix transposed (and for bfloat16 rounded as XLA
  rounds, to nearest, ties to even): whole blocks, rows and columns beyond
  them, odd row counts, one column; ties, infinities, -0, the smallest
  normal, a subnormal and a value that rounds up to infinity included."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape).astype(np.float32)
  specials = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -0.0, np.inf, -np.inf,
                       np.finfo(np.float32).tiny, 3.4e38, 1e-42],
                      np.float32)
  flat = x.reshape(-1)
  flat[:len(specials)] = specials[:flat.size]
  result = jax.jit(cpu_transpose.transpose, static_argnums=1)(x, dtype)
  expected = jnp.swapaxes(jnp.asarray(x), 1, 2).astype(dtype)
  assert result.shape == expected.shape and result.dtype == dtype
  np.testing.assert_array_equal(_bits(result), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_stays_nan_and_wrong_input_is_named(dtype):
  x = np.full((1, 2, 3), np.nan, np.float32)
  assert np.isnan(np.asarray(cpu_transpose.transpose(x, dtype),
                             np.float32)).all()
  with pytest.raises(ValueError, match=r"\(G, M, K\) float32 .*float32\[4, 4\]"):
    cpu_transpose.transpose(jnp.ones((4, 4)), dtype)
  with pytest.raises(ValueError, match="float32 or bfloat16, not float16"):
    cpu_transpose.transpose(x, jnp.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_under_a_batch_split_mesh_each_device_transposes_its_own_rows(dtype):
  mesh = sharding.make_mesh()
  count = mesh.devices.size
  x = jax.device_put(
      np.random.default_rng(1).normal(size=(count, 24, 40)).astype(np.float32),
      NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES)))
  transpose = jax.jit(functools.partial(cpu_transpose.transpose, dtype=dtype))
  program = transpose.lower(x).compile().as_text()
  assert "all-gather" not in program and "VitTranspose" in program
  result = transpose(x)
  assert len(result.sharding.device_set) == count  # still split
  assert {shard.data.shape for shard in result.addressable_shards} == {
      (1, 40, 24)}
  np.testing.assert_array_equal(
      _bits(result), _bits(jnp.swapaxes(x, 1, 2).astype(dtype)))


def _rounded(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


@pytest.mark.parametrize("operand_dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("depth,width", [(48, 80), (80, 48)])
def test_kernel_gradient_is_a_plain_product_of_a_transposed_copy(
    depth, width, operand_dtype):
  """x^T dy on a CPU: the transposed operand comes from the kernel, the
  product left to the library (YNNPACK for bfloat16 operands, where XLA
  has it) is a plain one, and the result is the float64 product (of the
  rounded operands, for bfloat16) to float32 accumulation, on one device
  and with the rows split over the mesh."""
  options = matmuls.xla_compiler_options(operand_dtype)
  if operand_dtype is not None and options is None:
    pytest.skip(f"XLA runs no bfloat16 products in YNNPACK here "
                f"(jaxlib {jax.lib.__version__})")
  rng = np.random.default_rng(2)
  x = rng.normal(size=(96, depth)).astype(np.float32)
  dy = rng.normal(size=(96, width)).astype(np.float32)
  gradient = jax.jit(lambda x, dy: matmuls.kernel_gradient(
      x, dy, operand_dtype=operand_dtype), compiler_options=options)
  program = gradient.lower(x, dy).compile().as_text()
  assert "VitTranspose" in program
  entry = program[program.index("ENTRY"):]
  if operand_dtype is None:  # a product of (G, K, R) by (G, R, N)
    assert ("lhs_contracting_dims={2}, rhs_batch_dims={0}, "
            "rhs_contracting_dims={1}") in program, program
    expected = x.astype(np.float64).T @ dy
  else:
    assert "__ynn_fusion" in program and " dot(" not in entry, entry
    expected = _rounded(x).T @ _rounded(dy)
  np.testing.assert_allclose(gradient(x, dy), expected, rtol=2e-5, atol=2e-4)

  mesh = sharding.make_mesh()
  rows = NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES))
  split = gradient(jax.device_put(x, rows), jax.device_put(dy, rows))
  np.testing.assert_allclose(split, expected, rtol=2e-5, atol=2e-4)


def test_xla_kernel_gradient_has_no_transpose_kernel():
  """`matmuls.xla_kernel_gradient`, the path off a CPU or without the
  kernels: one XLA product over the rows, no custom call."""
  x, dy = jnp.ones((64, 32)), jnp.ones((64, 48))
  program = jax.jit(matmuls.xla_kernel_gradient).lower(x, dy).as_text()
  assert "VitTranspose" not in program
  np.testing.assert_allclose(matmuls.xla_kernel_gradient(x, dy),
                             np.full((32, 48), 64.0))
