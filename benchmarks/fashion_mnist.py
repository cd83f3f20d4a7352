r"""Trains a config on Fashion-MNIST against the clock; test accuracy vs time.

  python benchmarks/fashion_mnist.py --config=configs/vit_fashion_mnist_15min.py

Runs `loop.train_and_evaluate` in a fresh workdir (default: a temporary
folder) on the Debian Fashion-MNIST files, timing from before the data is
read, so loading and compilation count. Prints each evaluation's test
accuracy (and the EMA params' when the config keeps them) against elapsed
wall minutes, writes that curve as a PNG (--plot, default
WORKDIR/fashion_mnist_curve.png), and ends with one line:

  summary: test_accuracy=0.9234 wall_minutes=14.1

test_accuracy is the final evaluation's: the EMA params' if the config has
ema_decay > 0 (that is the model such a config delivers), else the params'.
Any config key can be overridden as in main.py (--config.num_epochs=2).
Like main.py it restarts itself once with a faster malloc
(vit_jax/runtime/host.py); unlike main.py it leaves the persistent compilation
cache off, so every run pays its compilation inside the budget.
"""

import os
import tempfile
import time

from absl import app, flags, logging
from ml_collections import config_flags

from vit_jax.inspection import plots
from vit_jax.runtime import host
from vit_jax.training import loop, metric_writer

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/vit_fashion_mnist_15min.py", "Config to train.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Run folder; default a new temporary one.")
_PLOT = flags.DEFINE_string("plot", None, "PNG of accuracy vs minutes.")


def accuracy_curve(workdir: str, start: float) -> list[dict]:
  """Eval records of `workdir` with their wall minutes since `start`."""
  return [dict(record, minutes=(record["time"] - start) / 60)
          for record in metric_writer.read_metrics(workdir)
          if record["split"] == "eval"]


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if config.dataset != "fashion_mnist":
    raise app.UsageError(f"{config.dataset}: this benchmark is for "
                         "fashion_mnist configs.")
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="fashion_mnist_")
  start = time.time()
  final = loop.train_and_evaluate(config, workdir)
  wall_minutes = (time.time() - start) / 60
  curve = accuracy_curve(workdir, start)
  print("\n| epoch | minutes | test accuracy | EMA test accuracy |")
  print("|---:|---:|---:|---:|")
  for record in curve:
    ema = record.get("ema_accuracy")
    print(f"| {record['epoch']:.0f} | {record['minutes']:.1f} | "
          f"{record['accuracy']:.4f} | "
          f"{'-' if ema is None else f'{ema:.4f}'} |")
  path = _PLOT.value or os.path.join(workdir, "fashion_mnist_curve.png")
  name = os.path.basename(
      config_flags.get_config_filename(flags.FLAGS["config"]))
  plots.accuracy_vs_time(curve, path, name)
  print(f"Curve: {path}")
  accuracy = final.get("ema_accuracy", final["accuracy"])
  print(f"summary: test_accuracy={accuracy:.4f} "
        f"wall_minutes={wall_minutes:.1f}", flush=True)


if __name__ == "__main__":
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  host.reexec_with_fast_malloc()
  app.run(main)
