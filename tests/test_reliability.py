"""Preemption (SIGTERM/SIGINT) and workdir safety."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import small_config
from vit_jax.checkpoints import orbax_checkpoints, pretrained
from vit_jax.data import datasets
from vit_jax.runtime import preemption
from vit_jax.training import loop, metric_writer

from helpers import ROOT  # pylint: disable=wrong-import-order
FLAGS = ["--config=configs/vit_tiny_fashion_mnist.py",
         "--config.dataset=synthetic", "--config.synthetic.image_size=16",
         "--config.synthetic.channels=1", "--config.synthetic.num_train=256",
         "--config.batch_size=64", "--config.num_train_steps=300",
         "--config.log_every_steps=50", "--config.checkpoint_every_steps=100",
         "--config.eval_every_epochs=25",
         "--config.model.num_layers=2", "--config.model.hidden_size=32",
         "--config.model.num_heads=2", "--config.model.mlp_dim=64"]


def _main(workdir, signal_number=None, when="Compiled and ran",
          committed_step=None):
  """Runs main.py; with signal_number, sends it on the first output line
  that starts with `when` (once the checkpoint of `committed_step`, if
  given, has been committed)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  process = subprocess.Popen(
      [sys.executable, "main.py", *FLAGS, f"--workdir={workdir}"], cwd=ROOT,
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  lines = []
  for line in process.stdout:
    lines.append(line)
    if signal_number and line.startswith(when):
      if committed_step is not None:
        _wait_for_checkpoint(workdir, committed_step)
      process.send_signal(signal_number)
      signal_number = None
  stderr = process.stderr.read()
  process.wait(timeout=600)
  return process.returncode, "".join(lines), stderr


def _wait_for_checkpoint(workdir, step, timeout_s=120.0):
  """Polls until Orbax has renamed the step's temporary folder to `step`.

  Saves are asynchronous: with a model this small, 50 steps can pass
  before the previous save is committed.
  """
  path = os.path.join(workdir, "checkpoints", str(step))
  deadline = time.monotonic() + timeout_s
  while not os.path.isdir(path):
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.05)


@pytest.mark.parametrize("signal_number", [
    signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_checkpoints_exits_and_resumes_exactly(tmp_path,
                                                      signal_number):
  stopped = str(tmp_path / "stopped")
  code, _, stderr = _main(stopped, signal_number)
  assert code == 128 + signal_number, stderr[-2000:]
  name = signal.Signals(signal_number).name
  assert f"Stopped by {name} after step" in stderr
  step = int(stderr.split("after step ")[1].split(";")[0])
  assert 0 < step < 300
  assert str(step) in os.listdir(os.path.join(stopped, "checkpoints"))

  code, stdout, stderr = _main(stopped)
  assert code == 0, stderr[-2000:]
  assert f"Resumed from the checkpoint of step {step}" in stdout
  code, _, stderr = _main(str(tmp_path / "uninterrupted"))
  assert code == 0, stderr[-2000:]
  resumed, _ = pretrained.load_params(stopped, 2)
  reference, _ = pretrained.load_params(str(tmp_path / "uninterrupted"), 2)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(a, b)


def test_a_signal_during_set_up_stops_at_once_and_the_rerun_trains(
    tmp_path, monkeypatch):
  """SIGTERM while the data is being prepared: no step, no checkpoint, the
  handler and the workdir's lock released, and the same call then trains."""
  workdir = str(tmp_path / "run")
  load = datasets.load
  before = signal.getsignal(signal.SIGTERM)

  def load_then_signal(config):
    load(config)
    os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line
    raise AssertionError("the signal did not stop set-up")

  monkeypatch.setattr(datasets, "load", load_then_signal)
  with pytest.raises(preemption.StoppedInSetUp,
                     match="Stopped by SIGTERM during set-up") as stopped:
    loop.train_and_evaluate(small_config(num_train_steps=2), workdir)
  assert stopped.value.exit_code == 128 + signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) == before
  checkpoints = os.path.join(workdir, "checkpoints")
  assert not os.path.isdir(checkpoints) or not os.listdir(checkpoints)
  monkeypatch.setattr(datasets, "load", load)
  loop.train_and_evaluate(small_config(num_train_steps=2), workdir)
  assert "2" in os.listdir(checkpoints)


def test_stop_signals_raise_until_training_starts_then_record():
  with preemption.StopSignals() as stop:
    with pytest.raises(preemption.StoppedInSetUp):
      os.kill(os.getpid(), signal.SIGINT)
    assert stop.received == signal.SIGINT
  with preemption.StopSignals() as stop:
    stop.training_started()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.received == signal.SIGTERM  # recorded; nothing raised


def _comparable(records):
  """metrics.jsonl records without wall-clock fields."""
  return [{k: v for k, v in r.items()
           if k not in ("time", "images_per_second")} for r in records]


@pytest.mark.slow
def test_sigkill_at_several_points_resumes_bit_exactly(tmp_path):
  """Killed before any checkpoint, as the step-100 save starts (usually
  mid-write), right after a restart's compile, and after step 250 once the
  step-200 save is committed: the finished run equals an uninterrupted one
  in every parameter and every metric written."""
  killed = str(tmp_path / "killed")
  for when, committed_step in (("train step     50", None),
                               ("train step    100", None),
                               ("Compiled and ran", None),
                               ("train step    250", 200)):
    code, stdout, _ = _main(killed, signal.SIGKILL, when, committed_step)
    assert code == -signal.SIGKILL, stdout[-2000:]
  # 200, unless the kill came only after the step-300 save was committed.
  latest = max(int(name) for name in os.listdir(
      os.path.join(killed, "checkpoints")) if name.isdigit())
  assert latest >= 200
  code, stdout, stderr = _main(killed)
  assert code == 0, stderr[-2000:]
  assert f"Resumed from the checkpoint of step {latest}" in stdout
  reference = str(tmp_path / "reference")
  assert _main(reference)[0] == 0
  final, _ = pretrained.load_params(killed, 2)
  expected, _ = pretrained.load_params(reference, 2)
  for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  assert _comparable(metric_writer.read_metrics(killed)) == _comparable(
      metric_writer.read_metrics(reference))


def test_second_run_on_a_locked_workdir_is_refused(tmp_path):
  workdir = str(tmp_path / "run")
  with orbax_checkpoints.locked_workdir(workdir):
    with pytest.raises(orbax_checkpoints.WorkdirError,
                       match=f"pid {os.getpid()}.* is using"):
      loop.train_and_evaluate(small_config(num_train_steps=2), workdir)
  # Released: the same workdir trains now.
  loop.train_and_evaluate(small_config(num_train_steps=2), workdir)


def test_unwritable_workdir_is_reported_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a folder")
  with pytest.raises(orbax_checkpoints.WorkdirError,
                     match="Cannot write to the workdir .*a_file/run"):
    loop.train_and_evaluate(small_config(), str(blocker / "run"))


@pytest.mark.slow
def test_keep_best_saves_the_params_of_the_best_evaluation(tmp_path):
  workdir = str(tmp_path)
  # 64 examples / batch 16 = 4 steps an epoch; evaluate and save each epoch.
  config = small_config(num_epochs=8, keep_best=True, learning_rate=1e-2,
                        checkpoint_every_steps=4, keep_checkpoints=10,
                        warmup_epochs=0.5, label_smoothing=0.0)
  loop.train_and_evaluate(config, workdir)
  evals = [r for r in metric_writer.read_metrics(workdir)
           if r["split"] == "eval"]
  best = max(evals, key=lambda r: r["accuracy"])  # first of equal maxima
  with open(os.path.join(workdir, "best", "metrics.json")) as f:
    saved = json.load(f)
  assert saved["step"] == best["step"]
  assert saved["accuracy"] == best["accuracy"]
  assert best["step"] > evals[0]["step"]  # it improved after epoch 1
  params, _ = pretrained.load_params(os.path.join(workdir, "best",
                                                  "params.npz"), 2)
  at_step, _ = pretrained.load_params(
      os.path.join(workdir, "checkpoints", str(best["step"])), 2)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(at_step)):
    np.testing.assert_array_equal(a, b)


