"""Metrics to the log, `workdir/metrics.jsonl` and TensorBoard event files.

Each line is {"step": ..., "split": "train" | "eval", <metric>: value, ...};
`pandas.read_json(path, lines=True)` or a two-line loop reads it back for
plots. The same scalars go to `workdir/events.out.tfevents.*` as
"<split>/<metric>" (`event_file`: no TensorFlow), so
`tensorboard --logdir WORKDIR` shows them. Only process 0 writes.
"""

import json
import os
import sys
import time
from typing import Mapping, Optional, Sequence, TextIO

import jax
import numpy as np

from vit_jax.training import event_file


# What the inspection tools need to run a trained model without its dataset.
MODEL_INFO = "model_info.json"


class StatusLine:
  """The last line of a terminal, rewritten in place (a progress bar);
  `log`'s lines print above it. Inert unless `stream` is a terminal and
  this is process 0, so logs and pipes get plain lines only."""

  def __init__(self, stream: TextIO = sys.stdout):
    self._stream = stream
    self.enabled = stream.isatty() and jax.process_index() == 0
    self.text = ""

  def show(self, text: str) -> None:
    if self.enabled:
      self.text = text
      self._stream.write("\r\033[K" + text)
      self._stream.flush()

  def clear(self) -> None:
    if self.enabled and self.text:
      self._stream.write("\r\033[K")
      self._stream.flush()

  def __enter__(self) -> "StatusLine":
    global _status_line
    _status_line = self
    return self

  def __exit__(self, *exc) -> None:
    global _status_line
    self.clear()
    self.text = ""
    _status_line = None


_status_line: Optional[StatusLine] = None  # the one being shown, if any


def log(message: str) -> None:
  """Prints a progress line from process 0 only (above the status line,
  if one is shown)."""
  if jax.process_index() != 0:
    return
  status = _status_line
  if status is not None:
    status.clear()
  print(message, flush=True)
  if status is not None and status.text:
    status.show(status.text)


class MetricWriter:
  """Appends metrics; on resume, first drops records past the resumed step.

  Records after the last checkpoint belong to steps that will be run again,
  so the file always reads as one uninterrupted run.
  """

  def __init__(self, workdir: str, resume_step: int = 0):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._enabled = jax.process_index() == 0
    self._tensorboard = None
    if self._enabled:
      # purge_step hides events of steps that will be run again, as below.
      self._tensorboard = event_file.EventFileWriter(
          workdir, purge_step=resume_step + 1 if resume_step else None)
    if self._enabled and os.path.exists(self.path):
      records = read_metrics(workdir)
      kept = [r for r in records if r["step"] <= resume_step]
      if len(kept) == len(records):
        return
      temporary = self.path + ".tmp"
      with open(temporary, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
      os.replace(temporary, self.path)

  def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
    if not self._enabled:
      return
    record = {"step": int(step), "split": split, "time": round(time.time(), 3)}
    # Fixed key order so log lines line up from one step to the next.
    ordered = sorted(metrics, key=lambda k: (_ORDER.index(k)
                                             if k in _ORDER else len(_ORDER)))
    record.update({k: float(metrics[k]) for k in ordered})
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    for key in ordered:
      self._tensorboard.add_scalar(f"{split}/{key}", record[key], step)
    self._tensorboard.flush()
    log(f"{split:5s} step {step:6d} | " + " | ".join(
        f"{k} {_format(record[k])}" for k in ordered))


  def close(self) -> None:
    if self._tensorboard is not None:
      self._tensorboard.close()


_ORDER = ["epoch", "loss", "accuracy", "ema_loss", "ema_accuracy",
          "learning_rate", "grad_norm", "images_per_second", "num_examples"]


def _format(value: float) -> str:
  if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5):
    return f"{value:.3e}"
  return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def read_metrics(workdir: str) -> list[dict]:
  """All records of `workdir/metrics.jsonl`, in the order written."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_model_info(workdir: str, dataset_name: str,
                     class_names: Sequence[str], image_shape: Sequence[int],
                     mean: np.ndarray, std: np.ndarray) -> None:
  """Records what the tools need to run the model without the dataset
  (`MODEL_INFO`, read by vit_jax.inspection.tools)."""
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  info = dict(dataset=dataset_name, class_names=list(class_names),
              image_shape=[int(x) for x in image_shape],
              mean=[float(x) for x in mean], std=[float(x) for x in std])
  with open(os.path.join(workdir, MODEL_INFO), "w") as f:
    json.dump(info, f, indent=1)
