"""What this host's CPU is: its vendor and feature flags, the cores this
process may use (its CPUs, and a container's CPU quota), and whether they
are of two kinds (performance and efficiency cores). Read from Linux's
/proc and sysfs, or macOS's sysctl; where neither answers, what the
functions say they return then. Nothing here changes a setting (`host`
does that)."""

import functools
import glob
import math
import os
import platform
import re
import subprocess
import sys
from typing import Optional

# Where the CPU's vendor and feature flags are read (Linux).
CPUINFO = "/proc/cpuinfo"


def cpu_features() -> tuple[str, frozenset[str]]:
  """(vendor, feature flags) of this host's CPU from /proc/cpuinfo, e.g.
  ("GenuineIntel", {"avx2", "avx512f", ...}); ("", {}) where it cannot be
  read (not Linux)."""
  vendor, flags = "", frozenset()
  try:
    with open(CPUINFO) as cpuinfo:
      for line in cpuinfo:
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id" and not vendor:
          vendor = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
          flags = frozenset(value.split())
  except OSError:
    pass
  return vendor, flags


def cpu_model() -> str:
  """The CPU's model name, e.g. "AMD EPYC" or "Apple M3 Pro": /proc/cpuinfo's
  (Linux), else the one sysctl names (macOS), else the processor's
  architecture."""
  try:
    with open(CPUINFO) as cpuinfo:
      for line in cpuinfo:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model name") and value.strip():
          return value.strip()
  except OSError:
    pass
  return (sysctl("machdep.cpu.brand_string") or platform.processor()
          or platform.machine())


def cpu_cores() -> int:
  """Cores this process may use: the CPUs it may run on (its affinity
  mask), or fewer where its cgroup's CPU quota (`cpu_quota`: a container's
  `--cpus`, a Kubernetes CPU limit) allows less time than that, rounded up.

  Devices, kernel tasks and input workers are sized by it. Threads beyond
  a quota burn it and then stall until the next period (100 ms): under a
  1-CPU quota on 2 CPUs a batch-1 ViT-Ti/16 forward pass sized for 2
  averaged 13.1 ms with a 90th percentile of 54 ms, sized for 1 11.2 and
  11.9 ms. Rounded up because a fractional quota's share still pays for
  large steps: at 1.5 CPUs two devices trained `vit_tiny_cifar` 1.43x as
  fast as one (docs/performance.md, *Containers' CPU quotas*).
  """
  quota = binding_cpu_quota()
  if quota is None:
    return allowed_cpus()
  return max(1, math.ceil(round(quota, 3)))  # 2.0000001 CPUs: 2


