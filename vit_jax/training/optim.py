"""Learning-rate schedule and optimizer: clip -> AdamW, LAMB or SGD.

The schedule warms up and decays; a run with an unmasked tuning
(config.unmasked_tuning_epochs) ends with that tuning's own short cosine.
Weight decay skips biases, norms and embeddings (a mask); layer-wise
learning-rate decay (config.layer_decay < 1) scales each block's updates by
layer_decay ** (depth from the top), for fine-tuning; with
config.trainable="head" every other parameter is frozen (no update, no
optimizer state). AdamW is `training.adamw`'s: optax.adamw's values,
quicker to trace, one C++ update on a CPU.
"""

import dataclasses
import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util

from vit_jax.kernels import cpu_adamw, cpu_sum_of_squares
from vit_jax.runtime import sharding
from vit_jax.training.adamw import adamw

# Parameters that get no weight decay unless config.decay_all_params: biases,
# LayerNorm scales and the learned embeddings (class token, positions).
# Biases, norm gains, embeddings and the attention temperatures of
# locality_attention (one scalar per block) are not decayed.
_NO_DECAY_NAMES = ("bias", "scale", "pos_embedding", "cls", "temperature")
OPTIMIZERS = ("adamw", "lamb", "sgd")
TRAINABLE = ("all", "head")
SCHEDULES = ("cosine", "linear")


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           total_steps: int, steps_per_epoch: int
                           ) -> optax.Schedule:
  """The schedule of a run of `total_steps`: decay_schedule over all but
  the last unmasked_tuning_steps, then the unmasked tuning's."""
  tuning_steps = unmasked_tuning_steps(config, steps_per_epoch)
  return with_unmasked_tuning(
      decay_schedule(config, total_steps - tuning_steps, steps_per_epoch),
      config, total_steps, steps_per_epoch)


def unmasked_tuning_steps(config: ml_collections.ConfigDict,
                          steps_per_epoch: int) -> int:
  """The steps at the end of a run that train on every patch (0 if
  config.unmasked_tuning_epochs is 0)."""
  return int(round(config.unmasked_tuning_epochs * steps_per_epoch))


def with_unmasked_tuning(schedule: optax.Schedule,
                         config: ml_collections.ConfigDict, total_steps: int,
                         steps_per_epoch: int) -> optax.Schedule:
  """`schedule` up to the unmasked tuning of a run of `total_steps`, then a
  cosine decay from config.unmasked_tuning_learning_rate to 0 over it: the
  main schedule has all but ended, and the tuning starts afresh, small."""
  tuning_steps = unmasked_tuning_steps(config, steps_per_epoch)
  if not tuning_steps:
    return schedule
  return optax.join_schedules(
      [schedule, optax.cosine_decay_schedule(
          config.unmasked_tuning_learning_rate, tuning_steps)],
      [total_steps - tuning_steps])


def decay_schedule(config: ml_collections.ConfigDict, total_steps: int,
                   steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up from 0 to `learning_rate`, then cosine (or linear,
  config.schedule) decay to `end_learning_rate` at step total_steps."""
  warmup_steps = config.warmup_steps
  if warmup_steps is None:
    warmup_steps = int(round(config.warmup_epochs * steps_per_epoch))
  # Short runs (smoke tests) keep at least one step of cosine decay.
  warmup_steps = max(min(warmup_steps, total_steps - 1), 0)
  if config.schedule == "linear":
    return optax.join_schedules([
        optax.linear_schedule(0.0, config.learning_rate, warmup_steps),
        optax.linear_schedule(config.learning_rate, config.end_learning_rate,
                              max(total_steps - warmup_steps, 1))],
                                [warmup_steps])
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


def layer_index(path: tuple[str, ...], num_layers: int) -> int:
  """0 for the embeddings, i + 1 for encoder block i, num_layers + 1 for
  the final norm and the head."""
  if (path[0] in ("embedding", "embedding_norm", "cls")
      or "posembed_input" in path):
    return 0
  block = re.fullmatch(r"encoderblock_(\d+)", path[1] if len(path) > 1
                       else "")
  return int(block.group(1)) + 1 if block else num_layers + 1


def scale_by_layer(decay: float) -> optax.GradientTransformation:
  """Multiplies the update of a parameter at layer_index i by
  decay ** (num_layers + 1 - i): the head keeps the full learning rate,
  each block below it a factor `decay` less (BEiT-style fine-tuning)."""

  def update(updates, state, params=None):
    del params
    flat = traverse_util.flatten_dict(updates)
    num_layers = len({path[1] for path in flat if len(path) > 1 and
                      path[1].startswith("encoderblock_")})
    scaled = {path: value * decay ** (num_layers + 1 -
                                      layer_index(path, num_layers))
              for path, value in flat.items()}
    return traverse_util.unflatten_dict(scaled), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update)


def trainable_labels(params, trainable: str):
  """"train" or "freeze" per parameter: everything, or only the head."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({
      path: "train" if trainable == "all" or path[0] == "head" else "freeze"
      for path in flat})


