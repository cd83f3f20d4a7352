"""The MLP's tanh GELU of the first product plus its bias as a C++ kernel
(`cpu_gelu`), and where `gelu_matmul.mlp` takes it; the model with it:
tests/kernels/test_cpu_gemm.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from vit_jax.kernels import cpu_build, cpu_gelu, cpu_gemm, gelu_matmul
from vit_jax.runtime import sharding

from helpers import split_kernel_calls  # pylint: disable=wrong-import-order

needs_kernels = pytest.mark.skipif(
    cpu_build.problem() is not None,
    reason=f"the C++ kernels cannot run: {cpu_build.problem()}")


def _inputs(seed: int, *shape: int) -> np.ndarray:
  """Normal values times 3, and the far tails and zeros of both signs."""
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 3
  flat = x.reshape(-1)
  extremes = [0.0, -0.0, 1e-20, -1e-20, 9.0, -9.0, 30.0, -30.0, 1e4, -1e4]
  flat[:len(extremes)] = extremes[:flat.size]
  return x


def _bias(seed: int, n: int) -> np.ndarray:
  """Normal values, zero where `_inputs` puts its extremes (row 0's first
  ten columns), which then reach the GELU as they are."""
  bias = np.random.default_rng(seed).normal(size=n).astype(np.float32)
  bias[:10] = 0.0
  return bias


def _gelu_and_gradient_f64(h, bias, activations_grad):
  """gelu(h + bias), its vjp for h and bias's, by JAX's autodiff in
  float64."""
  with jax.enable_x64(True):
    activations, vjp = jax.vjp(
        lambda x, b: jax.nn.gelu(x + b, approximate=True),
        jnp.asarray(h, jnp.float64), jnp.asarray(bias, jnp.float64))
    h_grad, bias_grad = vjp(jnp.asarray(activations_grad, jnp.float64))
    return np.asarray(activations), np.asarray(h_grad), np.asarray(bias_grad)


@needs_kernels
@pytest.mark.parametrize("tasks", [1, 3])
@pytest.mark.parametrize("shape", [(2, 197, 64), (3, 5, 17), (1, 7)])
def test_values_and_gradients_match_a_float64_reference(monkeypatch, tasks,
                                                        shape):
  """Every group's rows split into `tasks` blocks (their bias gradients
  summed), rows that are not whole vectors, and tails where tanh saturates
  or exp would overflow."""
  split_kernel_calls(monkeypatch, tasks)
  h = _inputs(0, *shape)
  bias = _bias(1, shape[-1])
  activations_grad = np.random.default_rng(2).normal(size=shape).astype(
      np.float32)
  expected, expected_grad, expected_bias_grad = _gelu_and_gradient_f64(
      h, bias, activations_grad)
  forward = jax.jit(cpu_gelu.gelu)(h, bias)
  activations, h_grad, bias_grad = jax.jit(cpu_gelu.gelu_and_gradient)(
      h, bias, activations_grad)
  for result, reference in ((forward, expected), (activations, expected),
                            (h_grad, expected_grad)):
    assert result.shape == shape and result.dtype == jnp.float32
    assert np.all(np.isfinite(result))
    np.testing.assert_allclose(result, reference, rtol=2e-6, atol=1e-6)
  assert bias_grad.shape == bias.shape
  rows = h.size // shape[-1]
  np.testing.assert_allclose(bias_grad, expected_bias_grad, rtol=1e-5,
                             atol=1e-6 * rows)


@needs_kernels
def test_under_a_batch_split_mesh_each_device_takes_its_own_rows():
  """Each device's rows in its own call, and the bias's gradient their
  sum (an all-reduce), with no gathering."""
  mesh = sharding.make_mesh()
  count = mesh.devices.size
  rows = NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES))
  h = jax.device_put(_inputs(2, count, 12, 40), rows)
  bias = _bias(3, 40)
  activations_grad = jax.device_put(_inputs(4, count, 12, 40), rows)
  step = jax.jit(cpu_gelu.gelu_and_gradient)
  program = step.lower(h, bias, activations_grad).compile().as_text()
  assert "all-gather" not in program and "VitGeluBackward" in program
  activations, h_grad, bias_grad = step(h, bias, activations_grad)
  assert {s.data.shape for s in h_grad.addressable_shards} == {(1, 12, 40)}
  expected, expected_grad, expected_bias_grad = _gelu_and_gradient_f64(
      h, bias, activations_grad)
  np.testing.assert_allclose(activations, expected, rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(h_grad, expected_grad, rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(bias_grad, expected_bias_grad, rtol=1e-5,
                             atol=1e-4)


def _mlp_operands(seed: int, rows_shape: tuple[int, ...], depth: int,
                  hidden: int, width: int) -> list[np.ndarray]:
  """inputs (*rows_shape, depth), kernel0 (depth, hidden), bias0 (hidden,),
  kernel1 (hidden, width): the hidden layer's values spread as _inputs'."""
  normal = np.random.default_rng(seed).normal
  return [normal(size=(*rows_shape, depth)).astype(np.float32),
          (normal(size=(depth, hidden)) * 3 / depth**0.5).astype(np.float32),
          normal(size=hidden).astype(np.float32),
          (normal(size=(hidden, width)) / 5).astype(np.float32)]


def _mlp_written_out(x, k0, b0, k1, approximate=True, operand_dtype=None):
  """The MLP by jnp: products of operands rounded to operand_dtype (if
  given), accumulated in float32; the GELU by jax.nn."""
  def product(a, b):
    if operand_dtype is not None:
      a, b = a.astype(operand_dtype), b.astype(operand_dtype)
    return jnp.einsum("...k,kn->...n", a, b,
                      preferred_element_type=jnp.float32)
  return product(jax.nn.gelu(product(x, k0) + b0, approximate=approximate),
                 k1)


@needs_kernels
@pytest.mark.parametrize("approximate,operand_dtype,implementation,kernel", [
    (True, None, "onednn", True), (False, None, "onednn", False),
    (True, None, "xla", True), (True, jnp.bfloat16, "xla", True)])
def test_mlp_takes_the_kernel_for_the_tanh_gelu(
    approximate, operand_dtype, implementation, kernel):
  """The tanh GELU of float32 inputs runs in the kernel, forward and
  backward under differentiation and alone in inference, whichever the
  products (oneDNN's, XLA's, with bfloat16 operands); the exact (erf)
  GELU keeps XLA's: the same values and gradients as the layers written
  out."""
  if implementation == "onednn" and cpu_gemm.problem() is not None:
    pytest.skip(f"the oneDNN products cannot run: {cpu_gemm.problem()}")
  operands = _mlp_operands(4, (2, 30), 20, 24, 16)

  def mlp(*operands):
    return gelu_matmul.mlp(*operands, approximate, operand_dtype,
                           implementation)

  gradient = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))),
                                argnums=(0, 1, 2, 3))
  loss = jax.jit(gradient(mlp))
  program = loss.lower(*operands).as_text()
  assert (("VitGelu" in program) and ("VitGeluBackward" in program)) == kernel
  reference = gradient(lambda *a: _mlp_written_out(*a, approximate,
                                                   operand_dtype))
  tolerance = 1e-4 if operand_dtype is None else 2e-2  # bfloat16 operands
  for result, expected in zip(loss(*operands), reference(*operands)):
    np.testing.assert_allclose(result, expected, rtol=tolerance,
                               atol=tolerance * np.abs(expected).max())
  inference = jax.jit(mlp)
  inference_program = inference.lower(*operands).as_text()
  assert ("VitGelu" in inference_program) == kernel
  assert "VitGeluBackward" not in inference_program
  expected = _mlp_written_out(*operands, approximate, operand_dtype)
  np.testing.assert_allclose(inference(*operands), expected,
                             rtol=tolerance,
                             atol=tolerance * np.abs(expected).max())


@needs_kernels
@pytest.mark.parametrize("shape", [(2, 197, 64), (3, 5, 17)])
def test_bfloat16_activations_are_the_float32_ones_rounded(shape):
  """With activations_dtype=bfloat16 the kernel's activations, forward and
  backward, are its float32 ones as XLA rounds them (to nearest, ties to
  even), in whole vectors and in a row's last part (17 columns), and so is
  the backward pass's gradient with gradient_dtype=bfloat16; the other
  results are unchanged (the bias's gradient sums the unrounded one). NaN and infinities stay so; results below
  float32's smallest normal (GELU(+-2e-38) = +-1e-38) are zeros in both, as
  XLA:CPU flushes denormals to zero (the kernel's AVX512_BF16 rounding
  does too)."""
  h = _inputs(5, *shape)
  h.reshape(-1)[2:4] = [2e-38, -2e-38]  # where the bias is zero
  h.reshape(-1)[10:13] = [np.nan, np.inf, -np.inf]
  bias = _bias(6, shape[-1])
  grad = np.random.default_rng(7).normal(size=shape).astype(np.float32)
  rounded = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
  forward = jax.jit(cpu_gelu.gelu, static_argnums=2)
  expected = rounded(forward(h, bias, jnp.float32))
  result = np.asarray(forward(h, bias, jnp.bfloat16))
  assert result.dtype == jnp.bfloat16
  np.testing.assert_array_equal(result.astype(np.float32),
                                expected.astype(np.float32))
  assert np.all(result.reshape(-1)[2:4].astype(np.float32) == 0)
  backward = jax.jit(cpu_gelu.gelu_and_gradient, static_argnums=(3, 4))
  reference = backward(h, bias, grad, jnp.float32, jnp.float32)
  for gradient_dtype in (jnp.float32, jnp.bfloat16):
    ours = backward(h, bias, grad, jnp.bfloat16, gradient_dtype)
    assert [a.dtype for a in ours] == [jnp.bfloat16, gradient_dtype,
                                       jnp.float32]
    for index in (0, 1) if gradient_dtype == jnp.bfloat16 else (0,):
      np.testing.assert_array_equal(
          np.asarray(ours[index]).astype(np.float32),
          rounded(reference[index]).astype(np.float32))
    if gradient_dtype == jnp.float32:
      np.testing.assert_array_equal(ours[1], reference[1])
    # The bias's gradient sums the unrounded gradient.
    np.testing.assert_array_equal(ours[2], reference[2])


@needs_kernels
@pytest.mark.parametrize("rows,implementation,backward_target", [
    (64, "xla", "VitGeluBackwardBf16"), (7, "xla", "VitGeluBackward"),
    pytest.param(64, "onednn", "VitGeluBackwardRounded",
                 marks=pytest.mark.skipif(
                     cpu_gemm.problem() is not None
                     or cpu_gemm.bfloat16_problem() is not None,
                     reason="bfloat16 operands do not take oneDNN's "
                     "products on this CPU"))])
def test_bfloat16_products_read_the_kernels_rounded_results(
    rows, implementation, backward_target):
  """With bfloat16 products the forward kernel returns the activations in
  bfloat16, which the second product reads. The backward kernel does too
  where the weight gradient's product reads them unchanged: XLA's YNNPACK
  product with rows in several groups (64 on the suite's 8 devices),
  oneDNN's always; in float32 where they are YNNPACK's transposed operand
  (7 rows, one group). With oneDNN's products it rounds the hidden layer's
  gradient as well, which both of the first product's gradients read.
  The values are those of the layers written out, the products on
  operands XLA rounds."""
  operands = _mlp_operands(8, (rows,), 24, 48, 16)
  gradient = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))),
                                argnums=(0, 1, 2, 3))
  ours = jax.jit(gradient(lambda *a: gelu_matmul.mlp(
      *a, True, jnp.bfloat16, implementation)))
  program = ours.lower(*operands).as_text()
  assert "VitGeluBf16" in program
  assert re.search(rf"{backward_target}\b", program)
  reference = gradient(lambda *a: _mlp_written_out(*a, True, jnp.bfloat16))
  for result, expected in zip(ours(*operands), reference(*operands)):
    np.testing.assert_allclose(result, expected, rtol=2e-2,
                               atol=2e-2 * np.abs(expected).max())


@needs_kernels
def test_wrong_operands_are_named():
  with pytest.raises(ValueError, match=r"h \(G, \.\.\., n\).*bias \(n,\).*"
                     r"float32\[2, 3\]', 'float32\[3\]', 'float32\[2, 4\]"):
    cpu_gelu.gelu_and_gradient(jnp.ones((2, 3)), jnp.ones(3), jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r"float32\[2, 3\]', 'float32\[4\]"):
    cpu_gelu.gelu(jnp.ones((2, 3)), jnp.ones(4))  # the bias's length
  with pytest.raises(ValueError, match=r"bfloat16\[2, 3\]"):
    cpu_gelu.gelu(jnp.ones((2, 3), jnp.bfloat16), jnp.ones(3))
  with pytest.raises(ValueError, match="not float32 and bfloat16"):
    cpu_gelu.gelu_and_gradient(jnp.ones((2, 3)), jnp.ones(3),
                               jnp.ones((2, 3)), jnp.float32, jnp.bfloat16)
