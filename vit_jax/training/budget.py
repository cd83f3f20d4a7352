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
"""

import json
import os
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils

from vit_jax.training import metric_writer, optim

PLAN_FILE = "time_plan.json"
# Steps timed after the first (compiling) one, before the plan is made.
MEASURED_STEPS = 20
# Planned to end this fraction of the budget early. Revisions correct the
# plan at each evaluation, so the margin covers the drift of the machine's
# speed after the last one: a 15% slowdown over the last fifth of the run.
SAFETY_FRACTION = 0.03
# Steps of the unmasked tuning timed after its compiling one, for the plan.
MEASURED_TUNING_STEPS = 5


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


class Measurements(NamedTuple):
  """What the trainer measures, once, for a plan (seconds)."""
  eval_compile: float  # compiling the eval step
  evaluation: float  # one evaluation, as training runs them
  save: float  # one checkpoint save, written through
  tuning_compile: float = 0.0  # the unmasked tuning's step: compiling it
  tuning_step: float = 0.0  # and one of its steps


def plan(config: ml_collections.ConfigDict, workdir: str, *, done: int,
         step_ends: list[tuple[float, int]], first_step_seconds: float,
         elapsed_seconds: float, measured: Measurements,
         steps_per_epoch: int, upper_bound: int) -> dict:
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
  planned = plan_total_steps(
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


def revise(config: ml_collections.ConfigDict, workdir: str, plan: dict, *,
           done: int, step_seconds: float, eval_seconds: float,
           recompile_seconds: float, elapsed_seconds: float,
           steps_per_epoch: int, upper_bound: int) -> bool:
  """Checks `plan` (as `plan` returned it) at step `done`
  (revised_total_steps). If it is revised (to process 0's revision, on
  every process), records the revision in `plan` and its file, logs it and
  returns True. The unmasked tuning's steps, if any, end every revised run
  as they end the plan; a revision changes the masked steps before them.
  """
  total = plan["total_steps"]
  tuning_steps = plan.get("unmasked_tuning_steps", 0)
  revised = -1
  if jax.process_index() == 0:
    revised = revised_total_steps(
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
