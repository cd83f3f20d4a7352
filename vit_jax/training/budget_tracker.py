"""The time budget during a run: measurements in, plans out.

`BudgetTracker` holds what the run that makes the plan has measured (the
steps before the plan, then the steps in windows between evaluations, and
the evaluations) and turns it into a plan (`make_plan`) or a revised plan
(`revise`), by the rules of `budget.py`. It runs nothing itself: the loop
passes the measurements in and follows the plan it gets back.

`budget.py` is the arithmetic (pure functions of numbers); this module is
its edge: the plan agreed across processes (process 0's), written to
workdir/time_plan.json (`first_plan`, `revise_plan`, `read_plan`) and
logged.
"""

import json
import os
import time
from typing import NamedTuple, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from vit_jax.training import budget, metric_writer, optim, progress

# Steps timed after the first (compiling) one, before the plan is made.
MEASURED_STEPS = 20
# Steps of the unmasked tuning timed after its compiling one, for the plan.
MEASURED_TUNING_STEPS = 5


class Measurements(NamedTuple):
  """What the trainer measures, once, for a plan (seconds)."""
  eval_compile: float  # compiling the eval step
  evaluation: float  # one evaluation, as training runs them
  save: float  # one checkpoint save, written through
  tuning_compile: float = 0.0  # the unmasked tuning's step: compiling it
  tuning_step: float = 0.0  # and one of its steps


