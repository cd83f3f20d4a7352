"""vit_jax.kernels.matmuls: the Dense layers' matmuls and their backward
passes."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.kernels import matmuls
from vit_jax.model import blocks

_DENSE = (((1,), (0,)), ((), ()))


def _weight_gradient_dots(compiled_text: str) -> dict[str, tuple[int, ...]]:
  """{op name: result shape} of the compiled dots that contract over rows
  (dim 0 of both operands): the kernels' gradients."""
  shapes = {}
  for line in compiled_text.splitlines():
    match = re.search(r"= f32\[([\d,]+)\]\S* dot\(.*lhs_contracting_dims=\{0\}"
                      r", rhs_contracting_dims=\{0\}.*op_name=\"([^\"]*)\"",
                      line)
    if match:
      shapes[match.group(2)] = tuple(int(d) for d in match.group(1).split(","))
  return shapes


@pytest.mark.parametrize("depth,width", [(8, 24), (24, 8), (16, 16)])
def test_kernel_gradient_is_inputs_transposed_times_output_grad(depth, width):
  """inputs^T @ output_grad against float64 NumPy, for a wide, a narrow and
  a square kernel. For a wide kernel XLA's product has the narrower side as
  its rows (JAX's transpose rule gives it (width, depth) rows x columns).
  A narrow kernel's (width, depth) product is transposed, and XLA turns it
  round when the result must be row-major, as here; in a train step the
  optimizer reads it transposed instead (see the MLP test below)."""
  rng = np.random.default_rng(0)
  inputs = rng.normal(size=(40, depth)).astype(np.float32)
  output_grad = rng.normal(size=(40, width)).astype(np.float32)
  fn = jax.jit(matmuls.kernel_gradient)
  got = fn(inputs, output_grad)
  assert got.shape == (depth, width)
  np.testing.assert_allclose(
      got, inputs.astype(np.float64).T @ output_grad, rtol=1e-5, atol=1e-5)
  text = fn.lower(inputs, output_grad).compile().as_text()
  (shape,) = _weight_gradient_dots(text).values()
  if depth <= width:
    assert shape == (depth, width)


@pytest.mark.parametrize("input_shape,kernel_shape,num_contracted", [
    ((12, 6), (6, 10), 1),            # Dense on tokens
    ((3, 4, 6), (6, 5), 1),           # Dense on (batch, tokens, width)
    ((7, 2, 3), (2, 3, 8), 2),        # DenseGeneral over (heads, head_dim)
])
def test_dense_dot_general_values_and_gradients(input_shape, kernel_shape,
                                                num_contracted):
  """Values and both gradients equal the matmul's, computed in float64
  NumPy over the flattened rows and contracted axes."""
  rng = np.random.default_rng(1)
  inputs = rng.normal(size=input_shape).astype(np.float32)
  kernel = rng.normal(size=kernel_shape).astype(np.float32)
  rank = len(input_shape)
  dims = ((tuple(range(rank - num_contracted, rank)),
           tuple(range(num_contracted))), ((), ()))
  output_shape = input_shape[:rank - num_contracted] + kernel_shape[
      num_contracted:]
  output_grad = rng.normal(size=output_shape).astype(np.float32)

  outputs, vjp = jax.vjp(
      lambda x, k: matmuls.dense_dot_general(x, k, dims), inputs, kernel)
  inputs_grad, kernel_grad = vjp(output_grad)

  depth = int(np.prod(kernel_shape[:num_contracted]))
  x = inputs.reshape(-1, depth).astype(np.float64)
  w = kernel.reshape(depth, -1).astype(np.float64)
  g = output_grad.reshape(x.shape[0], -1).astype(np.float64)
  np.testing.assert_allclose(outputs, (x @ w).reshape(output_shape),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(inputs_grad, (g @ w.T).reshape(input_shape),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(kernel_grad, (x.T @ g).reshape(kernel_shape),
                             rtol=1e-5, atol=1e-5)


def test_dense_dot_general_keeps_dtypes_and_falls_back():
  """bfloat16 operands get bfloat16 gradients; dimension numbers other
  than a Dense layer's give lax.dot_general's values and gradients."""
  inputs = jnp.ones((4, 6), jnp.bfloat16)
  kernel = jnp.ones((6, 3), jnp.bfloat16)
  grads = jax.grad(lambda x, k: matmuls.dense_dot_general(
      x, k, _DENSE).astype(jnp.float32).sum(), argnums=(0, 1))(inputs, kernel)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
  np.testing.assert_array_equal(grads[1].astype(np.float32), 4.0)

  rng = np.random.default_rng(2)
  lhs = rng.normal(size=(5, 4)).astype(np.float32)
  rhs = rng.normal(size=(5, 3)).astype(np.float32)
  over_rows = (((0,), (0,)), ((), ()))
  ours = jax.grad(lambda a, b: jnp.sum(jnp.sin(matmuls.dense_dot_general(
      a, b, over_rows))), argnums=(0, 1))(lhs, rhs)
  plain = jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.lax.dot_general(
      a, b, over_rows))), argnums=(0, 1))(lhs, rhs)
  chex.assert_trees_all_close(ours, plain, rtol=1e-6, atol=1e-6)


def test_mlp_kernel_gradients_have_the_narrow_side_as_rows():
  """In the compiled gradient of an MlpBlock (64 -> 256 -> 64) the first
  kernel's gradient is a (64, 256) product, not JAX's (256, 64) one, and
  the gradients equal those of Dense -> GELU -> Dense."""
  mlp = blocks.MlpBlock(mlp_dim=256)
  x = jax.random.normal(jax.random.PRNGKey(0), (300, 64))
  params = mlp.init(jax.random.PRNGKey(1), x, deterministic=True)

  def loss(params, x):
    return jnp.sum(jnp.sin(mlp.apply(params, x, deterministic=True)))

  def reference_loss(params, x):
    p = params["params"]
    hidden = nn.gelu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return jnp.sum(jnp.sin(hidden @ p["Dense_1"]["kernel"]
                           + p["Dense_1"]["bias"]))

  grad = jax.jit(jax.grad(loss))
  chex.assert_trees_all_close(grad(params, x),
                              jax.grad(reference_loss)(params, x),
                              rtol=1e-4, atol=1e-4)
  # As in a data-parallel train step: the rows split between two devices,
  # the gradients summed over them and read by an update. XLA then reads a
  # product's result transposed rather than turn the product round.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  x = jax.device_put(x, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")))
  params = jax.device_put(params, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  sgd = jax.jit(lambda params, x: jax.tree.map(
      lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x)))
  text = sgd.lower(params, x).compile().as_text()
  dots = _weight_gradient_dots(text)
  (first,) = [shape for name, shape in dots.items() if "Dense_0" in name]
  assert first == (64, 256), dots
