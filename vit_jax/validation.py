"""Config checks that run before any data is read or anything compiles."""

import ml_collections

from vit_jax import datasets, models


def image_shape_of(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
  """(H, W, C) of the configured dataset, known without loading it."""
  if config.dataset == "synthetic":
    s = config.synthetic
    return (s.image_size, s.image_size, s.channels)
  if config.dataset not in datasets.SPECS:
    raise ValueError(
        f"config.dataset={config.dataset!r} is not supported; choose one of "
        f"{sorted(datasets.SPECS) + ['synthetic']}.")
  return datasets.SPECS[config.dataset].image_shape


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the key and the fix for an impossible config."""
  positive = ("batch_size", "eval_batch_size", "log_every_steps",
              "eval_every_epochs", "checkpoint_every_steps",
              "keep_checkpoints")
  for key in positive:
    if config[key] <= 0:
      raise ValueError(f"config.{key}={config[key]} must be positive.")
  if config.num_train_steps is None and config.num_epochs <= 0:
    raise ValueError(f"config.num_epochs={config.num_epochs} must be positive "
                     "(or set config.num_train_steps).")
  if not 0.0 <= config.label_smoothing < 1.0:
    raise ValueError(f"config.label_smoothing={config.label_smoothing} must "
                     "be in [0, 1).")
  if config.crop_padding < 0:
    raise ValueError(f"config.crop_padding={config.crop_padding} must be >= 0.")

  model = config.model
  height, width, _ = image_shape_of(config)
  if height % model.patch_size or width % model.patch_size:
    raise ValueError(
        f"config.model.patch_size={model.patch_size} does not divide the "
        f"{height}x{width} images of {config.dataset}; choose a patch size "
        f"that divides {height} and {width}.")
  if model.hidden_size % model.num_heads:
    raise ValueError(
        f"config.model.num_heads={model.num_heads} does not divide "
        f"config.model.hidden_size={model.hidden_size}.")
  if model.classifier not in models.CLASSIFIERS:
    raise ValueError(
        f"config.model.classifier={model.classifier!r} is not supported; "
        f"choose one of {models.CLASSIFIERS}.")
