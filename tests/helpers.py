"""Shared helpers of the tests: small models and configs, counting
compiles, and running the project's scripts in fresh processes."""

import logging
import os
import subprocess
import sys
from typing import Mapping, Optional

import jax

from vit_jax import config as config_lib
from vit_jax.kernels import cpu_gemm
from vit_jax.training import loop
from vit_jax.model.vit import VisionTransformer

# The repository's root: the scripts (main.py, benchmarks/) run from there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def run_python(*args: str, env: Optional[Mapping[str, str]] = None,
               timeout: int = 600) -> subprocess.CompletedProcess:
  """`python *args` in a fresh process at the repository's root, with
  `env` over this process's environment (the repository and tests/
  importable); its output captured as text. Does not check the exit code:
  the caller asserts it, with the stderr."""
  full_env = dict(os.environ, **(env or {}))
  full_env["PYTHONPATH"] = os.pathsep.join(
      [ROOT, TESTS] + ([full_env["PYTHONPATH"]]
                       if full_env.get("PYTHONPATH") else []))
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env,
                        capture_output=True, text=True, timeout=timeout)


def split_kernel_calls(monkeypatch, tasks: int) -> None:
  """Makes the CPU kernels split each call into `tasks` parts, in the
  programs traced from now on. JAX's caches are cleared: a function jitted
  again with the same shapes would reuse the trace of a test before, with
  the split that test asked for."""
  monkeypatch.setattr(cpu_gemm, "tasks_per_device", lambda: tasks)
  monkeypatch.setattr(cpu_gemm, "tasks_for_elements", lambda _: tasks)
  jax.clear_caches()


def small_vit(**overrides) -> VisionTransformer:
  """A 2-layer, 32-wide, 4-head ViT with patch 4 and 10 classes."""
  fields = dict(num_classes=10, patch_size=4, hidden_size=32, num_layers=2,
                num_heads=4, mlp_dim=64)
  fields.update(overrides)
  return VisionTransformer(**fields)


def small_config(**overrides):
  """A 2-layer, 32-wide ViT on 16x16 synthetic data: compiles in seconds."""
  config = config_lib.base_config("ViT-Mini/4")
  config.model.hidden_size = 32
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.mlp_dim = 64
  config.dataset = "synthetic"
  config.synthetic.image_size = 16
  config.synthetic.num_train = 64
  config.synthetic.num_eval = 40
  config.batch_size = 16
  config.eval_batch_size = 16
  config.warmup_epochs = 1.0
  config.log_every_steps = 2
  for key, value in overrides.items():
    config[key] = value
  return config


def train_counting_compiles(config, workdir, caplog):
  """loop.train_and_evaluate(config, workdir) -> (its metrics, the names of
  the jitted functions it compiled, in order, e.g. "jit(train_step)")."""
  caplog.set_level(logging.WARNING, logger="jax")
  with jax.log_compiles():
    metrics = loop.train_and_evaluate(config, workdir)
  return metrics, [r.getMessage().split(" with ")[0].removeprefix("Compiling ")
                   for r in caplog.records
                   if r.getMessage().startswith("Compiling ")]
