"""The loop's bookkeeping: wall time and pauses (`Clock`), the train
steps' metrics between two log lines (`TrainMetrics`: held on device,
checked for NaN/Inf, averaged and logged with the throughput), and the
progress bar on a terminal (`ProgressBar`)."""

import contextlib
import time
from typing import Iterator

import jax
import numpy as np

from vit_jax.training import metric_writer

# Dispatches queued on the device before the loop waits for an older one.
MAX_STEPS_IN_FLIGHT = 2


class Clock:
  """A run's wall time since `start`, and the part of it spent in pauses
  (evaluations, saves, planning, compiling a phase's step) that the
  throughput and the step timings leave out."""

  def __init__(self, start: float):
    self.start = start
    self.paused = 0.0

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  @contextlib.contextmanager
  def pause(self) -> Iterator[float]:
    """Counts the block's time as paused; yields when it began."""
    began = time.perf_counter()
    try:
      yield began
    finally:
      self.paused += time.perf_counter() - began

  def add_pause(self, seconds: float) -> None:
    self.paused += seconds


def per_step(pending: list[dict[str, jax.Array]]) -> dict[str, np.ndarray]:
  """The metrics of `pending` dispatches, each a step's scalars or several
  steps' stacked, as one host array per metric over the steps in order."""
  fetched = jax.device_get(pending)
  return {key: np.concatenate([np.atleast_1d(m[key]) for m in fetched])
          for key in fetched[0]}


def mean_metrics(pending: list[dict[str, jax.Array]]) -> dict[str, float]:
  """Means over the steps; skipped non-finite steps are left out."""
  stacked = per_step(pending)
  finite = np.isfinite(stacked["loss"]) & np.isfinite(stacked["grad_norm"])
  if not finite.any():
    return {k: float("nan") for k in stacked}
  return {k: float(np.mean(v[finite])) for k, v in stacked.items()}


class TrainMetrics:
  """The metrics of the steps since the last log line, still on device.

  `add` queues a dispatch's metrics (one step's, or several steps' stacked)
  and bounds the device's queue; `flush`
  logs their mean, the images per second since the last flush (pauses
  left out) and the epoch; `check_finite` raises on a NaN/Inf loss or
  gradient (or logs it, when such steps are skipped).
  """

  def __init__(self, *, batch_size: int, steps_per_epoch: int,
               skip_nonfinite: bool, checkpoint_dir: str, clock: Clock,
               start_step: int):
    self._batch_size = batch_size
    self._steps_per_epoch = steps_per_epoch
    self._skip_nonfinite = skip_nonfinite
    self._checkpoint_dir = checkpoint_dir
    self._clock = clock
    self.pending: list[dict[str, jax.Array]] = []
    self.restart_timer(start_step)

  def restart_timer(self, step: int) -> None:
    """Counts the throughput from now and `step` (e.g. after compiling)."""
    self._timer = (time.perf_counter(), step, self._clock.paused)

  def seconds_since_timer(self) -> float:
    return time.perf_counter() - self._timer[0]

  def add(self, metrics: dict[str, jax.Array]) -> None:
    self.pending.append(metrics)
    if len(self.pending) > MAX_STEPS_IN_FLIGHT:
      # Bound the asynchronous queue: waiting on an older step keeps the
      # device fed while deep queues of sharded programs could deadlock
      # XLA:CPU's collectives with many simulated devices on few cores.
      jax.block_until_ready(self.pending[-MAX_STEPS_IN_FLIGHT - 1]["loss"])

  def check_finite(self, step: int) -> None:
    """Raises if a pending step's loss or gradient is NaN/Inf, unless such
    steps are skipped (then it logs them). One small transfer."""
    if not self.pending:
      return
    metrics = per_step([{key: m[key] for key in ("loss", "grad_norm")}
                        for m in self.pending])
    values = np.stack([metrics["loss"], metrics["grad_norm"]], axis=1)
    bad = ~np.all(np.isfinite(values), axis=1)
    if not bad.any():
      return
    bad_steps = step - len(values) + 1 + np.flatnonzero(bad)
    what = ("loss" if not np.isfinite(values[bad][0, 0]) else
            "gradient norm")
    value = values[bad][0, 0 if what == "loss" else 1]
    if self._skip_nonfinite:
      metric_writer.log(f"Skipped the update of step(s) "
                        f"{bad_steps.tolist()}: non-finite loss or gradient.")
      return
    raise FloatingPointError(
        f"The training {what} became {value} at step {bad_steps[0]}. Likely "
        "causes: a learning rate too high (--config.learning_rate), no "
        "gradient clipping (--config.grad_clip_norm), or bad input data; "
        "--config.skip_nonfinite_steps=True skips such steps instead. This "
        f"state was not saved; the checkpoints in {self._checkpoint_dir} "
        "are intact.")

  def flush(self, step: int, writer: metric_writer.MetricWriter) -> None:
    """Logs the mean of the metrics since the last flush, if any."""
    if not self.pending:
      return
    self.check_finite(step)
    metrics = mean_metrics(self.pending)
    self.pending = []
    started, started_step, paused = self._timer
    elapsed = time.perf_counter() - started - (self._clock.paused - paused)
    metrics["images_per_second"] = ((step - started_step) * self._batch_size
                                    / max(elapsed, 1e-9))
    metrics["epoch"] = step / self._steps_per_epoch
    writer.write(step, "train", metrics)
    self.restart_timer(step)


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  return (f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours
          else f"{rest // 60}:{rest % 60:02d}")


class ProgressBar:
  """Steps done of the total, steps and images per second, and the time
  left at that rate (pauses for evaluations and saves left out), on a
  terminal's last line (`metric_writer.StatusLine`); redrawn at most every
  `interval` seconds. Off a terminal it prints nothing."""

  def __init__(self, status: metric_writer.StatusLine, *, batch_size: int,
               start_step: int, clock: Clock, interval: float = 0.5,
               width: int = 24):
    self._status = status
    self._batch_size = batch_size
    self._clock = clock
    self.restart(start_step)
    self._interval = interval
    self._width = width
    self._drawn_at = float("-inf")

  def restart(self, step: int) -> None:
    """Counts the rate from now and `step` (e.g. after compiling)."""
    self._start = (time.perf_counter(), step, self._clock.paused)

  def update(self, step: int, total_steps: int) -> None:
    now = time.perf_counter()
    if not self._status.enabled or (now - self._drawn_at < self._interval
                                    and step < total_steps):
      return
    self._drawn_at = now
    began, start_step, paused = self._start
    seconds = now - began - (self._clock.paused - paused)
    rate = (step - start_step) / seconds if seconds > 0 else 0.0
    filled = int(self._width * step / max(total_steps, 1))
    left = (f"{_duration((total_steps - step) / rate)} left" if rate > 0
            else "")
    self._status.show(
        f"[{'#' * filled}{'.' * (self._width - filled)}] step {step}/"
        f"{total_steps}  {rate:.1f} steps/s  "
        f"{rate * self._batch_size:,.0f} images/s  {left}")

  def announce(self, what: str) -> None:
    """Says on the bar what the loop does now (an evaluation, a save)."""
    if self._status.enabled:
      self._status.show(f"{self._status.text.split(' | ')[0]} | {what}")
