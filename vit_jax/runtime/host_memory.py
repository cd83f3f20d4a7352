"""Whether a compiled step fits in the host's memory, checked before it runs.

On a CPU every device's buffers live in the host's memory, and a step that
needs more than the host has is not refused: the kernel's OOM killer ends
the process partway (`Killed`, exit status 137), with nothing logged. XLA
knows each program's needs once it is compiled (`memory_analysis`), so the
trainer asks before a step's first run (`check_fits`) and stops with the
numbers and the settings that lower them. ViT-B/16 at 384 px, for one:
XLA's scratch is ~420 MiB an image on each device (1.8 GiB for 4 images,
13.2 GiB for 32), about half of it the attention probabilities kept for the
backward pass (docs/performance.md, *ViT-B/16 at 384 px*).
"""

from typing import Any, Callable, Optional

import jax

from vit_jax.runtime import cpu_info

MEMINFO = "/proc/meminfo"
# cgroup v2's limit and use for this process's group, or v1's (containers,
# `docker run --memory`, systemd slices): MemAvailable is the machine's.
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
# Above this share of the available memory, a warning: the data pipeline,
# checkpoint writes and other processes need some too.
WARN_FRACTION = 0.8
GIB = 2**30


class HostMemoryError(MemoryError):
  """A step would need more of the host's memory than it has available."""


def _number(path: str) -> Optional[int]:
  text = (cpu_info.read_text(path) or "").strip()
  return int(text) if text.isdigit() else None  # "max": no limit


def available_bytes() -> Optional[int]:
  """Memory this process can still take: Linux's MemAvailable, or less
  where its cgroup's limit leaves less; None where neither can be read
  (macOS, Windows)."""
  available = []
  try:
    with open(MEMINFO) as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          available.append(int(line.split()[1]) * 1024)  # kB
  except (OSError, ValueError, IndexError):
    pass
  for limit_path, usage_path in CGROUP_FILES:
    limit, usage = _number(limit_path), _number(usage_path)
    if limit is not None and usage is not None and limit < 2**60:
      available.append(max(limit - usage, 0))
  return min(available) if available else None


def needed_bytes(compiled: Any, devices: int) -> int:
  """What running `compiled` (a `jax.stages.Compiled`) adds to the host's
  memory on `devices` CPU devices: each device's scratch and the outputs
  that do not reuse a donated input's buffer."""
  analysis = compiled.memory_analysis()
  per_device = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes
                - analysis.alias_size_in_bytes)
  return devices * max(per_device, 0)


def problem(needed: int, available: int, devices: int, what: str,
            fixes: str) -> tuple[Optional[str], Optional[str]]:
  """(error, warning) for a program needing `needed` bytes where
  `available` are free: an error if it does not fit, a warning if it takes
  more than WARN_FRACTION of it, else neither."""
  where = (f"{needed / devices / GIB:.1f} GiB on each of {devices} CPU "
           "devices" if devices > 1 else "on its one CPU device")
  size = (f"The {what} needs {needed / GIB:.1f} GiB of host memory "
          f"({where}: XLA's scratch for its activations, and its outputs), "
          f"and {available / GIB:.1f} GiB are available")
  if needed > available:
    return (f"{size}: the system would kill the process partway. {fixes} "
            "(--config.check_host_memory=False runs it regardless, e.g. "
            "where swap makes up the difference.)"), None
  if needed > WARN_FRACTION * available:
    return None, f"Warning: {size}, {needed / available:.0%} of it. {fixes}"
  return None, None


def check_fits(jitted: Callable, args: tuple, what: str,
               fixes: str) -> Optional[str]:
  """Raises HostMemoryError if `jitted(*args)` would need more memory than
  the host has available; returns a warning for the log if it needs most
  of it, else None. Off a CPU, or where the available memory is unknown,
  checks nothing. Compiles the program, which `jitted`'s first call then
  reuses (jit keeps the executable)."""
  local = set()  # the devices of this process that the program runs on
  for x in jax.tree.leaves(args):
    if isinstance(x, jax.Array):
      local |= x.sharding.addressable_devices
  if not local:
    return None
  available = available_bytes()
  if available is None or any(d.platform != "cpu" for d in local):
    return None
  needed = needed_bytes(jitted.lower(*args).compile(), len(local))
  error, warning = problem(needed, available, len(local), what, fixes)
  if error:
    raise HostMemoryError(error)
  return warning


class CheckedOnFirstRun:
  """`jitted`, checked by `check_fits` before its first run with each shape
  of its batch (the arguments after the first: the state or params come
  first and keep their shapes). A warning goes to `log`."""

  def __init__(self, jitted: Callable, what: str, fixes: str,
               log: Callable[[str], None]):
    self.jitted, self.what, self.fixes, self.log = jitted, what, fixes, log
    self._checked = set()

  def __call__(self, *args):
    shapes = tuple((x.shape, x.dtype) for x in jax.tree.leaves(args[1:]))
    if shapes not in self._checked:
      warning = check_fits(self.jitted, args, self.what, self.fixes)
      self._checked.add(shapes)
      if warning:
        self.log(warning)
    return self.jitted(*args)
