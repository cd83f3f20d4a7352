"""Two processes on jax.distributed (localhost, gloo) train like one."""

import os
import shutil
import socket
import subprocess
import sys

import chex
import numpy as np
import pytest

from vit_jax.checkpoints import pretrained
from vit_jax.runtime import multihost
from vit_jax.training import metric_writer

from helpers import ROOT  # pylint: disable=wrong-import-order
FLAGS = ["--config=configs/vit_tiny_fashion_mnist.py",
         "--config.dataset=synthetic", "--config.synthetic.image_size=16",
         "--config.synthetic.channels=3", "--config.batch_size=32",
         "--config.eval_batch_size=32", "--config.log_every_steps=2",
         "--config.checkpoint_every_steps=3", "--config.model.num_layers=2",
         "--config.model.hidden_size=32", "--config.model.num_heads=2",
         "--config.model.mlp_dim=64", "--config.fsdp_min_size=256"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start(flags, devices):
  env = dict(os.environ,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.Popen([sys.executable, "main.py", *FLAGS, *flags],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _finish(processes, timeout=400):
  """stdout of each process; kills them all if one fails or hangs."""
  outputs = []
  try:
    for process in processes:
      out, err = process.communicate(timeout=timeout)
      assert process.returncode == 0, err[-3000:]
      outputs.append(out)
  finally:
    for process in processes:
      process.kill()
  return outputs


def _losses(workdir):
  return [r["loss"] for r in metric_writer.read_metrics(workdir)
          if r["split"] == "train"]


def _assert_same_params(workdir_a, workdir_b):
  """Params equal up to reduction order (atol 1e-5), except the attention
  key biases: their true gradient is zero (a bias on every key shifts all
  of a query's logits alike, which softmax ignores), so their values are
  rounding noise scaled up by Adam and differ between summation orders;
  for them the invariant is that they stay at that noise level."""
  params_a, params_b = (pretrained.load_params(w, 2)[0]
                        for w in (workdir_a, workdir_b))
  for params in (params_a, params_b):
    for name, block in params["Transformer"].items():
      if name.startswith("encoderblock_"):
        key = block["MultiHeadDotProductAttention_1"].pop("key")
        largest = np.abs(key.pop("bias")).max()
        assert largest < 1e-3, (name, largest)
        block["MultiHeadDotProductAttention_1"]["key"] = key
  chex.assert_trees_all_close(params_a, params_b, atol=1e-5)


def test_initialize_needs_the_whole_address_of_the_run(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
               "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert multihost.initialize() is False  # one process: nothing to start
  with pytest.raises(ValueError, match="process_id=None"):
    multihost.initialize("localhost:1234", num_processes=2)
  monkeypatch.setenv("JAX_PROCESS_ID", "5")
  with pytest.raises(ValueError, match=r"--process_id=5 must be in \[0, 2\)"):
    multihost.initialize("localhost:1234", num_processes=2)


@pytest.mark.slow
def test_two_processes_match_one_and_their_checkpoint_resumes_in_one(
    tmp_path):
  pair, single = str(tmp_path / "pair"), str(tmp_path / "single")
  mesh = ["--config.mesh.data=-1", "--config.mesh.fsdp=2"]
  address = f"localhost:{_free_port()}"
  outputs = _finish([
      _start([*mesh, "--config.num_train_steps=6", f"--workdir={pair}",
              f"--coordinator_address={address}", "--num_processes=2",
              f"--process_id={index}"], devices=2)
      for index in (0, 1)])
  assert "4 device(s) (cpu) in 2 process(es), mesh {'data': 2, 'fsdp': 2}" \
      in outputs[0]
  assert "Final test accuracy" in outputs[0]
  assert "train step" not in outputs[1]  # only process 0 logs
  _finish([_start([*mesh, "--config.num_train_steps=6",
                   f"--workdir={single}"], devices=4)])

  # One writer: each step's record appears once.
  assert [r["step"] for r in metric_writer.read_metrics(pair)] == [
      2, 4, 6, 6]
  chex.assert_trees_all_close(_losses(pair), _losses(single), rtol=1e-5)
  # Same global batches in the same order: the same parameters, up to the
  # order of the cross-process reductions.
  _assert_same_params(pair, single)

  # The pair's checkpoint (params, Adam state, step, key) resumes in one
  # process on one device and continues exactly like the single run.
  resumed = str(tmp_path / "resumed")
  shutil.copytree(pair, resumed)
  one_device = ["--config.mesh.data=1", "--config.mesh.fsdp=1",
                "--config.num_train_steps=8"]
  out = _finish([_start([*one_device, f"--workdir={resumed}"], devices=1),
                 _start([*one_device, f"--workdir={single}"], devices=1)])
  assert all("Resumed from the checkpoint of step 6" in o for o in out)
  _assert_same_params(resumed, single)


@pytest.mark.slow
def test_two_processes_stream_a_folder_like_one(tmp_path):
  """Each process decodes its own rows of every global batch of a streamed
  folder; together they train exactly like one process."""
  sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
  from test_streaming import write_folder  # pylint: disable=g-import-not-at-top
  folder = write_folder(tmp_path / "photos", per_class=(16, 4))
  data = [f"--config.dataset={folder}", "--config.image_size=16",
          "--config.data_pipeline=stream", "--config.data_workers=1",
          "--config.random_resized_crop=True", "--config.crop_padding=0",
          "--config.batch_size=16", "--config.eval_batch_size=16",
          "--config.num_train_steps=6", "--config.mesh.data=-1"]
  pair, single = str(tmp_path / "pair"), str(tmp_path / "single")
  address = f"localhost:{_free_port()}"
  outputs = _finish([
      _start([*data, f"--workdir={pair}", f"--coordinator_address={address}",
              "--num_processes=2", f"--process_id={index}"], devices=1)
      for index in (0, 1)])
  assert "2 device(s) (cpu) in 2 process(es)" in outputs[0]
  _finish([_start([*data, f"--workdir={single}"], devices=2)])
  chex.assert_trees_all_close(_losses(pair), _losses(single), rtol=1e-5)
  evals = [r for r in metric_writer.read_metrics(pair) if r["split"] == "eval"]
  assert evals[-1]["num_examples"] == 12  # every test image once