# The one subprocess: the C++ compiler building vit_jax's own kernel source
# (an argument list, no shell).
_MAY_RUN_A_COMPILER = {"cpu_attention.py": "subprocess"}


def test_library_never_unpickles_or_shells_out():
  """Loading user files must not run code: no pickle, no shell, no eval."""
  import ast  # pylint: disable=g-import-not-at-top
  package = os.path.join(ROOT, "vit_jax")
  for name in sorted(os.listdir(package)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(package, name)) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""])
        for module in modules:
          if _MAY_RUN_A_COMPILER.get(name) == module:
            continue
          assert module.split(".")[0] not in ("pickle", "subprocess",
                                              "dill", "shelve"), (name,
                                                                  module)
      if isinstance(node, ast.Call):
        func = node.func
        called = getattr(func, "attr", getattr(func, "id", ""))
        assert called not in ("system", "popen", "eval", "exec"), (name,
                                                                   called)
      if isinstance(node, ast.keyword) and node.arg == "shell":
        assert getattr(node.value, "value", None) is False, name
      if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
        assert getattr(node.value, "value", None) is False, name
      if isinstance(node, ast.keyword) and node.arg == "weights_only":
        assert getattr(node.value, "value", None) is True, name


@pytest.mark.slow
def test_resume_with_another_model_names_the_checkpoint(tmp_path):
  loop.train_and_evaluate(small_config(num_train_steps=2), str(tmp_path))
  wider = small_config(num_train_steps=4)
  wider.model.mlp_dim = 48
  with pytest.raises(orbax_checkpoints.CheckpointRestoreError,
                     match=f"(?s)Cannot restore the checkpoint {tmp_path}/"
                     r"checkpoints/2: parameter .*MlpBlock_3/Dense_0/bias has "
                     r"shape \(64,\) in the checkpoint and \(48,\) in the "
                     "model.*different model"):
    loop.train_and_evaluate(wider, str(tmp_path))


@pytest.mark.slow
def test_damaged_checkpoint_names_the_file(tmp_path):
  loop.train_and_evaluate(small_config(num_train_steps=2), str(tmp_path))
  step_dir = tmp_path / "checkpoints" / "2"
  for path in step_dir.rglob("*"):
    if path.is_file() and path.stat().st_size > 0:
      path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
  with pytest.raises(orbax_checkpoints.CheckpointRestoreError,
                     match="(?s)checkpoints/2.*damaged"):
    loop.train_and_evaluate(small_config(num_train_steps=4), str(tmp_path))


@pytest.mark.slow
def test_failed_checkpoint_write_keeps_the_last_good_one(tmp_path,
                                                         monkeypatch):
  config = small_config(num_train_steps=4, checkpoint_every_steps=2)
  real_save = orbax_checkpoints.ocp.CheckpointManager.save

  def full_disk(self, step, *args, **kwargs):
    if step == 4:
      raise OSError(28, "No space left on device")
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(orbax_checkpoints.ocp.CheckpointManager, "save",
                      full_disk)
  with pytest.raises(orbax_checkpoints.WorkdirError,
                     match="step 4 .*No space left.*last complete "
                     "checkpoint is step 2"):
    loop.train_and_evaluate(config, str(tmp_path))
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
  # The same command resumes from step 2 and finishes.
  loop.train_and_evaluate(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
