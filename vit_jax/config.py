"""The trainer's config: its defaults (`base_config`, which every file in
configs/ starts from) and the one validation pass (`validate_config`), run
before any data is read or anything compiles.

Every config is locked: an override of a key that does not exist
(`--config.batch_sise=64`) fails with the list of valid keys instead of being
silently ignored.
"""

import dataclasses
import functools
import os

import jax
import ml_collections
import numpy as np
from ml_collections import config_dict

from vit_jax.checkpoints import pretrained
from vit_jax.data import augment, datasets, file_sources, image_folder
from vit_jax.data import tfds_source
from vit_jax.model import variants, vit
from vit_jax.runtime import sharding
from vit_jax.training import optim


def base_config(model: str = "ViT-Ti/4") -> ml_collections.ConfigDict:
  """Defaults for every option of the trainer, with model `model`."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Data. `dataset` is cifar10, cifar100, mnist, fashion_mnist, synthetic
  # (these five held in memory), a folder of images (root/train/<class>/*,
  # root/test/<class>/* or val/), or any TFDS image-classification name
  # (imagenette, oxford_iiit_pet, food101, imagenet2012, ...); see
  # vit_jax/data/file_sources.py.
  config.dataset = "cifar10"
  # Where to look: "auto" tries raw files (raw_data_dir, then known system
  # paths), then TFDS; "raw" and "tfds" use only that source.
  config.data_source = "auto"
  config.raw_data_dir = config_dict.placeholder(str)  # IDX / CIFAR binary files
  config.data_dir = config_dict.placeholder(str)  # TFDS data_dir
  config.manual_dir = config_dict.placeholder(str)  # TFDS manual_dir
  config.tfds_download = True  # let TFDS download and prepare when missing
  # Use only the first N examples (folders, TFDS: a fixed random N).
  config.max_train_examples = config_dict.placeholder(int)
  config.max_eval_examples = config_dict.placeholder(int)
  # Folders and TFDS datasets: decoded at image_size (224 if unset) with
  # `channels` (None: 3); "auto" holds them in memory when that takes at
  # most in_memory_max_mib, else streams them ("memory", "stream" force it).
  config.data_pipeline = "auto"
  config.in_memory_max_mib = 2048
  config.channels = config_dict.placeholder(int)
  # Worker processes decoding a streamed dataset; None: half the cores.
  config.data_workers = config_dict.placeholder(int)
  # A folder without test/ or val/: this fraction of each class held out
  # (the same files for the same seed).
  config.holdout_fraction = 0.1
  # Unreadable images: an error naming the file (False), or skipped,
  # counted and reported each epoch (True).
  config.skip_bad_images = False
  # Evaluation of folder/TFDS data: the central crop_fraction of the
  # shorter side, resized to image_size. None: 0.875 with
  # random_resized_crop (the ImageNet recipes' 224/256), else 1.0.
  config.eval_crop_fraction = config_dict.placeholder(float)
  # Synthetic data (dataset="synthetic"): class-dependent patterns + noise.
  config.synthetic = ml_collections.ConfigDict(dict(
      num_train=512, num_eval=128, image_size=32, channels=3, num_classes=10))

  # Augmentation, applied on device inside the train step.
  config.crop_padding = 4  # random crop after zero padding; 0 disables
  # Or an Inception-style random resized crop (box of min_crop_area..1 of
  # the image, aspect 3/4..4/3) resized to image_size: the official
  # fine-tuning augmentation. Use with crop_padding=0.
  config.random_resized_crop = False
  config.min_crop_area = 0.05
  config.random_flip = config_dict.placeholder(bool)  # None: dataset default
  # Evaluation (and the report, predict, attention tools) classify by the
  # mean logits of each image and its mirror image: 2x the eval forward.
  config.eval_flip_average = False
  # After crop and flip: "randaugment" (randaugment_num_ops operations at
  # randaugment_magnitude, 0-10) or "trivialaugment" (one operation, random
  # magnitude), on device; see vit_jax/data/randaugment.py. "none" disables.
  config.auto_augment = "none"
  config.randaugment_num_ops = 2
  config.randaugment_magnitude = 9.0
  # Probability of erasing a random box of each image (after
  # normalisation, with noise); 0 disables.
  config.random_erasing = 0.0
  # Mixup / CutMix Beta(alpha, alpha) weights; 0 disables one. Both > 0:
  # each batch uses one of them, 50/50. Targets are mixed the same way.
  config.mixup_alpha = 0.0
  config.cutmix_alpha = 0.0
  # Resize (bilinear, on device) to image_size x image_size after the crop,
  # e.g. 384 to fine-tune at the paper's resolution; None keeps the size.
  config.image_size = config_dict.placeholder(int)
  # Pixel scaling: "dataset" (per-channel mean/std of the training split),
  # "inception" ([-1, 1]: official and big_vision checkpoints) or
  # "imagenet" (ImageNet mean/std: torchvision, timm and most HF models).
  config.normalization = "dataset"

  # Start from a pretrained checkpoint (.npz, Orbax folder or PyTorch state
  # dict); see vit_jax/checkpoints/pretrained.py. Ignored when resuming
  # from workdir.
  config.init_from = config_dict.placeholder(str)
  config.posemb_resize = "bilinear"  # or "bicubic": for a new image size
  config.trainable = "all"  # "head" freezes the rest: a linear probe

  config.model = variants.get_variant(model)

  # Devices: config.mesh gives the size of each mesh axis; -1 takes the
  # remaining devices. `data` splits the batch; `fsdp` also splits every
  # floating array of at least fsdp_min_size elements (params and optimizer
  # state) along its largest divisible dimension. E.g. data=-1 (default:
  # data parallel on every device), or data=4, fsdp=2 on 8 devices.
  # Training results do not depend on the mesh (up to float rounding).
  config.mesh = sharding.default_mesh_config()
  config.fsdp_min_size = 1024
  # On a CPU: split it into this many devices (-1: one per core), each
  # running its part of the batch, so that independent chains of kernels
  # keep the cores busy. Pays for small models (docs/performance.md);
  # 0 keeps one multi-threaded device. Applied by main.py before JAX starts;
  # an XLA_FLAGS device count of the user's wins.
  config.cpu_devices = 0
  # Train steps per dispatch from the host: k > 1 runs k steps as one
  # program looping on the device (steps.train_steps), so the host's work
  # per step (sending a state of hundreds of arrays) is paid once per k
  # steps. Pays where that work sets the pace: small models on a GPU. The
  # steps and their results are the same; logs, evaluations and
  # checkpoints fall between dispatches, so choose a k that divides
  # log_every_steps, checkpoint_every_steps and the steps between
  # evaluations (others run single steps around them, compiled apart).
  config.steps_per_dispatch = 1

  # Optimisation: linear warm-up then cosine decay, global-norm clip, and
  # "adamw", "lamb" or "sgd" (with momentum: the paper's fine-tuning
  # recipe).
  config.optimizer = "adamw"
  config.batch_size = 128  # examples per update, over all devices
  # Split each batch into accum_steps micro-batches whose gradients are
  # averaged: the same update as the whole batch, in 1/accum_steps memory.
  # So batch_size = (examples per device per micro-batch) x accum_steps x
  # devices (data x fsdp), whatever the mesh or the number of hosts.
  config.accum_steps = 1
  config.eval_batch_size = 500
  config.num_epochs = 100
  config.num_train_steps = config_dict.placeholder(int)  # overrides epochs
  # Train as many steps as fit this many wall minutes (at most the epochs or
  # steps above), planned from the speed of the first steps; 0: off.
  # The plan is kept in workdir/time_plan.json for resuming (budget.py).
  config.time_budget_minutes = 0.0
  config.learning_rate = 1e-3
  config.end_learning_rate = 1e-5
  config.schedule = "cosine"  # decay after warm-up: "cosine" or "linear"
  config.warmup_epochs = 5.0
  config.warmup_steps = config_dict.placeholder(int)  # overrides the epochs
  config.weight_decay = 0.05
  config.decay_all_params = False  # also decay biases, LN scales, embeddings
  config.adam_b1 = 0.9
  config.adam_b2 = 0.999
  config.momentum = 0.9  # for optimizer="sgd"
  # Layer-wise learning-rate decay: block i from the top learns at
  # layer_decay ** i times the head's rate (e.g. 0.75 to fine-tune); 1 off.
  config.layer_decay = 1.0
  # Exponential moving average of the params, evaluated next to them
  # (eval metrics ema_loss, ema_accuracy); 0 disables, e.g. 0.999.
  config.ema_decay = 0.0
  config.grad_clip_norm = 1.0  # 0 disables clipping
  # A NaN/Inf loss or gradient stops training (nothing poisoned is saved);
  # True skips that step's update instead and logs it.
  config.skip_nonfinite_steps = False
  config.label_smoothing = 0.1
  # Sharpness-aware minimisation: each update takes the gradient at the
  # params moved sam_rho along the normalised gradient (two passes a step);
  # 0 disables, e.g. 0.05.
  config.sam_rho = 0.0
  # Unmasked tuning (Li et al. 2023, FLIP), for a model trained with
  # model.patch_dropout_rate > 0: the run's last unmasked_tuning_epochs
  # train on every patch, as the model is tested, at a learning rate
  # decaying from unmasked_tuning_learning_rate to 0 (cosine). 0 disables.
  config.unmasked_tuning_epochs = 0.0
  config.unmasked_tuning_learning_rate = 1e-4

  # Bookkeeping.
  config.log_every_steps = 50
  # And after the last step; an interval's evaluation less than half an
  # interval before it is skipped (budget.evaluates_after).
  config.eval_every_epochs = 1
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 3  # the latest N (resume uses the last one)
  # Also keep the params of the best eval accuracy in workdir/best/
  # (params.npz, official layout, usable as init_from; metrics.json).
  config.keep_best = False
  config.lock()
  return config

def _is_file_dataset(config: ml_collections.ConfigDict) -> bool:
  """Whether config.dataset is a folder or a TFDS name (file_sources.py)."""
  return (config.dataset != "synthetic"
          and config.dataset not in datasets.SPECS)


def image_shape_of(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
  """(H, W, C) the model sees, known without loading the dataset.

  That is the dataset's image shape, or config.image_size square if set;
  folders and TFDS datasets: image_size (224 if unset) and config.channels.
  """
  if config.dataset == "synthetic":
    s = config.synthetic
    shape = (s.image_size, s.image_size, s.channels)
  elif _is_file_dataset(config):
    return file_sources.image_shape(config)
  else:
    shape = datasets.SPECS[config.dataset].image_shape
  if config.image_size is not None:
    shape = (config.image_size, config.image_size, shape[2])
  return shape


def num_classes_of(config: ml_collections.ConfigDict) -> int:
  """Number of classes of the configured dataset, without decoding it."""
  if config.dataset == "synthetic":
    return config.synthetic.num_classes
  if _is_file_dataset(config):
    return file_sources.num_classes(config)
  return datasets.SPECS[config.dataset].num_classes


def _check_choice(config, key: str, choices) -> None:
  if config[key] not in choices:
    raise ValueError(f"config.{key}={config[key]!r} is not supported; choose "
                     f"one of {tuple(choices)}.")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the key and the fix for an impossible config."""
  _check_ranges(config)
  _check_choice(config, "optimizer", optim.OPTIMIZERS)
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
  if model.classifier not in vit.CLASSIFIERS:
    raise ValueError(
        f"config.model.classifier={model.classifier!r} is not supported; "
        f"choose one of {vit.CLASSIFIERS}.")
  if model.matmul_dtype not in (None, "bfloat16"):
    raise ValueError(
        f"config.model.matmul_dtype={model.matmul_dtype!r} is not supported: "
        "set 'bfloat16' (bfloat16 operands, float32 accumulation) or leave "
        "it unset (the matmuls compute in config.model.dtype).")


