r"""One multi-threaded CPU device vs a device per core (config.cpu_devices).

  python benchmarks/cpu_devices.py --config=configs/vit_fashion_mnist_15min.py
  python benchmarks/cpu_devices.py --config=configs/vit_tiny_cifar.py --steps=5

XLA reads the device count once per process, so each measurement is a fresh
`benchmarks/train_throughput.py` process (the config's real train step,
batch 128), alternating `--config.cpu_devices=0` (one device, operations
split between threads) and `--config.cpu_devices=-1` (one device per
core, the batch split between them) for --rounds rounds, so machine noise
hits both alike; with main.py's malloc settings (huge pages, and tcmalloc
if installed; vit_jax/runtime/host.py) unless GLIBC_TUNABLES / LD_PRELOAD are
set. Prints images/s and compile time per process, and ends with

  summary: per_core_over_one_device=1.31 one_device=305.2 per_core=399.8

(medians of the rounds; numbers illustrative). On a CPU with cores of two
speeds (`cpu_info.core_kinds`: performance and efficiency cores) a third
setting, a device per fast core, runs too, and the line ends with its
per_fast_core=... .
"""

import os
import re
import statistics
import subprocess
import sys

from absl import app, flags

from vit_jax.runtime import cpu_info, host

_CONFIG = flags.DEFINE_string("config", "configs/vit_fashion_mnist_15min.py",
                              "Config whose train step is measured.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Alternating rounds.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per process.")
_OVERRIDES = flags.DEFINE_list(
    "overrides", [], "Config overrides passed on, e.g. "
    "--overrides=--config.model.num_layers=2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SETTINGS = {"one_device": "0", "per_core": "-1"}
_SUMMARY = re.compile(r"summary: images_per_second=([\d.]+) \S+ "
                      r"compile_seconds=([\d.]+)")
_DEVICES = re.compile(r"(\d+) cpu device\(s\)")


def _measure(cpu_devices: str) -> tuple[float, float, int]:
  """(images/s, compile seconds, devices) of one train_throughput.py run."""
  env = dict(os.environ)
  env.update(host.fast_malloc_environment(  # as main.py trains
      env, host.find_tcmalloc()))
  # The device count is what is compared: drop one the caller may have set.
  env["XLA_FLAGS"] = " ".join(
      flag for flag in env.get("XLA_FLAGS", "").split()
      if not flag.startswith(host.CPU_DEVICE_COUNT_FLAG))
  command = [sys.executable, os.path.join(ROOT, "benchmarks",
                                          "train_throughput.py"),
             f"--config={_CONFIG.value}", f"--config.cpu_devices={cpu_devices}",
             f"--steps={_STEPS.value}", "--rounds=1", *_OVERRIDES.value]
  out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True,
                       text=True, check=False)
  match, devices = _SUMMARY.search(out.stdout), _DEVICES.search(out.stdout)
  if out.returncode or not match or not devices:
    raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-2000:]}")
  return float(match.group(1)), float(match.group(2)), int(devices.group(1))


def main(argv):
  del argv
  print("python benchmarks/cpu_devices.py " + " ".join(
      [f"--config={_CONFIG.value}", f"--rounds={_ROUNDS.value}",
       f"--steps={_STEPS.value}"] + [f"--overrides={override}"
                                     for override in _OVERRIDES.value]))
  print(f"{cpu_info.cpu_cores()} cores; train step of "
        f"{_CONFIG.value}, batch 128")
  settings = dict(_SETTINGS)
  kinds = cpu_info.core_kinds()
  if kinds is not None:  # a device per fast core too (main.py's note)
    print(f"{kinds[0]} fast and {kinds[1]} slower cores")
    settings["per_fast_core"] = str(kinds[0])
  rates = {name: [] for name in settings}
  for round_index in range(_ROUNDS.value):
    for name, setting in settings.items():
      rate, compile_seconds, devices = _measure(setting)
      rates[name].append(rate)
      print(f"round {round_index + 1}  {name:10s} (cpu_devices={setting:>2s}, "
            f"{devices} device(s))  {rate:7.1f} images/s  compile "
            f"{compile_seconds:5.1f} s", flush=True)
  medians = {name: statistics.median(values) for name, values in rates.items()}
  print(f"summary: per_core_over_one_device="
        f"{medians['per_core'] / medians['one_device']:.2f} "
        f"one_device={medians['one_device']:.1f} "
        f"per_core={medians['per_core']:.1f}"
        + (f" per_fast_core={medians['per_fast_core']:.1f}"
           if "per_fast_core" in medians else ""))


if __name__ == "__main__":
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  app.run(main)
