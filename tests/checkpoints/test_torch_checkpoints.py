"""torchvision / timm / Hugging Face models -> vit_jax: same logits (<=1e-4).

Each source model is built locally with random weights (no download), its
state dict converted, and both models run on the same random images.
"""

import fractions

import jax
import numpy as np
import pytest

from helpers import run_python
from vit_jax.checkpoints import (npz, pretrained, state_dict_files,
                                 torch_state_dicts)
from vit_jax.model import variants
from vit_jax.model.vit import VisionTransformer
from vit_jax.checkpoints.npz import CheckpointFormatError

torch = pytest.importorskip(
    "torch", reason="the PyTorch converters need the extra: pip install "
    "-e '.[torch]'")
timm = pytest.importorskip("timm", reason="needs the [torch] extra")
torchvision = pytest.importorskip("torchvision", reason="needs [torch] extra")
transformers = pytest.importorskip("transformers", reason="needs [torch]")
safetensors_torch = pytest.importorskip("safetensors.torch",
                                        reason="needs [torch]")

DIMS = dict(image=32, patch=4, width=48, layers=2, heads=3, mlp=96,
            classes=10)
TOLERANCE = 1e-4


def _randomize(module, seed=0, std=0.3):
  """Every parameter random (zero-init heads would hide mapping errors)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for param in module.parameters():
      param.copy_(torch.randn(param.shape, generator=generator) * std)
  return module.eval()


def _images(batch=3, seed=1):
  return np.random.default_rng(seed).normal(
      size=(batch, DIMS["image"], DIMS["image"], 3)).astype(np.float32)


def _torch_logits(module, images):
  with torch.no_grad():
    out = module(torch.from_numpy(images.transpose(0, 3, 1, 2)))
  return getattr(out, "logits", out).numpy()


def _our_model(settings, representation_size=None):
  return VisionTransformer(
      num_classes=DIMS["classes"], patch_size=DIMS["patch"],
      hidden_size=DIMS["width"], num_layers=DIMS["layers"],
      num_heads=DIMS["heads"], mlp_dim=DIMS["mlp"],
      classifier=settings["classifier"],
      approximate_gelu=settings["approximate_gelu"],
      layer_norm_epsilon=settings["layer_norm_epsilon"],
      representation_size=representation_size)


def _state(module):
  return {k: v.numpy() for k, v in module.state_dict().items()}


def _check_parity(module, representation_size=None):
  params, settings = torch_state_dicts.convert_state_dict(_state(module),
                                                          DIMS["heads"])
  images = _images()
  ours = _our_model(settings, representation_size).apply(
      {"params": params}, images)
  diff = np.max(np.abs(np.asarray(ours) - _torch_logits(module, images)))
  print(f"max |dlogit| {settings['source']}: {diff:.2e}")
  assert diff <= TOLERANCE
  return params, settings


def _timm_model(**kwargs):
  return timm.models.vision_transformer.VisionTransformer(
      img_size=DIMS["image"], patch_size=DIMS["patch"],
      embed_dim=DIMS["width"], depth=DIMS["layers"], num_heads=DIMS["heads"],
      mlp_ratio=DIMS["mlp"] / DIMS["width"], num_classes=DIMS["classes"],
      **kwargs)


def _torchvision_model(**kwargs):
  return torchvision.models.vision_transformer.VisionTransformer(
      image_size=DIMS["image"], patch_size=DIMS["patch"],
      num_layers=DIMS["layers"], num_heads=DIMS["heads"],
      hidden_dim=DIMS["width"], mlp_dim=DIMS["mlp"],
      num_classes=DIMS["classes"], **kwargs)


def _hf_model():
  config = transformers.ViTConfig(
      hidden_size=DIMS["width"], num_hidden_layers=DIMS["layers"],
      num_attention_heads=DIMS["heads"], intermediate_size=DIMS["mlp"],
      image_size=DIMS["image"], patch_size=DIMS["patch"],
      num_labels=DIMS["classes"], attn_implementation="eager")
  return transformers.ViTForImageClassification(config)


def test_timm_token_parity():
  _, settings = _check_parity(_randomize(_timm_model()))
  assert settings == dict(approximate_gelu=False, layer_norm_epsilon=1e-6,
                          classifier="token", source="timm")


def test_timm_global_average_pooling_parity():
  model = _randomize(_timm_model(class_token=False, global_pool="avg",
                                 fc_norm=False))
  _, settings = _check_parity(model)
  assert settings["classifier"] == "gap"


def test_torchvision_parity():
  _, settings = _check_parity(_randomize(_torchvision_model()))
  assert settings["source"] == "torchvision"


def test_torchvision_pre_logits_parity():
  params, _ = _check_parity(
      _randomize(_torchvision_model(representation_size=20)),
      representation_size=20)
  assert params["pre_logits"]["kernel"].shape == (DIMS["width"], 20)


def test_hugging_face_parity_and_epsilon():
  _, settings = _check_parity(_randomize(_hf_model()))
  assert settings["layer_norm_epsilon"] == 1e-12
  assert settings["source"] == "hugging_face"


def test_hugging_face_vit_model_pooler_is_pre_logits():
  """ViTModel (no `vit.` prefix, tanh pooler) -> our pre-logits layer."""
  config = _hf_model().config
  model = _randomize(transformers.ViTModel(config, add_pooling_layer=True))
  params, settings = torch_state_dicts.convert_state_dict(_state(model),
                                                          DIMS["heads"])
  assert "head" not in params and settings["source"] == "hugging_face"
  params["head"] = {"kernel": np.zeros((DIMS["width"], 1), np.float32),
                    "bias": np.zeros(1, np.float32)}
  images = _images()
  ours = VisionTransformer(
      num_classes=1, patch_size=DIMS["patch"], hidden_size=DIMS["width"],
      num_layers=DIMS["layers"], num_heads=DIMS["heads"],
      mlp_dim=DIMS["mlp"], representation_size=DIMS["width"],
      approximate_gelu=False, layer_norm_epsilon=1e-12)
  _, state = ours.apply({"params": params}, images,
                        mutable=["intermediates"])
  with torch.no_grad():
    pooled = model(torch.from_numpy(images.transpose(0, 3, 1, 2)))
  np.testing.assert_allclose(state["intermediates"]["features"][0],
                             pooled.pooler_output.numpy(), atol=TOLERANCE)


def test_hugging_face_transformers_v4_names():
  """Files on the Hub use transformers-4 names; they load the same."""
  model = _randomize(_hf_model())
  new_names, old_names = (torch_state_dicts.HUGGING_FACE,
                          torch_state_dicts.HUGGING_FACE_V4)
  state = {}
  for key, value in _state(model).items():
    for name, module in new_names.block_modules.items():
      key = key.replace("." + module + ".",
                        "." + old_names.block_modules[name] + ".")
    state[key.replace("vit.layers.", "vit.encoder.layer.")] = value
  assert any(".attention.attention.query." in k for k in state)
  params, settings = torch_state_dicts.convert_state_dict(state,
                                                          DIMS["heads"])
  assert settings["source"] == "hugging_face_v4"
  reference, _ = torch_state_dicts.convert_state_dict(_state(model),
                                                      DIMS["heads"])
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, params,
                                          reference)))


@pytest.mark.parametrize("layout", ["timm", "torchvision"])
def test_export_loads_into_pytorch_and_round_trips(layout, tmp_path):
  """Our params -> state dict file -> the PyTorch model: same logits."""
  model = _randomize(_timm_model() if layout == "timm" else
                     _torchvision_model(), seed=3)
  params, settings = torch_state_dicts.convert_state_dict(_state(model),
                                                          DIMS["heads"])
  exported = torch_state_dicts.export_state_dict(params, layout)
  for suffix in (".safetensors", ".pth"):
    path = str(tmp_path / f"model{suffix}")
    state_dict_files.save_state_dict(exported, path)
    fresh = _timm_model() if layout == "timm" else _torchvision_model()
    if suffix == ".safetensors":  # read back with the reference reader
      fresh.load_state_dict(safetensors_torch.load_file(path))
    else:
      fresh.load_state_dict(torch.load(path, weights_only=True))
    images = _images(seed=4)
    np.testing.assert_array_equal(_torch_logits(fresh.eval(), images),
                                  _torch_logits(model, images))
    back, _ = pretrained.load_params(path, DIMS["heads"])
    exact = jax.tree.map(np.array_equal, back, params)
    assert all(jax.tree.leaves(exact))
  assert settings["source"] == layout


def test_exported_npz_loads_with_timm_npz_loader(tmp_path):
  """timm's own loader for official .npz files accepts our export."""
  ours = _our_model(dict(classifier="token", approximate_gelu=False,
                         layer_norm_epsilon=1e-6))
  images = _images(seed=5)
  params = ours.init(jax.random.PRNGKey(0), images)["params"]
  params = jax.tree.map(  # non-zero head so the check sees it
      lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(1), x.shape),
      params)
  path = str(tmp_path / "exported.npz")
  npz.save_npz(params, path)
  model = _timm_model()
  timm.models.vision_transformer._load_weights(model, path)  # pylint: disable=protected-access
  diff = np.max(np.abs(_torch_logits(model.eval(), images) -
                       np.asarray(ours.apply({"params": params}, images))))
  assert diff <= TOLERANCE


