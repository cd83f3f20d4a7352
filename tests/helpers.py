"""Shared helpers of the tests."""

from vit_jax import configs
from vit_jax.models import VisionTransformer


def small_vit(**overrides) -> VisionTransformer:
  """A 2-layer, 32-wide, 4-head ViT with patch 4 and 10 classes."""
  fields = dict(num_classes=10, patch_size=4, hidden_size=32, num_layers=2,
                num_heads=4, mlp_dim=64)
  fields.update(overrides)
  return VisionTransformer(**fields)


def small_config(**overrides):
  """A 2-layer, 32-wide ViT on 16x16 synthetic data: compiles in seconds."""
  config = configs.base_config("ViT-Mini/4")
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
