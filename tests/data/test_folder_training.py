"""main.py trains on a folder of images through worker processes, resumes
exactly mid-epoch, and each process of two reads only its rows."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from test_streaming import _config, write_folder  # pylint: disable=g-bad-import-order
from vit_jax.checkpoints import pretrained
from vit_jax.data import datasets, examples

from helpers import ROOT, run_python  # pylint: disable=wrong-import-order

FLAGS = ["--config=configs/vit_tiny_fashion_mnist.py",
         "--config.image_size=16", "--config.batch_size=8",
         "--config.eval_batch_size=8", "--config.num_train_steps=30",
         "--config.log_every_steps=5", "--config.checkpoint_every_steps=10",
         "--config.eval_every_epochs=100", "--config.data_pipeline=stream",
         "--config.data_workers=1", "--config.random_resized_crop=True",
         "--config.crop_padding=0", "--config.model.num_layers=1",
         "--config.model.hidden_size=32", "--config.model.num_heads=2",
         "--config.model.mlp_dim=64", "--config.normalization=inception"]


def _main(folder, workdir, stop_after_step=None):
  """Runs main.py on `folder`; with stop_after_step, sends SIGTERM on the
  log line of that train step."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  process = subprocess.Popen(
      [sys.executable, "main.py", *FLAGS, f"--config.dataset={folder}",
       f"--workdir={workdir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  lines = []
  for line in process.stdout:
    lines.append(line)
    if stop_after_step and line.split("|")[0].split() == [
        "train", "step", str(stop_after_step)]:
      process.send_signal(signal.SIGTERM)
      stop_after_step = None
  stderr = process.stderr.read()
  process.wait(timeout=600)
  return process.returncode, "".join(lines), stderr


def test_folder_run_names_classes_and_resumes_exactly_mid_epoch(tmp_path):
  folder = write_folder(tmp_path / "photos", per_class=(40, 4))
  straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
  code, out, err = _main(folder, straight)
  assert code == 0, err[-3000:]
  assert f"from the folder {folder} (test: test/)" in out
  assert "Final test accuracy" in out
  with open(os.path.join(straight, "model_info.json")) as f:
    assert json.load(f)["class_names"] == ["circle", "square", "stripes"]

  # 120 images, batch 8: an epoch is 15 steps; the stop lands a step or a
  # few after the signal (more on a loaded machine), mid-epoch.
  code, _, err = _main(folder, stopped, stop_after_step=5)
  assert code == 128 + signal.SIGTERM, err[-3000:]
  step = int(err.split("after step ")[1].split(";")[0])
  assert step % 15 and 5 <= step < 30
  code, out, err = _main(folder, stopped)
  assert code == 0, err[-3000:]
  assert f"Resumed from the checkpoint of step {step}" in out
  resumed, _ = pretrained.load_params(stopped, 2)
  reference, _ = pretrained.load_params(straight, 2)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(a, b)


def test_each_process_decodes_only_its_rows_of_the_global_batch(tmp_path):
  dataset = datasets.load(_config(write_folder(tmp_path / "photos")))
  transform = dataset._transform(train=True)  # pylint: disable=protected-access
  # Two processes of 4 rows each against one of 8, over two steps.
  elements = [examples.TrainElement(dataset.train, transform, 8, per_process,
                                    index, 0, False)
              for per_process, index in ((8, 0), (4, 0), (4, 1))]
  for step in range(2):
    whole = [elements[0](step * 8 + row) for row in range(8)]
    halves = ([elements[1](step * 4 + row) for row in range(4)] +
              [elements[2](step * 4 + row) for row in range(4)])
    for a, b in zip(whole, halves):
      np.testing.assert_array_equal(a["image"], b["image"])
      assert a["label"] == b["label"]


SMALL_MODEL = ["--config.model.num_layers=1", "--config.model.hidden_size=32",
               "--config.model.num_heads=2", "--config.model.mlp_dim=64"]


def test_imagenet_config_runs_end_to_end_on_an_imagenet_layout_folder(
    tmp_path):
  folder = write_folder(tmp_path / "imagenet_like", sizes=((80, 60),))
  os.rename(os.path.join(folder, "test"), os.path.join(folder, "val"))
  result = run_python(
      "main.py", "--config=configs/vit_imagenet.py", *SMALL_MODEL,
      f"--config.dataset={folder}", "--config.batch_size=8",
      "--config.num_train_steps=3", "--config.warmup_steps=1",
      "--config.eval_batch_size=8", "--config.image_size=32",
      "--config.data_workers=1", f"--workdir={tmp_path / 'run'}",
      env=dict(os.environ,
               XLA_FLAGS="--xla_force_host_platform_device_count=1"))
  assert result.returncode == 0, result.stderr[-3000:]
  assert "(test: val/)" in result.stdout
  assert "Final test accuracy" in result.stdout


@pytest.mark.slow
def test_finetune_folder_config_from_an_official_layout_checkpoint(tmp_path):
  """configs/vit_finetune_folder.py: an official-layout .npz (random
  ViT-Ti/16 weights, 21k-class head) fine-tuned on a folder, and the
  linear probe: only the head moves."""
  npz = str(tmp_path / "ViT-Ti_16.npz")
  converted = run_python(
      "-m", "vit_jax.checkpoints.convert", "--random_init=ViT-Ti/16",
      "--num_classes=21843", f"--output={npz}")
  assert converted.returncode == 0, converted.stderr
  folder = write_folder(tmp_path / "photos", sizes=((80, 60), (50, 70)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  common = [f"--config.init_from={npz}", f"--config.dataset={folder}",
            "--config.batch_size=8",
            "--config.accum_steps=2", "--config.num_train_steps=3",
            "--config.warmup_steps=1", "--config.eval_batch_size=8",
            "--config.image_size=64"]
  for mode in ("", ",linear_probe"):
    workdir = str(tmp_path / f"run{mode.strip(',')}")
    result = run_python(
        "main.py", f"--config=configs/vit_finetune_folder.py:ViT-Ti/16{mode}",
        *common,
        f"--workdir={workdir}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters loaded" in result.stdout
    assert "Final test accuracy" in result.stdout
  tuned, _ = pretrained.load_params(str(tmp_path / "run"), 3)
  probed, _ = pretrained.load_params(str(tmp_path / "runlinear_probe"), 3)
  start, _ = pretrained.load_params(npz, 3)
  embedding = ("embedding", "kernel")
  assert not np.array_equal(tuned[embedding[0]][embedding[1]],
                            start[embedding[0]][embedding[1]])
  np.testing.assert_array_equal(probed[embedding[0]][embedding[1]],
                                start[embedding[0]][embedding[1]])


def _children(pid: int) -> list[int]:
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/status") as f:
          if f"PPid:\t{pid}\n" in f.read():
            found.append(int(entry))
      except OSError:
        pass
  return found


def test_decoding_workers_exit_when_the_trainer_is_killed(tmp_path):
  """SIGKILL runs no clean-up in the trainer; its workers must notice and
  exit rather than live on, orphaned, holding memory."""
  folder = write_folder(tmp_path / "photos")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  process = subprocess.Popen(
      [sys.executable, "main.py", *FLAGS, f"--config.dataset={folder}",
       "--config.num_train_steps=100000", f"--workdir={tmp_path / 'run'}"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
      text=True)
  try:
    for line in process.stdout:
      if line.startswith("Compiled and ran"):
        break
    workers = _children(process.pid)
    assert workers, "no decoding worker process found"
  finally:
    process.kill()
    process.wait(timeout=60)
  deadline = time.monotonic() + 20
  while any(os.path.exists(f"/proc/{w}") for w in workers):
    assert time.monotonic() < deadline, f"workers {workers} outlived it"
    time.sleep(0.2)
