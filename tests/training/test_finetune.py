"""Fine-tuning: gradient accumulation, SGD, linear probe, init_from."""

import logging

import jax
import numpy as np
import optax
import pytest

from helpers import small_config
from vit_jax import config as config_lib
from vit_jax.checkpoints import (npz, pretrained, state_dict_files,
                                 torch_state_dicts)
from vit_jax.data import datasets, input_pipeline
from vit_jax.model import variants
from vit_jax.runtime import sharding
from vit_jax.training import loop, optim, steps
from vit_jax.model.vit import VisionTransformer


def _config(**overrides):
  defaults = dict(batch_size=32, eval_batch_size=32, crop_padding=0,
                  label_smoothing=0.0, warmup_epochs=0.0, log_every_steps=1)
  config = small_config(**dict(defaults, **overrides))
  config.synthetic.num_eval = 32
  return config


def _run_steps(config, mesh, num_steps):
  dataset = datasets.load(config)
  model = variants.build_model(config.model, dataset.num_classes)
  schedule = optim.learning_rate_schedule(config, 10, 2)
  state = steps.create_train_state(model, dataset.image_shape,
                                   optim.make_optimizer(config, schedule),
                                   config.seed, mesh)
  initial = jax.device_get(state.params)
  mean, std = dataset.channel_stats()
  train_fn = steps.compile_train_step(
      mesh, steps.shardings_of(state), schedule,
      **config_lib.train_step_options(config, mean, std, False))
  batches = input_pipeline.train_batches(
      dataset.train_images, dataset.train_labels, config.batch_size, 0, 0,
      mesh)
  losses = []
  for _ in range(num_steps):
    state, metrics = train_fn(state, *next(batches))
    losses.append(float(metrics["loss"]))
  return initial, state, losses


def test_accumulated_micro_batches_give_the_large_batch_update():
  """accum_steps=4 on 8 devices == one batch of 32, update for update."""
  mesh = sharding.make_mesh()
  results = {}
  for accum_steps in (1, 4):
    config = _config(optimizer="sgd", learning_rate=0.1,
                     accum_steps=accum_steps)
    _, state, losses = _run_steps(config, mesh, 3)
    results[accum_steps] = (jax.device_get(state.params), losses)
  np.testing.assert_allclose(results[4][1], results[1][1], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6),
               results[4][0], results[1][0])
  # ... and training really moved the parameters.
  changed = jax.tree.map(lambda a, b: np.abs(a - b).max(), results[1][0],
                         _run_steps(_config(), mesh, 0)[0])
  assert max(jax.tree.leaves(changed)) > 1e-3


def test_sgd_momentum_and_clipping_match_the_formula():
  config = _config(optimizer="sgd", momentum=0.9, grad_clip_norm=1.0,
                   weight_decay=0.0)
  tx = optim.make_optimizer(config, optax.constant_schedule(0.5))
  params = {"head": {"kernel": np.zeros(4, np.float32)}}
  grads = {"head": {"kernel": np.full(4, 5.0, np.float32)}}  # norm 10
  state = tx.init(params)
  clipped = 5.0 / 10.0  # each entry after scaling to global norm 1
  updates, state = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["head"]["kernel"], -0.5 * clipped)
  updates, state = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["head"]["kernel"],
                             -0.5 * (clipped + 0.9 * clipped), rtol=1e-6)


def test_linear_probe_trains_only_the_head():
  mesh = sharding.make_mesh()
  initial, state, _ = _run_steps(_config(trainable="head"), mesh, 2)
  final = jax.device_get(state.params)
  for name in final:
    same = all(jax.tree.leaves(jax.tree.map(np.array_equal, initial[name],
                                            final[name])))
    assert same == (name != "head"), name
  # Frozen parameters carry no optimizer state.
  state_size = sum(x.size for x in jax.tree.leaves(state.opt_state))
  head_size = sum(x.size for x in jax.tree.leaves(final["head"]))
  assert state_size < 3 * head_size + 10


