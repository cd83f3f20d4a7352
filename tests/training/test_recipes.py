"""Recipe options: drop path, 2-D sin-cos embeddings, LAMB, layer-wise lr
decay, linear decay, EMA, SAM, and the trainer with all of them on."""

import flax.linen as nn
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from helpers import small_config, small_vit
from vit_jax import config as config_lib
from vit_jax.checkpoints import orbax_checkpoints
from vit_jax.data import datasets, input_pipeline
from vit_jax.model import options, variants, vit
from vit_jax.runtime import sharding
from vit_jax.training import loop, optim, steps
from vit_jax.training import run as run_lib


class _DropPath(nn.Module):
  rate: float

  @nn.compact
  def __call__(self, x):
    return options.drop_path(self, x, self.rate, deterministic=False)


def test_drop_path_drops_whole_examples_at_the_rate_and_keeps_the_mean():
  x = jnp.ones((4000, 3, 5))
  out = np.asarray(_DropPath(0.3).apply({}, x, rngs={
      "dropout": jax.random.PRNGKey(0)}))
  per_example = out.reshape(4000, -1)
  zero = np.all(per_example == 0, axis=1)
  assert np.all(per_example[~zero] == pytest.approx(1 / 0.7))
  assert zero.mean() == pytest.approx(0.3, abs=0.03)
  assert out.mean() == pytest.approx(1.0, abs=0.05)
  # Given uniform draws, exactly the examples whose draw is below 1 - rate
  # are kept (the encoder draws them for every block at once).
  uniform = jax.random.uniform(jax.random.PRNGKey(1), (4000,))
  out = np.asarray(options.drop_path(None, x, 0.3, False, uniform))
  kept = np.all(out.reshape(4000, -1) != 0, axis=1)
  np.testing.assert_array_equal(kept, np.asarray(uniform) < 0.7)


def test_drop_path_is_linear_over_depth_and_off_at_eval():
  model = small_vit(drop_path_rate=0.5, num_layers=2)
  images = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16, 16, 3)),
                       jnp.float32)
  params = model.init(jax.random.PRNGKey(0), images)["params"]

  def blocks(key):
    _, state = model.apply({"params": params}, images, train=True,
                           rngs={"dropout": key}, mutable=["intermediates"])
    return state["intermediates"]["Transformer"]["block_outputs"]

  first, second = blocks(jax.random.PRNGKey(1)), blocks(jax.random.PRNGKey(2))
  # Block 0 has rate 0 * 0.5 / 1 = 0; block 1 the full 0.5.
  np.testing.assert_array_equal(first[0], second[0])
  assert not np.allclose(first[1], second[1])
  plain = small_vit(num_layers=2).apply({"params": params}, images)
  np.testing.assert_array_equal(model.apply({"params": params}, images),
                                plain)


def test_sincos_2d_posemb_formula_and_model_without_posemb_params():
  table = np.asarray(options.sincos_2d_posemb(3, 4, 16))[0]
  assert table.shape == (12, 16)
  frequencies = 1.0 / 10_000 ** (np.arange(4) / 4)
  row, col = divmod(7, 4)  # token 7 = row 1, column 3
  np.testing.assert_allclose(table[7], np.concatenate([
      np.sin(col * frequencies), np.cos(col * frequencies),
      np.sin(row * frequencies), np.cos(row * frequencies)]), rtol=1e-6)
  # Nearer positions are more alike than farther ones.
  assert table[0] @ table[1] > table[0] @ table[3]
  for classifier in ("token", "gap"):
    model = small_vit(posemb="sincos2d", classifier=classifier)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))
    assert "posembed_input" not in variables["params"]["Transformer"]
    assert model.apply(variables, jnp.zeros((2, 16, 16, 3))).shape == (2, 10)
  with pytest.raises(vit.ViTInputError, match="divisible by 4"):
    options.sincos_2d_posemb(2, 2, 6)


