"""The functional core of training: state, steps, their compilation.

`create_train_state` builds the state in place on a mesh; `train_step` and
`eval_step` are pure functions of arrays and pytrees, and
`compile_train_step` / `compile_eval_step` jit them once with declared
shardings (the state placed by the rules of `sharding.state_shardings`:
replicated, or split over the "fsdp" mesh axis; batches split over every
device). `evaluate` runs a compiled eval step over a test set. Nothing here
reads a config: `vit_jax.config.train_step_options` and
`eval_step_options` turn one into the steps' keyword arguments. The loop
around them, with its I/O, logging and checkpoints, is
`loop.train_and_evaluate`.
"""

import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from vit_jax.data import augment, datasets, mixing
from vit_jax.runtime import prng, sharding
from vit_jax.training import optim


class TrainState(train_state.TrainState):
  """Params, optimizer state, step, and the run's base RNG key.

  The key of step s is fold_in(rng, s), so randomness depends on the step
  only and a resumed run draws exactly what an uninterrupted one would.
  `rng` is a raw uint32[2] key (so checkpoints hold plain integers); the
  step draws through `prng.flat_draws(rng)`, a typed key with the same
  values, which XLA:CPU compiles faster.
  """
  rng: jax.Array
  ema_params: Any = None  # moving average of params, if enabled

  def apply_gradients(self, *, grads, **kwargs) -> "TrainState":
    """flax's (step + 1, params and opt_state updated, kwargs replaced),
    the update applied by `optim.apply_gradients`: AdamW's kernel writes
    the new params itself."""
    params, opt_state = optim.apply_gradients(self.tx, grads, self.opt_state,
                                              self.params)
    return self.replace(step=self.step + 1, params=params,
                        opt_state=opt_state, **kwargs)


def create_train_state(model: nn.Module, image_shape: tuple[int, int, int],
                       optimizer: optax.GradientTransformation, seed: int,
                       mesh: jax.sharding.Mesh, fsdp_min_size: int = 1024,
                       ema: bool = False) -> TrainState:
  """Initialises parameters and optimizer state directly in place on `mesh`.

  Each device computes only its own slice (jit with out_shardings), so a
  model split by FSDP never exists whole on one device, not even at init.
  With `ema`, the state also holds a moving average of the params, started
  at the initial params.
  """

  def init(key):
    params_key, state_key = jax.random.split(key)
    dummy = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
    params = model.init({"params": prng.flat_draws(params_key)}, dummy,
                        train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params,
                             tx=optimizer, rng=state_key,
                             ema_params=params if ema else None)

  key = jax.random.PRNGKey(seed)
  shardings = sharding.state_shardings(mesh, jax.eval_shape(init, key),
                                       fsdp_min_size)
  return jax.jit(init, out_shardings=shardings)(key)


def shardings_of(tree):
  """The sharding of every array in `tree` (for jit's in/out_shardings)."""
  return jax.tree.map(lambda x: x.sharding, tree)


def soft_targets(labels: jax.Array, num_classes: int,
                 label_smoothing: float = 0.0) -> jax.Array:
  """int labels (B,) -> one-hot (B, K), smoothed if label_smoothing > 0."""
  targets = jax.nn.one_hot(labels, num_classes)
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  return targets


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  label_smoothing: float = 0.0) -> jax.Array:
  """Per-example softmax cross-entropy. logits (B, K), int labels (B,)."""
  return optax.softmax_cross_entropy(
      logits, soft_targets(labels, logits.shape[-1], label_smoothing))


