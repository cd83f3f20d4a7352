"""Learning-rate schedule and optimizer: clip -> AdamW or SGD-momentum.

Weight decay skips biases, norms and embeddings (a mask); with
config.trainable="head" every other parameter is frozen (no update, no
optimizer state).
"""

import ml_collections
import optax
from flax import traverse_util

# Parameters that get no weight decay unless config.decay_all_params: biases,
# LayerNorm scales and the learned embeddings (class token, positions).
_NO_DECAY_NAMES = ("bias", "scale", "pos_embedding", "cls")
OPTIMIZERS = ("adamw", "sgd")
TRAINABLE = ("all", "head")


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           total_steps: int, steps_per_epoch: int
                           ) -> optax.Schedule:
  """Linear warm-up from 0 to `learning_rate`, then cosine to the end value."""
  warmup_steps = config.warmup_steps
  if warmup_steps is None:
    warmup_steps = int(round(config.warmup_epochs * steps_per_epoch))
  # Short runs (smoke tests) keep at least one step of cosine decay.
  warmup_steps = min(warmup_steps, total_steps - 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=max(warmup_steps, 0),
      decay_steps=max(total_steps, 1),
      end_value=config.end_learning_rate)


def weight_decay_mask(params):
  """True for the parameters weight decay applies to (kernels)."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict(
      {path: path[-1] not in _NO_DECAY_NAMES for path in flat})


def trainable_labels(params, trainable: str):
  """"train" or "freeze" per parameter: everything, or only the head."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({
      path: "train" if trainable == "all" or path[0] == "head" else "freeze"
      for path in flat})


def make_optimizer(config: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """Global-norm clipping (if grad_clip_norm > 0), then AdamW or SGD."""
  mask = None if config.decay_all_params else weight_decay_mask
  if config.optimizer == "adamw":
    update = optax.adamw(
        learning_rate=schedule, b1=config.adam_b1, b2=config.adam_b2,
        weight_decay=config.weight_decay, mask=mask)
  elif config.optimizer == "sgd":
    update = optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask),
        optax.sgd(learning_rate=schedule, momentum=config.momentum))
  else:
    raise ValueError(f"config.optimizer={config.optimizer!r} is not "
                     f"supported; choose one of {OPTIMIZERS}.")
  if config.grad_clip_norm > 0:
    update = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm),
                         update)
  if config.trainable != "all":
    update = optax.multi_transform(
        {"train": update, "freeze": optax.set_to_zero()},
        lambda params: trainable_labels(params, config.trainable))
  return update
