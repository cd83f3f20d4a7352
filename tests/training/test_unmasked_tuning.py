"""Unmasked tuning: a run with patch dropout ends on every patch."""

import json
import os
import shutil

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import small_config, train_counting_compiles
from vit_jax import config as config_lib
from vit_jax.data import augment, datasets, input_pipeline
from vit_jax.model import variants
from vit_jax.runtime import sharding
from vit_jax.training import (budget, budget_tracker, loop, metric_writer,
                              optim, steps)


def _tuning_config(**overrides):
  """16x16 images, 4x4 patches (16), half of them dropped; 4 steps an
  epoch, the last unmasked_tuning_epochs of them on every patch."""
  settings = dict(unmasked_tuning_epochs=1.0,
                  unmasked_tuning_learning_rate=2e-4)
  config = small_config(**dict(settings, **overrides))
  config.model.patch_dropout_rate = 0.5
  return config


def _cosine(peak, steps_in, length):
  """The tuning's rate, written out: peak * (1 + cos(pi * t / length)) / 2."""
  return peak * 0.5 * (1.0 + np.cos(np.pi * np.asarray(steps_in) / length))


def test_schedule_ends_with_a_cosine_from_the_tuning_rate_to_zero():
  config = _tuning_config(learning_rate=1e-3, warmup_steps=10,
                          unmasked_tuning_epochs=2.0)
  schedule = optim.learning_rate_schedule(config, 100, 10)  # 20 tuning steps
  masked = np.arange(80)
  np.testing.assert_allclose(
      schedule(masked), optim.decay_schedule(config, 80, 10)(masked),
      rtol=1e-6)
  # The decay ends at the tuning's first step, not at the run's last.
  assert float(schedule(79)) == pytest.approx(config.end_learning_rate,
                                             rel=0.1)
  tuning = np.arange(80, 101)
  np.testing.assert_allclose(schedule(tuning),
                             _cosine(2e-4, tuning - 80, 20), rtol=1e-5,
                             atol=1e-12)


def test_planned_schedule_moves_the_tuning_to_each_revised_end():
  config = _tuning_config(learning_rate=1e-3, warmup_steps=10)
  tuning_steps = 4  # one epoch of 4 steps
  plan = {"first_total_steps": 124, "total_steps": 96,
          "revisions": [[48, 96]], "unmasked_tuning_steps": tuning_steps}
  schedule = budget.planned_schedule(config, plan, 4)
  masked = np.arange(92)
  warped = budget.warped_schedule(optim.decay_schedule(config, 120, 4), 120,
                                  [(48, 92)])
  np.testing.assert_allclose(schedule(masked), warped(masked), rtol=1e-6)
  tuning = np.arange(92, 97)
  np.testing.assert_allclose(schedule(tuning),
                             _cosine(2e-4, tuning - 92, tuning_steps),
                             rtol=1e-5, atol=1e-12)
  # A plan made for another tuning length is refused, naming the fix.
  with pytest.raises(ValueError, match="unmasked_tuning_epochs.*delete"):
    budget.planned_schedule(config, dict(plan, unmasked_tuning_steps=8), 4)


def _plan(tmp_path, config, tuning=None):
  """budget_tracker.first_plan on made-up timings: 0.1 s a step, a 2 s
  evaluation every 40 steps, free saves, nothing elapsed or compiled."""
  return budget_tracker.first_plan(
      config, str(tmp_path), done=21,
      step_ends=[(0.1 * step, step) for step in range(21)],
      first_step_seconds=0.0, elapsed_seconds=0.0,
      measured=budget_tracker.Measurements(0.0, 2.0, 0.0, *(tuning or ())),
      steps_per_epoch=4, upper_bound=10**6)


def test_plan_fits_the_masked_steps_in_what_the_tuning_leaves(tmp_path):
  config = _tuning_config(time_budget_minutes=2.0, eval_every_epochs=10,
                          checkpoint_every_steps=10**6,
                          unmasked_tuning_epochs=5.0)  # 20 steps
  plan = _plan(tmp_path, config, tuning=(3.0, 0.3))
  assert plan["unmasked_tuning_steps"] == 20
  assert plan["unmasked_tuning_seconds"] == pytest.approx(3.0 + 20 * 0.3)
  with open(tmp_path / budget.PLAN_FILE) as f:
    assert json.load(f) == plan

  def run_seconds(total, tuning_steps):
    """Written out: the measurements (an evaluation; the tuning's step
    compiled and timed 5 times), the steps after the 21st, each evaluation
    (every 40 steps at least 20 before the end, and the last), and the
    tuning's steps, compiled again."""
    evals = sum(1 for s in range(22, total + 1)
                if s == total or (s % 40 == 0 and total - s >= 20))
    tuning = 3.0 + tuning_steps * 0.3 if tuning_steps else 0.0
    measuring = 2.0 + (3.0 + 5 * 0.3 if tuning_steps else 0.0)
    return (measuring + (total - tuning_steps - 21) * 0.1 + evals * 2.0
            + tuning)

  available = 120 * (1 - budget.SAFETY_FRACTION)
  assert run_seconds(plan["total_steps"], 20) <= available
  assert run_seconds(plan["total_steps"] + 1, 20) > available
  # Without the tuning, its 13.5 s (measured and run) buy about 90 steps at
  # 0.15 s (0.1 s and a fortieth of a 2 s evaluation), 20 of them in place
  # of the tuning's.
  config.unmasked_tuning_epochs = 0.0
  untuned = _plan(tmp_path, config)
  assert untuned["unmasked_tuning_steps"] == 0
  assert run_seconds(untuned["total_steps"], 0) <= available
  assert run_seconds(untuned["total_steps"] + 1, 0) > available
  assert untuned["total_steps"] - plan["total_steps"] == pytest.approx(
      90 - 20, abs=15)


