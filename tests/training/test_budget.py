"""Training to a wall-time budget: the plan's arithmetic, and a planned run."""

import itertools
import json
import os

import chex
import numpy as np
import pytest

from helpers import small_config, train_counting_compiles
from vit_jax.checkpoints import pretrained
from vit_jax.training import budget, budget_tracker, loop, metric_writer, optim


def _trainer_saves(done, total, every_steps):
  """The steps after `done` at which the trainer saves a checkpoint, by its
  rule: each multiple of every_steps, and the last step."""
  return sum(1 for d in range(done + 1, total + 1)
             if d == total or d % every_steps == 0)


def _trainer_evals(done, total, every_steps):
  """The steps after `done` at which the trainer evaluates (every_steps =
  steps per epoch x eval_every_epochs), step by step by its rule."""
  return sum(1 for d in range(done + 1, total + 1)
             if budget.evaluates_after(d, total, every_steps))


def test_evaluations_skip_an_interval_end_close_to_the_last_step():
  every = 20
  assert [d for d in range(1, 73) if budget.evaluates_after(d, 72, every)
          ] == [20, 40, 60, 72]
  # Step 60 is 5 steps before the end: the last step's evaluation serves.
  assert [d for d in range(1, 66) if budget.evaluates_after(d, 65, every)
          ] == [20, 40, 65]
  assert budget.evaluates_after(60, 70, every)  # half an interval: kept
  assert [d for d in range(1, 4) if budget.evaluates_after(d, 3, 1)
          ] == [1, 2, 3]


@pytest.mark.parametrize("done,total,every", [
    (21, 22, 50), (21, 50, 50), (21, 51, 50), (21, 74, 50), (21, 75, 50),
    (21, 400, 50), (21, 400, 150), (0, 150, 150), (100, 101, 14),
    (49, 250, 50), (21, 5000, 1000), (21, 21, 50), (3, 9, 1)])
def test_events_between_follows_the_trainer(done, total, every):
  assert budget.events_between(done, total, every) == (
      _trainer_saves(done, total, every))
  assert budget.events_between(done, total, every,
                               budget.evaluation_gap(every)) == (
      _trainer_evals(done, total, every))


@pytest.mark.parametrize("budget_seconds,upper_bound", [
    (100.0, 10_000), (100.0, 300), (31.0, 10_000), (1e4, 2_000)])
def test_plan_is_the_longest_run_that_fits(budget_seconds, upper_bound):
  measured = dict(elapsed_seconds=10.0, done=21, step_seconds=0.1,
                  fixed_seconds=5.0, eval_seconds=2.0, eval_every_steps=50,
                  save_seconds=1.5, save_every_steps=120)

  def predicted(total):  # an independent count of the run's seconds
    return (10.0 + 5.0 + 0.1 * (total - 21) +
            2.0 * _trainer_evals(21, total, 50) +
            1.5 * _trainer_saves(21, total, 120))

  planned = budget.plan_total_steps(budget_seconds=budget_seconds,
                                    upper_bound=upper_bound, **measured)
  available = budget_seconds * (1 - budget.SAFETY_FRACTION)
  # predicted() grows with n: the runs that fit are the first ones.
  fitting = list(itertools.takewhile(lambda n: predicted(n) <= available,
                                     range(22, upper_bound + 1)))
  assert planned == (max(fitting) if fitting else 22)
  assert 21 < planned <= upper_bound


_MEASURED = dict(budget_seconds=900.0, elapsed_seconds=300.0, done=1000,
                 eval_seconds=20.0, eval_every_steps=500, save_seconds=2.0,
                 save_every_steps=2000, upper_bound=10_000)


def _predicted_end(total, step_seconds, fixed_seconds=0.0):
  """An independent count of a run's end with _MEASURED, from step 1000."""
  return (300.0 + fixed_seconds + step_seconds * (total - 1000)
          + 20.0 * _trainer_evals(1000, total, 500)
          + 2.0 * _trainer_saves(1000, total, 2000))


def _longest(fits):
  """The last step count from 1001 on that fits (ends grow with it)."""
  return max(itertools.takewhile(fits, range(1001, 10_001)))


