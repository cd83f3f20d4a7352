"""Parameters prepared for inference (`model.inference`): the encoder's
Dense kernels in the products' dtype, the same logits bit for bit, and
nothing else touched."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from vit_jax.kernels import matmuls
from vit_jax.model import inference, self_attention, vit


def _random_params(model, images):
  """The model's params, every leaf drawn anew (normal, scaled to its
  fan-in): initialisation zeroes the head, which would make every logit
  its bias whatever the rest."""
  params = jax.jit(model.init)(jax.random.PRNGKey(0), images)["params"]
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  return treedef.unflatten([
      jax.random.normal(key, leaf.shape) / np.sqrt(max(leaf.shape[0], 1))
      for key, leaf in zip(keys, leaves)])


def _model(**overrides) -> vit.VisionTransformer:
  fields = dict(num_classes=5, patch_size=4, hidden_size=32, num_layers=2,
                num_heads=2, mlp_dim=64, matmul_dtype=jnp.bfloat16)
  fields.update(overrides)
  return vit.VisionTransformer(**fields)


@pytest.mark.parametrize("overrides", [
    {}, {"scan_blocks": True}, {"classifier": "gap"},
    {"matmul_implementation": "xla"}])
def test_logits_are_the_same_bits_from_half_the_kernels(overrides):
  """Every kernel of the encoder's products (6 a block) in bfloat16, every
  other parameter as it was, and the model's logits identical: the model
  rounds those kernels to bfloat16 itself otherwise."""
  model = _model(**overrides)
  images = jax.random.normal(jax.random.PRNGKey(1), (3, 16, 16, 3))
  params = _random_params(model, images)
  prepared = inference.inference_params(params, model.matmul_dtype)
  flat, flat_prepared = (traverse_util.flatten_dict(p)
                         for p in (params, prepared))
  assert flat.keys() == flat_prepared.keys()
  cast = [path for path, value in flat_prepared.items()
          if value.dtype == jnp.bfloat16]
  assert len(cast) == 6 * model.num_layers
  assert all(path[-1] == "kernel" for path in cast)
  for path, value in flat.items():
    if path not in cast:
      assert flat_prepared[path] is value
    else:
      np.testing.assert_array_equal(
          flat_prepared[path], np.asarray(value).astype(jnp.bfloat16))
  apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
  logits = apply(params, images)
  assert np.std(np.asarray(logits)) > 0.1  # logits that depend on it all
  np.testing.assert_array_equal(apply(prepared, images), logits)


def test_the_model_converts_no_prepared_kernel():
  """From prepared params the compiled forward pass converts less: XLA
  removes the output projection's and the MLP's kernels' round trips to
  float32 and back, which is the point."""
  model = _model(num_layers=1)
  images = jnp.zeros((1, 16, 16, 3))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), images)["params"]
  apply = jax.jit(lambda p, x: model.apply({"params": p}, x))

  def converts(p):
    hlo = apply.lower(p, images).compile().as_text()
    return hlo.count("convert(")

  assert converts(inference.inference_params(params, jnp.bfloat16)) < (
      converts(params))


@pytest.mark.parametrize("implementation", ["xla", "onednn"])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_prepared_query_key_value_kernels_stay_bfloat16(classifier,
                                                        implementation):
  """The q, k and v kernels of their one product: joined in bfloat16 for
  XLA's products, neither widened nor joined for oneDNN's, which read them
  side by side. XLA:CPU runs a bfloat16 concatenation in float32 (each
  kernel converted up, the result down: 8-9% of a batch-1
  `vit_tiny_cifar` forward pass on a Zen 5, docs/performance.md), which
  the model's concatenation of their bits avoids. With the class token,
  the last block's query and key/value products are joined apart."""
  if implementation == "onednn" and matmuls.resolve_implementation(
      "auto", jnp.float32, jnp.bfloat16) != "onednn":
    pytest.skip("oneDNN's bfloat16 products do not run on this CPU")
  model = _model(num_layers=2, mlp_dim=40, classifier=classifier,
                 matmul_implementation=implementation)
  images = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 16, 3))
  params = _random_params(model, images)
  prepared = inference.inference_params(params, jnp.bfloat16)
  apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
  hlo = apply.lower(prepared, images).compile().as_text()
  if implementation == "xla":
    # Joined in bfloat16 (where the CPU's own bfloat16 dot may widen its
    # operands after, as XLA's does without AMX).
    assert "bf16[32,96]" in hlo
    assert not re.search(r"f32\[32,(64|96)\]\S* concatenate\(", hlo)
  else:
    # (32, 2, 16) kernels, (32, 32) reshaped, never widened nor joined.
    for shape in ("32,2,16", "32,32", "32,64", "32,96"):
      assert f"f32[{shape}]" not in hlo, shape
    assert not re.search(r"(bf16|u16)\[32,(64|96)\]", hlo)
    assert "VitGemmBf16" in hlo
  np.testing.assert_array_equal(apply(prepared, images),
                                apply(params, images))


def test_float32_products_and_unknown_paths_are_left_alone():
  params = {"encoderblock_0": {"MlpBlock_3": {"Dense_0": {
      "kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}},
            "head": {"kernel": jnp.ones((2, 2))}}
  assert inference.inference_params(params, None) is params
  assert inference.inference_params(params, jnp.float32) is params
  prepared = inference.inference_params(params, jnp.bfloat16)
  assert prepared["encoderblock_0"]["MlpBlock_3"]["Dense_0"][
      "kernel"].dtype == jnp.bfloat16
  assert prepared["encoderblock_0"]["MlpBlock_3"]["Dense_0"][
      "bias"].dtype == jnp.float32
  assert prepared["head"]["kernel"].dtype == jnp.float32
  assert inference.is_product_kernel(
      ("MultiHeadDotProductAttention_1", "out", "kernel"))
  assert not inference.is_product_kernel(("out", "kernel"))