def _plan_step(start_step: int, steps_per_dispatch: int) -> int:
  """The step after which a run from start_step makes its plan: at a
  dispatch's end (a multiple of steps_per_dispatch), once MEASURED_STEPS
  steps follow the first (which compiles) and enough dispatches for the
  median interval to be the steps' pace: the first MAX_STEPS_IN_FLIGHT
  after the compiling one return at once, filling the device's queue."""
  round_up = lambda step: -(-step // steps_per_dispatch) * steps_per_dispatch
  timed_dispatches = 2 * progress.MAX_STEPS_IN_FLIGHT + 2
  return max(round_up(start_step + 1 + MEASURED_STEPS),
             round_up(start_step) + (1 + timed_dispatches) * steps_per_dispatch)


class BudgetTracker:
  """The plan of a run with config.time_budget_minutes, and its timings.

  A run that starts without a plan (a fresh run, or one resumed without a
  plan file) makes one after MEASURED_STEPS steps and then checks it after
  each evaluation; a run that resumes with a plan follows it unchecked.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
               plan: Optional[dict], start_step: int, steps_per_epoch: int,
               upper_bound: int):
    self._config = config
    self._workdir = workdir
    self._steps_per_epoch = steps_per_epoch
    self._upper_bound = upper_bound
    self.plan = plan
    # The step after which to make a plan; None: no plan to make or check.
    self.plan_after = (
        _plan_step(start_step, config.steps_per_dispatch)
        if config.time_budget_minutes and plan is None else None)
    # (time, step) at which the dispatches before the plan returned.
    self._step_ends: list[tuple[float, int]] = []
    self.first_step_seconds: Optional[float] = None  # compile + first step
    # After a plan or a check the steps are timed from (time, step, paused
    # seconds) at the first step that follows, so that a recompilation
    # does not count; the windows so far are (seconds, steps).
    self._mark: Optional[tuple[float, int, float]] = None
    self._windows: list[tuple[float, int]] = []
    self._eval_seconds: list[float] = []

  def step_done(self, done: int, total_steps: int, metrics, paused: float
                ) -> bool:
    """Records that the steps up to `done` were dispatched (their metrics
    still on device); True when the plan is due now."""
    if self.plan_after is None:
      return False
    if done <= self.plan_after:
      self._step_ends.append((time.perf_counter(), done))
      return done == self.plan_after and done < total_steps
    if self._mark is None and done < total_steps:
      jax.block_until_ready(metrics)  # time from this step's end
      self._mark = (time.perf_counter(), done, paused)
    return False

  def make_plan(self, done: int, elapsed_seconds: float,
                measured: Measurements) -> dict:
    """The plan (saved and logged) from the steps so far and `measured`;
    elapsed_seconds: the run's time before `measured` was taken."""
    self.plan = first_plan(
        self._config, self._workdir, done=done, step_ends=self._step_ends,
        first_step_seconds=self.first_step_seconds,
        elapsed_seconds=elapsed_seconds, measured=measured,
        steps_per_epoch=self._steps_per_epoch, upper_bound=self._upper_bound)
    self._mark = None
    return self.plan

  def evaluated(self, seconds: float) -> None:
    self._eval_seconds.append(seconds)

  def due_for_check(self) -> bool:
    """Whether an evaluation now may revise the plan (the steps since the
    plan or the last check are being timed)."""
    return self.plan_after is not None and self._mark is not None

  def revise(self, done: int, train_end: float, paused: float,
             elapsed_seconds: float) -> Optional[dict]:
    """Checks the plan after the evaluation of step `done`, timing the
    steps from the mark to `train_end` (paused: the pauses until then).
    Returns the revised plan (saved and logged), or None if it stands."""
    mark_time, mark_step, mark_paused = self._mark
    if done - mark_step < MEASURED_STEPS:
      return None  # too few steps to time; the next evaluation checks
    self._windows.append((train_end - mark_time - (paused - mark_paused),
                          done - mark_step))
    self._mark = None  # timed again from the next step
    revised = revise_plan(
        self._config, self._workdir, self.plan, done=done,
        step_seconds=budget.recent_step_seconds(self._windows),
        eval_seconds=float(np.mean(self._eval_seconds)),
        recompile_seconds=self.first_step_seconds,
        elapsed_seconds=elapsed_seconds,
        steps_per_epoch=self._steps_per_epoch, upper_bound=self._upper_bound)
    return self.plan if revised else None


def first_plan(config: ml_collections.ConfigDict, workdir: str, *,
               done: int, step_ends: list[tuple[float, int]],
               first_step_seconds: float, elapsed_seconds: float,
               measured: Measurements, steps_per_epoch: int,
               upper_bound: int) -> dict:
  """Plans, saves and logs the number of steps that fit the budget; returns
  the plan (its "total_steps" is the number of steps).

  step_ends: (time, step) at which the dispatches since the first one
  returned (a dispatch runs config.steps_per_dispatch steps, or one); the
  median of their intervals per step is the step time, so an evaluation or
  a save between two dispatches does not count. first_step_seconds:
  compilation and first step, paid again for the new schedule (the train
  step only: the eval step takes params, not the optimizer).
  elapsed_seconds: the run's time before `measured` was measured. Every
  process trains to process 0's plan. With an unmasked tuning
  (config.unmasked_tuning_epochs), its steps, a fixed number at the end,
  cost measured.tuning_compile + steps x measured.tuning_step: the plan
  fits the masked steps in the time they leave.
  """
  times, steps = np.transpose(step_ends)
  step_seconds = float(np.median(np.diff(times) / np.diff(steps)))
  eval_compile_seconds, eval_seconds = (measured.eval_compile,
                                        measured.evaluation)
  save_seconds = measured.save
  tuning_steps = optim.unmasked_tuning_steps(config, steps_per_epoch)
  tuning_compile_seconds, tuning_step_seconds = (
      (measured.tuning_compile, measured.tuning_step) if tuning_steps
      else (0.0, 0.0))
  tuning_seconds = tuning_compile_seconds + tuning_steps * tuning_step_seconds
  planned = budget.plan_total_steps(
      budget_seconds=60 * config.time_budget_minutes,
      elapsed_seconds=(elapsed_seconds + eval_compile_seconds + eval_seconds
                       + save_seconds + tuning_compile_seconds
                       + MEASURED_TUNING_STEPS * tuning_step_seconds),
      done=done, step_seconds=step_seconds,
      fixed_seconds=first_step_seconds,  # the eval step is not recompiled
      eval_seconds=eval_seconds,
      eval_every_steps=steps_per_epoch * config.eval_every_epochs,
      save_seconds=save_seconds,
      save_every_steps=config.checkpoint_every_steps,
      tuning_steps=tuning_steps, tuning_seconds=tuning_seconds,
      upper_bound=upper_bound, steps_per_dispatch=config.steps_per_dispatch)
  planned = int(multihost_utils.broadcast_one_to_all(np.int32(planned)))
  the_plan = dict(
      total_steps=planned, epochs=round(planned / steps_per_epoch, 3),
      time_budget_minutes=config.time_budget_minutes, planned_at_step=done,
      step_seconds=round(step_seconds, 5),
      eval_seconds=round(eval_seconds, 3),
      save_seconds=round(save_seconds, 3),
      unmasked_tuning_steps=tuning_steps,
      unmasked_tuning_seconds=round(tuning_seconds, 3),
      first_total_steps=planned, revisions=[])
  if jax.process_index() == 0:
    write_plan(workdir, the_plan)
  tuning = (f", the last {tuning_steps} on every patch "
            f"({tuning_step_seconds * 1e3:.1f} ms per step, "
            f"{tuning_compile_seconds:.1f} s to compile)"
            if tuning_steps else "")
  metric_writer.log(
      f"Time budget of {config.time_budget_minutes:g} minutes: "
      f"{step_seconds * 1e3:.1f} ms per step, {eval_seconds:.1f} s per "
      f"evaluation, {save_seconds:.1f} s per checkpoint; training to step "
      f"{planned} ({planned / steps_per_epoch:.2f} epochs){tuning}.")
  return the_plan


def revise_plan(config: ml_collections.ConfigDict, workdir: str, plan: dict,
                *, done: int, step_seconds: float, eval_seconds: float,
                recompile_seconds: float, elapsed_seconds: float,
                steps_per_epoch: int, upper_bound: int) -> bool:
  """Checks `plan` (as `first_plan` returned it) at step `done`
  (budget.revised_total_steps). If it is revised (to process 0's revision, on
  every process), records the revision in `plan` and its file, logs it and
  returns True. The unmasked tuning's steps, if any, end every revised run
  as they end the plan; a revision changes the masked steps before them.
  """
  total = plan["total_steps"]
  tuning_steps = plan.get("unmasked_tuning_steps", 0)
  revised = -1
  if jax.process_index() == 0:
    revised = budget.revised_total_steps(
        total=total, recompile_seconds=recompile_seconds,
        budget_seconds=60 * config.time_budget_minutes,
        elapsed_seconds=elapsed_seconds, done=done,
        step_seconds=step_seconds, eval_seconds=eval_seconds,
        eval_every_steps=steps_per_epoch * config.eval_every_epochs,
        save_seconds=plan["save_seconds"],
        save_every_steps=config.checkpoint_every_steps,
        tuning_steps=tuning_steps,
        tuning_seconds=plan.get("unmasked_tuning_seconds", 0.0),
        upper_bound=upper_bound, steps_per_dispatch=config.steps_per_dispatch)
    revised = -1 if revised is None else revised
  revised = int(multihost_utils.broadcast_one_to_all(np.int32(revised)))
  if revised < 0:
    return False
  plan["revisions"].append([done, revised])
  plan.update(total_steps=revised, epochs=round(revised / steps_per_epoch, 3))
  if jax.process_index() == 0:
    write_plan(workdir, plan)
  measured = (f"Time budget of {config.time_budget_minutes:g} minutes: at "
              f"step {done}, {step_seconds * 1e3:.1f} ms per step (recent "
              f"windows weighing more) and {eval_seconds:.1f} s per "
              "evaluation since the plan; ")
  if revised == done + tuning_steps:
    ending = ("the masked steps here, the unmasked tuning next,"
              if tuning_steps else "the run here")
    metric_writer.log(
        measured + f"ending {ending} instead of at step {total}: the "
        "steps that still fit would take less time than the recompilation "
        "and the final evaluation they need.")
  else:
    metric_writer.log(
        measured + f"training to step {revised} "
        f"({revised / steps_per_epoch:.2f} epochs) instead of {total}, the "
        "rest of the schedule warped to end there.")
  return True


def read_plan(workdir: str) -> Optional[dict]:
  """The plan saved in `workdir`, or None."""
  path = os.path.join(workdir, budget.PLAN_FILE)
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
  path = os.path.join(workdir, budget.PLAN_FILE)
  temporary = path + ".tmp"
  with open(temporary, "w") as f:
    json.dump(plan, f, indent=1)
  os.replace(temporary, path)