def test_revision_shortens_a_run_that_would_overrun():
  # Planned to 3000 steps at 0.25 s; the steps now take 0.3 s.
  assert _predicted_end(3000, 0.3) > 900  # as planned, it would overrun
  revised = budget.revised_total_steps(total=3000, recompile_seconds=10.0,
                                       step_seconds=0.3, **_MEASURED)
  available = 900 * (1 - budget.SAFETY_FRACTION)
  assert revised == _longest(lambda n: _predicted_end(n, 0.3, 10.0)
                            <= available)


@pytest.mark.parametrize("elapsed_seconds,ends", [
    (780.0, False), (830.0, True), (870.0, True)])
def test_revision_ends_the_run_when_the_steps_left_would_not_pay(
    elapsed_seconds, ends):
  # Late in the run, the steps that fit after a revision train for less
  # time than its recompilation (10 s) and final evaluation (20 s) cost at
  # 830 s (and none fit at 870 s): the run ends at the step just evaluated.
  measured = dict(_MEASURED, elapsed_seconds=elapsed_seconds)
  available = 900 * (1 - budget.SAFETY_FRACTION)
  late = elapsed_seconds - 300.0
  fitting = max(itertools.takewhile(
      lambda n: late + _predicted_end(n, 0.3, 10.0) <= available,
      range(1001, 10_001)), default=1001)
  assert (0.3 * (fitting - 1000) < 10.0 + 20.0) == ends
  revised = budget.revised_total_steps(total=3000, recompile_seconds=10.0,
                                       step_seconds=0.3, **measured)
  assert revised == (1000 if ends else fitting)


def test_revision_keeps_a_run_on_time_and_lengthens_only_when_it_pays():
  # The plan still ends inside the budget (if in its margin): kept.
  on_time = _longest(lambda n: _predicted_end(n, 0.3) <= 890)
  assert budget.revised_total_steps(total=on_time, recompile_seconds=10.0,
                                    step_seconds=0.3, **_MEASURED) is None
  # Faster than planned: lengthened if the steps gained outlast twice the
  # recompilation, else kept.
  fitting = _longest(lambda n: _predicted_end(n, 0.3, 10.0)
                     <= 900 * (1 - budget.SAFETY_FRACTION))
  assert 0.3 * (fitting - 2000) > 2 * 10.0
  assert budget.revised_total_steps(total=2000, recompile_seconds=10.0,
                                    step_seconds=0.3, **_MEASURED) == fitting
  short = budget.revised_total_steps(total=fitting - 20,
                                     recompile_seconds=10.0,
                                     step_seconds=0.3, **_MEASURED)
  assert short is None  # 20 steps (6 s) do not pay a 10 s recompilation


def test_step_time_forecast_follows_a_lasting_change_of_speed():
  """Timed windows [(seconds, steps)], each weighing half as much as the
  next: steady windows give their speed, a lasting speed-up is followed
  more closely than by the mean since the plan."""
  assert budget.recent_step_seconds([(30.0, 1000)]) == pytest.approx(0.03)
  steady = [(30.0, 1000), (15.0, 500), (60.0, 2000)]
  assert budget.recent_step_seconds(steady) == pytest.approx(0.03)
  # 0.03 s a step for three windows, then 0.02 s for two; the weights of
  # the five equal windows, newest last: 1/16, 1/8, 1/4, 1/2, 1.
  windows = [(30.0, 1000)] * 3 + [(20.0, 1000)] * 2
  expected = ((0.03 * (1 / 16 + 1 / 8 + 1 / 4) + 0.02 * (1 / 2 + 1))
              / (1 / 16 + 1 / 8 + 1 / 4 + 1 / 2 + 1))
  forecast = budget.recent_step_seconds(windows)
  assert forecast == pytest.approx(expected)
  assert forecast < 0.025 < 130.0 / 5000  # the mean since the plan: 0.026
  # Windows of different lengths: weighed by steps as well.
  assert budget.recent_step_seconds([(10.0, 100), (10.0, 400)]) == (
      pytest.approx((0.5 * 10.0 + 10.0) / (0.5 * 100 + 400)))


def _warped_by_stepping(schedule, first_total, revisions, last_step):
  """Reference: walks the schedule a step at a time, each step advancing
  the schedule's step by what is left of it over the steps left."""
  values, position, end = [], 0.0, first_total
  pending = dict(revisions)
  for step in range(last_step + 1):
    end = pending.get(step, end)
    values.append(position)
    position += (first_total - position) / (end - step) if step < end else 0
  return np.asarray(schedule(np.array(values)))