def test_revision_keeps_the_tuning_at_the_end(tmp_path, capsys):
  config = _tuning_config(time_budget_minutes=2.0, eval_every_epochs=10,
                          checkpoint_every_steps=10**6,
                          unmasked_tuning_epochs=5.0)
  plan = _plan(tmp_path, config, tuning=(3.0, 0.3))
  planned = plan["total_steps"]
  measured = dict(done=80, eval_seconds=2.0, recompile_seconds=1.0,
                  steps_per_epoch=4, upper_bound=10**6)
  # Steps twice as slow as planned: fewer masked steps, the same 20 tuning
  # steps at the end.
  assert budget_tracker.revise_plan(config, str(tmp_path), plan,
                                    step_seconds=0.2, elapsed_seconds=25.0,
                                    **measured)
  revised = plan["total_steps"]
  assert plan["revisions"] == [[80, revised]] and 100 < revised < planned
  assert plan["unmasked_tuning_steps"] == 20
  schedule = budget.planned_schedule(config, plan, 4)
  np.testing.assert_allclose(
      schedule(np.arange(revised - 20, revised + 1)),
      _cosine(2e-4, np.arange(21), 20), rtol=1e-5, atol=1e-12)
  # Far too slow: the masked steps end at once, the tuning follows.
  assert budget_tracker.revise_plan(config, str(tmp_path), plan,
                                    step_seconds=0.2, elapsed_seconds=110.0,
                                    **dict(measured, done=88))
  assert plan["revisions"][-1] == [88, 108]
  assert ("ending the masked steps here, the unmasked tuning next, instead "
          f"of at step {revised}") in capsys.readouterr().out


def _restore(workdir, step, template):
  """The trainer's checkpoint of `step`, laid out like `template`."""
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      template)
  state = manager.restore(step, args=ocp.args.StandardRestore(target))
  manager.close()
  return state


@pytest.mark.slow  # ~1 minute: six train-step compiles
def test_trainer_tunes_its_last_epoch_on_every_patch_and_resumes_in_it(
    tmp_path, capsys):
  """Steps 9-12 of 12 train on all 16 patches: replayed from the step-8
  checkpoint with the model without patch dropout and the EMA's ramp
  restarted at step 8, they give the trainer's params and EMA, and with
  patch dropout they do not. A run resumed at step 10 ends where the
  uninterrupted one did."""
  config = _tuning_config(num_train_steps=12, checkpoint_every_steps=2,
                          keep_checkpoints=10, log_every_steps=2,
                          ema_decay=0.99)
  workdir = str(tmp_path)
  loop.train_and_evaluate(config, workdir)
  assert "Unmasked tuning: steps 9-12 train on all 16 patches" in (
      capsys.readouterr().out)

  mesh = sharding.make_mesh(config.mesh)
  dataset = datasets.load(config)
  model = variants.build_model(config.model, dataset.num_classes)
  schedule = optim.learning_rate_schedule(config, 12, 4)
  template = steps.create_train_state(
      model, dataset.image_shape, optim.make_optimizer(config, schedule),
      config.seed, mesh, ema=True)
  mean, std = augment.pixel_stats(config.normalization, dataset)
  flip = dataset.flip if config.random_flip is None else config.random_flip
  final = _restore(workdir, 12, template)

  def replay(patch_dropout_rate, ema_start_step=8):
    state = _restore(workdir, 8, template).replace(
        apply_fn=model.clone(patch_dropout_rate=patch_dropout_rate).apply)
    train_fn = steps.compile_train_step(
        mesh, steps.shardings_of(state), schedule,
        **config_lib.train_step_options(config, mean, std, flip,
                                        ema_start_step))
    batches = input_pipeline.train_batches(
        dataset.train_images, dataset.train_labels, config.batch_size,
        config.seed, 8, mesh)
    for _ in range(4):
      state, _ = train_fn(state, *next(batches))
    return jax.device_get((state.params, state.ema_params))

  def largest_difference(tree, other):
    return max(float(np.abs(a - b).max()) for a, b in
               zip(jax.tree.leaves(tree), jax.tree.leaves(other)))

  expected = jax.device_get((final.params, final.ema_params))
  chex.assert_trees_all_close(replay(0.0), expected, rtol=1e-6, atol=1e-7)
  assert largest_difference(replay(0.5)[0], expected[0]) > 1e-5
  # Without the restart, the EMA (decay 0.99 from step 8) lags far behind.
  assert largest_difference(replay(0.0, ema_start_step=0)[1],
                            expected[1]) > 1e-5

  # The masked steps are logged apart from the tuning's, whose rate is the
  # cosine from 2e-4 (mean of each line's two steps).
  records = metric_writer.read_metrics(workdir)
  logged = {r["step"]: r["learning_rate"] for r in records
            if r["split"] == "train"}
  assert sorted(logged) == [2, 4, 6, 8, 10, 12]
  np.testing.assert_allclose(
      [logged[10], logged[12]],
      [_cosine(2e-4, [0, 1], 4).mean(), _cosine(2e-4, [2, 3], 4).mean()],
      rtol=1e-5)

  shutil.rmtree(os.path.join(workdir, "checkpoints", "12"))
  loop.train_and_evaluate(config, workdir)
  assert "Unmasked tuning: steps 11-12" in capsys.readouterr().out
  chex.assert_trees_all_equal(_restore(workdir, 12, template).params,
                              final.params)


