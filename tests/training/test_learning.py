"""Slow: the shipped Fashion-MNIST config learns on the real data.

  python -m pytest -m slow
"""

import re

import pytest
from helpers import run_python



@pytest.mark.slow
def test_fashion_mnist_15min_config_learns_in_1000_steps(tmp_path,
                                                         fashion_mnist_dir):
  """The 15-minute recipe, run by main.py as a user runs it (a device per
  core, not the test suite's 8 simulated devices), cut to 1000 steps with
  its schedule: 2.1 epochs, about a minute of patch-dropped steps (600
  gave 77.7%). Without the time budget, whose plan would time an evaluation
  and recompile the step (tests/training/test_budget.py covers it)."""
  result = run_python(
      "main.py", "--config=configs/vit_fashion_mnist_15min.py",
      f"--config.raw_data_dir={fashion_mnist_dir}",
      "--config.num_train_steps=1000", "--config.checkpoint_every_steps=1000",
      "--config.time_budget_minutes=0", f"--workdir={tmp_path / 'run'}",
      env={"XLA_FLAGS": ""}, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  final = re.search(r"Final test accuracy ([0-9.]+), loss [0-9.]+ over "
                    r"(\d+) images", result.stdout)
  assert final, result.stdout[-3000:]
  assert int(final.group(2)) == 10_000
  assert float(final.group(1)) > 0.78, result.stdout[-3000:]  # chance: 0.10