def test_lamb_first_step_is_the_trust_ratio_times_the_adam_direction():
  config = small_config(optimizer="lamb", weight_decay=0.0, grad_clip_norm=0)
  tx = optim.make_optimizer(config, optax.constant_schedule(0.1))
  params = {"head": {"kernel": jnp.array([3.0, -4.0])}}  # norm 5
  grads = {"head": {"kernel": jnp.array([0.5, 2.0])}}
  updates, _ = tx.update(grads, tx.init(params), params)
  # Step 1 of Adam is sign(g) (bias-corrected); LAMB scales it to the
  # parameter's norm: 0.1 * 5 / ||(1, 1)|| * (1, 1).
  np.testing.assert_allclose(updates["head"]["kernel"],
                             -0.1 * 5 / np.sqrt(2) * np.ones(2), rtol=1e-4)


def test_layer_decay_scales_each_block_by_its_depth():
  model = small_vit(num_layers=2, shifted_patches=True)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))[
      "params"]
  ones = jax.tree.map(jnp.ones_like, params)
  scaled, _ = optim.scale_by_layer(0.5).update(ones, optax.EmptyState())
  factor = lambda tree: float(jax.tree.leaves(tree)[0].ravel()[0])
  assert factor(scaled["head"]) == 1.0
  assert factor(scaled["Transformer"]["encoder_norm"]) == 1.0
  assert factor(scaled["Transformer"]["encoderblock_1"]) == 0.5
  assert factor(scaled["Transformer"]["encoderblock_0"]) == 0.25
  assert factor(scaled["embedding"]) == 0.125
  assert factor(scaled["embedding_norm"]) == 0.125
  assert factor(scaled["cls"]) == 0.125
  assert factor(scaled["Transformer"]["posembed_input"]) == 0.125


def test_linear_schedule():
  config = small_config(schedule="linear", learning_rate=1.0,
                        end_learning_rate=0.0, warmup_steps=10)
  schedule = optim.learning_rate_schedule(config, 110, 10)
  assert float(schedule(5)) == pytest.approx(0.5)
  assert float(schedule(10)) == pytest.approx(1.0)
  assert float(schedule(60)) == pytest.approx(0.5)
  assert float(schedule(110)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_ema_follows_the_formula_and_is_evaluated(tmp_path):
  config = small_config(ema_decay=0.9, num_train_steps=6, log_every_steps=3,
                        checkpoint_every_steps=3, num_epochs=1)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  dataset = datasets.load(config)
  model = variants.build_model(config.model, dataset.num_classes)
  schedule = optim.learning_rate_schedule(config, 6, 4)
  state = steps.create_train_state(model, dataset.image_shape,
                                   optim.make_optimizer(config, schedule), 0,
                                   mesh, fsdp_min_size=256, ema=True)
  mean, std = dataset.channel_stats()
  train_fn = steps.compile_train_step(
      mesh, steps.shardings_of(state), schedule,
      **config_lib.train_step_options(config, mean, std, True))
  stream = input_pipeline.train_batches(dataset.train_images,
                                        dataset.train_labels, 16, 0, 0, mesh)
  expected = jax.device_get(state.params)
  for step in range(4):
    state, _ = train_fn(state, *next(stream))
    decay = min(0.9, (1 + step) / (10 + step))
    expected = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p,
                            expected, jax.device_get(state.params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-7),
               jax.device_get(state.ema_params), expected)
  for ema, param in zip(jax.tree.leaves(state.ema_params),
                        jax.tree.leaves(state.params)):
    assert ema.sharding == param.sharding

  metrics = loop.train_and_evaluate(config, str(tmp_path))
  assert 0.0 <= metrics["ema_accuracy"] <= 1.0 and "ema_loss" in metrics


def _sgd_step(model, params, rho):
  """One train_step with plain SGD (lr 0.5) on a fixed 8-image batch."""
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.integers(0, 256, (8, 16, 16, 3)), jnp.uint8)
  labels = jnp.asarray(rng.integers(0, 10, 8), jnp.int32)
  state = steps.TrainState.create(apply_fn=model.apply, params=params,
                                  tx=optax.sgd(0.5), rng=jax.random.PRNGKey(1))
  step = jax.jit(lambda state: steps.train_step(
      state, images, labels, preprocess=lambda x, key: x / 255.0,
      label_smoothing=0.0, learning_rate_fn=lambda step: 0.5, sam_rho=rho))
  new_state, metrics = step(state)
  return images / 255.0, labels, new_state, metrics


