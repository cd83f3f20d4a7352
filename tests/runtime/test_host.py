"""Process settings for speed (vit_jax/runtime/host.py) and compile-once
training."""

import json
import logging
import os
import subprocess
import sys

import jax
import pytest

from helpers import small_config
from vit_jax.runtime import cpu_info, host
from vit_jax.training import loop

from helpers import ROOT  # pylint: disable=wrong-import-order

# Prints what the process sees before and after host.reexec_with_fast_malloc.
_PROBE = """
import os, sys
print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"),
      os.environ.get("LD_PRELOAD"), flush=True)
from vit_jax.runtime import host
host.reexec_with_fast_malloc()
print("after", os.getpid(), os.environ.get("GLIBC_TUNABLES"),
      os.environ.get("LD_PRELOAD"), sys.argv[1:], "jax" in sys.modules,
      flush=True)
"""
_MALLOC_VARIABLES = ("GLIBC_TUNABLES", "LD_PRELOAD", host.NO_REEXEC_VARIABLE)


def _run(code: str, env_changes: dict, *args: str) -> str:
  env = {k: v for k, v in os.environ.items() if k not in _MALLOC_VARIABLES}
  env.update(env_changes)
  env["PYTHONPATH"] = ROOT
  return subprocess.run([sys.executable, "-u", "-c", code, *args], env=env,
                        capture_output=True, text=True, check=True).stdout


def _probe(env_changes: dict) -> list[list[str]]:
  out = _run(_PROBE, env_changes, "a", "--b=1")
  return [line.split(" ", 3) for line in out.splitlines()]


def test_fast_malloc_environment_adds_only_what_the_user_left_unset():
  tcmalloc = "libtcmalloc_minimal.so.4"
  assert host.fast_malloc_environment({}, tcmalloc) == {
      "GLIBC_TUNABLES": host.HUGE_PAGES_TUNABLE, "LD_PRELOAD": tcmalloc}
  assert host.fast_malloc_environment({}, None) == {
      "GLIBC_TUNABLES": host.HUGE_PAGES_TUNABLE}
  # An empty value is a choice too: LD_PRELOAD= keeps glibc's malloc.
  assert host.fast_malloc_environment(
      {"LD_PRELOAD": "", "GLIBC_TUNABLES": "x"}, tcmalloc) == {}
  assert host.fast_malloc_environment({"GLIBC_TUNABLES": ""}, tcmalloc) == {
      "LD_PRELOAD": tcmalloc}


def test_reexec_restarts_once_with_fast_malloc_and_same_arguments():
  lines = _probe({})
  # The first start prints, execs, and the new image prints both lines.
  assert [line[0] for line in lines] == ["start", "start", "after"]
  assert lines[0][1] == lines[1][1] == lines[2][1]  # same pid: exec, no fork
  assert lines[0][2:] == ["None", "None"]
  tcmalloc = str(host.find_tcmalloc())  # "None" where not installed
  assert lines[1][2:] == [host.HUGE_PAGES_TUNABLE, tcmalloc]
  assert lines[2][2:3] == [host.HUGE_PAGES_TUNABLE]
  # The arguments are kept, and importing vit_jax.runtime.host loads no JAX.
  assert lines[2][3] == f"{tcmalloc} ['a', '--b=1'] False"


def test_reexec_leaves_a_user_choice_alone():
  for env in ({"GLIBC_TUNABLES": "", "LD_PRELOAD": ""},
              {host.NO_REEXEC_VARIABLE: "1"}):
    lines = _probe(env)
    assert [line[0] for line in lines] == ["start", "after"], env


# Runs a jitted function whose 64 MiB product lives in XLA's scratch (a
# fresh allocation each call) and prints the page faults of its later calls.
_FAULTS = """
import resource
from vit_jax.runtime import host
host.reexec_with_fast_malloc()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0) + jnp.exp(x).sum(1))
x = jnp.ones((4096, 4096 // 4))
faults = []
for _ in range(10):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults[2:])
"""


@pytest.mark.skipif(host.find_tcmalloc() is None,
                    reason="tcmalloc is not installed (Debian: "
                    "apt-get install libtcmalloc-minimal4; .ci/run does)")
def test_tcmalloc_reuses_xla_scratch_without_page_faults():
  glibc = [int(n) for n in _run(_FAULTS, {"LD_PRELOAD": ""}).split()]
  tcmalloc = [int(n) for n in _run(_FAULTS, {}).split()]
  # glibc maps the scratch afresh on every call and faults it in (here
  # 169-2,846 faults a call with huge pages, ~21,000 with 4 KiB pages);
  # tcmalloc keeps it from the call before (0-3 faults), but now and then
  # hands some back to the kernel (one call in ~12 faulted ~20,600 pages).
  assert min(glibc) >= 30, glibc
  assert sorted(tcmalloc)[len(tcmalloc) // 2] < 10, tcmalloc


def test_importing_vit_jax_changes_no_process_setting():
  """Importing the package and its trainer leaves XLA_FLAGS and the
  compilation cache as they were; main.py applies its settings itself."""
  code = ("import os, jax, vit_jax; from vit_jax.training import loop; "
          "vit_jax.VisionTransformer; "
          "print(repr(os.environ.get('XLA_FLAGS'))); "
          "print(jax.config.jax_compilation_cache_dir)")
  env = dict(os.environ, PYTHONPATH=ROOT)
  for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):
    env.pop(name, None)
  out = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, check=True).stdout
  assert out.split() == ["None", "None"]


