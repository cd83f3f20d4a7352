"""TensorBoard event files written by vit_jax, read back by TensorBoard."""

import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT
from vit_jax.training import event_file

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")


def _scalars(logdir, tag):
  events = event_accumulator.EventAccumulator(logdir)
  events.Reload()
  return [(e.step, e.value) for e in events.Scalars(tag)]


def test_crc32c_matches_its_check_value_and_tensorboards():
  from tensorboard.compat.tensorflow_stub import pywrap_tensorflow  # pylint: disable=g-import-not-at-top
  assert event_file.crc32c(b"123456789") == 0xE3069283  # CRC-32C's check
  rng = np.random.default_rng(0)
  for size in (0, 1, 8, 255, 1000):
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    assert event_file.masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(
        data)


def test_scalars_read_back_by_tensorboard(tmp_path):
  writer = event_file.EventFileWriter(str(tmp_path))
  values = [2.5, 1e-8, -3.0, 12345.678, 0.0]
  for step, value in enumerate(values, start=1):
    writer.add_scalar("train/loss", value, step)
    writer.add_scalar("eval/accuracy", step / 10, 2**40 + step)
  writer.close()
  # TensorBoard's reader checks every record's CRCs as it goes.
  assert _scalars(str(tmp_path), "train/loss") == [
      (step, float(np.float32(v))) for step, v in enumerate(values, start=1)]
  assert [s for s, _ in _scalars(str(tmp_path), "eval/accuracy")] == [
      2**40 + step for step in range(1, 6)]


def test_a_resumed_run_hides_the_steps_it_runs_again(tmp_path):
  logdir = str(tmp_path)
  first = event_file.EventFileWriter(logdir)
  for step in range(1, 11):
    first.add_scalar("train/loss", 1.0, step)
  first.close()
  # As if written a second earlier (TensorBoard reads files in name order).
  seconds, host = os.path.basename(first.path).split(".", 4)[3:]
  os.rename(first.path, os.path.join(
      logdir, f"events.out.tfevents.{int(seconds) - 1:010d}.{host}"))
  # Resumed from the checkpoint at step 5: steps 6 on are run again.
  second = event_file.EventFileWriter(logdir, purge_step=6)
  for step in range(6, 9):
    second.add_scalar("train/loss", 2.0, step)
  second.close()
  assert _scalars(logdir, "train/loss") == (
      [(step, 1.0) for step in range(1, 6)] +
      [(step, 2.0) for step in range(6, 9)])


def test_the_trainer_tools_and_command_line_do_not_import_pytorch():
  """tensorboardX imported PyTorch where it is installed: seconds and
  hundreds of MB at the start of every command."""
  code = ("import sys; import vit_jax.training.loop, vit_jax.data.streaming,"
          " vit_jax.inspection.tools, vit_jax.cli; "
          "print('torch' in sys.modules)")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          capture_output=True, text=True, check=True)
  assert result.stdout.strip() == "False"
