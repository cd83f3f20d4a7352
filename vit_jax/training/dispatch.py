"""How train steps go to the device: one at a time, or several in one
dispatch (config.steps_per_dispatch).

A `Phase` is the train step being run (masked, then the unmasked tuning),
jitted for one step and for a dispatch of k steps (`steps.train_steps`, a
loop on the device); `steps_in_dispatch` says how many the loop runs next:
k where the loop does nothing between them (no log line, evaluation, save,
plan or change of phase), one elsewhere.
"""

import dataclasses
from typing import Any, Callable, Optional

import ml_collections

from vit_jax import config as config_lib
from vit_jax.training import budget, steps


@dataclasses.dataclass
class Phase:
  """The train step being run: jitted for one step (`train_fn`) and, with
  config.steps_per_dispatch = k > 1, for k steps in one dispatch
  (`multi_step_fn`); whether it is the unmasked tuning (every patch, after a
  run with patch dropout). Each compiles on its first call."""
  train_fn: Callable[..., Any]
  multi_step_fn: Optional[Callable[..., Any]] = None
  unmasked: bool = False
  compiled: set[int] = dataclasses.field(default_factory=set)

  def run(self, state: steps.TrainState, batches: list[tuple]):
    """(state, metrics, whether this call compiled): the steps of
    `batches`, a list of (images, labels); metrics are stacked over the
    steps when there are several."""
    count = len(batches)
    compiling = count not in self.compiled
    self.compiled.add(count)
    if count == 1:
      return (*self.train_fn(state, *batches[0]), compiling)
    images, labels = zip(*batches)
    return (*self.multi_step_fn(state, images, labels), compiling)


def steps_in_dispatch(step: int, total_steps: int, steps_per_dispatch: int,
                      acts_after: Callable[[int], bool]) -> int:
  """How many steps the loop runs from `step` in one dispatch.

  steps_per_dispatch when `step` is a multiple of it and the loop does not
  act (log, evaluate, save, plan, begin the unmasked tuning: `acts_after`)
  inside the dispatch, after any of the steps but its last; else 1. Being
  a function of the step alone, it dispatches a resumed run's steps as the
  uninterrupted run did: a run stops only between dispatches, so it resumes
  at a multiple of steps_per_dispatch or amid single steps.
  """
  count = steps_per_dispatch
  if (count == 1 or step % count or step + count > total_steps
      or any(acts_after(done) for done in range(step + 1, step + count))):
    return 1
  return count


def loop_acts_after(config: ml_collections.ConfigDict,
                    spec: config_lib.RunSpec, phase: Phase, total_steps: int,
                    plan_after: Optional[int]) -> Callable[[int], bool]:
  """Whether the training loop acts after step `done`: logs, saves,
  evaluates, begins the unmasked tuning or makes its time plan (after step
  plan_after). Stop signals are heeded between dispatches, and with
  several processes at log steps, which this includes."""
  tuning_start = (total_steps - spec.tuning_steps
                  if spec.tuning_steps and not phase.unmasked else None)
  return lambda done: (
      done % config.log_every_steps == 0
      or done % config.checkpoint_every_steps == 0
      or budget.evaluates_after(done, total_steps, spec.eval_every_steps)
      or done in (tuning_start, plan_after))
