"""vit_jax: the Vision Transformer (Dosovitskiy et al., 2020) in JAX/Flax.

  from vit_jax import VisionTransformer, get_variant, build_model
  model = build_model(get_variant("ViT-B/16"), num_classes=1000)

The trainer: `train_and_evaluate(config, workdir)`, or the pieces
`create_train_state`, `train_step`, `eval_step` for a loop of your own.
Pretrained checkpoints: `load_params(path, num_heads)` reads official .npz,
Orbax and PyTorch files, `adapt_params` fits them to a model
(vit_jax.pretrained); `python -m vit_jax.convert` writes them back out.

Importing vit_jax adds measured XLA:CPU flags to XLA_FLAGS unless you set
them (vit_jax/host.py). The names below are imported on first use, so
`import vit_jax.host` (which must run before JAX starts) does not pay for
importing JAX, Flax and Orbax.
"""

import importlib

from vit_jax import host as _host

_host.default_xla_flags()  # before JAX's CPU backend starts; see host.py

# Public name -> (module, attribute).
_EXPORTS = {
    "base_config": ("configs", "base_config"),
    "Dataset": ("datasets", "Dataset"),
    "DatasetUnavailableError": ("datasets", "DatasetUnavailableError"),
    "load_dataset": ("datasets", "load"),
    "Encoder": ("models", "Encoder"),
    "Encoder1DBlock": ("models", "Encoder1DBlock"),
    "MlpBlock": ("models", "MlpBlock"),
    "MultiHeadSelfAttention": ("models", "MultiHeadSelfAttention"),
    "ViTInputError": ("models", "ViTInputError"),
    "VisionTransformer": ("models", "VisionTransformer"),
    "adapt_params": ("pretrained", "adapt_params"),
    "load_params": ("pretrained", "load_params"),
    "resize_pos_embedding": ("pretrained", "resize_pos_embedding"),
    "TrainState": ("steps", "TrainState"),
    "create_train_state": ("steps", "create_train_state"),
    "eval_step": ("steps", "eval_step"),
    "train_and_evaluate": ("train", "train_and_evaluate"),
    "train_step": ("steps", "train_step"),
    "VARIANTS": ("variants", "VARIANTS"),
    "build_model": ("variants", "build_model"),
    "get_variant": ("variants", "get_variant"),
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'vit_jax' has no attribute {name!r}")
  module, attribute = _EXPORTS[name]
  value = getattr(importlib.import_module(f"vit_jax.{module}"), attribute)
  globals()[name] = value  # later look-ups skip this function
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
