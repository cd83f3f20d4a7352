"""Config checks that run before any data is read or anything compiles."""

import os

import jax
import ml_collections

from vit_jax import augment, datasets, models, optim, pretrained, sharding


def image_shape_of(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
  """(H, W, C) the model sees, known without loading the dataset.

  That is the dataset's image shape, or config.image_size square if set.
  """
  if config.dataset == "synthetic":
    s = config.synthetic
    shape = (s.image_size, s.image_size, s.channels)
  elif config.dataset not in datasets.SPECS:
    raise ValueError(
        f"config.dataset={config.dataset!r} is not supported; choose one of "
        f"{sorted(datasets.SPECS) + ['synthetic']}.")
  else:
    shape = datasets.SPECS[config.dataset].image_shape
  if config.image_size is not None:
    shape = (config.image_size, config.image_size, shape[2])
  return shape


def num_classes_of(config: ml_collections.ConfigDict) -> int:
  """Number of classes of the configured dataset, without loading it."""
  if config.dataset == "synthetic":
    return config.synthetic.num_classes
  image_shape_of(config)  # raises for an unknown dataset
  return datasets.SPECS[config.dataset].num_classes


def _check_choice(config, key: str, choices) -> None:
  if config[key] not in choices:
    raise ValueError(f"config.{key}={config[key]!r} is not supported; choose "
                     f"one of {tuple(choices)}.")


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
  _check_choice(config, "optimizer", optim.OPTIMIZERS)
  _check_choice(config, "trainable", optim.TRAINABLE)
  _check_choice(config, "normalization", augment.NORMALIZATIONS)
  _check_choice(config, "posemb_resize", pretrained.RESIZE_METHODS)
  _check_choice(config, "schedule", optim.SCHEDULES)
  _check_choice(config, "auto_augment", augment.AUTO_AUGMENTS)
  if config.model.posemb not in models.POSITION_EMBEDDINGS:
    raise ValueError(
        f"config.model.posemb={config.model.posemb!r} is not supported; "
        f"choose one of {models.POSITION_EMBEDDINGS}.")
  for key in ("random_erasing", "ema_decay", "model.drop_path_rate",
              "model.patch_dropout_rate"):
    value = (config.model[key.removeprefix("model.")]
             if key.startswith("model.") else config[key])
    if not 0.0 <= value < 1.0:
      raise ValueError(f"config.{key}={value} must be in [0, 1).")
  for key in ("mixup_alpha", "cutmix_alpha", "sam_rho",
              "unmasked_tuning_epochs"):
    if config[key] < 0:
      raise ValueError(f"config.{key}={config[key]} must be >= 0 (0 "
                       "disables it).")
  if config.unmasked_tuning_epochs and not config.model.patch_dropout_rate:
    raise ValueError(
        f"config.unmasked_tuning_epochs={config.unmasked_tuning_epochs} "
        "tunes a model trained with patch dropout on every patch, but "
        "config.model.patch_dropout_rate is 0: set a rate, or set "
        "unmasked_tuning_epochs=0.")
  if config.unmasked_tuning_learning_rate <= 0:
    raise ValueError(f"config.unmasked_tuning_learning_rate="
                     f"{config.unmasked_tuning_learning_rate} must be > 0.")
  if not 0.0 < config.layer_decay <= 1.0:
    raise ValueError(f"config.layer_decay={config.layer_decay} must be in "
                     "(0, 1]; 1 disables it.")
  if not 0.0 <= config.randaugment_magnitude <= 10.0:
    raise ValueError(f"config.randaugment_magnitude="
                     f"{config.randaugment_magnitude} must be in [0, 10].")
  if config.accum_steps < 1 or config.batch_size % config.accum_steps:
    raise ValueError(
        f"config.accum_steps={config.accum_steps} must be >= 1 and divide "
        f"config.batch_size={config.batch_size}.")
  if config.time_budget_minutes < 0:
    raise ValueError(f"config.time_budget_minutes={config.time_budget_minutes}"
                     " must be >= 0 (0: train num_epochs or num_train_steps).")
  if config.image_size is not None and config.image_size <= 0:
    raise ValueError(f"config.image_size={config.image_size} must be "
                     "positive (or None to keep the dataset's size).")
  sharding.mesh_shape(config.mesh, jax.device_count())  # raises if unfit
  if config.fsdp_min_size < 0:
    raise ValueError(f"config.fsdp_min_size={config.fsdp_min_size} must be "
                     ">= 0.")
  if config.init_from is not None and not os.path.exists(config.init_from):
    raise ValueError(
        f"config.init_from={config.init_from!r}: no such file or folder. "
        "Give the path of a checkpoint: an official .npz (release files such "
        "as imagenet21k/ViT-B_16.npz), a vit_jax workdir, or a torchvision/"
        "timm/Hugging Face state dict (.pth, .bin, .safetensors).")
  if config.random_resized_crop and config.crop_padding:
    raise ValueError(
        "config.random_resized_crop=True and config.crop_padding="
        f"{config.crop_padding} are two crops; set crop_padding=0.")
  if not 0.0 < config.min_crop_area <= 1.0:
    raise ValueError(f"config.min_crop_area={config.min_crop_area} must be "
                     "in (0, 1].")
  if config.crop_padding < 0:
    raise ValueError(f"config.crop_padding={config.crop_padding} must be >= 0.")

  model = config.model
  height, width, channels = image_shape_of(config)
  if height % model.patch_size or width % model.patch_size:
    raise ValueError(
        f"config.model.patch_size={model.patch_size} does not divide the "
        f"{height}x{width} images of {config.dataset}; choose a patch size "
        f"that divides {height} and {width} (or set config.image_size).")
  if config.normalization == "imagenet" and channels != 3:
    raise ValueError(
        f"config.normalization='imagenet' needs RGB images; {config.dataset} "
        f"has {channels} channel(s). Use 'dataset' or 'inception'.")
  if model.hidden_size % model.num_heads:
    raise ValueError(
        f"config.model.num_heads={model.num_heads} does not divide "
        f"config.model.hidden_size={model.hidden_size}.")
  if model.classifier not in models.CLASSIFIERS:
    raise ValueError(
        f"config.model.classifier={model.classifier!r} is not supported; "
        f"choose one of {models.CLASSIFIERS}.")
