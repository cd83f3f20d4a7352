"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, exit.

Schedulers (SLURM, Kubernetes, preemptible VMs) send SIGTERM some seconds
before killing a job. Once training has started, the trainer polls
`StopSignals.received` after every step; when set, it saves a checkpoint
and raises `Preempted`, whose `exit_code` (128 + signal number, 143 for
SIGTERM) tells the scheduler the job was stopped, not finished. A second
Ctrl-C interrupts at once.

During set-up (preparing the data, building and restoring the model) there
is nothing new to save, and set-up can take minutes (a dataset's first
preparation), so a signal then stops at once with `StoppedInSetUp`.
"""

import signal
import threading
from typing import Optional


class Preempted(Exception):
  """Training stopped on a signal after saving a checkpoint."""

  def __init__(self, signal_number: int, step: int, directory: str):
    name = signal.Signals(signal_number).name
    super().__init__(
        f"Stopped by {name} after step {step}; the checkpoint of step {step} "
        f"is in {directory}. Run the same command again to resume.")
    self.exit_code = 128 + signal_number


class StoppedInSetUp(BaseException):
  """A signal came before training started: nothing was lost or saved.

  A BaseException, as KeyboardInterrupt is: it is raised wherever set-up
  happens to be, and an `except Exception` there (a library's retry loop)
  must not swallow it.
  """

  def __init__(self, signal_number: int):
    name = signal.Signals(signal_number).name
    super().__init__(
        f"Stopped by {name} during set-up, before this run trained a step; "
        "nothing new to save. Run the same command again to continue.")
    self.exit_code = 128 + signal_number


class StopSignals:
  """Context manager for SIGTERM/SIGINT: stops at once during set-up, and
  records them instead of dying on them from `training_started()` on.

  Only the main thread can install handlers; elsewhere this records nothing
  and signals keep their previous behaviour. With several processes, the
  one that stops during set-up leaves the others waiting for it in their
  next collective until jax.distributed's heartbeat ends them; schedulers
  send the signal to every process.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self._signals = signals
    self._previous = {}
    self.received: Optional[int] = None
    self._training = False

  def training_started(self) -> None:
    """From now on a signal is only recorded: the trainer saves first."""
    self._training = True

  def _handle(self, signal_number, frame):
    del frame
    self.received = signal_number
    # A second signal of the same kind acts as it did before (Ctrl-C twice).
    signal.signal(signal_number, self._previous[signal_number])
    if not self._training:
      raise StoppedInSetUp(signal_number)

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for signal_number in self._signals:
        self._previous[signal_number] = signal.signal(signal_number,
                                                      self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for signal_number, handler in self._previous.items():
      signal.signal(signal_number, handler)
