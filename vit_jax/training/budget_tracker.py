"""The time budget's state during a run: measurements in, plans out.

`BudgetTracker` holds what the run that makes the plan has measured (the
steps before the plan, then the steps in windows between evaluations, and
the evaluations) and turns it into a plan (`make_plan`) or a revised plan
(`revise`), by the rules of `budget.py`. It runs nothing itself: the loop
passes the measurements in and follows the plan it gets back.
"""

import time
from typing import Optional

import jax
import ml_collections
import numpy as np

from vit_jax.training import budget, progress


def _plan_step(start_step: int, steps_per_dispatch: int) -> int:
  """The step after which a run from start_step makes its plan: at a
  dispatch's end (a multiple of steps_per_dispatch), once MEASURED_STEPS
  steps follow the first (which compiles) and enough dispatches for the
  median interval to be the steps' pace: the first MAX_STEPS_IN_FLIGHT
  after the compiling one return at once, filling the device's queue."""
  round_up = lambda step: -(-step // steps_per_dispatch) * steps_per_dispatch
  timed_dispatches = 2 * progress.MAX_STEPS_IN_FLIGHT + 2
  return max(round_up(start_step + 1 + budget.MEASURED_STEPS),
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
                measured: budget.Measurements) -> dict:
    """The plan (saved and logged) from the steps so far and `measured`;
    elapsed_seconds: the run's time before `measured` was taken."""
    self.plan = budget.plan(
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
    if done - mark_step < budget.MEASURED_STEPS:
      return None  # too few steps to time; the next evaluation checks
    self._windows.append((train_end - mark_time - (paused - mark_paused),
                          done - mark_step))
    self._mark = None  # timed again from the next step
    revised = budget.revise(
        self._config, self._workdir, self.plan, done=done,
        step_seconds=budget.recent_step_seconds(self._windows),
        eval_seconds=float(np.mean(self._eval_seconds)),
        recompile_seconds=self.first_step_seconds,
        elapsed_seconds=elapsed_seconds,
        steps_per_epoch=self._steps_per_epoch, upper_bound=self._upper_bound)
    return self.plan if revised else None
