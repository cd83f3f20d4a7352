"""Training to a wall-time budget: the plan's arithmetic, and a planned run."""

import json
import os

import chex
import pytest

from helpers import small_config
from vit_jax import budget, metric_writer, pretrained, train


def _trainer_events(done, total, every_steps):
  """The steps after `done` at which the trainer evaluates (every_steps =
  steps per epoch x eval_every_epochs) or saves (checkpoint_every_steps),
  by its own rule: each multiple of every_steps, and the last step."""
  return sum(1 for d in range(done + 1, total + 1)
             if d == total or d % every_steps == 0)


@pytest.mark.parametrize("done,total,every", [
    (21, 22, 50), (21, 50, 50), (21, 51, 50), (21, 400, 50), (21, 400, 150),
    (0, 150, 150), (100, 101, 14), (49, 250, 50), (21, 5000, 1000)])
def test_events_between_follows_the_trainer(done, total, every):
  assert budget.events_between(done, total, every) == (
      _trainer_events(done, total, every))


@pytest.mark.parametrize("budget_seconds,upper_bound", [
    (100.0, 10_000), (100.0, 300), (31.0, 10_000), (1e4, 2_000)])
def test_plan_is_the_longest_run_that_fits(budget_seconds, upper_bound):
  measured = dict(elapsed_seconds=10.0, done=21, step_seconds=0.1,
                  fixed_seconds=5.0, eval_seconds=2.0, eval_every_steps=50,
                  save_seconds=1.5, save_every_steps=120)

  def predicted(total):  # an independent count of the run's seconds
    return (10.0 + 5.0 + 0.1 * (total - 21) +
            2.0 * _trainer_events(21, total, 50) +
            1.5 * _trainer_events(21, total, 120))

  planned = budget.plan_total_steps(budget_seconds=budget_seconds,
                                    upper_bound=upper_bound, **measured)
  available = budget_seconds * (1 - budget.SAFETY_FRACTION)
  fitting = [n for n in range(22, upper_bound + 1) if predicted(n) <= available]
  assert planned == (max(fitting) if fitting else 22)
  assert 21 < planned <= upper_bound


def test_plan_file_round_trip_and_damage(tmp_path):
  assert budget.read_plan(str(tmp_path)) is None
  budget.write_plan(str(tmp_path), {"total_steps": 123, "epochs": 2.46})
  assert budget.read_plan(str(tmp_path))["total_steps"] == 123
  assert os.listdir(tmp_path) == [budget.PLAN_FILE]  # no temporary left
  (tmp_path / budget.PLAN_FILE).write_text('{"total_steps": "many"}')
  with pytest.raises(ValueError, match="damaged.*Delete it"):
    budget.read_plan(str(tmp_path))


def test_negative_budget_is_rejected(tmp_path):
  config = small_config(time_budget_minutes=-1.0)
  with pytest.raises(ValueError, match="time_budget_minutes=-1.0 must be"):
    train.train_and_evaluate(config, str(tmp_path))


@pytest.mark.slow
def test_budgeted_run_equals_a_run_configured_with_its_planned_steps(
    tmp_path, capsys):
  """A budget-bound run (the upper bound of 100,000 epochs does not fit) plans
  during warm-up, trains to its plan, and ends with the params of a run
  given that many steps from the start; resuming reads the plan."""
  # An evaluation every 200 steps, so that on a loaded machine (CI's other
  # worker) the steps, not the evaluations, fill what compiling leaves.
  settings = dict(num_epochs=100_000, eval_every_epochs=50, warmup_steps=40,
                  log_every_steps=10, checkpoint_every_steps=10_000,
                  time_budget_minutes=1.25)
  workdir = str(tmp_path / "budget")
  train.train_and_evaluate(small_config(**settings), workdir)
  log = capsys.readouterr().out
  with open(os.path.join(workdir, budget.PLAN_FILE)) as f:
    plan = json.load(f)
  planned = plan["total_steps"]
  assert plan["planned_at_step"] == 1 + budget.MEASURED_STEPS
  # Past the warm-up (which a shorter run would cut), short of the bound.
  assert settings["warmup_steps"] < planned < 100_000 * 4  # 4 steps an epoch
  assert f"training to step {planned} " in log
  last = [r for r in metric_writer.read_metrics(workdir)
          if r["split"] == "train"][-1]
  assert last["step"] == planned

  reference = str(tmp_path / "fixed")
  train.train_and_evaluate(small_config(**dict(
      settings, num_train_steps=planned, time_budget_minutes=0.0)), reference)
  chex.assert_trees_all_close(pretrained.load_params(workdir, 2)[0],
                              pretrained.load_params(reference, 2)[0],
                              rtol=1e-6, atol=1e-7)

  # Resumed (here: already done), the run reads its plan, whatever the speed.
  train.train_and_evaluate(small_config(**settings), workdir)
  assert f"training to step {planned}, as planned in" in capsys.readouterr().out
