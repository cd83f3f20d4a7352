"""vit_jax's C++ attention kernel for XLA:CPU (`vit_jax.kernels.cpu_attention`):
values and gradients against a float64 NumPy reference in the packed and
split forms, vmap, sharding, the model taking it (where "auto" picks it:
test_attention.py; its builds for other CPUs and compilers:
test_cpu_builds.py)."""

import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.kernels import cpu_attention
from vit_jax.model import vit
from vit_jax.runtime import cpu_info, sharding

from helpers import split_kernel_calls  # pylint: disable=wrong-import-order

pytestmark = pytest.mark.skipif(
    cpu_attention.problem(jnp.float32, 64) is not None,
    reason=f"the CPU kernel cannot be built here: "
    f"{cpu_attention.problem(jnp.float32, 64)}")


def _reference(query, key, value, output_grad, scale, bias):
  """Output and (d query, d key, d value, d bias) of softmax(scale q k^T) v
  in float64, q, k and v the operands plus their bias (3, H, D), the
  gradient written out by hand; token-major (B, T, H, D)."""
  q, k, v, g = (np.asarray(x, np.float64) + b for x, b in
                zip((query, key, value, output_grad), (*bias, 0.0)))
  logits = scale * np.einsum("bqhd,bkhd->bhqk", q, k)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  output = np.einsum("bhqk,bkhd->bqhd", p, v)
  d_p = np.einsum("bqhd,bkhd->bhqk", g, v)
  d_logits = scale * p * (d_p - np.sum(d_p * p, -1, keepdims=True))
  gradients = (np.einsum("bhqk,bkhd->bqhd", d_logits, k),
               np.einsum("bhqk,bqhd->bkhd", d_logits, q),
               np.einsum("bhqk,bqhd->bkhd", p, g))
  return output, (*gradients,
                  np.stack([grad.sum((0, 1)) for grad in gradients]))


def _operands(batch, heads, query_tokens, key_tokens, head_dim, seed=0):
  """query, key, value, output_grad, token-major (B, T, H, D), and the
  bias (3, H, D)."""
  rng = np.random.default_rng(seed)
  draw = lambda tokens, scale: (scale * rng.standard_normal(
      (batch, tokens, heads, head_dim))).astype(np.float32)
  # Logits of a few units after the scale 1/sqrt(head_dim): the softmax
  # far from uniform, nothing saturated.
  return (draw(query_tokens, 1.0), draw(key_tokens, 1.0),
          draw(key_tokens, 1.0), draw(query_tokens, 1.0),
          (0.5 * rng.standard_normal((3, heads, head_dim))).astype(
              np.float32))


def _kernel(query, key, value, bias, operand_dtype=None):
  """The kernel on token-major q, k, v without their bias: self_attention
  over them stacked as the projections lay them out where there are as
  many queries as keys, else query_attention. Returns (output, vjp), vjp
  mapping the output's gradient to (d query, d key, d value, d bias)."""
  scale = query.shape[-1] ** -0.5
  if query.shape[1] == key.shape[1]:
    packed = np.stack([query, key, value], axis=2)  # (B, T, 3, H, D)
    output, vjp = jax.vjp(lambda packed, bias: cpu_attention.self_attention(
        packed, bias, scale, operand_dtype), packed, bias)
    def gradients(grad):
      d_packed, d_bias = vjp(grad)
      return (*np.moveaxis(d_packed, 2, 0), d_bias)
    return output, gradients
  output, vjp = jax.vjp(
      lambda query, keys_values, bias: cpu_attention.query_attention(
          query, keys_values, bias, scale, operand_dtype),
      query, np.stack([key, value], axis=2), bias)
  def split_gradients(grad):
    d_query, d_keys_values, d_bias = vjp(grad)
    return d_query, d_keys_values[:, :, 0], d_keys_values[:, :, 1], d_bias
  return output, split_gradients


