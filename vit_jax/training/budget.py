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

The speed of a shared machine drifts: on this project's 2-core VMs the same
run's steps went 10-20% slower or faster within minutes, and sometimes
stayed 40% faster for the last third of a run. So after each evaluation the
run that made the plan checks it against its step time and mean evaluation
since the plan, and revises the step count if it would overrun the budget,
or if lengthening it pays for the recompilation. The step time is timed in
windows between checks, each weighing half as much as the next
(`recent_step_seconds`): a lasting change of speed is followed within a
window or two, and one noisy window moves the forecast by only half.
A revision time-warps the rest of the learning-rate schedule
(`warped_schedule`) rather than rebuilding it: the schedule goes on from
where it is, without a jump, and ends at the new step count. Revisions
are kept in the plan, so a resumed run rebuilds the same schedule.

This module is the arithmetic of it, pure functions of numbers;
`budget_tracker.py` measures, writes and logs the plans.
"""

from typing import Optional

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vit_jax.training import optim

PLAN_FILE = "time_plan.json"
# Planned to end this fraction of the budget early. Revisions correct the
# plan at each evaluation, so the margin covers the drift of the machine's
# speed after the last one: a 15% slowdown over the last fifth of the run.
SAFETY_FRACTION = 0.03


def evaluates_after(done: int, total: int, every_steps: int) -> bool:
  """Whether the trainer evaluates after step `done` of a run to `total`:
  at the last step, and at each multiple of every_steps (eval_every_epochs
  in steps) at least evaluation_gap(every_steps) steps before it; a closer
  one would cost an evaluation to measure nearly the last step's params."""
  return done == total or (done % every_steps == 0 and
                           total - done >= evaluation_gap(every_steps))


