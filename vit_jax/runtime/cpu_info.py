"""What this host's CPU is: its vendor and feature flags, the cores this
process may run on, and whether they are of two kinds (performance and
efficiency cores). Read from Linux's /proc/cpuinfo and sysfs, or macOS's
sysctl; where neither answers, what the functions say they return then.
Nothing here changes a setting (`host` does that)."""

import glob
import os
import platform
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
  """Cores this process may run on."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


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
