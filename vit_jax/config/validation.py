"""The one validation pass over a config (`validate_config`), run before
any data is read or anything compiles: every impossible value or
combination raises ValueError naming the key and the fix.

What needs the devices or the dataset (the batch against the mesh, the
epoch's length) is checked later, once, by `derived.run_spec`.
"""

import os

import jax
import ml_collections

from vit_jax.checkpoints import pretrained
from vit_jax.config import derived
from vit_jax.data import augment, file_sources, image_folder, tfds_source
from vit_jax.kernels import cpu_adamw, cpu_layer_norm, matmuls
from vit_jax.model import vit
from vit_jax.runtime import sharding
from vit_jax.training import optim


def _check_choice(config, key: str, choices) -> None:
  if config[key] not in choices:
    raise ValueError(f"config.{key}={config[key]!r} is not supported; choose "
                     f"one of {tuple(choices)}.")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the key and the fix for an impossible config."""
  _check_ranges(config)
  _check_choice(config, "optimizer", optim.OPTIMIZERS)
  _check_choice(config, "optimizer_implementation",
                cpu_adamw.IMPLEMENTATIONS)
  _check_choice(config, "trainable", optim.TRAINABLE)
  _check_choice(config, "normalization", augment.NORMALIZATIONS)
  _check_choice(config, "posemb_resize", pretrained.RESIZE_METHODS)
  _check_choice(config, "schedule", optim.SCHEDULES)
  _check_choice(config, "auto_augment", augment.AUTO_AUGMENTS)
  _check_choice(config, "data_pipeline", file_sources.PIPELINES)
  _validate_file_data(config)
  _check_combinations(config)
  sharding.mesh_shape(config.mesh, jax.device_count())  # raises if unfit
  _check_model(config)


def _value(config: ml_collections.ConfigDict, key: str):
  """config's value at a dotted key such as "model.drop_path_rate"."""
  for part in key.split("."):
    config = config[part]
  return config


def _check_ranges(config: ml_collections.ConfigDict) -> None:
  """Each number in its range."""
  for key in ("batch_size", "eval_batch_size", "log_every_steps",
              "eval_every_epochs", "checkpoint_every_steps",
              "keep_checkpoints", "steps_per_dispatch"):
    if config[key] <= 0:
      raise ValueError(f"config.{key}={config[key]} must be positive.")
  if config.num_train_steps is None and config.num_epochs <= 0:
    raise ValueError(f"config.num_epochs={config.num_epochs} must be positive "
                     "(or set config.num_train_steps).")
  for key in ("label_smoothing", "random_erasing", "ema_decay",
              "model.drop_path_rate", "model.patch_dropout_rate"):
    if not 0.0 <= _value(config, key) < 1.0:
      raise ValueError(f"config.{key}={_value(config, key)} must be in "
                       "[0, 1).")
  for key in ("mixup_alpha", "cutmix_alpha", "sam_rho",
              "unmasked_tuning_epochs"):
    if config[key] < 0:
      raise ValueError(f"config.{key}={config[key]} must be >= 0 (0 "
                       "disables it).")
  if config.unmasked_tuning_learning_rate <= 0:
    raise ValueError(f"config.unmasked_tuning_learning_rate="
                     f"{config.unmasked_tuning_learning_rate} must be > 0.")
  if not 0.0 < config.layer_decay <= 1.0:
    raise ValueError(f"config.layer_decay={config.layer_decay} must be in "
                     "(0, 1]; 1 disables it.")
  if not 0.0 <= config.randaugment_magnitude <= 10.0:
    raise ValueError(f"config.randaugment_magnitude="
                     f"{config.randaugment_magnitude} must be in [0, 10].")
  if config.time_budget_minutes < 0:
    raise ValueError(f"config.time_budget_minutes={config.time_budget_minutes}"
                     " must be >= 0 (0: train num_epochs or num_train_steps).")
  if config.image_size is not None and config.image_size <= 0:
    raise ValueError(f"config.image_size={config.image_size} must be "
                     "positive (or None to keep the dataset's size).")
  if config.fsdp_min_size < 0:
    raise ValueError(f"config.fsdp_min_size={config.fsdp_min_size} must be "
                     ">= 0.")
  if not 0.0 < config.min_crop_area <= 1.0:
    raise ValueError(f"config.min_crop_area={config.min_crop_area} must be "
                     "in (0, 1].")
  if config.crop_padding < 0:
    raise ValueError(f"config.crop_padding={config.crop_padding} must be >= 0.")


