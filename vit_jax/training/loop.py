"""Training and evaluation: `train_and_evaluate(config, workdir)`.

  run = build_run(config, workdir)    # data, model, state, restored
  for each step of the plan: train, log, evaluate, save
  a final evaluation if the run trained nothing

Steps go to the device one at a time, or config.steps_per_dispatch at a
time between the steps the loop acts after (dispatch.py).

The pure, jit-compiled steps are `steps.py`'s; this module does the I/O
around them. The pieces with state of their own are small objects:
`progress.Clock` (wall time and pauses), `progress.TrainMetrics` (metrics
between log lines, the throughput), `budget_tracker.BudgetTracker`
(measurements in, a plan out) and `dispatch.Phase` (the train step being
run, for one step and for a dispatch of several: masked, then the unmasked
tuning).
"""

import dataclasses
import os
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils

from vit_jax import config as config_lib
from vit_jax.checkpoints import orbax_checkpoints, pretrained
from vit_jax.data import augment, datasets
from vit_jax.kernels import matmuls
from vit_jax.model import options, variants, vit
from vit_jax.runtime import host, preemption, sharding
from vit_jax.training import (budget, budget_tracker, dispatch, metric_writer,
                              optim, progress, steps)

log = metric_writer.log


@dataclasses.dataclass
class Run:
  """What a run is made of, built once by `build_run`."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: jax.sharding.Mesh
  dataset: datasets.Dataset
  spec: config_lib.RunSpec  # the quantities derived from config and data
  mean: np.ndarray
  std: np.ndarray
  flip: bool
  model: vit.VisionTransformer
  manager: Any  # orbax CheckpointManager
  writer: metric_writer.MetricWriter
  eval_fn: Callable[..., dict]

  def make_phase(self, state: steps.TrainState,
                 learning_rate_fn: optax.Schedule, ema_start_step: int = 0,
                 unmasked: bool = False) -> dispatch.Phase:
    """The train step of `state` as it is (its layout, model, optimizer),
    for one step and for config.steps_per_dispatch steps at a time."""
    args = (self.mesh, steps.shardings_of(state), learning_rate_fn)
    options = config_lib.train_step_options(
        self.config, self.mean, self.std, self.flip, ema_start_step,
        crops_on_host=self.dataset.crops_on_host)
    options["compiler_options"] = matmuls.xla_compiler_options(
        self.model.matmul_dtype)
    per_dispatch = self.config.steps_per_dispatch
    return dispatch.Phase(
        steps.compile_train_step(*args, **options),
        steps.compile_train_steps(*args, per_dispatch, **options)
        if per_dispatch > 1 else None, unmasked=unmasked)

  @property
  def unmasked_model(self) -> vit.VisionTransformer:
    """The model without patch dropout: the same params, every patch."""
    return self.model.clone(patch_dropout_rate=0.0)

  def evaluate(self, state: steps.TrainState) -> dict[str, float]:
    """Test metrics of the params, and of their moving average as ema_*."""
    batch_size = self.config.eval_batch_size
    metrics = steps.evaluate(self.eval_fn, state.params, self.dataset,
                             batch_size, self.mesh)
    if state.ema_params is not None:
      ema = steps.evaluate(self.eval_fn, state.ema_params, self.dataset,
                           batch_size, self.mesh)
      metrics.update(ema_loss=ema["loss"], ema_accuracy=ema["accuracy"])
    return metrics


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Returns the metrics of the last evaluation. Holds a lock on `workdir`
  while it runs; on SIGTERM/SIGINT it checkpoints the current step and
  raises `preemption.Preempted`. With config.time_budget_minutes, the number
  of steps is planned to fit that wall time from this call on (budget.py).
  """
  clock = progress.Clock(time.perf_counter())
  host.split_cpu_into_devices(  # if JAX has not started
      config.cpu_devices, (config.batch_size, config.eval_batch_size))
  config_lib.validate_config(config)
  with orbax_checkpoints.locked_workdir(workdir), \
      preemption.StopSignals() as stop:
    run, state, start_step, plan = build_run(config, workdir)
    try:
      with metric_writer.StatusLine() as status:  # a terminal's progress bar
        return _train(run, state, start_step, plan, stop, clock, status)
    finally:
      # Let a save in flight finish even when training stops with an
      # error, so the last good checkpoint is complete on disk.
      orbax_checkpoints.finish(run.manager)
      run.writer.close()


