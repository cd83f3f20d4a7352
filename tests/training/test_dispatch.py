"""Several train steps per dispatch (config.steps_per_dispatch): the same
steps as one at a time, dispatched where the loop does not act, resumed
exactly, planned to whole dispatches."""

import os
import shutil

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import small_config
from vit_jax import config as config_lib
from vit_jax.data import datasets
from vit_jax.model import variants
from vit_jax.runtime import sharding
from vit_jax.training import (budget, budget_tracker, dispatch, loop,
                              metric_writer, optim, steps)


def _state_and_fns(config, mesh, num_steps):
  dataset = datasets.load(config)
  model = variants.build_model(config.model, dataset.num_classes)
  schedule = optim.learning_rate_schedule(config, 20, 4)
  tx = optim.make_optimizer(config, schedule)
  make_state = lambda: steps.create_train_state(
      model, dataset.image_shape, tx, config.seed, mesh, ema=True)
  mean, std = dataset.channel_stats()
  options = config_lib.train_step_options(config, mean, std, True)
  layout = steps.shardings_of(make_state())
  return (dataset, make_state,
          steps.compile_train_step(mesh, layout, schedule, **options),
          steps.compile_train_steps(mesh, layout, schedule, num_steps,
                                    **options))


@pytest.mark.parametrize("num_devices", [1, 8])
def test_k_steps_in_one_dispatch_are_the_k_single_steps(num_devices):
  """Params, optimizer state, EMA and each step's metrics after 3 steps in
  one program equal those of 3 single steps, to float32 rounding: XLA
  compiles the loop's body apart from the single step, and may fuse or
  order its sums differently (a few elements 1 ulp apart here)."""
  config = small_config(ema_decay=0.9)
  config.model.dropout_rate = 0.1  # each step must draw its own key
  mesh = sharding.make_mesh(devices=jax.devices()[:num_devices])
  dataset, make_state, single, multi = _state_and_fns(config, mesh, 3)
  batches = [
      tuple(sharding.to_global_batch(mesh, array[16 * i:16 * (i + 1)])
            for array in (dataset.train_images, dataset.train_labels))
      for i in range(3)]
  state, single_metrics = make_state(), []
  for batch in batches:
    state, metrics = single(state, *batch)
    single_metrics.append(metrics)
  images, labels = zip(*batches)
  multi_state, multi_metrics = multi(make_state(), images, labels)
  assert int(multi_state.step) == 3
  assert multi_metrics["loss"].shape == (3,)
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *single_metrics)
  trees = ((state.params, state.opt_state, state.ema_params, stacked),
           (multi_state.params, multi_state.opt_state, multi_state.ema_params,
            multi_metrics))
  chex.assert_trees_all_close(*trees, rtol=1e-5, atol=1e-7)
  # Not a trivial agreement: the steps changed the params.
  assert not np.allclose(state.params["head"]["kernel"],
                         make_state().params["head"]["kernel"])


def _partition(start, total, per_dispatch, acts_after):
  """The dispatch sizes of a loop from `start` to `total`."""
  sizes, step = [], start
  while step < total:
    sizes.append(dispatch.steps_in_dispatch(step, total, per_dispatch,
                                        acts_after))
    step += sizes[-1]
  return sizes


def test_dispatches_are_whole_and_never_hide_a_step_the_loop_acts_after():
  acts_after = lambda done: done % 6 == 0  # e.g. a checkpoint every 6 steps
  sizes = _partition(0, 15, 4, acts_after)
  ends = np.cumsum(sizes)
  # 0-4 whole; 4-8 would hide step 6; 8-12 whole; 12-16 passes the end.
  assert sizes == [4, 1, 1, 1, 1, 4, 1, 1, 1]
  assert all(end % 6 or end in ends for end in range(1, 16))
  # Every resume point of that run dispatches the rest as the run did.
  for resume_at in [0] + list(ends[:-1]):
    rest = ends[ends > resume_at]
    assert list(np.cumsum(_partition(resume_at, 15, 4, acts_after))
                + resume_at) == list(rest)
  assert _partition(0, 9, 1, acts_after) == [1] * 9
  assert _partition(2, 12, 4, lambda done: False) == [1, 1, 4, 4]


def _read_checkpoint(workdir, step):
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  tree = manager.restore(step, args=ocp.args.StandardRestore())
  manager.close()
  return tree


def test_run_with_several_steps_per_dispatch_trains_and_resumes_as_one(
    tmp_path, capsys):
  """12 steps, 4 per dispatch, a checkpoint every 6 (steps 4-8 go singly):
  the same params and logged metrics as a run of single steps, and a run
  killed after step 6 resumes to the uninterrupted run's state bit for
  bit."""
  settings = dict(num_train_steps=12, checkpoint_every_steps=6,
                  log_every_steps=4, keep_checkpoints=5)
  single_dir, multi_dir = str(tmp_path / "single"), str(tmp_path / "multi")
  loop.train_and_evaluate(small_config(**settings), single_dir)
  capsys.readouterr()
  config = small_config(steps_per_dispatch=4, **settings)
  loop.train_and_evaluate(config, multi_dir)
  out = capsys.readouterr().out
  assert "Compiled and ran the first 4 train steps in one dispatch" in out
  assert "Compiled and ran the first train step in" in out  # step 5, singly
  uninterrupted = _read_checkpoint(multi_dir, 12)
  chex.assert_trees_all_close(
      uninterrupted["params"], _read_checkpoint(single_dir, 12)["params"],
      rtol=1e-5, atol=1e-7)
  without_time = lambda workdir: [
      {k: v for k, v in r.items() if k not in ("time", "images_per_second")}
      for r in metric_writer.read_metrics(workdir)]
  single_records, multi_records = map(without_time, (single_dir, multi_dir))
  assert [r["step"] for r in multi_records] == [
      r["step"] for r in single_records] == [4, 4, 8, 8, 12, 12]
  for ours, theirs in zip(multi_records, single_records):
    assert ours.keys() == theirs.keys()
    np.testing.assert_allclose([ours[k] for k in sorted(ours)
                                if k != "split"],
                               [theirs[k] for k in sorted(theirs)
                                if k != "split"], rtol=1e-4)

  shutil.rmtree(os.path.join(multi_dir, "checkpoints", "12"))
  loop.train_and_evaluate(config, multi_dir)
  resumed = _read_checkpoint(multi_dir, 12)
  chex.assert_trees_all_equal(resumed["params"], uninterrupted["params"])
  chex.assert_trees_all_equal(resumed["opt_state"],
                              uninterrupted["opt_state"])