def allowed_cpus() -> int:
  """CPUs this process may run on: its affinity mask (`taskset`), or every
  CPU where the OS has none (macOS)."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def binding_cpu_quota() -> Optional[float]:
  """`cpu_quota()` where it is below `allowed_cpus()`, so that it, not the
  CPUs, sets `cpu_cores()`; else None."""
  quota = cpu_quota()
  return quota if quota is not None and quota < allowed_cpus() else None


# Where Linux says which cgroups this process is in and where the cgroup
# filesystems are mounted ("cgroup" and "mountinfo").
PROC_SELF = "/proc/self"


def cpu_quota() -> Optional[float]:
  """CPUs' worth of time this process's cgroups allow it (cgroup v2's
  cpu.max, v1's cpu.cfs_quota_us over cpu.cfs_period_us; the smallest on
  the way from its cgroup up to the root), e.g. 1.5; None without a
  limit, or off Linux."""
  return _cpu_quota_under(PROC_SELF)


@functools.lru_cache(maxsize=None)  # read once a process: mountinfo is long
def _cpu_quota_under(proc_self: str) -> Optional[float]:
  memberships = read_text(os.path.join(proc_self, "cgroup"))
  mounts = read_text(os.path.join(proc_self, "mountinfo"))
  if not memberships or not mounts:
    return None
  quotas = [quota for directory, top in cpu_cgroup_dirs(memberships, mounts)
            for quota in _quotas_up_to(directory, top)]
  return min(quotas, default=None)


def _unescape(field: str) -> str:
  """A mountinfo path: spaces and the like are written as octal escapes."""
  return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cpu_cgroup_dirs(memberships: str, mounts: str) -> list[tuple[str, str]]:
  """(this process's cgroup directory, its mount point) in each mounted
  hierarchy that can hold a CPU quota: cgroup v2's, v1's "cpu" one."""
  paths = {}  # "cgroup2" or "cpu" -> the cgroup's path in that hierarchy
  for line in memberships.splitlines():
    number, _, rest = line.partition(":")
    controllers, _, path = rest.partition(":")
    if number == "0" and not controllers:
      paths["cgroup2"] = path
    elif "cpu" in controllers.split(","):
      paths["cpu"] = path
  dirs = []
  for line in mounts.splitlines():
    fields, _, fs = line.partition(" - ")
    fields, fs = fields.split(), fs.split()
    if len(fields) < 5 or len(fs) < 3:
      continue
    kind = ("cgroup2" if fs[0] == "cgroup2" else "cpu" if fs[0] == "cgroup"
            and "cpu" in fs[2].split(",") else None)
    if kind not in paths:
      continue
    root, top = _unescape(fields[3]), _unescape(fields[4])
    # In a container the mount's root is often the cgroup itself.
    relative = (os.path.relpath(paths[kind], root)
                if (paths[kind] + "/").startswith(root.rstrip("/") + "/")
                else ".")
    dirs.append((os.path.normpath(os.path.join(top, relative)), top))
  return dirs


def _quota_in(directory: str) -> Optional[float]:
  """The CPU quota one cgroup directory sets (v2's cpu.max, "150000
  100000" or "max 100000"; v1's cpu.cfs_quota_us, -1 for none), or None."""
  text = read_text(os.path.join(directory, "cpu.max"))
  if text is not None:
    limit, _, period = text.partition(" ")
  else:
    limit = read_text(os.path.join(directory, "cpu.cfs_quota_us")) or ""
    period = read_text(os.path.join(directory, "cpu.cfs_period_us")) or ""
  try:
    limit, period = float(limit), float(period)
  except ValueError:
    return None  # "max", or nothing to read
  return limit / period if limit > 0 and period > 0 else None


def _quotas_up_to(directory: str, top: str) -> list[float]:
  """The CPU quotas set in `directory` and its parents up to `top` (a
  parent's quota binds its children too)."""
  quotas = []
  while True:
    quota = _quota_in(directory)
    if quota is not None:
      quotas.append(quota)
    if len(directory) <= len(top) or not directory.startswith(top):
      return quotas
    directory = os.path.dirname(directory)


# Where Linux says which CPUs are which kind: a hybrid Intel CPU's
# performance (cpu_core) and efficiency (cpu_atom) cores; each core's
# relative capacity on Arm (big.LITTLE, DynamIQ).
SYSFS_DEVICES = "/sys/devices"


def _cpu_list(text: str) -> set[int]:
  """The CPUs of a sysfs CPU list such as "0-3,8,10-11"."""
  cpus = set()
  for part in filter(None, text.strip().split(",")):
    first, _, last = part.partition("-")
    cpus.update(range(int(first), int(last or first) + 1))
  return cpus


def read_text(path: str) -> Optional[str]:
  """A small file's text (sysfs, procfs), or None where it cannot be read."""
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return None


def _linux_core_kinds() -> Optional[tuple[set[int], set[int]]]:
  """(fast CPUs, slower CPUs) from sysfs, or None if all are alike."""
  fast = read_text(os.path.join(SYSFS_DEVICES, "cpu_core", "cpus"))
  slow = read_text(os.path.join(SYSFS_DEVICES, "cpu_atom", "cpus"))
  if fast is not None and slow is not None:
    return _cpu_list(fast), _cpu_list(slow)
  capacities = {}
  for path in glob.glob(os.path.join(SYSFS_DEVICES, "system", "cpu",
                                     "cpu[0-9]*", "cpu_capacity")):
    text = read_text(path)
    if text and text.strip().isdigit():
      cpu = int(os.path.basename(os.path.dirname(path))[3:])
      capacities[cpu] = int(text)
  if len(set(capacities.values())) < 2:
    return None
  top = max(capacities.values())
  return ({cpu for cpu, c in capacities.items() if c == top},
          {cpu for cpu, c in capacities.items() if c < top})


def threads_per_core() -> int:
  """Hardware threads a core runs for this process (2 with SMT, Intel's
  Hyper-Threading, on most x86 CPUs): the most of one core's siblings in
  its affinity mask, from Linux's sysfs; 1 where it cannot tell."""
  if not hasattr(os, "sched_getaffinity"):
    return 1
  allowed = os.sched_getaffinity(0)
  counts = [len(_cpu_list(text) & allowed) for cpu in allowed
            if (text := read_text(os.path.join(
                SYSFS_DEVICES, "system", "cpu", f"cpu{cpu}", "topology",
                "thread_siblings_list")))]
  return max(counts, default=1)


def sysctl(name: str) -> Optional[str]:
  """The value of a sysctl variable (macOS, the BSDs), or None where there
  is none."""
  try:
    return subprocess.run(["sysctl", "-n", name], capture_output=True,
                          text=True, check=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def _sysctl_count(name: str) -> Optional[int]:
  value = sysctl(name)
  return int(value) if value and value.isdigit() else None


def core_kinds() -> Optional[tuple[int, int]]:
  """(fast, slower): this process's cores on a CPU with cores of two kinds
  (Intel's performance and efficiency cores, Arm's big and LITTLE, Apple's
  performance levels), from Linux's sysfs or macOS's sysctl; None where
  the cores are alike or it cannot tell."""
  if sys.platform == "darwin":
    if (_sysctl_count("hw.nperflevels") or 1) < 2:
      return None
    fast, total = _sysctl_count("hw.perflevel0.logicalcpu"), _sysctl_count(
        "hw.logicalcpu")
    return (fast, total - fast) if fast and total and total > fast else None
  kinds = _linux_core_kinds()
  if kinds is None:
    return None
  allowed = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
             else kinds[0] | kinds[1])
  fast, slow = len(kinds[0] & allowed), len(kinds[1] & allowed)
  return (fast, slow) if fast and slow else None
