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


def _proc_self(root, cgroup: str, mounts: list[tuple[str, str, str, str]]):
  """A fake /proc/self: its "cgroup" text, and a "mountinfo" line for each
  (mount root, mount point, file system type, super options)."""
  proc = root / "proc_self"
  proc.mkdir()
  (proc / "cgroup").write_text(cgroup)
  (proc / "mountinfo").write_text("".join(
      f"{30 + i} 23 0:{40 + i} {mount_root} {point} rw,relatime - {fs} {fs} "
      f"{options}\n" for i, (mount_root, point, fs, options) in
      enumerate([("/", "/", "ext4", "rw")] + mounts)))
  return str(proc)


def _quota_files(directory, files: dict[str, str]) -> None:
  for name, text in files.items():
    (directory / name).parent.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text + "\n")


def test_cpu_quota_reads_cgroup_v2_and_the_tightest_parent(tmp_path,
                                                          monkeypatch):
  """cgroup v2 (systemd, Kubernetes): cpu.max in the process's cgroup and
  each parent up to the mount; the smallest binds ("max": no limit)."""
  top = tmp_path / "cgroup v2"  # a space: mountinfo writes it as \040
  _quota_files(top, {"kubepods/pod1/app/cpu.max": "max 100000",
                     "kubepods/pod1/cpu.max": "150000 100000",
                     "kubepods/cpu.max": "400000 100000",
                     "cpu.max": "max 100000"})
  monkeypatch.setattr(cpu_info, "PROC_SELF", _proc_self(
      tmp_path, "0::/kubepods/pod1/app\n",
      [("/", str(top).replace(" ", "\\040"), "cgroup2", "rw")]))
  assert cpu_info.cpu_quota() == pytest.approx(1.5)


@pytest.mark.parametrize("cgroup,mount_root,files,quota", [
    # Docker on cgroup v1: its cgroup mounted as the container's root.
    ("4:cpu,cpuacct:/docker/abc\n", "/docker/abc",
     {"cpu.cfs_quota_us": "50000", "cpu.cfs_period_us": "100000"}, 0.5),
    # A host's view: the cgroup below the hierarchy's root.
    ("2:cpuacct:/\n4:cpu:/batch/job\n", "/",
     {"batch/job/cpu.cfs_quota_us": "-1", "batch/job/cpu.cfs_period_us":
      "100000", "batch/cpu.cfs_quota_us": "300000",
      "batch/cpu.cfs_period_us": "200000"}, 1.5),
    # No limit anywhere (-1), or no quota files at all.
    ("4:cpu:/\n", "/", {"cpu.cfs_quota_us": "-1",
                       "cpu.cfs_period_us": "100000"}, None),
    ("4:cpu:/\n", "/", {}, None)])
def test_cpu_quota_reads_cgroup_v1s_cpu_hierarchy(tmp_path, monkeypatch,
                                                 cgroup, mount_root, files,
                                                 quota):
  top = tmp_path / "cpu"
  top.mkdir()
  _quota_files(top, files)
  # A v1 hierarchy of another controller, and an empty v2 one beside it
  # (the hybrid layout): neither has a CPU quota to read.
  monkeypatch.setattr(cpu_info, "PROC_SELF", _proc_self(tmp_path, cgroup, [
      (mount_root, str(top), "cgroup", "rw,cpu"),
      ("/", str(tmp_path / "memory"), "cgroup", "rw,memory"),
      ("/", str(tmp_path / "unified"), "cgroup2", "rw")]))
  assert cpu_info.cpu_quota() == (None if quota is None
                                  else pytest.approx(quota))


def test_cpu_quota_is_none_without_procfs(tmp_path, monkeypatch):
  monkeypatch.setattr(cpu_info, "PROC_SELF", str(tmp_path / "absent"))
  assert cpu_info.cpu_quota() is None


@pytest.mark.parametrize("quota,cores", [
    (None, 8), (1.0, 1), (1.5, 2), (0.3, 1), (2.0001, 2), (12.0, 8)])
def test_cpu_cores_is_the_cpus_held_to_the_quota_rounded_up(monkeypatch,
                                                            quota, cores):
  """8 CPUs in the affinity mask; a quota of 1.5 still gets 2 (a large
  step uses the half), one of 12 the 8 CPUs."""
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)),
                      raising=False)
  monkeypatch.setattr(cpu_info, "cpu_quota", lambda: quota)
  assert cpu_info.cpu_cores() == cores



@pytest.mark.parametrize("siblings,allowed,threads", [
    # Two threads a core (SMT), CPUs numbered core by core or thread by
    # thread; held by the affinity mask to one thread of each core.
    ({0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, range(4), 2),
    ({0: "0,4", 1: "1,5", 4: "0,4", 5: "1,5"}, [0, 1, 4, 5], 2),
    ({0: "0,4", 1: "1,5", 4: "0,4", 5: "1,5"}, [0, 1], 1),
    ({0: "0", 1: "1"}, range(2), 1),  # one thread a core (this guest)
    ({}, range(2), 1)])  # no sysfs
def test_threads_per_core_counts_the_allowed_siblings(tmp_path, monkeypatch,
                                                      siblings, allowed,
                                                      threads):
  _sysfs(tmp_path, {f"system/cpu/cpu{cpu}/topology/thread_siblings_list":
                    text for cpu, text in siblings.items()})
  monkeypatch.setattr(cpu_info, "SYSFS_DEVICES", str(tmp_path))
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed),
                      raising=False)
  assert cpu_info.threads_per_core() == threads
