"""Shared helpers of the tests."""

import logging

import jax

from vit_jax import config as config_lib
from vit_jax.training import loop
from vit_jax.model.vit import VisionTransformer


def small_vit(**overrides) -> VisionTransformer:
  """A 2-layer, 32-wide, 4-head ViT with patch 4 and 10 classes."""
  fields = dict(num_classes=10, patch_size=4, hidden_size=32, num_layers=2,
                num_heads=4, mlp_dim=64)
  fields.update(overrides)
  return VisionTransformer(**fields)


def small_config(**overrides):
  """A 2-layer, 32-wide ViT on 16x16 synthetic data: compiles in seconds."""
  config = config_lib.base_config("ViT-Mini/4")
  config.model.hidden_size = 32
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.mlp_dim = 64
  config.dataset = "synthetic"
  config.synthetic.image_size = 16
  config.synthetic.num_train = 64
  config.synthetic.num_eval = 40
  config.batch_size = 16
  config.eval_batch_size = 16
  config.warmup_epochs = 1.0
  config.log_every_steps = 2
  for key, value in overrides.items():
    config[key] = value
  return config


def train_counting_compiles(config, workdir, caplog):
  """loop.train_and_evaluate(config, workdir) -> (its metrics, the names of
  the jitted functions it compiled, in order, e.g. "jit(train_step)")."""
  caplog.set_level(logging.WARNING, logger="jax")
  with jax.log_compiles():
    metrics = loop.train_and_evaluate(config, workdir)
  return metrics, [r.getMessage().split(" with ")[0].removeprefix("Compiling ")
                   for r in caplog.records
                   if r.getMessage().startswith("Compiling ")]