def _validate_file_data(config: ml_collections.ConfigDict) -> None:
  """The keys of folder and TFDS datasets; a TFDS name TFDS knows."""
  if (_is_file_dataset(config)
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


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """The quantities a run derives from its config, mesh and dataset,
  computed once (`run_spec`) and passed to the layers that need them."""
  steps_per_epoch: int
  upper_bound: int  # num_train_steps, or num_epochs in steps
  tuning_steps: int  # the unmasked tuning's, at the end; 0 without one
  eval_every_steps: int
  image_shape: tuple[int, int, int]  # the model's input (H, W, C)
  num_patches: int


def run_spec(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
             dataset: datasets.Dataset) -> RunSpec:
  """`RunSpec` of `config` on `mesh` and `dataset`; raises ValueError
  naming the key and the fix where they do not fit together (the checks
  `validate_config` cannot make before the devices and the data are
  known)."""
  sharding.check_batch_size(config.batch_size, mesh, "batch_size")
  sharding.check_batch_size(config.eval_batch_size, mesh, "eval_batch_size")
  micro_batch = config.batch_size // config.accum_steps
  if micro_batch % mesh.size:
    raise ValueError(
        f"The micro-batch config.batch_size / config.accum_steps = "
        f"{micro_batch} does not split over {mesh.size} devices; pick "
        f"accum_steps so that batch_size / accum_steps is a multiple of "
        f"{mesh.size}.")
  num_train = dataset.num_train
  steps_per_epoch = num_train // config.batch_size
  if steps_per_epoch == 0:
    raise ValueError(f"config.batch_size={config.batch_size} exceeds the "
                     f"{num_train} training examples; lower it.")
  upper_bound = config.num_train_steps or config.num_epochs * steps_per_epoch
  tuning_steps = optim.unmasked_tuning_steps(config, steps_per_epoch)
  if tuning_steps >= upper_bound:
    raise ValueError(
        f"config.unmasked_tuning_epochs={config.unmasked_tuning_epochs} "
        f"({tuning_steps} steps) leaves nothing of the run's {upper_bound} "
        "steps to train with patch dropout; make it shorter.")
  height, width, channels = dataset.image_shape
  if config.image_size is not None:
    height = width = config.image_size
  patch = config.model.patch_size
  return RunSpec(steps_per_epoch=steps_per_epoch, upper_bound=upper_bound,
                 tuning_steps=tuning_steps,
                 eval_every_steps=steps_per_epoch * config.eval_every_epochs,
                 image_shape=(height, width, channels),
                 num_patches=(height // patch) * (width // patch))


def train_step_options(config: ml_collections.ConfigDict, mean: np.ndarray,
                       std: np.ndarray, flip: bool,
                       ema_start_step: int = 0,
                       crops_on_host: bool = False) -> dict:
  """`steps.train_step`'s keyword arguments (but the learning rate) for
  `config`: the on-device augmentation and normalisation (`preprocess`;
  mean, std: the pixel statistics; flip: random mirroring) and the step's
  options. ema_start_step: where the EMA's ramp starts (the unmasked
  tuning restarts it). crops_on_host: the input pipeline has made the
  random-resized crop already (streamed data), so the step does not."""
  return dict(
      preprocess=functools.partial(
          augment.train_preprocess, mean=mean, std=std,
          crop_padding=config.crop_padding, flip=flip,
          image_size=config.image_size,
          resized_crop=config.random_resized_crop and not crops_on_host,
          min_crop_area=config.min_crop_area,
          auto_augment=config.auto_augment,
          randaugment_num_ops=config.randaugment_num_ops,
          randaugment_magnitude=config.randaugment_magnitude,
          erase_probability=config.random_erasing),
      label_smoothing=config.label_smoothing,
      accum_steps=config.accum_steps,
      skip_nonfinite=config.skip_nonfinite_steps,
      mixup_alpha=config.mixup_alpha, cutmix_alpha=config.cutmix_alpha,
      ema_decay=config.ema_decay, ema_start_step=ema_start_step,
      sam_rho=config.sam_rho, sharded_params=optim.shards_params(config))


def eval_step_options(config: ml_collections.ConfigDict, apply_fn,
                      mean: np.ndarray, std: np.ndarray) -> dict:
  """`steps.eval_step`'s keyword arguments for `config` and the model's
  `apply_fn`."""
  return dict(apply_fn=apply_fn, preprocess=functools.partial(
      augment.eval_preprocess, mean=mean, std=std,
      image_size=config.image_size),
              flip_average=config.eval_flip_average)