def test_compilation_cache_defaults_to_the_user_cache_dir(tmp_path):
  code = ("import jax; from vit_jax.runtime import host; "
          "print(host.enable_compilation_cache()); "
          "print(jax.config.jax_compilation_cache_dir)")
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=ROOT)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, check=True).stdout
  expected = str(tmp_path / "vit_jax" / "xla")
  assert out.split() == [expected, expected]
  assert os.path.isdir(expected)

  env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "mine")
  out = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, check=True).stdout
  assert out.split() == ["None", str(tmp_path / "mine")]


# Splits the CPU as asked, then prints what JAX sees and XLA_FLAGS.
_SPLIT_PROBE = """
import os, sys
from vit_jax.runtime import host
count, start_first = int(sys.argv[1]), sys.argv[2] == "start_first"
if start_first:
  import jax; jax.devices()
result = host.split_cpu_into_devices(count)
import jax
print(result, jax.device_count(), os.environ.get("XLA_FLAGS", ""))
"""


def _split(count: int, xla_flags: str = "", start_first: bool = False):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags)
  out = subprocess.run(
      [sys.executable, "-c", _SPLIT_PROBE, str(count),
       "start_first" if start_first else "-"],
      env=env, capture_output=True, text=True, check=True)
  result, devices, flags = (out.stdout.strip().split(" ", 2) + [""])[:3]
  return int(result), int(devices), flags, out.stderr


def test_split_cpu_into_devices_gives_single_threaded_devices():
  result, devices, flags, _ = _split(3)
  assert (result, devices) == (3, 3)
  assert "--xla_cpu_multi_thread_eigen=false" in flags.split()
  # -1: one device per core this process may use.
  cores = cpu_info.cpu_cores()
  result, devices, _, _ = _split(-1)
  assert devices == cores and result == (cores if cores > 1 else 0)
  # 0 leaves one multi-threaded device.
  result, devices, flags, _ = _split(0)
  assert (result, devices) == (0, 1) and "eigen" not in flags


def test_split_cpu_into_devices_leaves_the_users_choices_alone():
  # A device count in XLA_FLAGS wins; so does the user's eigen setting.
  user = f"{host.CPU_DEVICE_COUNT_FLAG}=2"
  result, devices, flags, _ = _split(4, user)
  assert (result, devices) == (0, 2) and "eigen" not in flags
  user = "--xla_cpu_multi_thread_eigen=true"
  result, devices, flags, _ = _split(2, user)
  assert (result, devices) == (2, 2)
  assert flags.split().count(user) == 1 and "=false" not in flags
  # Too late once JAX has started: nothing changes, and a warning says so.
  result, devices, _, stderr = _split(2, start_first=True)
  assert (result, devices) == (0, 1)
  assert "split_cpu_into_devices before any JAX computation" in stderr


def test_a_device_per_core_only_as_far_as_the_batches_split_evenly():
  assert host.per_core_device_count((128, 256), cores=2) == 2
  # 6 cores: 128 and 100 split evenly over 4 devices at most.
  assert host.per_core_device_count((128, 100), cores=6) == 4
  assert host.per_core_device_count((7,), cores=4) == 1
  assert host.per_core_device_count((), cores=3) == 3
  assert host.per_core_device_count() == cpu_info.cpu_cores()


def test_split_cpu_into_devices_rejects_a_negative_count():
  with pytest.raises(ValueError, match="cpu_devices=-2 must be >= -1"):
    host.split_cpu_into_devices(-2)


def test_training_compiles_the_train_and_eval_steps_once(tmp_path, caplog):
  """Three epochs and a step, evaluated after epochs 1 and 2 and the last
  step (the last eval batch padded; epoch 3 ends too close to the last step
  to evaluate): one compilation of each step, none per step or per eval."""
  config = small_config(num_train_steps=13, eval_every_epochs=1)
  caplog.set_level(logging.WARNING, logger="jax")
  with jax.log_compiles():
    loop.train_and_evaluate(config, str(tmp_path))
  compiled = [r.getMessage().split(" with ")[0] for r in caplog.records
              if r.getMessage().startswith("Compiling ")]
  assert compiled.count("Compiling jit(train_step)") == 1, compiled
  assert compiled.count("Compiling jit(eval_step)") == 1, compiled
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  evals = [r for r in records if r.get("split") == "eval"]
  trains = [r for r in records if r.get("split") == "train"]
  assert [r["step"] for r in evals] == [4, 8, 13]  # 4 steps an epoch
  assert len(trains) >= 3, len(trains)