def global_norm(tree, sharded: bool = False,
                implementation: str = "auto") -> jax.Array:
  """The L2 norm of all of `tree`'s leaves together, a scalar
  (`optax.global_norm`'s value, up to float rounding).

  On a CPU, float32 leaves whole on each device are read once by a C++
  kernel (`kernels.cpu_sum_of_squares` says why); implementation is
  config.optimizer_implementation ("auto", "cpu_kernel" or "xla", as for
  AdamW's update). XLA's path reduces one vector of the leaves
  concatenated: optax reduces each leaf on its own, ~200 reductions for a
  ViT, which XLA:CPU compiled ~2.5 s slower in a vit_tiny_cifar train step.
  With `sharded` (leaves split over devices, FSDP) each leaf is reduced
  where it lies: concatenating would gather every shard onto every device.
  """
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  if sharded:  # in their own shapes: raveling can gather too
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in leaves))
  if cpu_adamw.resolve_implementation(implementation,
                                      leaves) == "cpu_kernel":
    return jnp.sqrt(cpu_sum_of_squares.sum_of_squares(leaves))
  flat = jnp.concatenate([jnp.ravel(leaf) for leaf in leaves])
  return jnp.sqrt(jnp.sum(jnp.square(flat)))


def shards_params(config: ml_collections.ConfigDict) -> bool:
  """Whether config.mesh splits parameters over devices (fsdp > 1)."""
  mesh_config = config.get("mesh") or sharding.default_mesh_config()
  sizes = sharding.mesh_shape(mesh_config, jax.device_count())
  return sizes[sharding.FSDP_AXIS] > 1


