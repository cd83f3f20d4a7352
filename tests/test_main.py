"""`python main.py ...` end to end, in a subprocess, as a user runs it."""

import glob
import importlib.util
import os
import re

import pytest

from helpers import ROOT, run_python
from vit_jax import config as config_lib
from vit_jax.training import metric_writer



def _run_main(*flags, devices=1):
  """devices=None leaves the device count to main.py (config.cpu_devices)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices}"
                      if devices else "")
  return run_python("main.py", *flags, env=env)


SMALL_MODEL = ["--config.model.num_layers=2", "--config.model.hidden_size=32",
               "--config.model.num_heads=2", "--config.model.mlp_dim=64"]


def test_main_on_synthetic_data_trains_checkpoints_and_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  flags = ["--config=configs/vit_tiny_fashion_mnist.py",
           "--config.dataset=synthetic", "--config.synthetic.image_size=28",
           "--config.synthetic.channels=1", "--config.batch_size=32",
           "--config.num_train_steps=12", "--config.log_every_steps=4",
           "--config.checkpoint_every_steps=6", f"--workdir={workdir}",
           *SMALL_MODEL]
  result = _run_main(*flags, devices=2)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Final test accuracy" in result.stdout
  assert "2 device(s)" in result.stdout
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12",
                                                                      "6"]
  records = metric_writer.read_metrics(workdir)
  train_steps = [r["step"] for r in records if r["split"] == "train"]
  assert train_steps == [4, 8, 12]
  assert {"loss", "accuracy", "learning_rate", "images_per_second"} <= set(
      records[0])
  evals = [r for r in records if r["split"] == "eval"]
  assert evals[-1]["num_examples"] == 128

  again = _run_main(*flags, devices=2)  # finished run: restores, trains none
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Resumed from the checkpoint of step 12" in again.stdout


def test_main_rejects_unknown_config_key(tmp_path):
  result = _run_main("--config=configs/vit_tiny_cifar.py",
                     "--config.batch_sise=64", f"--workdir={tmp_path}")
  assert result.returncode != 0
  assert "batch_sise" in result.stderr
  assert "batch_size" in result.stderr  # the "did you mean" suggestion


def test_main_reports_missing_data_with_fixes(tmp_path):
  result = _run_main("--config=configs/vit_tiny_cifar.py",
                     f"--config.raw_data_dir={tmp_path / 'none'}",
                     f"--config.data_dir={tmp_path / 'tfds'}",
                     "--config.tfds_download=False", f"--workdir={tmp_path}")
  assert result.returncode != 0
  assert "DatasetUnavailableError" in result.stderr
  assert "--config.raw_data_dir=DIR" in result.stderr


@pytest.mark.parametrize("config", sorted(
    os.path.relpath(path, ROOT)
    for path in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not path.endswith("__init__.py")))
def test_shipped_configs_are_valid(config, tmp_path):
  spec = importlib.util.spec_from_file_location("config_module",
                                                os.path.join(ROOT, config))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  loaded = module.get_config()
  if loaded.init_from is not None:  # a file the user downloads
    loaded.init_from = str(tmp_path)
  config_lib.validate_config(loaded)
  assert loaded.is_locked
  # Each config documents the command that runs it (the trainer, or the
  # benchmark that measured it).
  command = rf"python (main|benchmarks/\w+)\.py --config={re.escape(config)}"
  assert re.search(command, module.__doc__), module.__doc__


@pytest.mark.slow
def test_finetune_config_runs_from_an_official_layout_checkpoint(tmp_path):
  """The fine-tuning recipe's smoke run: random ImageNet-21k-shaped ViT-B/16
  .npz, new head, SGD with accumulation, on synthetic data; at 128 px, where
  the recipe has 384, for time (the run took 32 s against 56 s alone): the
  14 x 14 position grid resized to 8 x 8 takes the path 24 x 24 does."""
  npz = str(tmp_path / "ViT-B_16.npz")
  converted = run_python(
      "-m", "vit_jax.checkpoints.convert", "--random_init=ViT-B/16",
      "--num_classes=21843", "--representation_size=768", f"--output={npz}")
  assert converted.returncode == 0, converted.stderr
  assert "103,186,515 parameters" in converted.stdout
  result = _run_main(
      "--config=configs/vit_b16_finetune_cifar10.py",
      f"--config.init_from={npz}", "--config.dataset=synthetic",
      "--config.batch_size=4", "--config.accum_steps=2",
      "--config.num_train_steps=2", "--config.eval_batch_size=4",
      "--config.synthetic.num_eval=4", "--config.image_size=128",
      f"--workdir={tmp_path / 'run'}")
  assert result.returncode == 0, result.stderr
  assert "85,697,280 of 85,704,970 parameters loaded" in result.stdout
  assert "(1, 197, 768) -> (1, 65, 768) (bilinear)" in result.stdout
  assert "Final test accuracy" in result.stdout


@pytest.mark.slow
def test_main_inspection_modes_on_fashion_mnist(tmp_path, fashion_mnist_dir):
  """summary, curves, report, attention, figure7 and predict, as a user
  runs them."""
  workdir = str(tmp_path / "run")
  common = ["--config=configs/vit_tiny_fashion_mnist.py",
            f"--config.raw_data_dir={fashion_mnist_dir}",
            "--config.max_train_examples=1024",
            "--config.max_eval_examples=500", "--config.eval_batch_size=250",
            f"--workdir={workdir}", *SMALL_MODEL]
  # Trained on the CPU split in 2 devices, as the config can ask; the modes
  # below read its checkpoint on one.
  trained = _run_main(*common, "--config.num_train_steps=16",
                      "--config.batch_size=64", "--config.log_every_steps=4",
                      "--config.cpu_devices=2", devices=None)
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert f"raw files in {fashion_mnist_dir}" in trained.stdout
  assert "2 device(s)" in trained.stdout
  assert "over 500 images" in trained.stdout

  summary = _run_main(*common, "--mode=summary")
  assert summary.returncode == 0, summary.stderr[-3000:]
  assert re.search(r"flatten to patch tokens +\(1, 49, 32\)", summary.stdout)
  assert "FLOPs per image" in summary.stdout and "total" in summary.stdout

  report = _run_main(*common, "--mode=report")
  assert report.returncode == 0, report.stderr[-3000:]
  assert "over 500 images" in report.stdout and "Ankle boot" in report.stdout
  figures = os.path.join(workdir, "figures")
  assert os.path.exists(os.path.join(figures, "confusion_matrix.png"))

  for mode in ("curves", "attention"):
    result = _run_main(*common, f"--mode={mode}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(os.path.join(figures, f"{mode}.png"))
  figure7 = _run_main(*common, "--mode=figure7")
  assert figure7.returncode == 0, figure7.stderr[-3000:]
  for name in ("position_embedding_similarity", "mean_attention_distance"):
    assert os.path.exists(os.path.join(figures, f"{name}.png"))

  from PIL import Image  # pylint: disable=g-import-not-at-top
  from vit_jax.data import raw_files  # pylint: disable=g-import-not-at-top
  images, _ = raw_files.read_idx_split(fashion_mnist_dir, "test")
  images = images[:2]
  paths = []
  for i, image in enumerate(images):
    paths.append(str(tmp_path / f"garment{i}.png"))
    Image.fromarray(image.reshape(28, 28)).resize((112, 112)).save(paths[-1])
  predict = _run_main(*common, "--mode=predict", "--attention",
                      f"--images={','.join(paths)}")
  assert predict.returncode == 0, predict.stderr[-3000:]
  lines = [l for l in predict.stdout.splitlines() if "garment" in l]
  assert len(lines) == 2 and lines[0].count(",") == 2  # top 3 each
  assert os.path.exists(os.path.join(figures, "garment0_attention.png"))

  missing = _run_main(*common, "--mode=predict", "--images=nope.png")
  assert missing.returncode != 0
  assert "No image file at nope.png" in missing.stderr


@pytest.mark.parametrize("flags, message", [
    (["--config=configs/nope.py"],
     r"No config file 'configs/nope.py'\. The shipped configs: .*"
     r"vit_tiny_cifar, "),
    (["--config=configs/vit_tiny_cifar.py", "tiny"],
     r"Unexpected arguments: \[.tiny.\]"),
    (["--config={broken}"],
     r"Could not load the config file .*broken\.py: SyntaxError"),
    (["--config={raising}"],
     r"Could not load the config file .*raising\.py: KeyError: 'x'"),
    (["--config=configs/vit_tiny_fashion_mnist.py", "--mode=bogus"],
     r"flag --mode=bogus: value should be one of"),
    (["--config=configs/vit_tiny_fashion_mnist.py",
      "--config.batch_size=abc"], r"flag --config\.batch_size=abc"),
    (["--config=configs/vit_tiny_fashion_mnist.py", "--config.batch_sise=8"],
     r"batch_sise"),
])
def test_cli_mistakes_end_in_one_clear_line(tmp_path, flags, message):
  """A missing or broken config file, an unknown mode, a bad flag value or
  config key: a non-zero exit and a message naming the problem, no
  traceback."""
  (tmp_path / "broken.py").write_text("def get_config(:\n")
  (tmp_path / "raising.py").write_text(
      "def get_config():\n  raise KeyError('x')\n")
  flags = [f.format(broken=tmp_path / "broken.py",
                    raising=tmp_path / "raising.py") for f in flags]
  result = run_python("main.py", *flags, f"--workdir={tmp_path / 'run'}",
                      timeout=120)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert re.search(message, result.stderr), result.stderr[-2000:]


@pytest.mark.parametrize("launcher", [["main.py"], ["-m", "vit_jax"]])
def test_mode_word_and_shipped_config_name(tmp_path, launcher):
  """`vit-jax summary --config=NAME` as `python -m vit_jax` (the console
  script's code) and through main.py: the mode as a word, the config by
  its name in the package, with a `:ARG`."""
  result = run_python(*launcher, "summary",
                      "--config=vit_finetune_folder:linear_probe",
                      "--config.dataset=synthetic", "--config.init_from=",
                      f"--workdir={tmp_path}", timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "85,806,346" in result.stdout  # ViT-B/16, 10 classes


def test_help_describes_the_modes_and_configs():
  result = run_python("-m", "vit_jax", "--help", timeout=120)
  # absl ends --help with exit status 1.
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "figure7|predict" in result.stdout
  assert "--config takes a file path" in result.stdout
