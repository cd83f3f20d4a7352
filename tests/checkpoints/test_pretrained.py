"""Official/big_vision .npz layouts, position-embedding resize, re-heading."""

import chex
import jax
import numpy as np
import pytest

from helpers import small_vit
from vit_jax.checkpoints import npz, pretrained
from vit_jax.model import variants
from vit_jax.checkpoints.npz import CheckpointFormatError


def _random_params(model, image_size=16, seed=0):
  """Initialised, then every leaf perturbed (zero-init leaves would hide
  mapping errors)."""
  params = model.init(jax.random.PRNGKey(seed),
                      np.zeros((1, image_size, image_size, 3)))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [
      np.array(x + 0.1 * jax.random.normal(k, x.shape))
      for x, k in zip(leaves, keys)])


def _big_vision_layout(params, scanned: bool, prefix: str):
  """Writes our tree the way big_vision names and stacks it."""
  flat = npz.flatten(params)
  out = {}
  rename = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
            "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0"}
  for key, value in flat.items():
    if key == "Transformer/posembed_input/pos_embedding":
      out["pos_embedding"] = value[:, 1:]  # big_vision has no class row
      continue
    for old, new in rename.items():
      key = key.replace(f"/{old}/", f"/{new}/")
    out[key] = value
  if scanned:
    stacked = {}
    for key in [k for k in out if k.startswith("Transformer/encoderblock_")]:
      layer, rest = key[len("Transformer/encoderblock_"):].split("/", 1)
      stacked.setdefault(rest, {})[int(layer)] = out.pop(key)
    for rest, layers in stacked.items():
      out[f"Transformer/encoderblock/{rest}"] = np.stack(
          [layers[i] for i in sorted(layers)])
  return {prefix + k: v for k, v in out.items()}


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_npz_round_trip_is_exact(tmp_path):
  params = _random_params(small_vit(representation_size=8))
  path = str(tmp_path / "model.npz")
  npz.save_npz(params, path)
  loaded, settings = pretrained.load_params(path, num_heads=4)
  _assert_trees_equal(loaded, params)
  assert settings["classifier"] == "token" and settings["approximate_gelu"]
  assert not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("prefix", ["params/", "params/img/", ""])
def test_big_vision_layout_loads_to_the_same_tree(tmp_path, scanned, prefix):
  params = _random_params(small_vit())
  # big_vision adds no position embedding to the class token.
  posemb = params["Transformer"]["posembed_input"]["pos_embedding"]
  posemb[:, 0] = 0.0
  path = str(tmp_path / "big_vision.npz")
  np.savez(path, **_big_vision_layout(params, scanned, prefix))
  loaded, _ = pretrained.load_params(path, num_heads=4)
  _assert_trees_equal(loaded, params)


def test_training_checkpoint_prefix_and_gap(tmp_path):
  params = _random_params(small_vit(classifier="gap"))
  path = str(tmp_path / "opt.npz")
  np.savez(path, **{"opt/target/" + k: v for k, v in
                    npz.flatten(params).items()})
  loaded, settings = pretrained.load_params(path, num_heads=4)
  _assert_trees_equal(loaded, params)
  assert settings["classifier"] == "gap"


def test_official_ti16_layout_param_count(tmp_path):
  """An AugReg-style ViT-Ti/16 file (big_vision names, scanned) loads into
  ViT-Ti/16 with the official parameter count and runs."""
  model = variants.build_model(variants.get_variant("ViT-Ti/16"), 1000)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                          np.zeros((1, 224, 224, 3)))["params"]
  rng = np.random.default_rng(0)
  params = jax.tree.map(
      lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32),
      shapes)
  params["Transformer"]["posembed_input"]["pos_embedding"][:, 0] = 0.0
  path = str(tmp_path / "Ti_16.npz")
  np.savez(path, **_big_vision_layout(params, scanned=True, prefix="params/"))
  loaded, _ = pretrained.load_params(path, num_heads=3)
  assert sum(x.size for x in jax.tree.leaves(loaded)) == 5_717_416
  logits = model.apply({"params": loaded}, np.ones((1, 224, 224, 3)))
  assert logits.shape == (1, 1000) and np.all(np.isfinite(logits))


def test_unsupported_npz_models_are_refused(tmp_path):
  flat = npz.flatten(_random_params(small_vit()))
  map_head = dict(flat, **{"MAPHead_0/probe": np.zeros((1, 1, 32))})
  np.savez(tmp_path / "map.npz", **map_head)
  with pytest.raises(CheckpointFormatError, match="'map'"):
    pretrained.load_params(str(tmp_path / "map.npz"), 4)
  del flat["Transformer/posembed_input/pos_embedding"]
  np.savez(tmp_path / "sincos.npz", **flat)
  with pytest.raises(CheckpointFormatError, match="sincos2d"):
    pretrained.load_params(str(tmp_path / "sincos.npz"), 4)
  np.savez(tmp_path / "resnet.npz", **{"conv_root/kernel": np.zeros(3)})
  with pytest.raises(CheckpointFormatError, match="hybrid"):
    pretrained.load_params(str(tmp_path / "resnet.npz"), 4)