def train_step(state: TrainState, images: jax.Array, labels: jax.Array, *,
               preprocess: Callable[[jax.Array, jax.Array], jax.Array],
               label_smoothing: float, learning_rate_fn: optax.Schedule,
               accum_steps: int = 1, skip_nonfinite: bool = False,
               mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
               ema_decay: float = 0.0, ema_start_step: int = 0,
               sam_rho: float = 0.0,
               global_norm: Callable[[Any], jax.Array] = optim.global_norm
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step on a uint8 batch (B, H, W, C) with int labels (B,).

  `preprocess(images, key)` augments and normalises on device; the targets
  are the smoothed one-hot labels, mixed with the images by Mixup/CutMix
  when an alpha is > 0 (accuracy is still against the original labels).
  With ema_decay > 0, state.ema_params follows the params with decay
  min(ema_decay, (1 + t) / (10 + t)), t = step - ema_start_step (a phase
  that changes the model, the unmasked tuning, restarts the ramp). With
  accum_steps > 1 the batch is processed as that many micro-batches (a scan:
  one micro-batch's activations live at a time) whose mean gradient makes
  the single update, equal to the whole batch's gradient. With
  skip_nonfinite, a step whose loss or gradient is NaN/Inf leaves params and
  optimizer state unchanged (the step counter still advances). With
  sam_rho > 0 (sharpness-aware minimisation, Foret et al. 2021) the update
  uses the gradient at params + sam_rho * g / |g|, g the batch's (or
  micro-batch's) gradient, on the same inputs and dropout: two forward and
  backward passes per step. Loss and accuracy are those at the params.
  global_norm(grads) is the gradients' norm (for the metrics and SAM):
  `optim.global_norm` with the config's sharding and implementation.
  """
  gradients = functools.partial(
      _gradients, state, preprocess=preprocess,
      label_smoothing=label_smoothing, mixup_alpha=mixup_alpha,
      cutmix_alpha=cutmix_alpha, sam_rho=sam_rho, global_norm=global_norm)
  step_key = jax.random.fold_in(prng.flat_draws(state.rng), state.step)
  if accum_steps == 1:
    grads, loss, accuracy = gradients(images, labels, step_key)
  else:
    grads, loss, accuracy = _mean_over_micro_batches(
        gradients, state.params, images, labels, step_key, accum_steps)
  # The scope names the update's kernels in profiles (cpu_profile.py).
  with jax.named_scope("optimizer"):
    grad_norm = global_norm(grads)
    new_state = state.apply_gradients(grads=grads)
    if ema_decay:
      new_state = new_state.replace(ema_params=_moving_average(
          state.ema_params, new_state.params, state.step - ema_start_step,
          ema_decay))
  metrics = {
      "loss": loss,
      "accuracy": accuracy,
      "learning_rate": learning_rate_fn(state.step),
      "grad_norm": grad_norm,
  }
  if skip_nonfinite:
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                             new_state, state).replace(step=state.step + 1)
  return new_state, metrics


def _gradients(state: TrainState, images: jax.Array, labels: jax.Array,
               key: jax.Array, *, preprocess, label_smoothing: float,
               mixup_alpha: float, cutmix_alpha: float, sam_rho: float,
               global_norm: Callable[[Any], jax.Array]
               ) -> tuple[Any, jax.Array, jax.Array]:
  """(gradient of the params, loss, accuracy) on one (micro-)batch, its
  augmentation, mixing and dropout drawn from `key`. With sam_rho, the
  gradient is taken again at the ascended params."""
  augment_key, mix_key, dropout_key = jax.random.split(key, 3)
  inputs = preprocess(images, augment_key)
  num_classes = state.params["head"]["bias"].shape[-1]
  targets = soft_targets(labels, num_classes, label_smoothing)
  inputs, targets = mixing.mix_batch(inputs, targets, mix_key,
                                     mixup_alpha=mixup_alpha,
                                     cutmix_alpha=cutmix_alpha)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, train=True,
                            rngs={"dropout": dropout_key})
    return optax.softmax_cross_entropy(logits, targets).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params)
  if sam_rho:
    # The global norm: under jit the gradient is already the whole
    # (micro-)batch's, so every device climbs to the same point.
    scale = sam_rho / (global_norm(grads) + 1e-12)
    ascended = jax.tree.map(lambda p, g: p + scale * g, state.params, grads)
    grads, _ = jax.grad(loss_fn, has_aux=True)(ascended)
  return grads, loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def _mean_over_micro_batches(gradients: Callable, params: Any,
                             images: jax.Array, labels: jax.Array,
                             key: jax.Array, accum_steps: int
                             ) -> tuple[Any, jax.Array, jax.Array]:
  """The mean of `gradients(images, labels, key)` over accum_steps
  micro-batches, in a scan: one micro-batch's activations live at a time.
  Micro-batch m takes rows m, m + accum_steps, ...: each device's rows
  stay on that device, so the split needs no communication."""
  def split(x):
    x = x.reshape((x.shape[0] // accum_steps, accum_steps) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)

  def accumulate(totals, micro_batch):
    images, labels, index = micro_batch
    results = gradients(images, labels, jax.random.fold_in(key, index))
    return jax.tree.map(jnp.add, totals, results), None

  zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()))
  totals, _ = jax.lax.scan(accumulate, zeros, (
      split(images), split(labels), jnp.arange(accum_steps)))
  return jax.tree.map(lambda x: x / accum_steps, totals)


def _moving_average(average: Any, params: Any, step: jax.Array,
                    ema_decay: float) -> Any:
  """The EMA after `step` steps of its ramp: decay min(ema_decay,
  (1 + step) / (10 + step)), so that early params weigh less."""
  step = step.astype(jnp.float32)
  decay = jnp.minimum(ema_decay, (1.0 + step) / (10.0 + step))
  return jax.tree.map(
      lambda average, new: decay * average + (1.0 - decay) * new,
      average, params)


def train_steps(state: TrainState, images: tuple[jax.Array, ...],
                labels: tuple[jax.Array, ...], **step_options
                ) -> tuple[TrainState, dict[str, jax.Array]]:
  """`train_step` on each of len(images) batches in turn, in one program.

  images: that many uint8 batches (B, H, W, C); labels: their (B,) labels.
  Returns the state after the last step and each metric stacked over the
  steps, shape (len(images),). A scan: the program is one step's, looped on
  the device, so k steps cost one dispatch from the host instead of k (the
  host's per-step work, flattening and sending a state of hundreds of
  arrays, sets the pace of small models on a GPU). Each step is the one
  `train_step` takes, with its own RNG key (fold_in of state.step).
  """
  def one_step(state, batch):
    return train_step(state, *batch, **step_options)
  return jax.lax.scan(one_step, state, (jnp.stack(images), jnp.stack(labels)))


def eval_step(params: Any, images: jax.Array, labels: jax.Array,
              mask: jax.Array, *, apply_fn: Callable[..., jax.Array],
              preprocess: Callable[[jax.Array], jax.Array],
              flip_average: bool = False) -> dict[str, jax.Array]:
  """Sums of loss and correct predictions over the real (mask=1) examples.

  Takes the params alone, not the train state: evaluating the moving
  average, or a state whose optimizer was rebuilt (a time budget's new
  schedule), then reuses the one compilation.
  apply_fn: the model's `apply`. flip_average: classify by the mean logits
  of each image and its mirror.
  """
  logits_fn = lambda inputs: apply_fn({"params": params}, inputs, train=False)
  inputs = preprocess(images)
  logits = (augment.mirror_averaged(logits_fn, inputs) if flip_average
            else logits_fn(inputs))
  correct = jnp.argmax(logits, -1) == labels
  return {"loss_sum": jnp.sum(cross_entropy(logits, labels) * mask),
          "correct": jnp.sum(correct * mask),
          "count": jnp.sum(mask)}


def compile_train_step(mesh: jax.sharding.Mesh, state_sharding,
                       learning_rate_fn: optax.Schedule,
                       compiler_options: Optional[dict] = None,
                       **step_options):
  """`train_step` jitted with shardings declared: state_sharding is the
  train state's layout (`shardings_of(state)`), which the new state keeps;
  batches are split over every device; metrics come back replicated; the
  state is donated. compiler_options: XLA's per-program options
  (`xla_products.xla_compiler_options` of the model's matmul_dtype).
  step_options: `train_step`'s keyword arguments
  (`config.train_step_options` makes them from a config)."""
  batch = sharding.batch_sharded(mesh)
  return jax.jit(
      functools.partial(train_step, learning_rate_fn=learning_rate_fn,
                        **step_options),
      in_shardings=(state_sharding, batch, batch),
      out_shardings=(state_sharding, sharding.replicated(mesh)),
      donate_argnums=0, compiler_options=compiler_options)


def compile_train_steps(mesh: jax.sharding.Mesh, state_sharding,
                        learning_rate_fn: optax.Schedule, num_steps: int,
                        compiler_options: Optional[dict] = None,
                        **step_options):
  """`train_steps` over `num_steps` batches, jitted as `compile_train_step`
  jits one: fn(state, images, labels) with images and labels tuples of
  num_steps global batches (each split over every device, as the data
  pipelines place them), metrics stacked over the steps."""
  batch = sharding.batch_sharded(mesh)
  batches = (batch,) * num_steps
  return jax.jit(
      functools.partial(train_steps, learning_rate_fn=learning_rate_fn,
                        **step_options),
      in_shardings=(state_sharding, batches, batches),
      out_shardings=(state_sharding, sharding.replicated(mesh)),
      donate_argnums=0, compiler_options=compiler_options)


def compile_eval_step(mesh: jax.sharding.Mesh, params_sharding,
                      compiler_options: Optional[dict] = None,
                      **eval_options):
  """`eval_step` jitted with shardings declared: eval_fn(params, images,
  labels, mask), params laid out as `params_sharding`
  (`shardings_of(params)`). eval_options: `eval_step`'s keyword arguments
  (`config.eval_step_options` makes them from a config)."""
  batch = sharding.batch_sharded(mesh)
  return jax.jit(functools.partial(eval_step, **eval_options),
                 in_shardings=(params_sharding, batch, batch, batch),
                 out_shardings=sharding.replicated(mesh),
                 compiler_options=compiler_options)


def evaluate(eval_fn, params: Any, dataset: datasets.Dataset,
             batch_size: int, mesh: jax.sharding.Mesh) -> dict[str, float]:
  """Loss and accuracy of `params` over every test example, each counted
  once."""
  totals = None
  for images, labels, mask in dataset.eval_batches(batch_size, mesh):
    sums = eval_fn(params, images, labels, mask)
    if totals is not None:
      jax.block_until_ready(totals)  # bounded queue, as in loop.py's loop
    # Summed on device: one host transfer per evaluation, not per batch.
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  count = float(totals["count"])
  return {"loss": float(totals["loss_sum"]) / count,
          "accuracy": float(totals["correct"]) / count,
          "num_examples": count}