def clip_by_global_norm(max_norm: float, sharded: bool = False,
                        implementation: str = "auto"
                        ) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` through `global_norm` (with `sharded` and
  `implementation`): updates scaled by max_norm / norm when their norm
  exceeds max_norm. No state, as optax's, so checkpoints of either restore
  into the other."""

  def update(updates, state, params=None):
    del params
    norm = global_norm(updates, sharded, implementation)
    keep = norm < max_norm
    return jax.tree.map(
        lambda u: jnp.where(keep, u, u / norm.astype(u.dtype) * max_norm),
        updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update)


def clip_by_global_norm_into(inner: optax.GradientTransformation,
                             max_norm: float, sharded: bool = False,
                             implementation: str = "auto"
                             ) -> optax.GradientTransformationExtraArgs:
  """`optax.chain(clip_by_global_norm(max_norm, sharded, implementation),
  inner)` for an `inner` that takes the clipping factor as its
  `grad_scale` argument (`adamw`, or a chain starting with it), with that
  chain's state, so checkpoints restore with either.

  Why: clipped gradients are a new array per parameter, which XLA fuses
  into its per-parameter updates but which `kernels.cpu_adamw` would read
  from ~200 fusions of their own; the kernel scales each gradient as it
  reads it instead (the vit_tiny_cifar step on a 2-core AMD EPYC compiled
  in 4.6-4.7 s against 7.8-8.3 s with optax.chain).
  """
  clip = clip_by_global_norm(max_norm, sharded, implementation)
  return optax.GradientTransformationExtraArgs(
      lambda params: (clip.init(params), inner.init(params)),
      _ClippedInto(inner, max_norm, sharded, implementation))


@dataclasses.dataclass(frozen=True)
class _ClippedInto:
  """`clip_by_global_norm_into`'s update function, and its `apply` (for
  `apply_gradients`) where `inner` applies its updates itself."""
  inner: optax.GradientTransformation
  max_norm: float
  sharded: bool
  implementation: str

  def _scale(self, grads) -> jax.Array:
    norm = global_norm(grads, self.sharded, self.implementation)
    return jnp.where(norm < self.max_norm, 1.0, self.max_norm / norm)

  def __call__(self, grads, state, params=None, **extra_args):
    clip_state, inner_state = state
    updates, inner_state = self.inner.update(
        grads, inner_state, params, grad_scale=self._scale(grads),
        **extra_args)
    return updates, (clip_state, inner_state)

  def apply(self, grads, state, params, **extra_args):
    clip_state, inner_state = state
    params, inner_state = apply_gradients(
        self.inner, grads, inner_state, params,
        grad_scale=self._scale(grads), **extra_args)
    return params, (clip_state, inner_state)


def apply_gradients(tx: optax.GradientTransformation, grads, state, params,
                    **extra_args) -> tuple[Any, Any]:
  """(params updated, tx's state after): `tx.update` then
  `optax.apply_updates`, or where tx's update function has an `apply`
  (`adamw`'s, and clipping into it), that: AdamW's kernel then writes the
  new params in its own pass over them, where apply_updates is another
  fusion per parameter reading them again (1 ms of a 30 ms
  vit_tiny_cifar step at batch 1 on a 2-core AMD EPYC)."""
  apply = getattr(tx.update, "apply", None)
  if apply is not None:
    return apply(grads, state, params, **extra_args)
  updates, state = tx.update(grads, state, params, **extra_args)
  return optax.apply_updates(params, updates), state


def optimizer_implementation(config: ml_collections.ConfigDict) -> str:
  """config.optimizer_implementation, or "xla" for "auto" where FSDP splits
  the parameters over devices (the kernel reads whole ones)."""
  requested = config.get("optimizer_implementation", "auto")
  if not shards_params(config):
    return requested
  if requested == "cpu_kernel":
    raise ValueError(
        "config.optimizer_implementation='cpu_kernel' updates whole "
        "parameters, but config.mesh splits them over devices (fsdp > 1): "
        "set it to 'auto' or 'xla', or set mesh.fsdp=1.")
  return "xla"


def global_norm_of(config: ml_collections.ConfigDict
                   ) -> Callable[[Any], jax.Array]:
  """`global_norm` of a tree of gradients, split over devices as config's
  mesh splits the parameters, by config's optimizer implementation."""
  return functools.partial(global_norm, sharded=shards_params(config),
                           implementation=optimizer_implementation(config))


def make_optimizer(config: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """Global-norm clipping (if grad_clip_norm > 0), then AdamW or SGD."""
  mask = None if config.decay_all_params else weight_decay_mask
  implementation = optimizer_implementation(config)
  if config.optimizer == "adamw":
    update = adamw(
        learning_rate=schedule, b1=config.adam_b1, b2=config.adam_b2,
        weight_decay=config.weight_decay, mask=mask,
        implementation=implementation)
  elif config.optimizer == "lamb":
    update = optax.lamb(
        learning_rate=schedule, b1=config.adam_b1, b2=config.adam_b2,
        weight_decay=config.weight_decay, mask=mask)
  elif config.optimizer == "sgd":
    update = optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask),
        optax.sgd(learning_rate=schedule, momentum=config.momentum))
  else:
    raise ValueError(f"config.optimizer={config.optimizer!r} is not "
                     f"supported; choose one of {OPTIMIZERS}.")
  if config.layer_decay < 1.0:
    update = optax.chain(update, scale_by_layer(config.layer_decay))
  if config.grad_clip_norm > 0 and config.optimizer == "adamw":
    update = clip_by_global_norm_into(update, config.grad_clip_norm,
                                      shards_params(config), implementation)
  elif config.grad_clip_norm > 0:
    update = optax.chain(
        clip_by_global_norm(config.grad_clip_norm, shards_params(config),
                            implementation),
        update)
  if config.trainable != "all":
    update = optax.multi_transform(
        {"train": update, "freeze": optax.set_to_zero()},
        lambda params: trainable_labels(params, config.trainable))
  return update