def test_damaged_or_pickled_npz_is_refused(tmp_path):
  path = tmp_path / "model.npz"
  npz.save_npz(_random_params(small_vit()), str(path))
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointFormatError, match="model.npz"):
    pretrained.load_params(str(path), 4)
  np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object))
  with pytest.raises(CheckpointFormatError, match="never unpickled"):
    pretrained.load_params(str(tmp_path / "objects.npz"), 4)


def test_resize_b16_224_to_384_gives_official_shape():
  posemb = np.random.default_rng(0).normal(size=(1, 197, 768)).astype(
      np.float32)
  for method in pretrained.RESIZE_METHODS:
    resized = pretrained.resize_pos_embedding(posemb, (24, 24), 1,
                                              method=method)
    assert resized.shape == (1, 577, 768)
    np.testing.assert_array_equal(resized[:, 0], posemb[:, 0])  # class row
    # The corners of the grid keep their values under corner alignment.
    if method == "bilinear":
      np.testing.assert_allclose(resized[0, 1], posemb[0, 1], rtol=1e-6)
      np.testing.assert_allclose(resized[0, -1], posemb[0, -1], rtol=1e-6)


@pytest.mark.parametrize("method", pretrained.RESIZE_METHODS)
def test_constant_grid_stays_constant_non_square(method):
  grid = np.full((1, 14 * 14, 5), 0.7, np.float32)
  posemb = np.concatenate([np.full((1, 1, 5), -3.0, np.float32), grid], 1)
  resized = pretrained.resize_pos_embedding(posemb, (12, 20), 1,
                                            method=method)
  assert resized.shape == (1, 1 + 12 * 20, 5)
  np.testing.assert_allclose(resized[:, 1:], 0.7, rtol=1e-6)
  assert resized[0, 0, 0] == -3.0


def test_linear_ramp_is_interpolated_linearly():
  """Bilinear on a linear ramp over the grid stays linear (corner-aligned)."""
  ramp = np.linspace(0.0, 1.0, 4, dtype=np.float32)
  grid = np.broadcast_to(ramp[None, :, None], (4, 4, 1)).reshape(1, 16, 1)
  resized = pretrained.resize_pos_embedding(grid, (7, 7), 0)
  np.testing.assert_allclose(resized.reshape(7, 7)[0],
                             np.linspace(0.0, 1.0, 7), atol=1e-6)


def test_adapt_reheads_resizes_and_drops_pre_logits():
  source = _random_params(small_vit(num_classes=21,
                                       representation_size=32))
  target_model = small_vit(num_classes=10)
  target = _random_params(target_model, image_size=32)
  params, report = pretrained.adapt_params(source, target, (8, 8))
  assert params["Transformer"]["posembed_input"]["pos_embedding"].shape == (
      1, 65, 32)
  assert "pre_logits" not in params
  np.testing.assert_array_equal(params["head"]["kernel"],
                                target["head"]["kernel"])
  np.testing.assert_array_equal(params["embedding"]["kernel"],
                                source["embedding"]["kernel"])
  text = "\n".join(report)
  assert "head: new 32x10" in text and "pre_logits: dropped" in text
  assert "resized (1, 17, 32) -> (1, 65, 32)" in text
  head = 32 * 10 + 10
  total = sum(x.size for x in jax.tree.leaves(target))
  assert report[0] == f"{total - head:,} of {total:,} parameters loaded"
  assert target_model.apply({"params": params},
                            np.ones((2, 32, 32, 3))).shape == (2, 10)


def test_adapt_loads_a_model_with_fixed_position_embeddings():
  """Sin-cos position embeddings are not parameters: a sincos2d model, at
  the same or another image size, loads every parameter of its checkpoint;
  a learned posemb on one side only is named."""
  model = small_vit(classifier="gap", posemb="sincos2d")
  source = _random_params(model)
  target = _random_params(model, image_size=32, seed=5)
  params, report = pretrained.adapt_params(source, target, (8, 8))
  chex.assert_trees_all_equal(params, source)
  total = sum(x.size for x in jax.tree.leaves(target))
  assert report == [f"{total:,} of {total:,} parameters loaded"]
  learned = _random_params(small_vit(classifier="gap"))
  with pytest.raises(ValueError, match="pos_embedding exists only in the "
                     "checkpoint"):
    pretrained.adapt_params(learned, source, (4, 4))


def test_adapt_names_the_first_mismatch():
  source = _random_params(small_vit(mlp_dim=48))
  target = _random_params(small_vit())
  with pytest.raises(ValueError, match=r"Dense_0/bias has shape \(48,\) in "
                     r"the checkpoint and \(64,\) in the model"):
    pretrained.adapt_params(source, target, (4, 4))
  with pytest.raises(ValueError, match="classifier=gap"):
    pretrained.adapt_params(_random_params(small_vit(classifier="gap")),
                            target, (4, 4))
  with pytest.raises(ValueError, match="only in the checkpoint"):
    pretrained.adapt_params(_random_params(small_vit(num_layers=3)),
                            target, (4, 4))