@pytest.mark.parametrize("release", ["0.10", "0.11", "0.12"])
def test_measured_xla_flags_apply_on_the_releases_they_were_measured_on(
    monkeypatch, release):
  """On a measured jaxlib release the flag turning YNNPACK's fusions off is
  added; a user's own value for it is kept; an unmeasured release gets
  nothing (an unknown flag would abort the process)."""
  flag = "--xla_cpu_experimental_ynn_fusion_type="
  monkeypatch.setattr(host, "jaxlib_release", lambda: release)
  monkeypatch.setattr(cpu_info, "CPUINFO", "/nonexistent/cpuinfo")  # no vendor
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  assert host.default_xla_flags() == [flag]
  assert os.environ["XLA_FLAGS"] == (
      f"--xla_force_host_platform_device_count=2 {flag}")
  assert host.default_xla_flags() == []  # already there
  monkeypatch.setenv("XLA_FLAGS", f"{flag}dot")
  assert host.default_xla_flags() == []
  assert os.environ["XLA_FLAGS"] == f"{flag}dot"
  monkeypatch.setattr(host, "jaxlib_release", lambda: "0.13")
  monkeypatch.setenv("XLA_FLAGS", "")
  assert host.default_xla_flags() == [] and os.environ["XLA_FLAGS"] == ""


def _cpuinfo(tmp_path, vendor: str, flags: str) -> str:
  """A two-processor /proc/cpuinfo of `vendor` with `flags`."""
  processor = (f"vendor_id\t: {vendor}\nmodel name\t: Some CPU\n"
               f"flags\t\t: {flags}\n\n")
  path = tmp_path / "cpuinfo"
  path.write_text(f"processor\t: 0\n{processor}processor\t: 1\n{processor}")
  return str(path)


@pytest.mark.parametrize("vendor,flags,wide", [
    ("GenuineIntel", "fpu avx2 fma avx512f avx512bw amx_bf16", True),
    ("GenuineIntel", "fpu avx2 fma", False),  # an AVX2-only Intel
    ("AuthenticAMD", "fpu avx2 fma avx512f avx512bw avx512_bf16", False)])
def test_xla_kernels_take_512_bit_vectors_on_intel_avx512_only(
    monkeypatch, tmp_path, vendor, flags, wide):
  """Where 512-bit vectors were measured faster (Intel's AVX-512 cores) the
  flag is added; on AMD's AVX-512 and without AVX-512 it is not; a user's
  own width is kept."""
  monkeypatch.setattr(host, "jaxlib_release", lambda: "0.10")
  monkeypatch.setattr(cpu_info, "CPUINFO", _cpuinfo(tmp_path, vendor, flags))
  assert cpu_info.cpu_features() == (vendor, frozenset(flags.split()))
  monkeypatch.setenv("XLA_FLAGS", "")
  width = "--xla_cpu_prefer_vector_width=512"
  assert (width in host.default_xla_flags()) is wide
  assert (width in os.environ["XLA_FLAGS"].split()) is wide
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_prefer_vector_width=256")
  assert width not in host.default_xla_flags()
  assert os.environ["XLA_FLAGS"].split()[0] == (
      "--xla_cpu_prefer_vector_width=256")


@pytest.mark.parametrize("cap,wide", [
    ("--xla_cpu_max_isa=AVX2", False), ("--xla_cpu_max_isa=avx2", False),
    ("--xla_cpu_max_isa=SSE4_2", False), ("--xla_cpu_max_isa=AVX512", True),
    ("--xla_cpu_max_isa=AMX --xla_cpu_max_isa=AVX2", False),
    ("--xla_cpu_max_isa=AVX512_BF16", True)])
def test_an_isa_cap_below_avx512_takes_no_512_bit_vectors(
    monkeypatch, tmp_path, cap, wide):
  """An Intel AVX-512 CPU capped at a lower instruction set (the stand-in
  for an AVX2-only CPU) gets what such a CPU gets: no 512-bit preference;
  the last cap is the one XLA reads."""
  monkeypatch.setattr(host, "jaxlib_release", lambda: "0.10")
  monkeypatch.setattr(cpu_info, "CPUINFO", _cpuinfo(
      tmp_path, "GenuineIntel", "fpu avx2 fma avx512f avx512bw"))
  monkeypatch.setenv("XLA_FLAGS", cap)
  width = "--xla_cpu_prefer_vector_width=512"
  assert (width in host.default_xla_flags()) is wide
  assert os.environ["XLA_FLAGS"].startswith(cap)


def test_jaxlib_release_is_the_installed_minor_release():
  import jaxlib  # pylint: disable=import-outside-toplevel
  major, minor = jaxlib.__version__.split(".")[:2]
  assert host.jaxlib_release() == f"{major}.{minor}"

