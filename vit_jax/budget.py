"""Training to a wall-time budget (`config.time_budget_minutes`).

A fixed number of epochs takes twice as long on a machine half as fast, so
a config meant for "15 minutes" either overruns or leaves time unused. With
a budget, the trainer runs its first steps on the schedule of the upper
bound (`num_epochs` or `num_train_steps`), measures a step, an evaluation
and a checkpoint save, then fixes the number of steps that fit: the
learning-rate schedule is rebuilt for it (one more compile) and training
goes on. The first steps are warm-up steps, which do not depend on the
schedule's length as long as the warm-up lasts longer than the measurement,
so the run is then the one that would have been configured with that many
steps from the start.

The plan is written to `workdir/time_plan.json` before training goes on; a
resumed run reads it and trains to the same step, whatever the speed of the
machine it resumes on. A run resumed without a plan makes one from the step
it resumes at. The budget counts from the call of `train_and_evaluate`
(data loading and compilation included, Python's start-up not).
"""

import json
import os
from typing import Callable, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from vit_jax import metric_writer

PLAN_FILE = "time_plan.json"
# Steps timed after the first (compiling) one, before the plan is made.
MEASURED_STEPS = 20
# Planned to end this fraction of the budget early: the speed of a step
# drifts within a run, and the steady step can be slower than the measured
# ones (ViT-Micro/4 on Fashion-MNIST, 2 CPU cores: 6-12% in three runs,
# which overran a 3% margin by up to 0.4 minutes in 15).
SAFETY_FRACTION = 0.08


def events_between(done: int, total: int, every_steps: int) -> int:
  """How often an event of the trainer's (an evaluation, a checkpoint) runs
  after step `done` up to step `total`: at every multiple of every_steps,
  and at the last step."""
  count = total // every_steps - done // every_steps
  return count + (total % every_steps != 0)


def plan_total_steps(*, budget_seconds: float, elapsed_seconds: float,
                     done: int, step_seconds: float, fixed_seconds: float,
                     eval_seconds: float, eval_every_steps: int,
                     save_seconds: float, save_every_steps: int,
                     upper_bound: int) -> int:
  """The largest step count N (done < N <= upper_bound) whose predicted
  wall time fits the budget less SAFETY_FRACTION; done + 1 if none does.

  Predicted: elapsed_seconds + fixed_seconds (e.g. the recompilation) +
  (N - done) * step_seconds + the evaluations and checkpoint saves up to N.
  """
  available = budget_seconds * (1.0 - SAFETY_FRACTION)

  def predicted(total: int) -> float:
    return (elapsed_seconds + fixed_seconds + (total - done) * step_seconds
            + events_between(done, total, eval_every_steps) * eval_seconds
            + events_between(done, total, save_every_steps) * save_seconds)

  # predicted() grows with N, so bisect for the last N that fits.
  low, high = done + 1, max(upper_bound, done + 1)
  if predicted(low) > available:
    return low
  while low < high:
    middle = (low + high + 1) // 2
    if predicted(middle) <= available:
      low = middle
    else:
      high = middle - 1
  return low


def plan(config: ml_collections.ConfigDict, workdir: str, *, done: int,
         step_ends: list[float], first_step_seconds: float,
         elapsed_seconds: float,
         time_evaluation: Callable[[], tuple[float, float]],
         time_save: Callable[[], float], steps_per_epoch: int,
         upper_bound: int) -> int:
  """Plans, saves and logs the number of steps that fit the budget.

  step_ends: the times at which the steps since the first one returned;
  their median interval is the step time, so an evaluation or a save
  between two steps does not count. first_step_seconds: compilation and
  first step, paid again for the new schedule. time_evaluation() -> (eval
  step compilation, one evaluation) and time_save() -> one checkpoint
  save, in seconds, each run once. Every process trains to process 0's
  plan.
  """
  step_seconds = float(np.median(np.diff(step_ends)))
  eval_compile_seconds, eval_seconds = time_evaluation()
  save_seconds = time_save()
  planned = plan_total_steps(
      budget_seconds=60 * config.time_budget_minutes,
      elapsed_seconds=(elapsed_seconds + eval_compile_seconds + eval_seconds
                       + save_seconds),
      done=done, step_seconds=step_seconds,
      fixed_seconds=first_step_seconds + eval_compile_seconds,
      eval_seconds=eval_seconds,
      eval_every_steps=steps_per_epoch * config.eval_every_epochs,
      save_seconds=save_seconds,
      save_every_steps=config.checkpoint_every_steps,
      upper_bound=upper_bound)
  planned = int(multihost_utils.broadcast_one_to_all(np.int32(planned)))
  if jax.process_index() == 0:
    write_plan(workdir, dict(
        total_steps=planned, epochs=round(planned / steps_per_epoch, 3),
        time_budget_minutes=config.time_budget_minutes, planned_at_step=done,
        step_seconds=round(step_seconds, 5),
        eval_seconds=round(eval_seconds, 3),
        save_seconds=round(save_seconds, 3)))
  metric_writer.log(
      f"Time budget of {config.time_budget_minutes:g} minutes: "
      f"{step_seconds * 1e3:.1f} ms per step, {eval_seconds:.1f} s per "
      f"evaluation, {save_seconds:.1f} s per checkpoint; training to step "
      f"{planned} ({planned / steps_per_epoch:.2f} epochs).")
  return planned


def read_plan(workdir: str) -> Optional[dict]:
  """The plan saved in `workdir`, or None."""
  path = os.path.join(workdir, PLAN_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      plan = json.load(f)
    int(plan["total_steps"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(
        f"{path} is damaged ({type(e).__name__}: {e}). Delete it to plan the "
        "time budget again from the step training resumes at.") from e
  return plan


def write_plan(workdir: str, plan: dict) -> None:
  """Writes `plan` to workdir/time_plan.json atomically."""
  path = os.path.join(workdir, PLAN_FILE)
  temporary = path + ".tmp"
  with open(temporary, "w") as f:
    json.dump(plan, f, indent=1)
  os.replace(temporary, path)
