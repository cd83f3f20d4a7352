"""Trains and evaluates a ViT: python main.py --config=configs/vit_tiny_cifar.py

Any config key can be overridden on the command line, e.g.
  python main.py --config=configs/vit_tiny_fashion_mnist.py \
      --config.batch_size=64 --config.num_epochs=5 --workdir=/tmp/run
Running the same command again resumes from the latest checkpoint in workdir.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from vit_jax import checkpoints, datasets, models, train

# Errors whose message already says what went wrong and how to fix it: shown
# as they are, without a traceback.
_USER_ERRORS = (ValueError, FileNotFoundError,
                datasets.DatasetUnavailableError,
                checkpoints.CheckpointRestoreError, FloatingPointError,
                models.ViTInputError)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file in configs/.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None,
    "Folder for checkpoints and metrics.jsonl; default runs/<config name>.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  workdir = _WORKDIR.value or os.path.join(
      "runs", os.path.splitext(os.path.basename(config_path))[0])
  # Orbax logs every save at INFO; keep the console to our progress lines.
  logging.set_verbosity(logging.WARNING)
  print(f"Config {config_path}, workdir {workdir}", flush=True)
  try:
    metrics = train.train_and_evaluate(_CONFIG.value, workdir)
  except _USER_ERRORS as e:
    raise SystemExit(f"{type(e).__name__}: {e}") from e
  print(f"Final test accuracy {metrics['accuracy']:.4f}, loss "
        f"{metrics['loss']:.4f} over {int(metrics['num_examples'])} images.",
        flush=True)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
