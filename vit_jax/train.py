"""Training and evaluation: `train_and_evaluate(config, workdir)`.

The loop: data, model and state, resumption, the time budget, logging,
evaluation and checkpoints, around the pure, jit-compiled steps of
`steps.py`. Training's I/O happens here, never in the steps.
"""

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from vit_jax import (augment, budget, checkpoints, datasets, host,
                     input_pipeline, metric_writer, models, optim,
                     preemption, pretrained, sharding, steps, tools,
                     validation, variants)


_MAX_STEPS_IN_FLIGHT = 2


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
  metric_writer.log(f"Initialised from {config.init_from} "
                    f"({settings['source']}): " + "; ".join(report) + ".")
  return state.replace(
      params=sharding.put(params, steps.shardings_of(state.params)))


def _mean_metrics(pending: list[dict[str, jax.Array]]) -> dict[str, float]:
  """Means over the steps; skipped non-finite steps are left out."""
  stacked = jax.device_get(jax.tree.map(lambda *xs: jnp.stack(xs), *pending))
  finite = np.isfinite(stacked["loss"]) & np.isfinite(stacked["grad_norm"])
  if not finite.any():
    return {k: float("nan") for k in stacked}
  return {k: float(np.mean(v[finite])) for k, v in stacked.items()}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Returns the metrics of the last evaluation. Holds a lock on `workdir`
  while it runs; on SIGTERM/SIGINT it checkpoints the current step and
  raises `preemption.Preempted`. With config.time_budget_minutes, the number
  of steps is planned to fit that wall time from this call on (budget.py).
  """
  start_time = time.perf_counter()
  host.split_cpu_into_devices(  # if JAX has not started
      config.cpu_devices, (config.batch_size, config.eval_batch_size))
  validation.validate_config(config)
  with checkpoints.locked_workdir(workdir), \
      preemption.StopSignals() as stop:
    return _train_and_evaluate(config, workdir, stop, start_time)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        stop: preemption.StopSignals, start_time: float
                        ) -> dict[str, float]:
  mesh = sharding.make_mesh(config.mesh)
  sharding.check_batch_size(config.batch_size, mesh, "batch_size")
  sharding.check_batch_size(config.eval_batch_size, mesh, "eval_batch_size")
  micro_batch = config.batch_size // config.accum_steps
  if micro_batch % mesh.size:
    raise ValueError(
        f"The micro-batch config.batch_size / config.accum_steps = "
        f"{micro_batch} does not split over {mesh.size} devices; pick "
        f"accum_steps so that batch_size / accum_steps is a multiple of "
        f"{mesh.size}.")
  log = metric_writer.log

  # Data.
  dataset = datasets.load(config)
  num_train = len(dataset.train_images)
  steps_per_epoch = num_train // config.batch_size
  if steps_per_epoch == 0:
    raise ValueError(f"config.batch_size={config.batch_size} exceeds the "
                     f"{num_train} training examples; lower it.")
  upper_bound = config.num_train_steps or config.num_epochs * steps_per_epoch
  total_steps = upper_bound
  time_plan = (budget.read_plan(workdir) if config.time_budget_minutes
               else None)
  if time_plan is not None:
    total_steps = int(time_plan["total_steps"])
    log(f"Time budget: training to step {total_steps}, as planned in "
        f"{os.path.join(workdir, budget.PLAN_FILE)}.")
  flip = (dataset.flip if config.random_flip is None else config.random_flip)
  mean, std = augment.pixel_stats(config.normalization, dataset)
  height, width, channels = dataset.image_shape
  if config.image_size is not None:
    height = width = config.image_size
  tools.write_model_info(workdir, dataset, (height, width, channels), mean,
                         std)
  log(f"Data: {dataset.name} from {dataset.source}: {num_train} train / "
      f"{len(dataset.test_images)} test images of shape "
      f"{dataset.image_shape}, {dataset.num_classes} classes.")

  # Model and optimizer.
  model = variants.build_model(config.model, dataset.num_classes)
  learning_rate_fn = (
      budget.planned_schedule(config, time_plan, steps_per_epoch) if time_plan
      else optim.learning_rate_schedule(config, total_steps, steps_per_epoch))
  optimizer = optim.make_optimizer(config, learning_rate_fn)
  state = steps.create_train_state(model, (height, width, channels),
                                   optimizer, config.seed, mesh,
                                   config.fsdp_min_size,
                                   ema=config.ema_decay > 0)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  # The last steps of a run with patch dropout may train on every patch
  # (config.unmasked_tuning_epochs): the same params, another train step.
  tuning_steps = optim.unmasked_tuning_steps(config, steps_per_epoch)
  if tuning_steps >= upper_bound:
    raise ValueError(
        f"config.unmasked_tuning_epochs={config.unmasked_tuning_epochs} "
        f"({tuning_steps} steps) leaves nothing of the run's {upper_bound} "
        "steps to train with patch dropout; make it shorter.")
  unmasked_model = model.clone(patch_dropout_rate=0.0)
  dims = config.model  # the name's dims may have been overridden: say them
  num_patches = (height // dims.patch_size) * (width // dims.patch_size)
  rate = dims.patch_dropout_rate
  patch_dropout = (
      f", trained on {models.num_kept_patches(num_patches, rate)} of its "
      f"{num_patches} patches (patch dropout {rate:g})" if rate else "")
  log(f"Model: {dims.name} (patch {dims.patch_size}, width {dims.hidden_size}"
      f", {dims.num_layers} layers, {dims.num_heads} heads, MLP "
      f"{dims.mlp_dim}), {num_params:,} parameters{patch_dropout}; "
      f"{mesh.size} device(s) ({jax.devices()[0].platform}) in "
      f"{jax.process_count()} process(es), mesh "
      f"{dict(mesh.shape)}; "
      f"{'at most ' if config.time_budget_minutes and not time_plan else ''}"
      f"{total_steps} steps of batch {config.batch_size} ({steps_per_epoch} "
      "per epoch).")

  # Resume.
  manager = checkpoints.make_manager(workdir, config.keep_checkpoints)
  state, restored_step = checkpoints.restore_latest(manager, state)
  start_step = restored_step or 0
  if restored_step is not None:
    log(f"Resumed from the checkpoint of step {restored_step} in {workdir}.")
  elif config.init_from is not None:
    state = init_from_pretrained(config, state, (height, width))
  writer = metric_writer.MetricWriter(workdir, resume_step=start_step)

  def compile_train_fn(of_state, ema_start_step=0):
    """The train step of `of_state` as it is: its layout, model and
    optimizer."""
    return steps.compile_train_step(config, mesh,
                                    steps.shardings_of(of_state), mean, std,
                                    flip, learning_rate_fn, ema_start_step)

  train_fn = compile_train_fn(state)
  unmasked_tuning = False  # whether train_fn trains on every patch
  eval_fn = steps.compile_eval_step(config, mesh, model.apply,
                                    steps.shardings_of(state.params), mean,
                                    std)
  batches = input_pipeline.train_batches(
      dataset.train_images, dataset.train_labels, config.batch_size,
      config.seed, start_step, mesh)

  pending = []  # per-step metrics, still on device
  eval_metrics = {}
  # Evaluations, saves and the plan pause training: their seconds so far.
  paused = 0.0
  # The throughput logged at a flush counts from (time, step, paused).
  timer_start, timer_step, timer_paused = time.perf_counter(), start_step, 0.0
  # With a time budget and no plan yet: the step after which to make one.
  plan_after = (start_step + 1 + budget.MEASURED_STEPS
                if config.time_budget_minutes and time_plan is None else None)
  step_ends = []  # times at which the steps before the plan returned
  first_step_seconds = None
  # The run that makes the plan checks it after each evaluation against its
  # step time and mean evaluation since the plan (budget.revise): the steps
  # are timed in windows from check_mark, (time, step, paused), set after
  # the first step that follows a plan or a check so that a recompilation
  # does not count; timed_windows holds (seconds, steps) of the windows so
  # far, for budget.recent_step_seconds.
  check_mark, timed_windows, eval_times = None, [], []

  def check_finite(step):
    """Raises if a pending step's loss or gradient is NaN/Inf, unless such
    steps are skipped (then it logs them). One small transfer."""
    if not pending:
      return
    values = np.asarray(jax.device_get(
        [(m["loss"], m["grad_norm"]) for m in pending]))
    bad = ~np.all(np.isfinite(values), axis=1)
    if not bad.any():
      return
    bad_steps = step - len(pending) + 1 + np.flatnonzero(bad)
    what = ("loss" if not np.isfinite(values[bad][0, 0]) else
            "gradient norm")
    value = values[bad][0, 0 if what == "loss" else 1]
    if config.skip_nonfinite_steps:
      log(f"Skipped the update of step(s) {bad_steps.tolist()}: non-finite "
          "loss or gradient.")
      return
    raise FloatingPointError(
        f"The training {what} became {value} at step {bad_steps[0]}. Likely "
        "causes: a learning rate too high (--config.learning_rate), no "
        "gradient clipping (--config.grad_clip_norm), or bad input data; "
        "--config.skip_nonfinite_steps=True skips such steps instead. This "
        f"state was not saved; the checkpoints in {manager.directory} are "
        "intact.")

  def flush(step):
    """Logs the mean of the metrics accumulated since the last flush."""
    nonlocal pending, timer_start, timer_step, timer_paused
    check_finite(step)
    metrics = _mean_metrics(pending)
    pending = []
    elapsed = time.perf_counter() - timer_start - (paused - timer_paused)
    metrics["images_per_second"] = ((step - timer_step) * config.batch_size /
                                    max(elapsed, 1e-9))
    metrics["epoch"] = step / steps_per_epoch
    writer.write(step, "train", metrics)
    timer_start, timer_step, timer_paused = time.perf_counter(), step, paused

  def agreed_stop(done):
    """The signal to stop on after step `done`, or None. Processes may get
    a signal at different times; they must stop at the same step (saving is
    collective), so with several processes they compare at log steps."""
    if jax.process_count() == 1:
      return stop.received
    if done % config.log_every_steps:
      return None
    received = multihost_utils.process_allgather(
        np.int32(stop.received or 0))
    return int(received.max()) or None

  def evaluate_all(state):
    """Test metrics of the params, and of their moving average as ema_*."""
    metrics = steps.evaluate(eval_fn, state.params, dataset,
                             config.eval_batch_size, mesh)
    if state.ema_params is not None:
      ema = steps.evaluate(eval_fn, state.ema_params, dataset,
                           config.eval_batch_size, mesh)
      metrics.update(ema_loss=ema["loss"], ema_accuracy=ema["accuracy"])
    return metrics

  def plan_time_budget(done):
    """Fixes total_steps to fit the time budget (budget.py); the schedule
    and the steps are rebuilt for it."""
    nonlocal time_plan

    def time_evaluation():
      # One batch compiles the eval step, then one evaluation as training
      # runs them.
      test_batch = next(input_pipeline.eval_batches(
          dataset.test_images, dataset.test_labels, config.eval_batch_size,
          mesh))
      tick = time.perf_counter()
      jax.block_until_ready(eval_fn(state.params, *test_batch))
      compile_seconds = time.perf_counter() - tick
      tick = time.perf_counter()
      evaluate_all(state)
      return compile_seconds, time.perf_counter() - tick

    def time_save():  # a real checkpoint of step `done`, written through
      check_finite(done)
      tick = time.perf_counter()
      checkpoints.save(manager, state)
      manager.wait_until_finished()
      return time.perf_counter() - tick

    def time_unmasked_tuning():
      # Compiles the tuning's step and times a few on the last batch, run
      # on a copy of the state (the step donates its input), then dropped.
      copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree),
                     out_shardings=steps.shardings_of(state))(state)
      copy = copy.replace(apply_fn=unmasked_model.apply)
      tuning_fn = compile_train_fn(copy)
      seconds = []
      for _ in range(1 + budget.MEASURED_TUNING_STEPS):
        tick = time.perf_counter()
        copy, metrics = tuning_fn(copy, *batch)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - tick)
      del copy
      return seconds[0], float(np.median(seconds[1:]))

    time_plan = budget.plan(
        config, workdir, done=done, step_ends=step_ends,
        first_step_seconds=first_step_seconds,
        elapsed_seconds=time.perf_counter() - start_time,
        time_evaluation=time_evaluation, time_save=time_save,
        steps_per_epoch=steps_per_epoch, upper_bound=total_steps,
        time_unmasked_tuning=time_unmasked_tuning)
    follow_plan()

  def follow_plan():
    """Trains to time_plan from here: its step count, its schedule, and the
    optimizer and train step rebuilt for that (the optimizer's state does
    not depend on the schedule; the eval step takes only params)."""
    nonlocal total_steps, learning_rate_fn, state, train_fn
    nonlocal check_mark
    total_steps = time_plan["total_steps"]
    learning_rate_fn = budget.planned_schedule(config, time_plan,
                                               steps_per_epoch)
    state = state.replace(tx=optim.make_optimizer(config, learning_rate_fn))
    train_fn = compile_train_fn(state)
    check_mark = None

  def start_unmasked_tuning(step):
    """Trains on every patch after step `step`: the state's model is the
    one without patch dropout, and its train step is compiled. The masked
    steps' metrics are logged apart. The EMA restarts its ramp where the
    tuning starts, so that it averages the tuned params, not the run."""
    nonlocal state, train_fn, unmasked_tuning
    if pending:
      flush(step)
    state = state.replace(apply_fn=unmasked_model.apply)
    train_fn = compile_train_fn(state,
                                ema_start_step=total_steps - tuning_steps)
    unmasked_tuning = True
    log(f"Unmasked tuning: steps {step + 1}-{total_steps} train on all "
        f"{num_patches} patches, the learning rate decaying from "
        f"{config.unmasked_tuning_learning_rate:g} to 0.")

  def revise_time_budget(done, train_end):
    """Revises total_steps if the plan no longer fits (budget.py), timing
    the steps from check_mark to `train_end`. A revision may end the run
    at `done`, just evaluated: then it is saved there, not recompiled (with
    an unmasked tuning, the tuning starts there instead)."""
    nonlocal check_mark, total_steps
    mark_time, mark_step, mark_paused = check_mark
    if done - mark_step < budget.MEASURED_STEPS:
      return  # too few steps to time; the next evaluation checks
    timed_windows.append((train_end - mark_time - (paused - mark_paused),
                          done - mark_step))
    if budget.revise(
        config, workdir, time_plan, done=done,
        step_seconds=budget.recent_step_seconds(timed_windows),
        eval_seconds=float(np.mean(eval_times)),
        recompile_seconds=first_step_seconds,
        elapsed_seconds=time.perf_counter() - start_time,
        steps_per_epoch=steps_per_epoch, upper_bound=upper_bound):
      if time_plan["total_steps"] > done:
        follow_plan()
      else:
        total_steps = done
        if pending:  # logged as the last step's metrics
          flush(done)
        checkpoints.save(manager, state)  # a no-op if saved already
    check_mark = None  # timed again from the next step

  best_accuracy = checkpoints.best_accuracy(workdir)  # read before any write
  try:
    step = start_step
    while step < total_steps:  # a time budget may change total_steps
      tuning_start = None
      if (tuning_steps and not unmasked_tuning
          and step >= total_steps - tuning_steps):
        tuning_start = time.perf_counter()
        start_unmasked_tuning(step)
      batch = next(batches)
      state, metrics = train_fn(state, *batch)
      pending.append(metrics)
      done = step + 1
      if tuning_start is not None:  # its compilation, out of the throughput
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - tuning_start
        paused += seconds
        log(f"Compiled and ran the first step of the unmasked tuning in "
            f"{seconds:.1f} s.")
      if len(pending) > _MAX_STEPS_IN_FLIGHT:
        # Bound the asynchronous queue: waiting on an older step keeps the
        # device fed while deep queues of sharded programs could deadlock
        # XLA:CPU's collectives with many simulated devices on few cores.
        jax.block_until_ready(pending[-_MAX_STEPS_IN_FLIGHT - 1]["loss"])
      if step == start_step:  # keep compilation out of the throughput figure
        jax.block_until_ready(metrics)
        first_step_seconds = time.perf_counter() - timer_start
        log(f"Compiled and ran the first train step in "
            f"{first_step_seconds:.1f} s.")
        timer_start, timer_step = time.perf_counter(), done
        timer_paused = paused
      if plan_after is not None and done <= plan_after:
        step_ends.append(time.perf_counter())
        if done == plan_after and done < total_steps:
          pause_start = time.perf_counter()
          plan_time_budget(done)
          paused += time.perf_counter() - pause_start
      elif (plan_after is not None and check_mark is None
            and done < total_steps):
        # The first step after a plan or a check: time from here.
        jax.block_until_ready(metrics)
        check_mark = (time.perf_counter(), done, paused)
      if done % config.log_every_steps == 0 or done == total_steps:
        flush(done)
      evaluate_now = budget.evaluates_after(
          done, total_steps, steps_per_epoch * config.eval_every_epochs)
      stop_signal = agreed_stop(done)
      save_now = (done % config.checkpoint_every_steps == 0 or
                  done == total_steps or stop_signal is not None)
      if evaluate_now or save_now:
        jax.block_until_ready(state)
        pause_start = time.perf_counter()  # not counted as training time
        if evaluate_now:
          eval_metrics = evaluate_all(state)
          eval_times.append(time.perf_counter() - pause_start)
          eval_metrics["epoch"] = done / steps_per_epoch
          writer.write(done, "eval", eval_metrics)
          if config.keep_best and eval_metrics["accuracy"] > best_accuracy:
            best_accuracy = eval_metrics["accuracy"]
            checkpoints.save_best(workdir, sharding.to_host(state.params),
                                  done, eval_metrics)
            log(f"New best eval accuracy {eval_metrics['accuracy']:.4f}: "
                f"params saved to {workdir}/{checkpoints.BEST_DIR}.")
        if save_now:
          check_finite(done)  # never save a state whose loss was not checked
          checkpoints.save(manager, state)
        if (evaluate_now and check_mark is not None and stop_signal is None
            and done < total_steps - tuning_steps):  # not during tuning
          revise_time_budget(done, train_end=pause_start)
        paused += time.perf_counter() - pause_start
      if stop_signal is not None:
        manager.wait_until_finished()
        raise preemption.Preempted(stop_signal, done, manager.directory)
      step = done
    if not eval_metrics:  # nothing left to train: report the restored state
      eval_metrics = evaluate_all(state)
  finally:
    # Let a save in flight finish even when training stops with an error,
    # so the last good checkpoint is complete on disk.
    checkpoints.finish(manager)
    writer.close()
  return eval_metrics