def test_half_precision_safetensors_are_read(tmp_path):
  """bfloat16/float16 files (common on the Hub) read without torch."""
  model = _randomize(_timm_model(), seed=8)
  for dtype in (torch.bfloat16, torch.float16):
    path = str(tmp_path / f"{dtype}.safetensors")
    half = {k: v.to(dtype) for k, v in model.state_dict().items()}
    safetensors_torch.save_file(half, path)
    state = state_dict_files.read_state_dict(path)
    for key, value in half.items():
      np.testing.assert_array_equal(state[key], value.float().numpy())


def test_truncated_safetensors_is_refused(tmp_path):
  path = tmp_path / "model.safetensors"
  safetensors_torch.save_file(_timm_model().state_dict(), str(path))
  path.write_bytes(path.read_bytes()[:1000])
  with pytest.raises(CheckpointFormatError, match="truncated"):
    state_dict_files.read_state_dict(str(path))


def test_unsupported_features_are_refused():
  model = _randomize(_timm_model(reg_tokens=4))
  with pytest.raises(CheckpointFormatError, match="reg_token"):
    torch_state_dicts.convert_state_dict(_state(model), DIMS["heads"])


def test_heads_must_divide_width():
  with pytest.raises(CheckpointFormatError, match="num_heads=5"):
    torch_state_dicts.convert_state_dict(
        _state(_randomize(_timm_model())), 5)


