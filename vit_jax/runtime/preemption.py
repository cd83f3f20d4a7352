"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, exit.

Schedulers (SLURM, Kubernetes, preemptible VMs) send SIGTERM some seconds
before killing a job. The trainer polls `StopSignals.received` after every
step; when set, it saves a checkpoint and raises `Preempted`, whose
`exit_code` (128 + signal number, 143 for SIGTERM) tells the scheduler the
job was stopped, not finished. A second Ctrl-C interrupts at once.
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


class StopSignals:
  """Context manager: records SIGTERM/SIGINT instead of dying on them.

  Only the main thread can install handlers; elsewhere this records nothing
  and signals keep their previous behaviour.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self._signals = signals
    self._previous = {}
    self.received: Optional[int] = None

  def _handle(self, signal_number, frame):
    del frame
    self.received = signal_number
    # A second signal of the same kind acts as it did before (Ctrl-C twice).
    signal.signal(signal_number, self._previous[signal_number])

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for signal_number in self._signals:
        self._previous[signal_number] = signal.signal(signal_number,
                                                      self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for signal_number, handler in self._previous.items():
      signal.signal(signal_number, handler)