def build_run(config: ml_collections.ConfigDict, workdir: str):
  """The run's data, model, optimizer and state, restored from `workdir`'s
  latest checkpoint (or initialised from config.init_from). Returns (run,
  state, start step, the time plan saved in workdir or None)."""
  mesh = sharding.make_mesh(config.mesh)
  dataset = datasets.load(config)
  spec = config_lib.run_spec(config, mesh, dataset)
  plan = budget.read_plan(workdir) if config.time_budget_minutes else None
  if plan is not None:
    log(f"Time budget: training to step {plan['total_steps']}, as planned "
        f"in {os.path.join(workdir, budget.PLAN_FILE)}.")
  mean, std = augment.pixel_stats(config.normalization, dataset)
  metric_writer.write_model_info(workdir, dataset.name, dataset.class_names,
                                 spec.image_shape, mean, std)
  log(f"Data: {dataset.name} from {dataset.source}: "
      f"{dataset.num_train} train / {dataset.num_test} test "
      f"images of shape {dataset.image_shape}, {dataset.num_classes} "
      "classes.")
  model = variants.build_model(config.model, dataset.num_classes)
  _, learning_rate_fn = _schedule(config, spec, plan)
  state = steps.create_train_state(
      model, spec.image_shape, optim.make_optimizer(config, learning_rate_fn),
      config.seed, mesh, config.fsdp_min_size, ema=config.ema_decay > 0)
  _log_model(config, spec, mesh, state, plan)
  manager = orbax_checkpoints.make_manager(workdir, config.keep_checkpoints)
  state, restored_step = orbax_checkpoints.restore_latest(manager, state)
  if restored_step is not None:
    log(f"Resumed from the checkpoint of step {restored_step} in {workdir}.")
  elif config.init_from is not None:
    state = init_from_pretrained(config, state, spec.image_shape[:2])
  start_step = restored_step or 0
  eval_fn = steps.compile_eval_step(
      mesh, steps.shardings_of(state.params),
      matmuls.xla_compiler_options(model.matmul_dtype),
      **config_lib.eval_step_options(config, model.apply, mean, std))
  flip = dataset.flip if config.random_flip is None else config.random_flip
  run = Run(config, workdir, mesh, dataset, spec, mean, std, flip, model,
            manager, metric_writer.MetricWriter(workdir, start_step), eval_fn)
  return run, state, start_step, plan


def _schedule(config, spec: config_lib.RunSpec, plan: Optional[dict]
              ) -> tuple[int, optax.Schedule]:
  """(total steps, learning-rate schedule) of the run: the plan's if there
  is one, else the config's upper bound."""
  if plan is not None:
    return (int(plan["total_steps"]),
            budget.planned_schedule(config, plan, spec.steps_per_epoch))
  return spec.upper_bound, optim.learning_rate_schedule(
      config, spec.upper_bound, spec.steps_per_epoch)


def _log_model(config, spec: config_lib.RunSpec, mesh, state,
               plan: Optional[dict]) -> None:
  dims = config.model  # the name's dims may have been overridden: say them
  rate = dims.patch_dropout_rate
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  patch_dropout = (
      f", trained on {options.num_kept_patches(spec.num_patches, rate)} of its "
      f"{spec.num_patches} patches (patch dropout {rate:g})" if rate else "")
  bound = "at most " if config.time_budget_minutes and not plan else ""
  total_steps = plan["total_steps"] if plan else spec.upper_bound
  log(f"Model: {dims.name} (patch {dims.patch_size}, width {dims.hidden_size}"
      f", {dims.num_layers} layers, {dims.num_heads} heads, MLP "
      f"{dims.mlp_dim}), {num_params:,} parameters{patch_dropout}; "
      f"{mesh.size} device(s) ({jax.devices()[0].platform}) in "
      f"{jax.process_count()} process(es), mesh {dict(mesh.shape)}; "
      f"{bound}{total_steps} steps of batch {config.batch_size} "
      f"({spec.steps_per_epoch} per epoch).")
  if (dims.matmul_dtype == "bfloat16" and jax.default_backend() == "cpu"
      and not matmuls.cpu_has_bfloat16_dots()):
    log("Warning: config.model.matmul_dtype='bfloat16' on a CPU without "
        "bfloat16 dot instructions (AVX512_BF16, AMX): the products widen "
        "to float32 and run slower than float32 ones. Unset it here.")