def test_a_non_finite_step_inside_a_dispatch_is_named(tmp_path):
  """The NaN check reads each step of a dispatch: a learning rate that
  blows the params up is reported at the step single steps report it at,
  and the run stops before saving."""
  messages = []
  for per_dispatch in (1, 4):
    config = small_config(num_train_steps=8, steps_per_dispatch=per_dispatch,
                          log_every_steps=4, checkpoint_every_steps=4,
                          learning_rate=1e30, grad_clip_norm=0.0,
                          warmup_steps=0)
    workdir = tmp_path / str(per_dispatch)
    with pytest.raises(FloatingPointError, match=r"at step \d+\.") as error:
      loop.train_and_evaluate(config, str(workdir))
    messages.append(str(error.value))
    assert os.listdir(workdir / "checkpoints") == []
  assert messages[0] == messages[1].replace(str(tmp_path / "4"),
                                            str(tmp_path / "1"))
  assert "at step 4." not in messages[1]  # not a dispatch's last step


def test_plan_ends_the_masked_steps_with_a_whole_dispatch():
  measured = dict(elapsed_seconds=10.0, done=24, step_seconds=0.1,
                  fixed_seconds=5.0, eval_seconds=2.0, eval_every_steps=60,
                  save_seconds=1.5, save_every_steps=10_000,
                  tuning_steps=18, tuning_seconds=3.0)
  longest = budget.plan_total_steps(budget_seconds=100.0, upper_bound=10_000,
                                    **measured)
  aligned = budget.plan_total_steps(budget_seconds=100.0, upper_bound=10_000,
                                    steps_per_dispatch=12, **measured)
  assert (aligned - 18) % 12 == 0 and longest - 12 < aligned <= longest
  # Nothing longer than the minimum fits: the minimum, whatever it is.
  assert budget.plan_total_steps(budget_seconds=1.0, upper_bound=10_000,
                                 steps_per_dispatch=12, **measured) == 43


def test_steps_per_dispatch_must_be_positive(tmp_path):
  with pytest.raises(ValueError, match="steps_per_dispatch=0 must be"):
    loop.train_and_evaluate(small_config(steps_per_dispatch=0), str(tmp_path))


def test_time_budget_plans_after_a_whole_dispatch_from_per_step_times(
    tmp_path, monkeypatch):
  """With 4 steps per dispatch the plan falls due at step 28 (the
  compiling dispatch and 6 timed ones, more than the 21 steps it
  measures), its step time is the median interval between dispatches over
  their 4 steps, and it plans whole dispatches."""
  config = small_config(time_budget_minutes=1.0, steps_per_dispatch=4,
                        num_epochs=1000, eval_every_epochs=5)
  tracker = budget_tracker.BudgetTracker(
      config, str(tmp_path), plan=None, start_step=0, steps_per_epoch=4,
      upper_bound=4000)
  assert tracker.plan_after == 28
  # The two dispatches after the compiling one return at once (the queue
  # fills), the others 0.4 s apart.
  returns = iter([5.0, 5.01, 5.02, 5.42, 5.82, 6.22, 6.62])
  monkeypatch.setattr(budget_tracker.time, "perf_counter",
                      lambda: float(next(returns)))
  due = [tracker.step_done(done, 4000, None, 0.0) for done in range(4, 32, 4)]
  assert due == [False] * 6 + [True]
  tracker.first_step_seconds = 2.0
  plan = tracker.make_plan(28, 5.0, budget_tracker.Measurements(1.0, 1.0, 0.5))
  assert plan["step_seconds"] == pytest.approx(0.1)
  assert plan["total_steps"] % 4 == 0 and 28 < plan["total_steps"] < 4000


@pytest.mark.parametrize("start_step,per_dispatch,plan_after", [
    (0, 1, 21), (7, 1, 28), (0, 4, 28), (0, 18, 126), (5, 18, 144),
    (0, 117, 819)])
def test_plan_waits_for_the_measured_steps_and_six_timed_dispatches(
    tmp_path, start_step, per_dispatch, plan_after):
  config = small_config(time_budget_minutes=1.0,
                        steps_per_dispatch=per_dispatch)
  tracker = budget_tracker.BudgetTracker(
      config, str(tmp_path), plan=None, start_step=start_step,
      steps_per_epoch=4, upper_bound=4000)
  assert tracker.plan_after == plan_after