def test_pickled_objects_are_refused(tmp_path):
  path = str(tmp_path / "hostile.pth")
  # Any object but tensors and containers needs real unpickling.
  torch.save({"weights": fractions.Fraction(1, 3)}, path)
  with pytest.raises(CheckpointFormatError, match="weights_only"):
    state_dict_files.read_state_dict(path)


@pytest.mark.slow
def test_torchvision_vit_b_16_full_size_parity():
  """The real torchvision builder, all 86M parameters, at 224 px."""
  # Small weights keep 12 random layers' logits O(1).
  model = _randomize(torchvision.models.vit_b_16(weights=None), std=0.02)
  params, settings = torch_state_dicts.convert_state_dict(_state(model), 12)
  ours = VisionTransformer(
      num_classes=1000, patch_size=16, hidden_size=768, num_layers=12,
      num_heads=12, mlp_dim=3072, approximate_gelu=False)
  images = np.random.default_rng(0).normal(size=(1, 224, 224, 3)).astype(
      np.float32)
  diff = np.max(np.abs(np.asarray(ours.apply({"params": params}, images)) -
                       _torch_logits(model, images)))
  scale = np.max(np.abs(_torch_logits(model, images)))
  print(f"max |dlogit| torchvision vit_b_16 @224: {diff:.2e} "
        f"(logits up to {scale:.2f})")
  assert diff <= TOLERANCE * max(1.0, scale)
  assert settings["classifier"] == "token"


