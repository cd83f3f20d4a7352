"""What vit_jax reads of the host's CPU (vit_jax/runtime/cpu_info.py): its
feature flags, model, and cores of two kinds, from fake /proc/cpuinfo,
sysfs and sysctl answers."""

import os
import sys

import pytest

from vit_jax.runtime import cpu_info


def test_cpu_features_and_model_without_cpuinfo(monkeypatch):
  """Without /proc/cpuinfo (macOS): no flags, and the model sysctl names."""
  monkeypatch.setattr(cpu_info, "CPUINFO", "/nonexistent/cpuinfo")
  assert cpu_info.cpu_features() == ("", frozenset())
  monkeypatch.setattr(cpu_info, "sysctl", {
      "machdep.cpu.brand_string": "Apple M3 Pro"}.get)
  assert cpu_info.cpu_model() == "Apple M3 Pro"


def test_cpu_model_reads_the_model_name(tmp_path, monkeypatch):
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                     "model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2\n")
  monkeypatch.setattr(cpu_info, "CPUINFO", str(cpuinfo))
  assert cpu_info.cpu_model() == "AMD EPYC 9R14"
  assert cpu_info.cpu_features() == ("AuthenticAMD",
                                     frozenset({"fpu", "avx2"}))


def _sysfs(root, files: dict[str, str]) -> None:
  for path, text in files.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text + "\n")


@pytest.mark.parametrize("files,allowed,kinds", [
    # A hybrid Intel CPU: performance cores (two threads each), then
    # efficiency cores; as this process's affinity mask admits them.
    ({"cpu_core/cpus": "0-7", "cpu_atom/cpus": "8-11"}, range(12), (8, 4)),
    ({"cpu_core/cpus": "0-3,6", "cpu_atom/cpus": "4-5,7"}, [0, 1, 5], (2, 1)),
    ({"cpu_core/cpus": "0-7", "cpu_atom/cpus": "8-11"}, [0, 1], None),
    # Arm's big.LITTLE: each core's relative capacity.
    ({f"system/cpu/cpu{i}/cpu_capacity": c for i, c in
      enumerate(["1024", "1024", "446", "446", "446"])}, range(5), (2, 3)),
    # Alike cores (this x86 VM's kernel writes 1024 for each), or no sysfs.
    ({f"system/cpu/cpu{i}/cpu_capacity": "1024" for i in range(4)},
     range(4), None),
    ({}, range(4), None)])
def test_core_kinds_counts_the_fast_and_slower_cores_linux_lists(
    tmp_path, monkeypatch, files, allowed, kinds):
  _sysfs(tmp_path, files)
  monkeypatch.setattr(cpu_info, "SYSFS_DEVICES", str(tmp_path))
  monkeypatch.setattr(sys, "platform", "linux")
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed))
  assert cpu_info.core_kinds() == kinds


@pytest.mark.parametrize("values,kinds", [
    ({"hw.nperflevels": 2, "hw.perflevel0.logicalcpu": 8,
      "hw.logicalcpu": 12}, (8, 4)),  # an M3 Pro's 8 + 4
    ({"hw.nperflevels": 1, "hw.logicalcpu": 8}, None),
    ({}, None)])  # no sysctl
def test_core_kinds_on_macos_reads_the_performance_levels(monkeypatch, values,
                                                          kinds):
  monkeypatch.setattr(sys, "platform", "darwin")
  answers = {name: str(value) for name, value in values.items()}
  monkeypatch.setattr(cpu_info, "sysctl", answers.get)
  assert cpu_info.core_kinds() == kinds
