"""What a run derives from its config: the images' shape and the number
of classes (known before the dataset is loaded), the run's step counts
(`RunSpec`), and the keyword arguments of the train and eval steps.
"""

import dataclasses
import functools

import jax
import ml_collections
import numpy as np

from vit_jax.data import augment, datasets, file_sources
from vit_jax.runtime import sharding
from vit_jax.training import optim


def is_file_dataset(config: ml_collections.ConfigDict) -> bool:
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
  elif is_file_dataset(config):
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
  if is_file_dataset(config):
    return file_sources.num_classes(config)
  return datasets.SPECS[config.dataset].num_classes



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
      sam_rho=config.sam_rho, global_norm=optim.global_norm_of(config))


def eval_step_options(config: ml_collections.ConfigDict, apply_fn,
                      mean: np.ndarray, std: np.ndarray) -> dict:
  """`steps.eval_step`'s keyword arguments for `config` and the model's
  `apply_fn`."""
  return dict(apply_fn=apply_fn, preprocess=functools.partial(
      augment.eval_preprocess, mean=mean, std=std,
      image_size=config.image_size),
              flip_average=config.eval_flip_average)