def _convert(*flags):
  return run_python("-m", "vit_jax.checkpoints.convert", *flags, timeout=300)


def test_convert_command_pytorch_to_npz_and_back(tmp_path):
  model = _randomize(_timm_model(), seed=6)
  source = str(tmp_path / "timm.pth")
  torch.save(model.state_dict(), source)
  missing_heads = _convert(f"--input={source}", "--output=x.npz")
  assert missing_heads.returncode != 0
  assert "does not record the number of attention heads" in (
      missing_heads.stderr)
  npz = str(tmp_path / "timm.npz")
  result = _convert(f"--input={source}", "--num_heads=3", f"--output={npz}")
  assert result.returncode == 0, result.stderr
  assert "exact GELU" in result.stdout and "as official .npz" in result.stdout
  expected, _ = torch_state_dicts.convert_state_dict(_state(model), 3)
  loaded, _ = pretrained.load_params(npz, 3)
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, loaded, expected)))
  back = str(tmp_path / "back.safetensors")
  assert _convert(f"--input={npz}", f"--output={back}").returncode == 0
  fresh = _timm_model()
  fresh.load_state_dict({k: torch.from_numpy(v) for k, v in
                         state_dict_files.read_state_dict(back).items()})
  images = _images(seed=7)
  np.testing.assert_array_equal(_torch_logits(fresh.eval(), images),
                                _torch_logits(model, images))


@pytest.mark.slow
@pytest.mark.parametrize("builder,variant", [
    ("vit_b_16", "ViT-B/16"), ("vit_b_32", "ViT-B/32"),
    ("vit_l_16", "ViT-L/16"), ("vit_l_32", "ViT-L/32"),
    ("vit_h_14", "ViT-H/14")])
def test_torchvision_builders_map_onto_the_named_variants(builder, variant):
  """Every torchvision builder's state dict has exactly our variant's tree."""
  model = getattr(torchvision.models, builder)(weights=None)
  config = variants.get_variant(variant)
  params, _ = torch_state_dicts.convert_state_dict(_state(model),
                                                   config.num_heads)
  del model
  shapes = jax.eval_shape(
      variants.build_model(config, 1000).init, jax.random.PRNGKey(0),
      jax.ShapeDtypeStruct((1, 224, 224, 3), np.float32))["params"]
  assert jax.tree.structure(params) == jax.tree.structure(shapes)
  assert jax.tree.map(np.shape, params) == jax.tree.map(
      lambda s: s.shape, shapes)


@pytest.mark.parametrize("option, value, named", [
    ("posemb", "sincos2d", "posemb='sincos2d'"),
    ("shifted_patches", True, "shifted_patches"),
    ("locality_attention", True, "locality_attention"),
])
def test_export_names_options_pytorch_layouts_cannot_hold(option, value,
                                                          named):
  ours = VisionTransformer(
      num_classes=DIMS["classes"], patch_size=DIMS["patch"],
      hidden_size=DIMS["width"], num_layers=DIMS["layers"],
      num_heads=DIMS["heads"], mlp_dim=DIMS["mlp"], **{option: value})
  params = jax.eval_shape(ours.init, jax.random.PRNGKey(0),
                          _images(seed=0))["params"]
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
  with pytest.raises(CheckpointFormatError, match=named):
    torch_state_dicts.export_state_dict(params, "timm")
