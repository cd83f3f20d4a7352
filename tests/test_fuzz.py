"""Property-based tests: any input works or raises one of our errors.

Random image shapes and dtypes go to the model; random config overrides go
to the config checks. Each either succeeds (finite logits of the right
shape; a config that passes) or raises the documented error type with a
message — never an XLA crash, a hang or a silent wrong result.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import small_config
from vit_jax import config as config_lib
from vit_jax.model import vit
from vit_jax.model.vit import VisionTransformer

_SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])
_DTYPES = [jnp.uint8, jnp.int32, jnp.float16, jnp.bfloat16, jnp.float32]


def _check_model_input(shape, dtype, patch_size, classifier) -> str:
  """Runs one input; returns "accepted" or "rejected", or fails."""
  model = VisionTransformer(num_classes=3, patch_size=patch_size,
                            hidden_size=8, num_layers=1, num_heads=2,
                            mlp_dim=8, classifier=classifier)
  # Initialised on 12x12x3 images: later inputs must match that geometry.
  init_shape = (1, 12, 12, 3)
  try:
    params = model.init(jax.random.PRNGKey(0), jnp.zeros(init_shape))
  except vit.ViTInputError as e:
    assert str(e)
    assert 12 % patch_size or classifier not in vit.CLASSIFIERS
    return "rejected"
  images = jnp.asarray(np.random.default_rng(0).integers(0, 255, shape),
                       dtype)
  try:
    logits = model.apply(params, images)
  except vit.ViTInputError as e:
    assert str(e)
    # Rejected only if the input really differs from what the model takes.
    assert len(shape) != 4 or tuple(shape[1:]) != init_shape[1:]
    return "rejected"
  assert tuple(shape[1:]) == init_shape[1:]
  assert logits.shape == (shape[0], 3) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  return "accepted"


@_SETTINGS
@given(shape=st.one_of(
    st.lists(st.integers(1, 24), min_size=2, max_size=5),
    st.integers(1, 3).map(lambda batch: [batch, 12, 12, 3])),  # valid ones
       dtype=st.sampled_from(_DTYPES),
       patch_size=st.integers(1, 6),
       classifier=st.sampled_from(["token", "gap", "map"]))
def test_model_takes_any_image_or_raises_vit_input_error(
    shape, dtype, patch_size, classifier):
  _check_model_input(shape, dtype, patch_size, classifier)


def test_the_fuzz_check_tells_valid_from_invalid_inputs():
  assert _check_model_input([2, 12, 12, 3], jnp.uint8, 4, "gap") == "accepted"
  assert _check_model_input([2, 12, 12, 1], jnp.float32, 4,
                            "token") == "rejected"
  assert _check_model_input([12, 12, 3], jnp.float32, 3, "token") == (
      "rejected")
  assert _check_model_input([1, 12, 12, 3], jnp.float32, 5, "token") == (
      "rejected")


_OVERRIDES = {
    "batch_size": st.integers(-4, 64),
    "eval_batch_size": st.integers(-4, 64),
    "accum_steps": st.integers(-1, 9),
    "crop_padding": st.integers(-2, 6),
    "label_smoothing": st.floats(-0.5, 1.5, allow_nan=False),
    "optimizer": st.sampled_from(["adamw", "sgd", "adam", ""]),
    "normalization": st.sampled_from(["dataset", "inception", "imagenet",
                                      "zscore"]),
    "trainable": st.sampled_from(["all", "head", "none"]),
    "image_size": st.one_of(st.none(), st.integers(-8, 64)),
    "min_crop_area": st.floats(-0.5, 1.5, allow_nan=False),
    "random_resized_crop": st.booleans(),
    "dataset": st.sampled_from(["synthetic", "cifar10", "mnist",
                                "imagenet"]),
    "model.patch_size": st.integers(1, 9),
    "model.num_heads": st.integers(1, 5),
    "model.classifier": st.sampled_from(["token", "gap", "cls"]),
    "model.patch_dropout_rate": st.floats(-0.5, 1.5, allow_nan=False),
    "posemb_resize": st.sampled_from(["bilinear", "bicubic", "nearest"]),
}


@_SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(_OVERRIDES)), st.none(),
                       max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries(
        {key: _OVERRIDES[key] for key in keys})))
def test_config_checks_accept_or_name_the_problem(overrides):
  config = small_config()
  for key, value in overrides.items():
    node, name = config, key
    if "." in key:
      parent, name = key.split(".")
      node = config[parent]
    node[name] = value
  try:
    config_lib.validate_config(config)
  except ValueError as e:
    message = str(e)
    assert "config." in message, message  # names the offending key
    return
  # Accepted: the combination really is coherent.
  assert config.batch_size > 0 and config.eval_batch_size > 0
  assert config.batch_size % config.accum_steps == 0
  assert 0 <= config.label_smoothing < 1
  assert 0 <= config.model.patch_dropout_rate < 1
  height = config_lib.image_shape_of(config)[0]
  assert height % config.model.patch_size == 0
  assert config.model.hidden_size % config.model.num_heads == 0