def test_unknown_choices_are_rejected_before_data(tmp_path):
  for key, value, message in (
      ("optimizer", "adam", "choose one of \\('adamw', 'lamb', 'sgd'\\)"),
      ("trainable", "body", "'all', 'head'"),
      ("normalization", "zscore", "'inception'"),
      ("accum_steps", 5, "divide config.batch_size=32"),
      ("init_from", str(tmp_path / "missing.npz"), "no such file"),
  ):
    config = _config(dataset="cifar10", data_source="raw",
                     raw_data_dir=str(tmp_path))
    config[key] = value
    with pytest.raises(ValueError, match=message):
      loop.train_and_evaluate(config, str(tmp_path / "work"))
  config = _config(dataset="cifar10", data_source="raw",
                   raw_data_dir=str(tmp_path))
  config.model.matmul_dtype = "float16"
  with pytest.raises(ValueError, match="matmul_dtype='float16' is not "
                     "supported: set 'bfloat16'"):
    loop.train_and_evaluate(config, str(tmp_path / "work"))
  config.model.matmul_dtype = None
  config.model.matmul_implementation = "mkl"
  with pytest.raises(ValueError, match="matmul_implementation='mkl' is not "
                     "one of .*'auto'"):
    loop.train_and_evaluate(config, str(tmp_path / "work"))
  config.model.matmul_implementation = "auto"
  config.model.layer_norm_implementation = "apex"
  with pytest.raises(ValueError, match="layer_norm_implementation='apex' is "
                     "not one of .*'cpu_kernel'"):
    loop.train_and_evaluate(config, str(tmp_path / "work"))


def test_init_from_npz_resizes_reheads_and_reports(tmp_path, capsys, caplog):
  """A 16 px, 21-class, pre-logits checkpoint fine-tunes at 32 px, 10 classes.

  With a zero learning rate the trained params are the adapted checkpoint.
  """
  source = VisionTransformer(num_classes=21, patch_size=4, hidden_size=32,
                             num_layers=2, num_heads=2, mlp_dim=64,
                             representation_size=16)
  params = source.init(jax.random.PRNGKey(7), np.zeros((1, 16, 16, 3)))[
      "params"]
  path = str(tmp_path / "pretrained.npz")
  npz.save_npz(params, path)
  config = _config(init_from=path, image_size=32, learning_rate=0.0,
                   end_learning_rate=0.0, num_train_steps=2,
                   normalization="inception")
  loop.train_and_evaluate(config, str(tmp_path / "work"))
  log = capsys.readouterr().out
  assert f"Initialised from {path} (npz)" in log
  assert "resized (1, 17, 32) -> (1, 65, 32)" in log
  assert "pre_logits: dropped" in log and "head: new 32x10" in log
  caplog.clear()
  with caplog.at_level(logging.WARNING):  # the Orbax workdir reads quietly
    restored, _ = pretrained.load_params(str(tmp_path / "work"), 2)
  assert not caplog.records, caplog.text
  np.testing.assert_array_equal(restored["embedding"]["kernel"],
                                params["embedding"]["kernel"])
  expected = pretrained.resize_pos_embedding(
      np.asarray(params["Transformer"]["posembed_input"]["pos_embedding"]),
      (8, 8), 1)
  np.testing.assert_array_equal(
      restored["Transformer"]["posembed_input"]["pos_embedding"], expected)
  assert not np.any(restored["head"]["kernel"])


def test_init_from_refuses_mismatched_numerics(tmp_path):
  pytest.importorskip("safetensors", reason="writing .safetensors needs "
                      "the [torch] extra")
  model = VisionTransformer(num_classes=10, patch_size=4, hidden_size=32,
                            num_layers=2, num_heads=2, mlp_dim=64)
  params = model.init(jax.random.PRNGKey(0), np.zeros((1, 16, 16, 3)))[
      "params"]
  path = str(tmp_path / "timm.safetensors")
  state_dict_files.save_state_dict(
      torch_state_dicts.export_state_dict(params, "timm"), path)
  with pytest.raises(ValueError, match="approximate_gelu=False"):
    loop.train_and_evaluate(_config(init_from=path),
                             str(tmp_path / "work"))
