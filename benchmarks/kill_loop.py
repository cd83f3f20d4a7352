r"""Kill training with SIGKILL over and over; the result must not change.

  python benchmarks/kill_loop.py                    # Fashion-MNIST config
  python benchmarks/kill_loop.py --min_seconds=30 --max_seconds=90 -- \
      --config.num_epochs=2 --config.max_train_examples=12800 \
      --config.eval_every_epochs=2 --config.checkpoint_every_steps=25

A supervisor runs `main.py --config=CONFIG` twice in fresh workdirs: once
uninterrupted, once killed with SIGKILL at random moments (uniform in
[min_seconds, max_seconds] after each start; so some kills land during a
checkpoint write) and restarted with the same command until it finishes.
It then compares the final parameters (max |difference|) and final test
accuracies of the two runs, which bit-exact resume makes 0.0, and ends with

  summary: kills=12 resumed=12 max_param_diff=0.0 accuracy_diff=0.0

Arguments after `--` are passed to main.py (config overrides). Each life
must be able to reach the next checkpoint: the shortest kill interval has
to exceed start-up (data, compile) + one checkpoint interval (+ an
evaluation if one falls inside it), or the run never advances; the
supervisor stops with that advice after --max_stuck kills in a row without
a new checkpoint.
"""

import os
import random
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging
import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from vit_jax.checkpoints import pretrained  # pylint: disable=g-import-not-at-top,wrong-import-position
from vit_jax.training import metric_writer

_CONFIG = flags.DEFINE_string("config", "configs/vit_tiny_fashion_mnist.py",
                              "Config file to train.")
_MIN = flags.DEFINE_float("min_seconds", 60.0, "Shortest time to a kill.")
_MAX = flags.DEFINE_float("max_seconds", 180.0, "Longest time to a kill.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the kill times.")
_MAX_STUCK = flags.DEFINE_integer(
    "max_stuck", 6, "Kills in a row without a new checkpoint before giving "
    "up.")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Where the two runs go; default a temp dir.")


def _command(workdir: str, overrides: list[str]) -> list[str]:
  return [sys.executable, os.path.join(ROOT, "main.py"),
          f"--config={_CONFIG.value}", f"--workdir={workdir}", *overrides]


def _final_accuracy(workdir: str) -> float:
  evals = [r for r in metric_writer.read_metrics(workdir)
           if r["split"] == "eval"]
  return evals[-1]["accuracy"]


def _checkpoint_steps(workdir: str) -> list[int]:
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO
  overrides = argv[1:]
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="kill_loop_")
  reference, killed = (os.path.join(root, name)
                       for name in ("uninterrupted", "killed"))
  print(f"Workdirs under {root}; overrides {overrides}", flush=True)

  start = time.time()
  subprocess.run(_command(reference, overrides), cwd=ROOT, check=True,
                 stdout=subprocess.DEVNULL)
  print(f"Uninterrupted run: {time.time() - start:.0f} s, test accuracy "
        f"{_final_accuracy(reference):.4f}", flush=True)

  rng = random.Random(_SEED.value)
  kills = resumed = stuck = 0
  latest = None
  start = time.time()
  while True:
    process = subprocess.Popen(_command(killed, overrides), cwd=ROOT,
                               stdout=subprocess.DEVNULL)
    if kills:
      resumed += 1
    try:
      code = process.wait(timeout=rng.uniform(_MIN.value, _MAX.value))
    except subprocess.TimeoutExpired:
      process.kill()  # SIGKILL: no handler, no cleanup
      process.wait()
      kills += 1
      steps = _checkpoint_steps(killed)
      print(f"kill {kills} at {time.time() - start:.0f} s; checkpoints on "
            f"disk: {steps}", flush=True)
      stuck = stuck + 1 if steps and steps[-1] == latest else 0
      latest = steps[-1] if steps else None
      if stuck >= _MAX_STUCK.value:
        raise SystemExit(
            f"No new checkpoint in {stuck} lives: --min_seconds is shorter "
            "than start-up + a checkpoint interval (+ evaluation). Raise it, "
            "or checkpoint more often.")
      continue
    if code != 0:
      raise SystemExit(f"The killed run failed with status {code}.")
    break
  print(f"Killed run finished after {kills} kills, "
        f"{time.time() - start:.0f} s", flush=True)

  final, _ = pretrained.load_params(killed, 1)
  expected, _ = pretrained.load_params(reference, 1)
  max_diff = max(float(np.max(np.abs(a - b))) for a, b in
                 zip(jax.tree.leaves(final), jax.tree.leaves(expected)))
  accuracy_diff = abs(_final_accuracy(killed) - _final_accuracy(reference))
  print(f"summary: kills={kills} resumed={resumed} "
        f"max_param_diff={max_diff} accuracy_diff={accuracy_diff}")


if __name__ == "__main__":
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  app.run(main)