def test_sam_steps_with_the_gradient_at_the_ascended_params():
  model = small_vit(num_layers=1)
  params = model.init(jax.random.PRNGKey(0),
                      jnp.zeros((1, 16, 16, 3)))["params"]
  rho = 0.5
  inputs, labels, sam_state, sam_metrics = _sgd_step(model, params, rho)
  _, _, plain_state, plain_metrics = _sgd_step(model, params, 0.0)

  def loss(params):  # written out, not steps.cross_entropy
    log_probs = jax.nn.log_softmax(model.apply({"params": params}, inputs))
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], 1))

  unflatten = jax.flatten_util.ravel_pytree(params)[1]
  flat = lambda tree: np.asarray(jax.flatten_util.ravel_pytree(tree)[0])
  gradient = jax.grad(loss)(params)
  direction = flat(gradient) / np.linalg.norm(flat(gradient))
  ascended = unflatten(flat(params) + rho * direction)
  expected = flat(params) - 0.5 * flat(jax.grad(loss)(ascended))
  np.testing.assert_allclose(flat(sam_state.params), expected, atol=2e-6)
  np.testing.assert_allclose(flat(plain_state.params),
                             flat(params) - 0.5 * flat(gradient), atol=2e-6)
  # The two updates differ by far more than the tolerance, and the metrics
  # are those at the params in both.
  assert np.abs(flat(sam_state.params) - flat(plain_state.params)).max() > 1e-3
  assert float(sam_metrics["loss"]) == pytest.approx(float(loss(params)),
                                                     rel=1e-5)
  assert float(sam_metrics["loss"]) == pytest.approx(
      float(plain_metrics["loss"]), rel=1e-6)


@pytest.mark.slow
def test_trainer_runs_with_every_recipe_component(tmp_path, capsys):
  config = small_config(
      auto_augment="trivialaugment", random_erasing=0.25, mixup_alpha=0.8,
      cutmix_alpha=1.0, optimizer="lamb", layer_decay=0.75,
      schedule="linear", ema_decay=0.99, sam_rho=0.05, num_train_steps=4,
      checkpoint_every_steps=2)
  config.model.drop_path_rate = 0.1
  config.model.posemb = "sincos2d"
  config.model.classifier = "gap"
  config.model.patch_dropout_rate = 0.5
  config.model.shifted_patches = True
  config.model.locality_attention = True
  metrics = loop.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["ema_loss"])
  # The model line says how many of the 16x16 image's 4x4 patches a step
  # trains on.
  assert "trained on 8 of its 16 patches (patch dropout 0.5)" in (
      capsys.readouterr().out)
  # Resumes: the EMA params are part of the checkpointed state. The
  # resumed run trains nothing and evaluates the restored state, so its
  # EMA metrics are the saved EMA params' (which differ from the params').
  assert metrics["ema_loss"] != metrics["loss"]
  resumed = loop.train_and_evaluate(config, str(tmp_path))
  assert resumed["accuracy"] == metrics["accuracy"]
  assert resumed["ema_loss"] == metrics["ema_loss"]
  assert resumed["ema_accuracy"] == metrics["ema_accuracy"]
  run, state, start_step, _ = run_lib.build_run(config, str(tmp_path))
  orbax_checkpoints.finish(run.manager)
  run.writer.close()
  assert start_step == 4
  saved = ocp.PyTreeCheckpointer().restore(
      str(tmp_path / "checkpoints" / "4" / "default"))
  for restored, on_disk in zip(jax.tree.leaves(state.ema_params),
                               jax.tree.leaves(saved["ema_params"])):
    np.testing.assert_array_equal(np.asarray(restored), on_disk)


@pytest.mark.parametrize("key, value, message", [
    ("auto_augment", "autoaugment", "auto_augment"),
    ("schedule", "step", "schedule"),
    ("random_erasing", 1.5, "random_erasing"),
    ("mixup_alpha", -1.0, "mixup_alpha"),
    ("layer_decay", 0.0, "layer_decay"),
    ("ema_decay", 1.0, "ema_decay"),
    ("sam_rho", -0.05, "sam_rho"),
    ("randaugment_magnitude", 11.0, "randaugment_magnitude"),
])
def test_bad_recipe_values_are_named(key, value, message):
  config = small_config()
  config[key] = value
  with pytest.raises(ValueError, match=message):
    config_lib.validate_config(config)