def init_from_pretrained(config: ml_collections.ConfigDict,
                         state: steps.TrainState,
                         image_size: tuple[int, int]) -> steps.TrainState:
  """`state` with params from config.init_from, fitted to the model."""
  loaded, settings = pretrained.load_params(config.init_from,
                                            config.model.num_heads)
  pretrained.check_settings(settings, config.model)
  grid = (image_size[0] // config.model.patch_size,
          image_size[1] // config.model.patch_size)
  params, report = pretrained.adapt_params(
      loaded, sharding.to_host(state.params), grid,
      method=config.posemb_resize)
  log(f"Initialised from {config.init_from} ({settings['source']}): "
      + "; ".join(report) + ".")
  return state.replace(
      params=sharding.put(params, steps.shardings_of(state.params)))


def _train(run: Run, state: steps.TrainState, start_step: int,
           plan: Optional[dict], stop: preemption.StopSignals,
           clock: progress.Clock, status: metric_writer.StatusLine
           ) -> dict[str, float]:
  """Trains from start_step to the plan's last step; the last evaluation's
  metrics."""
  config, spec = run.config, run.spec
  total_steps, learning_rate_fn = _schedule(config, spec, plan)
  tracker = budget_tracker.BudgetTracker(
      config, run.workdir, plan=plan, start_step=start_step,
      steps_per_epoch=spec.steps_per_epoch, upper_bound=spec.upper_bound)
  meter = progress.TrainMetrics(
      batch_size=config.batch_size, steps_per_epoch=spec.steps_per_epoch,
      skip_nonfinite=config.skip_nonfinite_steps,
      checkpoint_dir=str(run.manager.directory), clock=clock,
      start_step=start_step)
  bar = progress.ProgressBar(status, batch_size=config.batch_size,
                             start_step=start_step, clock=clock)
  phase = run.make_phase(state, learning_rate_fn)
  batches = run.dataset.train_batches(config.batch_size, config.seed,
                                      start_step, run.mesh)
  best_accuracy = orbax_checkpoints.best_accuracy(run.workdir)  # before writes
  eval_metrics = {}
  step = start_step
  while step < total_steps:  # a time budget may change total_steps
    if (spec.tuning_steps and not phase.unmasked
        and step >= total_steps - spec.tuning_steps):
      meter.flush(step, run.writer)
      state, phase = _start_unmasked_tuning(run, state, step, total_steps,
                                            learning_rate_fn)
    count = dispatch.steps_in_dispatch(
        step, total_steps, config.steps_per_dispatch,
        dispatch.loop_acts_after(config, spec, phase, total_steps,
                                 tracker.plan_after))
    batch = [next(batches) for _ in range(count)]
    began = time.perf_counter()
    state, metrics, compiled = phase.run(state, batch)
    meter.add(metrics)
    done = step + count
    if step == start_step:  # keep compilation out of the throughput figure
      jax.block_until_ready(metrics)
      tracker.first_step_seconds = meter.seconds_since_timer()
      log(f"Compiled and ran the first {_dispatch_name(count, phase)} in "
          f"{tracker.first_step_seconds:.1f} s.")
      meter.restart_timer(done)
      bar.restart(done)
    elif compiled:  # a new phase's or dispatch size's: out of the throughput
      jax.block_until_ready(metrics)
      seconds = time.perf_counter() - began
      clock.add_pause(seconds)
      log(f"Compiled and ran the first {_dispatch_name(count, phase)} in "
          f"{seconds:.1f} s.")
    if tracker.step_done(done, total_steps, metrics, clock.paused):
      elapsed = clock.elapsed()
      with clock.pause():
        plan = tracker.make_plan(done, elapsed, _measure_for_plan(
            run, state, batch[-1], done, meter, learning_rate_fn))
        total_steps, learning_rate_fn, state, phase = _follow_plan(
            run, state, plan)
    if done % config.log_every_steps == 0 or done == total_steps:
      meter.flush(done, run.writer)
    bar.update(done, total_steps)
    evaluate_now = budget.evaluates_after(done, total_steps,
                                          spec.eval_every_steps)
    stop_signal = _agreed_stop(stop, done, config.log_every_steps)
    save_now = (done % config.checkpoint_every_steps == 0 or
                done == total_steps or stop_signal is not None)
    if evaluate_now or save_now:
      jax.block_until_ready(state)
      with clock.pause() as pause_began:  # not counted as training time
        if evaluate_now:
          bar.announce(f"evaluating at step {done}")
          eval_metrics = run.evaluate(state)
          tracker.evaluated(time.perf_counter() - pause_began)
          eval_metrics["epoch"] = done / spec.steps_per_epoch
          run.writer.write(done, "eval", eval_metrics)
          best_accuracy = _keep_best(run, state, done, eval_metrics,
                                     best_accuracy)
        if save_now:
          bar.announce(f"saving the checkpoint of step {done}")
          meter.check_finite(done)  # never save a state not yet checked
          orbax_checkpoints.save(run.manager, state)
        if (evaluate_now and tracker.due_for_check() and stop_signal is None
            and done < total_steps - spec.tuning_steps):  # not in tuning
          revised = tracker.revise(done, pause_began, clock.paused,
                                   clock.elapsed())
          if revised is not None and revised["total_steps"] > done:
            total_steps, learning_rate_fn, state, phase = _follow_plan(
                run, state, revised)
          elif revised is not None:  # ends here, just evaluated
            total_steps = done
            meter.flush(done, run.writer)
            orbax_checkpoints.save(run.manager, state)  # no-op if saved
    if stop_signal is not None:
      run.manager.wait_until_finished()
      raise preemption.Preempted(stop_signal, done, run.manager.directory)
    step = done
  return eval_metrics or run.evaluate(state)  # nothing trained: restored


def _dispatch_name(count: int, phase: dispatch.Phase) -> str:
  """What a dispatch of `count` steps of `phase` is, for the log."""
  steps_run = (f"{count} train steps in one dispatch" if count > 1
               else "train step")
  return steps_run + (" of the unmasked tuning" if phase.unmasked else "")


def _start_unmasked_tuning(run: Run, state, step: int, total_steps: int,
                           learning_rate_fn) -> tuple[Any, dispatch.Phase]:
  """The state and phase that train on every patch after step `step`. The
  EMA restarts its ramp where the tuning starts, so that it averages the
  tuned params, not the run."""
  state = state.replace(apply_fn=run.unmasked_model.apply)
  phase = run.make_phase(state, learning_rate_fn,
                         ema_start_step=total_steps - run.spec.tuning_steps,
                         unmasked=True)
  log(f"Unmasked tuning: steps {step + 1}-{total_steps} train on all "
      f"{run.spec.num_patches} patches, the learning rate decaying from "
      f"{run.config.unmasked_tuning_learning_rate:g} to 0.")
  return state, phase


def _follow_plan(run: Run, state, plan: dict):
  """(total steps, schedule, state, phase) of training to `plan` from here:
  the optimizer and train step rebuilt for its schedule (the optimizer's
  state does not depend on the schedule; the eval step takes only
  params)."""
  total_steps, learning_rate_fn = _schedule(run.config, run.spec, plan)
  state = state.replace(tx=optim.make_optimizer(run.config, learning_rate_fn))
  return (total_steps, learning_rate_fn, state,
          run.make_phase(state, learning_rate_fn))


def _measure_for_plan(run: Run, state, batch, done: int,
                      meter: progress.TrainMetrics, learning_rate_fn
                      ) -> budget.Measurements:
  """Times what the plan needs, once each: compiling the eval step and one
  evaluation, a real checkpoint of step `done` written through, and (with
  an unmasked tuning) its step's compilation and a few of its steps, run
  on a copy of the state and the last batch."""
  test_batch = next(run.dataset.eval_batches(run.config.eval_batch_size,
                                             run.mesh))
  tick = time.perf_counter()
  jax.block_until_ready(run.eval_fn(state.params, *test_batch))
  eval_compile = time.perf_counter() - tick
  tick = time.perf_counter()
  run.evaluate(state)
  evaluation = time.perf_counter() - tick
  meter.check_finite(done)
  tick = time.perf_counter()
  orbax_checkpoints.save(run.manager, state)
  run.manager.wait_until_finished()
  save = time.perf_counter() - tick
  if not run.spec.tuning_steps:
    return budget.Measurements(eval_compile, evaluation, save)
  copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree),
                 out_shardings=steps.shardings_of(state))(state)
  copy = copy.replace(apply_fn=run.unmasked_model.apply)
  tuning_fn = run.make_phase(copy, learning_rate_fn).train_fn
  seconds = []
  for _ in range(1 + budget.MEASURED_TUNING_STEPS):
    tick = time.perf_counter()
    copy, metrics = tuning_fn(copy, *batch)  # the step donates its input
    jax.block_until_ready(metrics)
    seconds.append(time.perf_counter() - tick)
  return budget.Measurements(eval_compile, evaluation, save, seconds[0],
                             float(np.median(seconds[1:])))


def _keep_best(run: Run, state, done: int, metrics: dict,
               best_accuracy: float) -> float:
  """Saves the params if config.keep_best and they are the best so far;
  the best accuracy now."""
  if not run.config.keep_best or metrics["accuracy"] <= best_accuracy:
    return best_accuracy
  orbax_checkpoints.save_best(run.workdir, sharding.to_host(state.params),
                              done, metrics)
  log(f"New best eval accuracy {metrics['accuracy']:.4f}: params saved to "
      f"{run.workdir}/{orbax_checkpoints.BEST_DIR}.")
  return metrics["accuracy"]


def _agreed_stop(stop: preemption.StopSignals, done: int,
                 log_every_steps: int) -> Optional[int]:
  """The signal to stop on after step `done`, or None. Processes may get a
  signal at different times; they must stop at the same step (saving is
  collective), so with several processes they compare at log steps."""
  if jax.process_count() == 1:
    return stop.received
  if done % log_every_steps:
    return None
  received = multihost_utils.process_allgather(np.int32(stop.received or 0))
  return int(received.max()) or None
