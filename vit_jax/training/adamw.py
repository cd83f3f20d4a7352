"""AdamW with `optax.adamw`'s state and values, quicker to trace and, on a
CPU, updated by one C++ kernel (`adamw`; `optim.make_optimizer` uses it)."""

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from vit_jax.kernels import cpu_adamw


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9,
          b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
          mask=None, implementation: str = "auto"
          ) -> optax.GradientTransformationExtraArgs:
  """`optax.adamw`, the same state and values, traced once per shape, or
  in one C++ kernel call on a CPU.

  Why: optax traces ~20 `jax.numpy` operations for every parameter, each a
  small jit of its own to trace and inline; for vit_tiny_cifar's 152
  parameter arrays that was most of the train step's tracing. Here one
  jitted function does a parameter's whole update (moments, bias
  correction, decay, learning rate), traced once for each shape and decay
  flag: tracing + lowering that step took 1.41-1.74 s with optax.adamw and
  0.97-1.08 s with this. The arithmetic is optax's, in its order
  (tests/training/test_train.py compares bit for bit); the state is
  optax.adamw's, so checkpoints restore with either.

  With implementation "auto" (or "cpu_kernel"), float32 parameters on a
  CPU are updated by `kernels.cpu_adamw` instead, a few leaves to a call
  (the same arithmetic up to the rounding of fused multiply-adds): XLA
  compiled the per-parameter updates 1.2-2.5 s slower on a 2-core AMD
  EPYC. "xla" keeps the per-parameter updates everywhere; "auto" does
  elsewhere. `grad_scale` (an extra argument of the update, which
  `optim.clip_by_global_norm_into` passes) multiplies the gradients first.

  learning_rate: a float or a schedule of the step count; weight_decay: a
  float; mask: a pytree of bools or a function of the params giving one
  (True: decayed); implementation: one of cpu_adamw.IMPLEMENTATIONS.
  """
  reference = optax.adamw(learning_rate, b1, b2, eps,
                          weight_decay=weight_decay, mask=mask)
  return optax.GradientTransformationExtraArgs(
      reference.init, AdamWUpdate(learning_rate, b1, b2, eps, weight_decay,
                                  mask, implementation))


def _leaf_update(grad, mu, nu, param, correction1, correction2, step_size,
                 *, b1, b2, eps, weight_decay, decayed):
  """One parameter's (update, mu, nu), in optax.adamw's order of operations;
  correction1 and correction2 are 1 - b1^t and 1 - b2^t."""
  mu = (1 - b1) * grad + b1 * mu
  nu = (1 - b2) * grad ** 2 + b2 * nu
  update = ((mu / correction1.astype(mu.dtype))
            / (jnp.sqrt(nu / correction2.astype(nu.dtype)) + eps))
  if decayed and weight_decay:
    update = update + weight_decay * param
  return jnp.asarray(step_size, grad.dtype) * update, mu, nu


def _is_masked(x) -> bool:
  """Under optax.multi_transform the parameters of other groups are
  MaskedNodes: no leaves, and no update of theirs here."""
  return isinstance(x, optax.MaskedNode)