def _inference(query, key, value, bias, operand_dtype=None):
  """The kernel's forward pass without differentiation (jitted: the
  probabilities stay in scratch, another custom call)."""
  scale = query.shape[-1] ** -0.5
  if query.shape[1] == key.shape[1]:
    return jax.jit(lambda packed: cpu_attention.self_attention(
        packed, bias, scale, operand_dtype))(
            np.stack([query, key, value], axis=2))
  return jax.jit(lambda query, keys_values: cpu_attention.query_attention(
      query, keys_values, bias, scale, operand_dtype))(
          query, np.stack([key, value], axis=2))


_SHAPES = [
    (2, 3, 65, 65, 64),   # vit_tiny_cifar's blocks: 65 = 4 vectors + 1
    (1, 2, 197, 197, 64),  # ViT-*/16 @224
    (3, 3, 1, 65, 64),    # the class-token-only last block
    (2, 1, 16, 16, 16),   # whole vectors, no padding
    (2, 2, 5, 7, 80),     # fewer tokens than a vector; ViT-H's head_dim
    (1, 1, 50, 50, 32),
    (2, 2, 3, 50, 32),
]


@pytest.mark.parametrize("batch, heads, query_tokens, key_tokens, head_dim",
                         _SHAPES)
def test_values_and_gradients_match_a_float64_reference(
    batch, heads, query_tokens, key_tokens, head_dim):
  """Output and gradients, the bias's included, of the packed form (as
  many queries as keys) or the split one, against float64."""
  query, key, value, output_grad, bias = _operands(
      batch, heads, query_tokens, key_tokens, head_dim)
  output, vjp = _kernel(query, key, value, bias)
  gradients = vjp(output_grad)
  expected_output, expected_gradients = _reference(
      query, key, value, output_grad, head_dim ** -0.5, bias)
  chex.assert_shape(output, query.shape)
  np.testing.assert_allclose(output, expected_output, rtol=2e-5, atol=2e-6)
  for got, expected in zip(gradients, expected_gradients):
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=3e-5)
  np.testing.assert_allclose(_inference(query, key, value, bias), output,
                             rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("operand_dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("batch, heads, query_tokens, key_tokens, head_dim", [
    (1, 3, 197, 197, 64),  # ViT-Ti/16 @224, one image: 3 pairs, 2 threads
    (1, 3, 65, 65, 64),    # vit_tiny_cifar, one image
    (1, 1, 50, 50, 32),    # one pair
    (1, 3, 40, 65, 32)])   # fewer queries than keys