@pytest.mark.parametrize("revisions", [
    [], [(300, 800)], [(300, 1400)], [(300, 800), (500, 700)],
    [(100, 900), (600, 1200), (1100, 1150)]])
def test_warped_schedule_goes_on_without_a_jump_to_the_new_end(revisions):
  config = small_config(learning_rate=1e-3, warmup_steps=50)
  schedule = optim.learning_rate_schedule(config, 1000, 100)
  warped = budget.warped_schedule(schedule, 1000, revisions)
  end = revisions[-1][1] if revisions else 1000
  steps = np.arange(end + 1)
  values = np.asarray(warped(steps))
  np.testing.assert_allclose(
      values, _warped_by_stepping(schedule, 1000, revisions, end),
      rtol=1e-4, atol=1e-9)
  # Up to the first revision it is the schedule planned first ...
  first = revisions[0][0] if revisions else end
  np.testing.assert_allclose(values[:first + 1],
                             np.asarray(schedule(steps[:first + 1])),
                             rtol=1e-6)
  # ... it has no jump anywhere (a step changes it by at most the largest
  # step of the warm-up), and it ends where the schedule ends.
  assert np.abs(np.diff(values)).max() <= 1e-3 / 50 * 1.01
  np.testing.assert_allclose(values[-1], float(schedule(1000)), atol=1e-9)


def test_warp_rejects_revisions_that_do_not_follow_the_plan():
  with pytest.raises(ValueError, match="does not follow.*delete"):
    budget.warp_knots(1000, [(1200, 1500)])  # revised after its end
  with pytest.raises(ValueError, match="does not follow"):
    budget.warp_knots(1000, [(500, 800), (400, 900)])  # out of order


def test_a_revision_to_its_own_step_ends_the_warp():
  steps, schedule_steps = budget.warp_knots(1000, [(500, 800), (600, 600)])
  assert steps == [0.0, 500.0, 600.0, 600.0]
  np.testing.assert_allclose(schedule_steps, [0, 500, 500 + 100 * 500 / 300,
                                              1000])
  with pytest.raises(ValueError, match="does not follow"):
    budget.warp_knots(1000, [(600, 600), (700, 800)])  # nothing follows


@pytest.mark.slow  # ~1 minute: three train-step compiles
def test_trainer_revises_its_plan_and_warps_its_schedule(tmp_path,
                                                         monkeypatch, capsys,
                                                         caplog):
  """A run whose first check finds it would overrun trains on with the
  warped schedule, and records the revision in its plan; a second check
  ends it at the step it has just evaluated. Only the train step is
  recompiled, once for the plan and once for the first revision."""
  checks = []

  def revise_twice(*, total, **measured):
    checks.append(dict(measured, total=total))
    return measured["done"] + 44 if len(checks) == 1 else measured["done"]

  monkeypatch.setattr(budget, "revised_total_steps", revise_twice)
  config = small_config(num_epochs=30, warmup_steps=10, log_every_steps=5,
                        eval_every_epochs=6, time_budget_minutes=60.0,
                        checkpoint_every_steps=1000)
  workdir = str(tmp_path)
  metrics, compiled = train_counting_compiles(config, workdir, caplog)
  # The upper bound's schedule, the plan's, the first revision's.
  assert compiled.count("jit(train_step)") == 3, compiled
  assert compiled.count("jit(eval_step)") == 1, compiled
  with open(os.path.join(workdir, budget.PLAN_FILE)) as f:
    plan = json.load(f)
  # 4 steps an epoch, an evaluation every 24 steps: planned (the upper bound
  # of 120 steps fits) at step 21, timed from step 22, so the evaluation at
  # step 24 is too early to check; the one at 48 checks, and the one at 72
  # (timed from step 49).
  assert plan["first_total_steps"] == 120
  assert plan["revisions"] == [[48, 92], [72, 72]]
  assert plan["total_steps"] == 72
  assert [c["done"] for c in checks] == [48, 72]
  assert checks[0]["total"] == 120 and checks[1]["total"] == 92
  assert checks[0]["step_seconds"] > 0
  out = capsys.readouterr().out
  assert "training to step 92 (23.00 epochs) instead of 120" in out
  assert "ending the run here instead of at step 92" in out
  records = metric_writer.read_metrics(workdir)
  train_records = [r for r in records if r["split"] == "train"]
  # Ended after its evaluation at step 72: no second one, saved there.
  assert [r["step"] for r in records if r["split"] == "eval"] == [24, 48, 72]
  assert train_records[-1]["step"] == 72 and metrics["epoch"] == 18.0
  saved = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))]
  assert max(saved) == 72
  warped = budget.warped_schedule(
      optim.learning_rate_schedule(config, 120, 4), 120, [(48, 92), (72, 72)])
  rates = np.asarray(warped(np.arange(72)))  # step s updates with rates[s-1]
  logged = {r["step"]: r["learning_rate"] for r in train_records}
  # Each log line has the mean rate of the steps since the last one; the
  # last line is the run's end, step 72, two steps after step 70's.
  ends = list(range(5, 71, 5)) + [72]
  assert sorted(logged) == ends
  np.testing.assert_allclose(
      [logged[end] for end in ends],
      [rates[start:end].mean() for start, end in zip([0] + ends, ends)],
      rtol=1e-5, atol=1e-9)
  # The rates after the first revision differ from the unrevised schedule's.
  unrevised = optim.learning_rate_schedule(config, 120, 4)
  assert rates[69] < 0.8 * float(unrevised(69))
  # A resumed run builds its schedule from the plan file: the same rates.
  from_file = budget.planned_schedule(
      config, budget_tracker.read_plan(workdir), 4)
  np.testing.assert_allclose(from_file(np.arange(72)), rates,
                             rtol=1e-6, atol=1e-12)


