"""Training and evaluation: `train_and_evaluate(config, workdir)`.

  run = build_run(config, workdir)    # data, model, state, restored (run.py)
  for each dispatch of the plan: train, log, evaluate, save
  a final evaluation if the run trained nothing

Steps go to the device one at a time, or config.steps_per_dispatch at a
time between the steps the loop acts after (dispatch.py).

The pure, jit-compiled steps are `steps.py`'s; this module does the I/O
around them. What changes between steps is held by `TrainingLoop`: the
state and the train step that advances it, and the schedule, which a time
plan or the unmasked tuning replaces. The pieces with state of their own
are small objects: `progress.Clock` (wall time and pauses),
`progress.TrainMetrics` (metrics between log lines, the throughput),
`budget_tracker.BudgetTracker` (measurements in, a plan out) and
`dispatch.Phase` (the train step, for one step and for a dispatch of
several: masked, then the unmasked tuning).
"""

import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from vit_jax import config as config_lib
from vit_jax.checkpoints import orbax_checkpoints
from vit_jax.runtime import host, preemption, sharding
from vit_jax.training import (budget, budget_tracker, dispatch, metric_writer,
                              optim, progress, steps)
from vit_jax.training import run as run_lib

log = metric_writer.log


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Returns the metrics of the last evaluation. Holds a lock on `workdir`
  while it runs; on SIGTERM/SIGINT it checkpoints the current step and
  raises `preemption.Preempted` (before the first step, it raises
  `preemption.StoppedInSetUp` at once). With config.time_budget_minutes,
  the number of steps is planned to fit that wall time from this call on
  (budget.py).
  """
  clock = progress.Clock(time.perf_counter())
  host.split_cpu_into_devices(  # if JAX has not started
      config.cpu_devices, (config.batch_size, config.eval_batch_size))
  config_lib.validate_config(config)
  with orbax_checkpoints.locked_workdir(workdir), \
      preemption.StopSignals() as stop:
    run, state, start_step, plan = run_lib.build_run(config, workdir)
    try:
      with metric_writer.StatusLine() as status:  # a terminal's progress bar
        loop = TrainingLoop(run, state, start_step, plan, clock, status)
        stop.training_started()
        return loop.train(stop)
    finally:
      # Let a save in flight finish even when training stops with an
      # error, so the last good checkpoint is complete on disk.
      orbax_checkpoints.finish(run.manager)
      run.writer.close()


class TrainingLoop:
  """A run's training from `start_step` on, and what changes as it goes.

  `state` and `phase` (the compiled train step that advances it) go
  together; `total_steps` and `learning_rate_fn` are the schedule, which a
  time plan replaces (with the optimizer and the phase) and the unmasked
  tuning keeps. The meter, the progress bar and the budget tracker watch.
  """

  def __init__(self, run: run_lib.Run, state: steps.TrainState,
               start_step: int, plan: Optional[dict], clock: progress.Clock,
               status: metric_writer.StatusLine):
    config, spec = run.config, run.spec
    self.run, self.state, self.start_step = run, state, start_step
    self.clock = clock
    self.total_steps, self.learning_rate_fn = run_lib.schedule(
        config, spec, plan)
    self.phase = run.make_phase(state, self.learning_rate_fn)
    self.tracker = budget_tracker.BudgetTracker(
        config, run.workdir, plan=plan, start_step=start_step,
        steps_per_epoch=spec.steps_per_epoch, upper_bound=spec.upper_bound)
    self.meter = progress.TrainMetrics(
        batch_size=config.batch_size, steps_per_epoch=spec.steps_per_epoch,
        skip_nonfinite=config.skip_nonfinite_steps,
        checkpoint_dir=str(run.manager.directory), clock=clock,
        start_step=start_step)
    self.bar = progress.ProgressBar(status, batch_size=config.batch_size,
                                    start_step=start_step, clock=clock)
    self.batches = run.dataset.train_batches(config.batch_size, config.seed,
                                             start_step, run.mesh)
    # Read before this run writes any.
    self.best_accuracy = orbax_checkpoints.best_accuracy(run.workdir)
    self.eval_metrics: dict[str, float] = {}

  def train(self, stop: preemption.StopSignals) -> dict[str, float]:
    """Trains to the last step of the schedule; the last evaluation's
    metrics. On a stop signal, saves and raises `preemption.Preempted`."""
    step = self.start_step
    while step < self.total_steps:  # a time plan may change total_steps
      self._start_tuning_if_due(step)
      batch = self._next_dispatch(step)
      done, metrics = self._run_dispatch(step, batch)
      self._plan_if_measured(done, metrics, batch[-1])
      if (done % self.run.config.log_every_steps == 0
          or done == self.total_steps):
        self.meter.flush(done, self.run.writer)
      self.bar.update(done, self.total_steps)
      stop_signal = _agreed_stop(stop, done, self.run.config.log_every_steps)
      self._evaluate_and_save(done, stop_signal)
      if stop_signal is not None:
        self.run.manager.wait_until_finished()
        raise preemption.Preempted(stop_signal, done,
                                   self.run.manager.directory)
      step = done
    # Nothing evaluated: a finished run was restored.
    return self.eval_metrics or self.run.evaluate(self.state)

  def _start_tuning_if_due(self, step: int) -> None:
    """From the unmasked tuning's first step on, trains on every patch.
    The EMA restarts its ramp there, so that it averages the tuned params,
    not the run."""
    tuning_start = self.total_steps - self.run.spec.tuning_steps
    if (not self.run.spec.tuning_steps or self.phase.unmasked
        or step < tuning_start):
      return
    self.meter.flush(step, self.run.writer)
    self.state = self.state.replace(apply_fn=self.run.unmasked_model.apply)
    self.phase = self.run.make_phase(self.state, self.learning_rate_fn,
                                     ema_start_step=tuning_start,
                                     unmasked=True)
    log(f"Unmasked tuning: steps {step + 1}-{self.total_steps} train on all "
        f"{self.run.spec.num_patches} patches, the learning rate decaying "
        f"from {self.run.config.unmasked_tuning_learning_rate:g} to 0.")

  def _next_dispatch(self, step: int) -> list[tuple[jax.Array, jax.Array]]:
    """The batches of the steps after `step` that run as one dispatch."""
    config = self.run.config
    count = dispatch.steps_in_dispatch(
        step, self.total_steps, config.steps_per_dispatch,
        dispatch.loop_acts_after(config, self.run.spec, self.phase,
                                 self.total_steps, self.tracker.plan_after))
    return [next(self.batches) for _ in range(count)]

  def _run_dispatch(self, step: int, batch: list) -> tuple[int, Any]:
    """Runs `batch`'s steps after `step`: (the step reached, their
    metrics). A compilation's time is kept out of the throughput and, after
    the first, out of the training time."""
    began = time.perf_counter()
    self.state, metrics, compiled = self.phase.run(self.state, batch)
    self.meter.add(metrics)
    done = step + len(batch)
    if step == self.start_step:
      jax.block_until_ready(metrics)
      self.tracker.first_step_seconds = self.meter.seconds_since_timer()
      self._log_compiled(len(batch), self.tracker.first_step_seconds)
      self.meter.restart_timer(done)
      self.bar.restart(done)
    elif compiled:  # a new phase's or dispatch size's
      jax.block_until_ready(metrics)
      seconds = time.perf_counter() - began
      self.clock.add_pause(seconds)
      self._log_compiled(len(batch), seconds)
    return done, metrics

  def _log_compiled(self, count: int, seconds: float) -> None:
    steps_run = (f"{count} train steps in one dispatch" if count > 1
                 else "train step")
    tuning = " of the unmasked tuning" if self.phase.unmasked else ""
    log(f"Compiled and ran the first {steps_run}{tuning} in {seconds:.1f} s.")

  def _plan_if_measured(self, done: int, metrics, last_batch) -> None:
    """Makes the time plan once the tracker has timed enough steps, and
    trains to it."""
    if not self.tracker.step_done(done, self.total_steps, metrics,
                                  self.clock.paused):
      return
    elapsed = self.clock.elapsed()
    with self.clock.pause():
      measured = self._measure_for_plan(done, last_batch)
      self._follow(self.tracker.make_plan(done, elapsed, measured))

  def _evaluate_and_save(self, done: int, stop_signal: Optional[int]
                         ) -> None:
    """Evaluates and/or saves after step `done` when due (saves before a
    stop too), paused from the training time; after an evaluation, lets
    the tracker revise the time plan."""
    config, spec = self.run.config, self.run.spec
    evaluate_now = budget.evaluates_after(done, self.total_steps,
                                          spec.eval_every_steps)
    save_now = (done % config.checkpoint_every_steps == 0 or
                done == self.total_steps or stop_signal is not None)
    if not (evaluate_now or save_now):
      return
    jax.block_until_ready(self.state)
    with self.clock.pause() as pause_began:
      if evaluate_now:
        self._evaluate(done, pause_began)
      if save_now:
        self.bar.announce(f"saving the checkpoint of step {done}")
        self.meter.check_finite(done)  # never save a state not yet checked
        orbax_checkpoints.save(self.run.manager, self.state)
      if (evaluate_now and self.tracker.due_for_check()
          and stop_signal is None
          and done < self.total_steps - spec.tuning_steps):  # not in tuning
        self._revise_plan(done, pause_began)

  def _evaluate(self, done: int, pause_began: float) -> None:
    self.bar.announce(f"evaluating at step {done}")
    self.eval_metrics = self.run.evaluate(self.state)
    self.tracker.evaluated(time.perf_counter() - pause_began)
    self.eval_metrics["epoch"] = done / self.run.spec.steps_per_epoch
    self.run.writer.write(done, "eval", self.eval_metrics)
    if (self.run.config.keep_best
        and self.eval_metrics["accuracy"] > self.best_accuracy):
      self.best_accuracy = self.eval_metrics["accuracy"]
      orbax_checkpoints.save_best(self.run.workdir,
                                  sharding.to_host(self.state.params), done,
                                  self.eval_metrics)
      log(f"New best eval accuracy {self.best_accuracy:.4f}: params saved "
          f"to {self.run.workdir}/{orbax_checkpoints.BEST_DIR}.")

  def _revise_plan(self, done: int, train_end: float) -> None:
    """Checks the time plan against the steps timed until `train_end`:
    trains to the revised plan, or ends at `done` (just evaluated)."""
    revised = self.tracker.revise(done, train_end, self.clock.paused,
                                  self.clock.elapsed())
    if revised is None:
      return
    if revised["total_steps"] > done:
      self._follow(revised)
    else:
      self.total_steps = done
      self.meter.flush(done, self.run.writer)
      orbax_checkpoints.save(self.run.manager, self.state)  # no-op if saved

  def _follow(self, plan: dict) -> None:
    """Trains to `plan` from here: the optimizer and train step rebuilt
    for its schedule (the optimizer's state does not depend on the
    schedule; the eval step takes only params)."""
    self.total_steps, self.learning_rate_fn = run_lib.schedule(
        self.run.config, self.run.spec, plan)
    self.state = self.state.replace(
        tx=optim.make_optimizer(self.run.config, self.learning_rate_fn))
    self.phase = self.run.make_phase(self.state, self.learning_rate_fn)

  def _measure_for_plan(self, done: int, last_batch) -> budget_tracker.Measurements:
    """Times what the plan needs, once each: compiling the eval step and
    one evaluation, a real checkpoint of step `done` written through, and
    (with an unmasked tuning) its step's compilation and a few of its
    steps, run on a copy of the state and the last batch."""
    run, state = self.run, self.state
    test_batch = next(run.dataset.eval_batches(run.config.eval_batch_size,
                                               run.mesh))
    tick = time.perf_counter()
    jax.block_until_ready(run.eval_fn(state.params, *test_batch))
    eval_compile = time.perf_counter() - tick
    tick = time.perf_counter()
    run.evaluate(state)
    evaluation = time.perf_counter() - tick
    self.meter.check_finite(done)
    tick = time.perf_counter()
    orbax_checkpoints.save(run.manager, state)
    run.manager.wait_until_finished()
    save = time.perf_counter() - tick
    if not run.spec.tuning_steps:
      return budget_tracker.Measurements(eval_compile, evaluation, save)
    return budget_tracker.Measurements(eval_compile, evaluation, save,
                               *self._time_tuning_steps(last_batch))

  def _time_tuning_steps(self, batch) -> tuple[float, float]:
    """(first, median of the next) seconds of the unmasked tuning's step,
    run on a copy of the state."""
    copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree),
                   out_shardings=steps.shardings_of(self.state))(self.state)
    copy = copy.replace(apply_fn=self.run.unmasked_model.apply)
    tuning_fn = self.run.make_phase(copy, self.learning_rate_fn).train_fn
    seconds = []
    for _ in range(1 + budget_tracker.MEASURED_TUNING_STEPS):
      tick = time.perf_counter()
      copy, metrics = tuning_fn(copy, *batch)  # the step donates its input
      jax.block_until_ready(metrics)
      seconds.append(time.perf_counter() - tick)
    return seconds[0], float(np.median(seconds[1:]))


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