def test_pairs_split_into_blocks_of_queries_give_the_same_values(
    monkeypatch, batch, heads, query_tokens, key_tokens, head_dim,
    operand_dtype):
  """With 2 threads a call and fewer pairs than keep both busy, each
  pair's queries run as blocks (attention_handlers.h, QueryBlocks): the
  output and dq the same bits as unsplit (each query row's arithmetic is
  its own), dk, dv and the bias's gradient (summed over the blocks) within
  float32 rounding of unsplit, and float32's against float64."""
  query, key, value, output_grad, bias = _operands(
      batch, heads, query_tokens, key_tokens, head_dim)
  results = []
  for tasks in (1, 2):
    split_kernel_calls(monkeypatch, tasks)
    output, vjp = _kernel(query, key, value, bias, operand_dtype)
    results.append((np.asarray(output), np.asarray(
        _inference(query, key, value, bias, operand_dtype)),
                    [np.asarray(g) for g in vjp(output_grad)]))
  (unsplit, unsplit_inferred, unsplit_gradients), (
      output, inferred, gradients) = results
  np.testing.assert_array_equal(output, unsplit)
  np.testing.assert_array_equal(inferred, unsplit_inferred)
  np.testing.assert_array_equal(gradients[0], unsplit_gradients[0])
  for got, want in zip(gradients[1:], unsplit_gradients[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  if operand_dtype is None:
    expected_output, expected_gradients = _reference(
        query, key, value, output_grad, head_dim ** -0.5, bias)
    np.testing.assert_allclose(output, expected_output, rtol=2e-5,
                               atol=2e-6)
    for got, expected in zip(gradients, expected_gradients):
      np.testing.assert_allclose(got, expected, rtol=2e-5, atol=3e-5)


def test_the_packed_and_split_forms_agree_and_reject_wrong_operands():
  """self_attention over (B, T, 3, H, D) and query_attention over its
  slices give the same values and gradients; bad shapes, bias and scales
  are named."""
  query, key, value, output_grad, bias = _operands(2, 2, 20, 20, 16)
  packed_output, packed_vjp = _kernel(query, key, value, bias)
  scale = 16 ** -0.5
  split_output, split_vjp = jax.vjp(
      lambda query, keys_values, bias: cpu_attention.query_attention(
          query, keys_values, bias, scale),
      query, np.stack([key, value], axis=2), bias)
  np.testing.assert_array_equal(packed_output, split_output)
  d_query, d_keys_values, d_bias = split_vjp(output_grad)
  d_packed = packed_vjp(output_grad)
  np.testing.assert_array_equal(d_packed[0], d_query)
  np.testing.assert_array_equal(d_packed[1], d_keys_values[:, :, 0])
  np.testing.assert_array_equal(d_packed[2], d_keys_values[:, :, 1])
  np.testing.assert_array_equal(d_packed[3], d_bias)
  packed = np.stack([query, key, value], 2)
  with pytest.raises(ValueError, match="scale must be positive"):
    cpu_attention.self_attention(packed, bias, 0.0)
  with pytest.raises(ValueError, match=r"bias must be \(3, heads, head_dim"):
    cpu_attention.self_attention(packed, bias[:2], scale)
  with pytest.raises(Exception, match=r"\(B, T, 3, H, D\)"):
    cpu_attention.self_attention(packed[:, :, :2], bias, scale)
  with pytest.raises(Exception, match=r"\(B, Tk, 2, H, D\)"):
    cpu_attention.query_attention(query, packed[:1, :, 1:], bias, scale)


def _rounded(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


@pytest.mark.parametrize("batch, heads, query_tokens, key_tokens, head_dim", [
    (1, 2, 197, 197, 64), (3, 3, 1, 65, 64), (2, 2, 5, 7, 80),
    (2, 1, 16, 16, 16), (1, 1, 50, 50, 32)])
def test_bfloat16_products_match_the_float64_reference_of_rounded_operands(
    batch, heads, query_tokens, key_tokens, head_dim):
  """operand_dtype=bfloat16: the output is softmax(s q k^T) v of q, k, v
  rounded to bfloat16, the probabilities rounded for the second product
  (within half a bfloat16 step of each weight: 2^-9 max|v|), not
  float32's; training's forward gives the same output; the gradient's
  four products round their operands too (dO, V, K, Q, P, dS): within a
  bfloat16 step or two of float64's (with AMX or without: the AVX2 and
  SSE builds run this test too)."""
  query, key, value, output_grad, bias = _operands(
      batch, heads, query_tokens, key_tokens, head_dim)
  # The rounding applies to q, k and v, their bias added.
  q, k, v = (_rounded(x + b) for x, b in zip((query, key, value), bias))
  logits = head_dim ** -0.5 * np.einsum("bqhd,bkhd->bhqk", q, k)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  expected = np.einsum("bhqk,bkhd->bqhd", p, v)
  output = np.asarray(_inference(query, key, value, bias, jnp.bfloat16))
  bound = 2.0**-9 * np.abs(v).max()
  assert np.abs(output - expected).max() < bound
  float32 = np.asarray(_inference(query, key, value, bias))
  assert np.abs(float32 - expected).max() > 1e-4  # the rounding shows
  trained, vjp = _kernel(query, key, value, bias, jnp.bfloat16)
  np.testing.assert_array_equal(trained, output)
  _, expected_gradients = _reference(query, key, value, output_grad,
                                     head_dim ** -0.5, bias)
  for got, want in zip(vjp(output_grad), expected_gradients):
    got = np.asarray(got, np.float64)
    assert np.abs(got - want).max() < 2.0**-6 * np.abs(want).max()
    assert np.sum(got * want) > 0.9999 * np.linalg.norm(got) * np.linalg.norm(
        want)
  with pytest.raises(ValueError, match="bfloat16 operands or float32"):
    _kernel(query, key, value, bias, jnp.float16)


def test_extreme_logits_stay_finite_and_exact():
  """A row of large logits (softmax one-hot up to rounding) and one of
  equal logits (uniform)."""
  query, key, value, output_grad, bias = _operands(1, 1, 2, 40, 16)
  bias[:2] = 0.0  # q and k as drawn below; v's bias kept
  key[0, 7, 0] = 120 * query[0, 0, 0] / np.sum(query[0, 0, 0] ** 2)
  query[0, 0, 0] *= 10  # logit 300 on key 7, far above the rest
  query[0, 1, 0] = 0.0  # all logits 0
  output, vjp = _kernel(query, key, value, bias)
  expected_output, expected_gradients = _reference(query, key, value,
                                                   output_grad, 0.25, bias)
  value = value + bias[2]
  np.testing.assert_allclose(output, expected_output, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(output[0, 0, 0], value[0, 7, 0], rtol=1e-5)
  np.testing.assert_allclose(output[0, 1, 0], value[0, :, 0].mean(0),
                             rtol=1e-5, atol=1e-6)
  for got, expected in zip(vjp(output_grad), expected_gradients):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_vmap_gives_each_slice_its_own_attention():
  """vmap over a leading axis, forward and gradient, against a Python
  loop over the slices; for query_attention also with unmapped keys and
  values."""
  operands = [_operands(2, 3, 20, 20, 16, seed) for seed in range(3)]
  packed = np.stack([np.stack(o[:3], axis=2) for o in operands])
  queries = np.stack([o[0][:, :4] for o in operands])  # (3, B, 4, H, D)
  keys_values = packed[0, :, :, 1:]
  output_grad, bias = operands[0][3:]

  def packed_loss(packed):
    return jnp.sum(cpu_attention.self_attention(packed, bias, 0.25) *
                   output_grad)

  def query_loss(query):
    return jnp.sum(cpu_attention.query_attention(
        query, keys_values, bias, 0.25) * output_grad[:, :4])

  for loss, inputs in ((packed_loss, packed), (query_loss, queries)):
    mapped = jax.vmap(jax.value_and_grad(loss))(inputs)
    for index, one in enumerate(inputs):
      looped = jax.value_and_grad(loss)(one)
      np.testing.assert_allclose(mapped[0][index], looped[0], rtol=1e-6)
      np.testing.assert_allclose(mapped[1][index], looped[1], rtol=1e-6,
                                 atol=1e-7)


def test_a_batch_split_mesh_runs_the_kernel_per_device_without_gathering():
  mesh = sharding.make_mesh()  # the tests' 8 CPU devices
  assert mesh.size == 8
  """The projections and their gradient split over the batch, the bias
  replicated: its gradient is each device's sum, all-reduced."""
  query, key, value, output_grad, bias = _operands(8, 3, 65, 65, 64)
  operands = (np.stack([query, key, value], axis=2), output_grad)
  split = jax.device_put(operands, sharding.batch_sharded(mesh))

  def loss(packed, bias, output_grad):
    output = cpu_attention.self_attention(packed, bias, 0.125)
    return jnp.sum(output * output_grad)

  gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))
  lowered = gradient.lower(split[0], bias, split[1])
  # Each device's pairs on its own cores: with 8 devices on this machine's
  # cores, one thread (no helper from XLA's pool, which would run on
  # another device's core).
  threads = max(1, cpu_info.cpu_cores() // 8)
  assert re.findall(r"threads = (\d+)", lowered.as_text()) == [
      str(threads)] * 2  # the training forward pass and the gradient
  compiled = lowered.compile().as_text()
  assert "VitAttentionPackedBackward" in compiled
  assert not re.search(r"all-gather|all-to-all|collective-permute",
                       compiled)
  got, got_bias = gradient(split[0], bias, split[1])
  expected, expected_bias = gradient(operands[0], bias, operands[1])
  assert got.sharding.is_equivalent_to(sharding.batch_sharded(mesh), 5)
  np.testing.assert_array_equal(got, expected)  # same kernel, same sums
  np.testing.assert_allclose(got_bias, expected_bias, rtol=1e-5, atol=1e-5)


_DIMS = dict(num_classes=5, patch_size=4, hidden_size=48, num_layers=2,
             num_heads=3, mlp_dim=64)  # head_dim 16


def test_the_kernels_count_the_cores_where_the_os_has_no_affinity_mask(
    monkeypatch):
  """macOS's os has no sched_getaffinity: the kernels' threads then come
  from os.cpu_count (an AttributeError before, raised as the model traced
  any kernel there)."""
  monkeypatch.delattr(os, "sched_getaffinity")
  monkeypatch.setattr(os, "cpu_count", lambda: 16)
  monkeypatch.setattr(cpu_info, "cpu_quota", lambda: None)  # no container's
  projections, bias = np.zeros((2, 5, 3, 1, 16), np.float32), np.zeros(
      (3, 1, 16), np.float32)
  lowered = jax.jit(lambda p, b: cpu_attention.self_attention(p, b, 0.25)
                   ).lower(projections, bias).as_text()
  threads = max(1, 16 // jax.local_device_count("cpu"))
  assert re.findall(r"threads = (\d+)", lowered) == [str(threads)]


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_the_model_takes_the_kernel_on_cpu_with_the_einsums_values(
    classifier):
  rng = np.random.default_rng(0)
  images = rng.standard_normal((3, 12, 12, 3)).astype(np.float32)
  params = jax.tree.map(
      lambda leaf: 0.3 * rng.standard_normal(leaf.shape).astype(np.float32),
      jax.eval_shape(vit.VisionTransformer(**_DIMS,
                                              classifier=classifier).init,
                     jax.random.key(0), images))

  def run(implementation):
    model = vit.VisionTransformer(
        **_DIMS, classifier=classifier,
        attention_implementation=implementation)
    loss = lambda params: jnp.sum(jnp.sin(model.apply(params, images)))
    grad = jax.jit(jax.value_and_grad(loss))
    return grad(params), str(grad.lower(params).as_text())

  (kernel_loss, kernel_grads), program = run("auto")
  (einsum_loss, einsum_grads), _ = run("einsum")
  assert "VitAttentionPackedBackward" in program  # "auto" took the kernel
  # The class token's query alone in the last block.
  assert ("VitAttentionSplitBackward" in program) == (classifier == "token")
  assert "Bf16" not in program
  np.testing.assert_allclose(kernel_loss, einsum_loss, rtol=1e-5)
  chex.assert_trees_all_close(kernel_grads, einsum_grads, atol=1e-5,
                              rtol=1e-4)


def test_the_models_bfloat16_products_take_the_kernels_bfloat16_products():
  """config.model.matmul_dtype=bfloat16 rounds the attention core's
  operands too, in training (forward and backward) and evaluation."""
  images = np.ones((2, 12, 12, 3), np.float32)
  model = vit.VisionTransformer(**_DIMS, matmul_dtype="bfloat16")
  params = model.init(jax.random.key(0), images)
  loss = lambda params: jnp.sum(model.apply(params, images))
  training = jax.jit(jax.grad(loss)).lower(params).as_text()
  assert "VitAttentionPackedForTrainingBf16" in training
  assert "VitAttentionPackedBackwardBf16" in training
  assert "VitAttentionSplitBackwardBf16" in training
  assert "VitAttentionPackedForInferenceBf16" in jax.jit(
      loss).lower(params).as_text()
