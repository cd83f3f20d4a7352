"""The trainer's config, by stage:

- `defaults.base_config`: every option with its default and a comment;
  each file in configs/ starts from it;
- `validation.validate_config`: the one check, before any data is read or
  anything compiles;
- `derived`: what a run computes from a valid config (the images' shape,
  `RunSpec`, the train and eval steps' arguments).

The names below are the ones the trainer, the configs and the tools use
(`from vit_jax import config as config_lib; config_lib.base_config()`).
"""

from vit_jax.config.defaults import base_config
from vit_jax.config.derived import (RunSpec, eval_step_options,
                                    image_shape_of, num_classes_of, run_spec,
                                    train_step_options)
from vit_jax.config.validation import validate_config

__all__ = ["base_config", "validate_config", "RunSpec", "run_spec",
           "image_shape_of", "num_classes_of", "train_step_options",
           "eval_step_options"]
