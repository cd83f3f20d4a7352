"""The benchmark scripts run as documented and print their summary line."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_fashion_mnist_benchmark_prints_curve_and_summary(tmp_path,
                                                          fashion_mnist_dir):
  del fashion_mnist_dir  # the config finds the Debian files itself
  plot = tmp_path / "curve.png"
  result = subprocess.run(
      [sys.executable, "benchmarks/fashion_mnist.py",
       "--config=configs/vit_fashion_mnist_15min.py",
       "--config.max_train_examples=1024", "--config.max_eval_examples=500",
       "--config.num_epochs=2", "--config.model.num_layers=1",
       "--config.eval_batch_size=250", f"--workdir={tmp_path / 'run'}",
       f"--plot={plot}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ,
               XLA_FLAGS="--xla_force_host_platform_device_count=1"))
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  summary = re.fullmatch(r"summary: test_accuracy=(\d\.\d{4}) "
                         r"wall_minutes=(\d+\.\d)", lines[-1])
  assert summary, lines[-1]
  rows = [line for line in lines if re.match(r"\| \d+ \|", line)]
  assert len(rows) == 2  # one evaluation per epoch
  # The summary reports the EMA params (the config keeps them).
  assert rows[-1].split("|")[4].strip() == summary.group(1)
  assert plot.stat().st_size > 10_000