def _check_combinations(config: ml_collections.ConfigDict) -> None:
  """Settings that are each fine but not together, and init_from's file."""
  if config.unmasked_tuning_epochs and not config.model.patch_dropout_rate:
    raise ValueError(
        f"config.unmasked_tuning_epochs={config.unmasked_tuning_epochs} "
        "tunes a model trained with patch dropout on every patch, but "
        "config.model.patch_dropout_rate is 0: set a rate, or set "
        "unmasked_tuning_epochs=0.")
  if config.accum_steps < 1 or config.batch_size % config.accum_steps:
    raise ValueError(
        f"config.accum_steps={config.accum_steps} must be >= 1 and divide "
        f"config.batch_size={config.batch_size}.")
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


def _check_model(config: ml_collections.ConfigDict) -> None:
  """The model's settings, and that it fits the images."""
  model = config.model
  if model.posemb not in vit.POSITION_EMBEDDINGS:
    raise ValueError(
        f"config.model.posemb={model.posemb!r} is not supported; "
        f"choose one of {vit.POSITION_EMBEDDINGS}.")
  height, width, channels = derived.image_shape_of(config)
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
  if model.classifier not in vit.CLASSIFIERS:
    raise ValueError(
        f"config.model.classifier={model.classifier!r} is not supported; "
        f"choose one of {vit.CLASSIFIERS}.")
  if model.matmul_dtype not in (None, "bfloat16"):
    raise ValueError(
        f"config.model.matmul_dtype={model.matmul_dtype!r} is not supported: "
        "set 'bfloat16' (bfloat16 operands, float32 accumulation) or leave "
        "it unset (the matmuls compute in config.model.dtype).")
  if model.matmul_implementation not in matmuls.IMPLEMENTATIONS:
    raise ValueError(
        f"config.model.matmul_implementation={model.matmul_implementation!r} "
        f"is not one of {matmuls.IMPLEMENTATIONS}: 'auto' (oneDNN's products "
        "for float32 on a CPU, XLA's elsewhere), 'onednn' or 'xla'.")
  if model.layer_norm_implementation not in cpu_layer_norm.IMPLEMENTATIONS:
    raise ValueError(
        "config.model.layer_norm_implementation="
        f"{model.layer_norm_implementation!r} is not one of "
        f"{cpu_layer_norm.IMPLEMENTATIONS}: 'auto' (the C++ kernel for "
        "float32 on a CPU, Flax's LayerNorm elsewhere), 'cpu_kernel' or "
        "'xla'.")


def _validate_file_data(config: ml_collections.ConfigDict) -> None:
  """The keys of folder and TFDS datasets; a TFDS name TFDS knows."""
  if (derived.is_file_dataset(config)
      and not image_folder.looks_like_folder(config.dataset)):
    tfds_source.check_name(config.dataset)
  if config.channels not in (None, 1, 3):
    raise ValueError(f"config.channels={config.channels}: 1 (grayscale) or "
                     "3 (RGB), or None for 3.")
  if config.data_workers is not None and config.data_workers < 0:
    raise ValueError(f"config.data_workers={config.data_workers} must be >= 0"
                     " (0 decodes in the training process).")
  if not 0.0 < config.holdout_fraction < 1.0:
    raise ValueError(f"config.holdout_fraction={config.holdout_fraction} "
                     "must be in (0, 1).")
  fraction = config.eval_crop_fraction
  if fraction is not None and not 0.0 < fraction <= 1.0:
    raise ValueError(f"config.eval_crop_fraction={fraction} must be in "
                     "(0, 1], or None.")
  if config.in_memory_max_mib < 0:
    raise ValueError(f"config.in_memory_max_mib={config.in_memory_max_mib} "
                     "must be >= 0 (0: always stream).")