def test_plan_file_round_trip_and_damage(tmp_path):
  assert budget_tracker.read_plan(str(tmp_path)) is None
  budget_tracker.write_plan(str(tmp_path), {"total_steps": 123, "epochs": 2.46})
  assert budget_tracker.read_plan(str(tmp_path))["total_steps"] == 123
  assert os.listdir(tmp_path) == [budget.PLAN_FILE]  # no temporary left
  (tmp_path / budget.PLAN_FILE).write_text('{"total_steps": "many"}')
  with pytest.raises(ValueError, match="damaged.*Delete it"):
    budget_tracker.read_plan(str(tmp_path))


def test_negative_budget_is_rejected(tmp_path):
  config = small_config(time_budget_minutes=-1.0)
  with pytest.raises(ValueError, match="time_budget_minutes=-1.0 must be"):
    loop.train_and_evaluate(config, str(tmp_path))


@pytest.mark.slow
def test_budgeted_run_equals_a_run_configured_with_its_planned_steps(
    tmp_path, capsys):
  """A budget-bound run (the upper bound of 100,000 epochs does not fit) plans
  during warm-up, trains to its plan, and ends with the params of a run
  given that many steps from the start; resuming reads the plan."""
  # No evaluation before the last: on a loaded machine (CI's other worker)
  # the steps, not the evaluations, fill what compiling leaves, and no
  # check can revise the plan (the revision is tested above).
  settings = dict(num_epochs=100_000, eval_every_epochs=100_000,
                  warmup_steps=40,
                  log_every_steps=10, checkpoint_every_steps=10_000,
                  time_budget_minutes=0.5)
  workdir = str(tmp_path / "budget")
  loop.train_and_evaluate(small_config(**settings), workdir)
  log = capsys.readouterr().out
  with open(os.path.join(workdir, budget.PLAN_FILE)) as f:
    plan = json.load(f)
  planned = plan["total_steps"]
  assert plan["planned_at_step"] == 1 + budget_tracker.MEASURED_STEPS
  assert plan["revisions"] == [] and plan["first_total_steps"] == planned
  # Past the warm-up (which a shorter run would cut), short of the bound.
  assert settings["warmup_steps"] < planned < 100_000 * 4  # 4 steps an epoch
  assert f"training to step {planned} " in log
  last = [r for r in metric_writer.read_metrics(workdir)
          if r["split"] == "train"][-1]
  assert last["step"] == planned

  reference = str(tmp_path / "fixed")
  loop.train_and_evaluate(small_config(**dict(
      settings, num_train_steps=planned, time_budget_minutes=0.0)), reference)
  chex.assert_trees_all_close(pretrained.load_params(workdir, 2)[0],
                              pretrained.load_params(reference, 2)[0],
                              rtol=1e-6, atol=1e-7)

  # Resumed (here: already done), the run reads its plan, whatever the speed.
  loop.train_and_evaluate(small_config(**settings), workdir)
  assert f"training to step {planned}, as planned in" in capsys.readouterr().out