def evaluation_gap(every_steps: int) -> int:
  """The fewest steps between an interval's evaluation and the last one."""
  return max(every_steps // 2, 1)


def events_between(done: int, total: int, every_steps: int,
                   min_gap: int = 1) -> int:
  """How often an event of the trainer's (an evaluation, a checkpoint) runs
  after step `done` up to step `total`: at the last step, and at each
  multiple of every_steps at least min_gap steps before it (checkpoints:
  1; evaluations: evaluation_gap, as evaluates_after)."""
  if total <= done:
    return 0
  return max(0, (total - min_gap) // every_steps - done // every_steps) + 1


def recent_step_seconds(windows: list[tuple[float, int]]) -> float:
  """Seconds per step forecast from timed windows [(seconds, steps), ...],
  oldest first: their steps' mean with each window weighing half as much as
  the one after it."""
  weights = 0.5 ** np.arange(len(windows))[::-1]
  seconds, steps = np.asarray(windows, np.float64).T
  return float(np.sum(weights * seconds) / np.sum(weights * steps))


def predicted_seconds(total: int, *, elapsed_seconds: float, done: int,
                      step_seconds: float, fixed_seconds: float,
                      eval_seconds: float, eval_every_steps: int,
                      save_seconds: float, save_every_steps: int,
                      tuning_steps: int = 0, tuning_seconds: float = 0.0
                      ) -> float:
  """When a run that is at step `done` after elapsed_seconds ends if trained
  to step `total`: after fixed_seconds (e.g. a recompilation), the steps,
  and the evaluations and checkpoint saves up to `total`. The last
  tuning_steps (an unmasked tuning, not begun) take tuning_seconds in all,
  their compilation included, instead of step_seconds each."""
  return (elapsed_seconds + fixed_seconds + tuning_seconds
          + (total - done - tuning_steps) * step_seconds
          + events_between(done, total, eval_every_steps,
                           evaluation_gap(eval_every_steps)) * eval_seconds
          + events_between(done, total, save_every_steps) * save_seconds)


def plan_total_steps(*, budget_seconds: float, upper_bound: int,
                     steps_per_dispatch: int = 1, **measured) -> int:
  """The largest step count N (done + tuning_steps < N <= upper_bound)
  whose predicted_seconds(N, **measured) fits the budget less
  SAFETY_FRACTION; done + tuning_steps + 1 if none does. Where one fits,
  N - tuning_steps is made a multiple of steps_per_dispatch if that leaves
  N in range, so that the masked steps end with a whole dispatch and the
  run needs no single step compiled for its end
  (dispatch.steps_in_dispatch).
  """
  available = budget_seconds * (1.0 - SAFETY_FRACTION)
  fits = lambda total: predicted_seconds(total, **measured) <= available
  # The prediction grows with N, so bisect for the last N that fits.
  low = measured["done"] + measured.get("tuning_steps", 0) + 1
  high = max(upper_bound, low)
  if not fits(low):
    return low
  least = low
  while low < high:
    middle = (low + high + 1) // 2
    if fits(middle):
      low = middle
    else:
      high = middle - 1
  aligned = low - (low - measured.get("tuning_steps", 0)) % steps_per_dispatch
  return aligned if aligned >= least else low


def revised_total_steps(*, total: int, recompile_seconds: float,
                        budget_seconds: float, upper_bound: int,
                        steps_per_dispatch: int = 1,
                        **measured) -> Optional[int]:
  """A new step count for a run planned to `total`, or None to keep it.

  Called after the evaluation of step `done`. measured: the keywords of
  predicted_seconds but fixed_seconds, measured now (step_seconds: the
  forecast of recent_step_seconds). Revised when the run as planned would end
  past the budget, or when the steps that fit beyond `total` take longer
  than twice the recompilation a revision costs; then to the longest run
  that fits, paying that recompilation. A shortened run that could train
  only for less time than the recompilation and its final evaluation take
  ends at `done` instead (that evaluation is its last): a few more steps
  would cost more than they train. With an unmasked tuning
  (measured["tuning_steps"]), the run's end is the tuning's, and "ends at
  `done`" means the tuning starts there.
  """
  fitting = plan_total_steps(budget_seconds=budget_seconds,
                             upper_bound=upper_bound,
                             steps_per_dispatch=steps_per_dispatch,
                             fixed_seconds=recompile_seconds, **measured)
  overruns = predicted_seconds(total, fixed_seconds=0.0,
                               **measured) > budget_seconds
  gain_seconds = (fitting - total) * measured["step_seconds"]
  if not overruns and gain_seconds <= 2 * recompile_seconds:
    return None
  masked_end = measured["done"] + measured.get("tuning_steps", 0)
  training_seconds = (fitting - masked_end) * measured["step_seconds"]
  if overruns and (training_seconds <
                   recompile_seconds + measured["eval_seconds"]):
    return masked_end
  return fitting if fitting != total else None


def warp_knots(first_total_steps: int, revisions: list[tuple[int, int]]
               ) -> tuple[list[float], list[float]]:
  """Knots (steps, schedule steps) of the piecewise-linear time warp that
  the revisions [(at_step, total_steps), ...] make: the identity up to the
  first revision, then after each one a straight run from where the
  schedule is to the end of the first plan's schedule at the new total. A
  last revision to total_steps == at_step ends the run there."""
  steps, schedule_steps = [0.0], [0.0]
  end = first_total_steps
  for at_step, total in revisions:
    if not steps[-1] < at_step < end or total < at_step:
      raise ValueError(
          f"Time plan revision ({at_step}, {total}) does not follow a run "
          f"planned to step {end} from step {steps[-1]:g}; delete "
          f"{PLAN_FILE} to plan again.")
    slope = (first_total_steps - schedule_steps[-1]) / (end - steps[-1])
    schedule_steps.append(schedule_steps[-1] + (at_step - steps[-1]) * slope)
    steps.append(float(at_step))
    end = total
  return steps + [float(end)], schedule_steps + [float(first_total_steps)]


def warped_schedule(schedule: optax.Schedule, first_total_steps: int,
                    revisions: list[tuple[int, int]]) -> optax.Schedule:
  """`schedule` (made for first_total_steps) as the revisions warp it."""
  if not revisions:
    return schedule
  steps, schedule_steps = warp_knots(first_total_steps, revisions)
  steps, schedule_steps = np.float32(steps), np.float32(schedule_steps)
  return lambda step: schedule(jnp.interp(step, steps, schedule_steps))


def planned_schedule(config: ml_collections.ConfigDict, plan: dict,
                     steps_per_epoch: int) -> optax.Schedule:
  """The learning-rate schedule of a run trained to `plan`: the decay made
  for the first plan's step count, warped by the plan's revisions, then the
  unmasked tuning's, which the revisions move but do not change."""
  tuning_steps = optim.unmasked_tuning_steps(config, steps_per_epoch)
  if plan.get("unmasked_tuning_steps", 0) != tuning_steps:
    raise ValueError(
        f"The time plan of this run ends with "
        f"{plan.get('unmasked_tuning_steps', 0)} steps of unmasked tuning, "
        f"the config with {tuning_steps}: resume with the run's "
        f"config.unmasked_tuning_epochs, or delete {PLAN_FILE} to plan "
        "again.")
  first_decay_steps = int(plan.get("first_total_steps",
                                   plan["total_steps"])) - tuning_steps
  revisions = [(at_step, total - tuning_steps)
               for at_step, total in plan.get("revisions", [])]
  return optim.with_unmasked_tuning(
      warped_schedule(
          optim.decay_schedule(config, first_decay_steps, steps_per_epoch),
          first_decay_steps, revisions),
      config, int(plan["total_steps"]), steps_per_epoch)
