"""vit_jax: the Vision Transformer (Dosovitskiy et al., 2020) in JAX/Flax.

  from vit_jax import VisionTransformer, get_variant, build_model
  model = build_model(get_variant("ViT-B/16"), num_classes=1000)

The trainer: `train_and_evaluate(config, workdir)`, or the pieces
`create_train_state`, `train_step`, `eval_step` for a loop of your own.
Pretrained checkpoints: `load_params(path, num_heads)` reads official .npz,
Orbax and PyTorch files, `adapt_params` fits them to a model;
`python -m vit_jax.checkpoints.convert` writes them back out.

The packages, by concern: `model` (the paper's ViT and its variants),
`kernels` (speed paths the model composes in), `data`, `training`,
`checkpoints`, `inspection`, `runtime` (host settings, devices, processes),
and `config` (defaults and the one validation pass).

Importing vit_jax changes nothing in the process. `main.py` applies its
process settings explicitly (vit_jax/runtime/host.py: measured XLA:CPU
flags, a faster malloc, the compilation cache); a library user who wants
them calls `vit_jax.runtime.host.default_xla_flags()` before JAX starts.
The names below are imported on first use.
"""

import importlib

# Public name -> (module, attribute).
_EXPORTS = {
    "base_config": ("config", "base_config"),
    "Dataset": ("data.datasets", "Dataset"),
    "DatasetUnavailableError": ("data.datasets", "DatasetUnavailableError"),
    "load_dataset": ("data.datasets", "load"),
    "Encoder": ("model.encoder", "Encoder"),
    "Encoder1DBlock": ("model.blocks", "Encoder1DBlock"),
    "MlpBlock": ("model.blocks", "MlpBlock"),
    "MultiHeadSelfAttention": ("model.self_attention",
                               "MultiHeadSelfAttention"),
    "ViTInputError": ("model.options", "ViTInputError"),
    "VisionTransformer": ("model.vit", "VisionTransformer"),
    "adapt_params": ("checkpoints.pretrained", "adapt_params"),
    "load_params": ("checkpoints.pretrained", "load_params"),
    "resize_pos_embedding": ("checkpoints.pretrained", "resize_pos_embedding"),
    "TrainState": ("training.steps", "TrainState"),
    "create_train_state": ("training.steps", "create_train_state"),
    "eval_step": ("training.steps", "eval_step"),
    "train_and_evaluate": ("training.loop", "train_and_evaluate"),
    "train_step": ("training.steps", "train_step"),
    "VARIANTS": ("model.variants", "VARIANTS"),
    "build_model": ("model.variants", "build_model"),
    "get_variant": ("model.variants", "get_variant"),
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