@dataclasses.dataclass(frozen=True)
class AdamWUpdate:
  """`adamw`'s update function: (grads, state, params, grad_scale) ->
  (updates, state), the state optax.adamw's (ScaleByAdamState, the
  decay's, the schedule's count); its `apply` returns the params updated
  instead of the updates."""
  learning_rate: optax.ScalarOrSchedule
  b1: float
  b2: float
  eps: float
  weight_decay: float
  mask: Any
  implementation: str
  _jitted_leaf_update: Callable = dataclasses.field(
      init=False, repr=False, compare=False)

  def __post_init__(self):
    # One jitted function per optimizer, whose traces serve every parameter
    # of a shape and decay flag.
    object.__setattr__(self, "_jitted_leaf_update", jax.jit(
        functools.partial(_leaf_update, b1=self.b1, b2=self.b2, eps=self.eps,
                          weight_decay=self.weight_decay),
        static_argnames="decayed"))

  def __call__(self, grads, state, params=None, grad_scale=None):
    return self._update(grads, state, params, grad_scale, apply=False)

  def apply(self, grads, state, params, grad_scale=None):
    """(params with the updates added, state): `optim.apply_gradients`
    takes this where it can, so that the kernel adds each update in its
    own pass over the parameters (optax.apply_updates is another fusion
    per leaf)."""
    return self._update(grads, state, params, grad_scale, apply=True)

  def _update(self, grads, state, params, grad_scale, apply: bool):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    adam, decay_state, rate_state = state
    count = optax.safe_increment(adam.count)
    step_size, rate_state = self._step_size(rate_state)
    treedef = jax.tree.structure(params, is_leaf=_is_masked)
    flat = [treedef.flatten_up_to(tree)
            for tree in (grads, adam.mu, adam.nu, params)]
    decayed = self._decay_flags(params, treedef)
    corrections = 1 - self.b1 ** count, 1 - self.b2 ** count
    live = [i for i, param in enumerate(flat[3]) if not _is_masked(param)]
    by_kernel = cpu_adamw.resolve_implementation(
        self.implementation, [flat[3][i] for i in live]) == "cpu_kernel"
    if by_kernel:
      leaves = self._kernel_leaves(flat, live, decayed, corrections,
                                   step_size, grad_scale, apply)
    else:
      leaves = self._xla_leaves(flat, decayed, corrections, step_size,
                                grad_scale)
    updates, mu, nu = (treedef.unflatten(part) for part in zip(*leaves))
    if apply and not by_kernel:
      updates = optax.apply_updates(params, updates)
    adam = adam._replace(count=count, mu=mu, nu=nu)
    return updates, (adam, decay_state, rate_state)

  def _step_size(self, rate_state):
    """(-learning rate at this step, the schedule's state advanced)."""
    if not callable(self.learning_rate):
      return -1 * self.learning_rate, rate_state
    return (-1 * self.learning_rate(rate_state.count),
            rate_state._replace(count=optax.safe_increment(rate_state.count)))

  def _decay_flags(self, params, treedef) -> list:
    """Whether each leaf of params is decayed (the mask, or all)."""
    mask = self.mask(params) if callable(self.mask) else self.mask
    if mask is None:
      return [True] * treedef.num_leaves
    return treedef.flatten_up_to(mask)

  def _kernel_leaves(self, flat, live, decayed, corrections, step_size,
                     grad_scale, apply: bool) -> list:
    """(update, mu, nu) per leaf from the C++ kernel, or with `apply`
    (param + update, mu, nu); masked leaves keep their MaskedNodes."""
    leaves = [(param,) * 3 for param in flat[3]]
    results = cpu_adamw.update(
        *([part[i] for i in live] for part in flat),
        [bool(decayed[i]) and bool(self.weight_decay) for i in live],
        *corrections, step_size, 1.0 if grad_scale is None else grad_scale,
        b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay,
        apply=apply)
    for i, leaf in zip(live, zip(*results)):
      leaves[i] = leaf
    return leaves

  def _xla_leaves(self, flat, decayed, corrections, step_size,
                  grad_scale) -> list:
    """(update, mu, nu) per leaf, each from the jitted per-leaf update."""
    grads = flat[0]
    if grad_scale is not None:  # XLA fuses it into each leaf's update
      grads = [g if _is_masked(g) else g * jnp.asarray(grad_scale, g.dtype)
               for g in grads]
    update = self._jitted_leaf_update
    return [(param,) * 3 if _is_masked(param) else
            update(grad, mu, nu, param, *corrections, step_size,
                   decayed=bool(flag))
            for grad, mu, nu, param, flag in zip(grads, *flat[1:], decayed)]