@pytest.mark.slow  # ~40 s: a budgeted run and its revisions' compiles
def test_budgeted_trainer_revised_to_end_its_masked_steps_tunes_next(
    tmp_path, monkeypatch, capsys, caplog):
  """A check at step 48 ends the masked steps: the run tunes steps 49-56
  on every patch, on the cosine from the tuning's rate, and ends there.
  The plan timed the tuning's step on a copy of the state: a compilation
  of its own."""

  def end_masked_steps(*, total, **measured):
    del total
    return measured["done"] + measured["tuning_steps"]

  monkeypatch.setattr(budget, "revised_total_steps", end_masked_steps)
  config = _tuning_config(num_epochs=30, warmup_steps=10, log_every_steps=4,
                          eval_every_epochs=6, time_budget_minutes=60.0,
                          checkpoint_every_steps=1000,
                          unmasked_tuning_epochs=2.0)  # 8 steps
  workdir = str(tmp_path)
  metrics, compiled = train_counting_compiles(config, workdir, caplog)
  # The upper bound's masked step, the tuning's timed for the plan, the
  # plan's masked step, the tuning's in the run (the revision's masked step
  # never runs).
  assert compiled.count("jit(train_step)") == 4, compiled
  out = capsys.readouterr().out
  plan = budget_tracker.read_plan(workdir)
  assert plan["first_total_steps"] == 120  # 30 epochs fit in the hour
  assert plan["unmasked_tuning_steps"] == 8
  assert plan["unmasked_tuning_seconds"] > 0
  assert "the last 8 on every patch" in out
  assert plan["revisions"] == [[48, 56]] and plan["total_steps"] == 56
  assert "ending the masked steps here, the unmasked tuning next" in out
  assert "Unmasked tuning: steps 49-56 train on all 16 patches" in out
  assert metrics["epoch"] == 14.0
  logged = {r["step"]: r["learning_rate"] for r in
            metric_writer.read_metrics(workdir) if r["split"] == "train"}
  np.testing.assert_allclose(
      [logged[52], logged[56]],
      [_cosine(2e-4, range(4), 8).mean(), _cosine(2e-4, range(4, 8), 8).mean()],
      rtol=1e-5)
  schedule = budget.planned_schedule(config, plan, 4)
  np.testing.assert_allclose(schedule(np.arange(48, 57)),
                             _cosine(2e-4, range(9), 8), rtol=1e-5,
                             atol=1e-12)


@pytest.mark.parametrize("overrides, rate, message", [
    (dict(unmasked_tuning_epochs=-1.0), 0.5, "unmasked_tuning_epochs=-1.0"),
    (dict(unmasked_tuning_epochs=1.0), 0.0, "patch_dropout_rate is 0"),
    (dict(unmasked_tuning_epochs=1.0, unmasked_tuning_learning_rate=0.0),
     0.5, "unmasked_tuning_learning_rate=0.0 must be > 0"),
])
def test_bad_tuning_settings_are_named(overrides, rate, message):
  config = small_config(**overrides)
  config.model.patch_dropout_rate = rate
  with pytest.raises(ValueError, match=message):
    config_lib.validate_config(config)


def test_tuning_as_long_as_the_run_is_refused(tmp_path):
  config = _tuning_config(num_train_steps=4)  # the tuning's epoch: 4 steps
  with pytest.raises(ValueError, match="leaves nothing.*make it shorter"):
    loop.train_and_evaluate(config, str(tmp_path))
