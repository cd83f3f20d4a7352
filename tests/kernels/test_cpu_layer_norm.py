"""LayerNorm as a C++ kernel (`cpu_layer_norm`), and the model's choice of
it (`cpu_layer_norm.resolve_implementation`); the model with it:
tests/kernels/test_cpu_gemm.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from vit_jax.kernels import cpu_build, cpu_layer_norm
from vit_jax.runtime import sharding

from helpers import split_kernel_calls  # pylint: disable=wrong-import-order

needs_kernels = pytest.mark.skipif(
    cpu_build.problem() is not None,
    reason=f"the C++ kernels cannot run: {cpu_build.problem()}")

EPSILON = 1e-6


def _normal(seed: int, *shape: int) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _values_and_gradients(norm, x, scale, bias, output_grad):
  """(y, dx, dscale, dbias) of y = norm(x, scale, bias) given dy."""
  y, backward = jax.vjp(norm, x, scale, bias)
  return (y, *backward(output_grad))


def _plain_layer_norm(x, scale, bias):
  mean = x.mean(axis=-1, keepdims=True)
  variance = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
  return (x - mean) / jnp.sqrt(variance + EPSILON) * scale + bias


@needs_kernels
@pytest.mark.parametrize("tasks", [1, 3])
@pytest.mark.parametrize("groups,rows,features", [
    (1, 197, 192), (2, 37, 20), (3, 5, 17)])
def test_values_and_gradients_match_a_float64_reference(
    monkeypatch, tasks, groups, rows, features):
  """Forward and backward against JAX's autodiff of the formula in float64,
  each group's rows split into `tasks` blocks (sizes that no block
  divides, widths that are not whole vectors, rows far from zero mean)."""
  split_kernel_calls(monkeypatch, tasks)
  x = 4.0 * _normal(0, groups, rows, features) + 3.0
  scale, bias = _normal(1, features), _normal(2, features)
  output_grad = _normal(3, groups, rows, features)
  results = jax.jit(lambda *a: _values_and_gradients(
      lambda x, s, b: cpu_layer_norm.layer_norm(x, s, b, EPSILON), *a))(
          x, scale, bias, output_grad)
  with jax.enable_x64(True):
    f64 = lambda a: jnp.asarray(a, jnp.float64)
    expected = _values_and_gradients(_plain_layer_norm, f64(x), f64(scale),
                                     f64(bias), f64(output_grad))
    expected = [np.asarray(e) for e in expected]
  for result, reference in zip(results, expected):
    assert result.shape == reference.shape and result.dtype == jnp.float32
    np.testing.assert_allclose(result, reference, rtol=1e-4,
                               atol=2e-6 * np.abs(reference).max())


@needs_kernels
@pytest.mark.parametrize("shape", [(2, 40, 24), (96, 24)])
def test_the_module_is_flax_layer_norm(shape):
  """Grouped rows (G, R, D) or flat ones (R, D), which it groups by the
  devices: Flax's parameters, values and gradients."""
  x = _normal(4, *shape) * 2.0 - 1.0
  ours = cpu_layer_norm.LayerNorm(epsilon=EPSILON)
  flax_norm = nn.LayerNorm(epsilon=EPSILON)
  params = flax_norm.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)) == (
      jax.tree.map(jnp.shape, params))
  params = jax.tree.map(lambda p: p + _normal(5, *p.shape), params)
  output_grad = _normal(6, *shape)

  def values_and_gradients(module, params, x):
    y, backward = jax.vjp(module.apply, params, x)
    return y, backward(output_grad)

  y, grads = jax.jit(values_and_gradients, static_argnums=0)(ours, params, x)
  y_ref, grads_ref = jax.jit(values_and_gradients, static_argnums=0)(
      flax_norm, params, x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4,
                               atol=1e-5 * np.abs(g_ref).max())


@needs_kernels
def test_under_a_batch_split_mesh_each_device_normalises_its_own_rows():
  mesh = sharding.make_mesh()
  count = mesh.devices.size
  rows = NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES))
  x = jax.device_put(_normal(7, count, 12, 40), rows)
  output_grad = jax.device_put(_normal(8, count, 12, 40), rows)
  scale, bias = _normal(9, 40), _normal(10, 40)
  step = jax.jit(lambda *a: _values_and_gradients(
      lambda x, s, b: cpu_layer_norm.layer_norm(x, s, b, EPSILON), *a))
  program = step.lower(x, scale, bias, output_grad).compile().as_text()
  assert "all-gather" not in program and "all-reduce" in program
  assert "VitLayerNormBackward" in program
  y, dx, dscale, dbias = step(x, scale, bias, output_grad)
  assert {shard.data.shape for shard in y.addressable_shards} == {(1, 12, 40)}
  y_ref, dx_ref, dscale_ref, dbias_ref = jax.jit(
      lambda *a: _values_and_gradients(_plain_layer_norm, *a))(
          x, scale, bias, output_grad)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dscale, dscale_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dbias, dbias_ref, rtol=1e-5, atol=1e-4)


def test_auto_takes_the_kernel_only_for_float32_on_a_cpu(monkeypatch):
  monkeypatch.setattr(cpu_build, "problem", lambda device=None: None)
  resolve = cpu_layer_norm.resolve_implementation
  assert resolve("auto", jnp.float32) == "cpu_kernel"
  assert resolve("auto", jnp.bfloat16) == "xla"
  assert resolve("xla", jnp.float32) == "xla"
  with pytest.raises(ValueError, match="computes in float32.*bfloat16"):
    resolve("cpu_kernel", jnp.bfloat16)
  with pytest.raises(ValueError, match="Unknown layer_norm_implementation"):
    resolve("apex", jnp.float32)
  monkeypatch.setattr(cpu_build, "problem",
                      lambda device=None: "no C++ compiler")
  assert resolve("auto", jnp.float32) == "xla"
  with pytest.raises(ValueError, match="cannot run here: no C.. compiler. "
                     "Use 'auto'"):
    resolve("cpu_kernel", jnp.float32)


@needs_kernels
def test_wrong_operands_are_named():
  with pytest.raises(ValueError, match=r"x \(G, rows, D\).*float32\[4, 8\]"):
    cpu_layer_norm.layer_norm(jnp.ones((4, 8)), jnp.ones(8), jnp.ones(8),
                              EPSILON)
