"""Which threads a C++ kernel call's tasks run on: helpers or XLA's own.

Where a CPU device has several cores (one image at a time), a kernel splits
a call into tasks (its `tasks` attribute). A short call's tasks go to
helper threads that spin for the next task before they sleep
(`csrc/helper_threads.h`; `$VIT_JAX_KERNEL_SPIN_US` microseconds, default
1000, 0 sleeps at once); a long call's, and every call of a train step, to
XLA's intra-op threads (`csrc/parallel_tasks.h`). `$VIT_JAX_KERNEL_HELPERS=0`
gives every call's tasks to XLA's threads.

Why not a train step's: a helper saves a call the ~30 us wake-up of a
sleeping thread, which made batch-1 inference 1.4-2x as fast on a Zen 5.
But a train step keeps XLA's threads busy with independent work of their
own (its backward pass), and a helper is a thread beyond them that competes
for the cores and is preempted mid-task: on a Zen 4 a batch-1 train step
ran 7-14% faster with all its calls on XLA's threads, where inference ran
6% slower so (docs/performance.md, *The Zen 4 again*).

The handlers that serve both (the products, the GELU, LayerNorm's forward
pass) take a `helpers` attribute, which their callers set from
`helpers_allowed()`: False while a function wrapped in `on_xla_threads` is
being traced, that is in the forward and backward rules of vit_jax's custom
VJPs, which are what a train step runs. The handlers that only training
calls (backward passes, the attention kernel's training forward pass,
AdamW, the gradients' sum of squares) never take helpers.
"""

import contextvars
import functools
from typing import Callable, TypeVar

_IN_TRAINING_RULE = contextvars.ContextVar("vit_jax_in_training_rule",
                                           default=False)

Rule = TypeVar("Rule", bound=Callable)


def helpers_allowed() -> bool:
  """Whether a kernel call bound now may put its tasks on helper threads:
  not inside a function wrapped in `on_xla_threads` (read at trace time,
  so it is part of the traced program)."""
  return not _IN_TRAINING_RULE.get()


def on_xla_threads(rule: Rule) -> Rule:
  """`rule` (a custom VJP's forward or backward rule), whose kernel calls
  put their tasks on XLA's threads, never on helpers."""
  @functools.wraps(rule)
  def wrapped(*args, **kwargs):
    token = _IN_TRAINING_RULE.set(True)
    try:
      return rule(*args, **kwargs)
    finally:
      _IN_TRAINING_RULE.reset(token)
  return wrapped  # type: ignore[return-value]
