"""The check that a step fits in the host's memory before it runs
(vit_jax/runtime/host_memory.py): the memory it reads from fake
/proc/meminfo and cgroup files, XLA's needs of real compiled programs, and
the error and warning the trainer shows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.runtime import host_memory

GIB = 2**30


def _files(tmp_path, monkeypatch, meminfo_kb=None, cgroup=None):
  """Points host_memory at fake files: MemAvailable of meminfo_kb, and
  cgroup v2's (limit, usage) if given."""
  meminfo = tmp_path / "meminfo"
  if meminfo_kb is not None:
    meminfo.write_text(f"MemTotal:       99999999 kB\n"
                       f"MemFree:         1000 kB\n"
                       f"MemAvailable:   {meminfo_kb} kB\n")
  monkeypatch.setattr(host_memory, "MEMINFO", str(meminfo))
  limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
  if cgroup is not None:
    limit.write_text(f"{cgroup[0]}\n")
    usage.write_text(f"{cgroup[1]}\n")
  monkeypatch.setattr(host_memory, "CGROUP_FILES",
                      ((str(limit), str(usage)),))


def test_available_bytes_from_meminfo_and_the_cgroup(tmp_path, monkeypatch):
  _files(tmp_path, monkeypatch, meminfo_kb=8 * 2**20)
  assert host_memory.available_bytes() == 8 * GIB
  # A container's limit leaves less than the machine has free.
  _files(tmp_path, monkeypatch, meminfo_kb=8 * 2**20,
         cgroup=(4 * GIB, 3 * GIB))
  assert host_memory.available_bytes() == 1 * GIB
  # cgroup v2 writes "max" where the group has no limit.
  _files(tmp_path, monkeypatch, meminfo_kb=8 * 2**20, cgroup=("max", 5))
  assert host_memory.available_bytes() == 8 * GIB
  # Neither file (macOS, Windows): unknown, and nothing is checked.
  (tmp_path / "none").mkdir()
  _files(tmp_path / "none", monkeypatch)
  assert host_memory.available_bytes() is None


def test_the_real_hosts_memory_is_read():
  available = host_memory.available_bytes()
  assert available is not None and 0 < available < 2**50


def _doubled(x):
  return x * 2.0 + 1.0


def test_needed_bytes_counts_outputs_unless_they_reuse_a_donated_input():
  x = jnp.ones((1024, 1024), jnp.float32)  # 4 MiB
  plain = jax.jit(_doubled).lower(x).compile()
  donated = jax.jit(_doubled, donate_argnums=0).lower(x).compile()
  assert host_memory.needed_bytes(plain, 1) >= 4 * 2**20
  assert (host_memory.needed_bytes(plain, 1)
          - host_memory.needed_bytes(donated, 1)) == 4 * 2**20
  # Every CPU device holds its own buffers in the host's memory.
  assert (host_memory.needed_bytes(plain, 3)
          == 3 * host_memory.needed_bytes(plain, 1))


def test_needed_bytes_grow_with_the_batch():
  """A gradient whose forward pass keeps an intermediate of (rows, 4096)
  floats for the backward pass: 512 more rows, 8 MiB more."""
  w = jnp.ones((256, 4096), jnp.float32)

  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)

  grad = jax.jit(jax.grad(loss))
  small, large = (host_memory.needed_bytes(grad.lower(
      w, jnp.ones((rows, 256))).compile(), 1) for rows in (512, 1024))
  assert large - small >= 512 * 4096 * 4, (small, large)


@pytest.mark.parametrize("needed,available,error,warning", [
    (30 * GIB, 20 * GIB, True, False),
    (17 * GIB, 20 * GIB, False, True),  # 85%: fits, but barely
    (10 * GIB, 20 * GIB, False, False),
])
def test_problem_says_what_and_how_much(needed, available, error, warning):
  found_error, found_warning = host_memory.problem(
      needed, available, 2, "train step", "Raise accum_steps.")
  assert (found_error is not None) == error
  assert (found_warning is not None) == warning
  message = found_error or found_warning or ""
  if message:
    assert f"{needed / GIB:.1f} GiB of host memory" in message
    assert f"{needed / 2 / GIB:.1f} GiB on each of 2 CPU devices" in message
    assert f"{available / GIB:.1f} GiB are available" in message
    assert "Raise accum_steps." in message
  if error:
    assert "--config.check_host_memory=False" in message


class _Counting:
  """A jitted function that counts its runs and its lowerings."""

  def __init__(self, fn):
    self.jitted, self.runs, self.lowered = jax.jit(fn), 0, 0

  def __call__(self, *args):
    self.runs += 1
    return self.jitted(*args)

  def lower(self, *args):
    self.lowered += 1
    return self.jitted.lower(*args)


def test_a_step_that_does_not_fit_is_stopped_before_it_runs(monkeypatch):
  monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**20)
  step = _Counting(lambda state, x: (state, x @ x.T))
  logged = []
  checked = host_memory.CheckedOnFirstRun(step, "train step",
                                          "Lower batch_size.", logged.append)
  x = jnp.ones((1024, 512))
  with pytest.raises(host_memory.HostMemoryError,
                     match="train step needs .* GiB of host memory .*"
                     "Lower batch_size"):
    checked(jnp.zeros(3), x)
  assert step.runs == 0 and not logged


def test_a_step_that_fits_runs_and_is_checked_once_per_batch_shape(
    monkeypatch):
  monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**40)
  step = _Counting(lambda state, x: (state + 1, x @ x.T))
  checked = host_memory.CheckedOnFirstRun(step, "train step", "", print)
  state = jnp.zeros(3)
  for rows in (8, 8, 16, 8):
    state, product = checked(state, jnp.ones((rows, 4)))
    np.testing.assert_allclose(product, np.full((rows, rows), 4.0))
  np.testing.assert_array_equal(state, np.full(3, 4.0))
  assert step.runs == 4 and step.lowered == 2


def test_a_step_that_takes_most_of_the_memory_is_logged(monkeypatch):
  x = jnp.ones((1024, 512))
  step = _Counting(lambda state, x: (state, x @ x.T))
  needed = host_memory.needed_bytes(step.lower(jnp.zeros(3), x).compile(), 1)
  monkeypatch.setattr(host_memory, "available_bytes",
                      lambda: int(needed / 0.9))
  logged = []
  checked = host_memory.CheckedOnFirstRun(step, "eval step", "Lower it.",
                                          logged.append)
  checked(jnp.zeros(3), x)
  assert step.runs == 1
  assert len(logged) == 1 and logged[0].startswith("Warning: The eval step")
  assert "90%" in logged[0]


def test_every_cpu_device_of_a_sharded_step_is_counted(monkeypatch):
  """Each of the host's CPU devices holds its own scratch in the host's
  memory: the check multiplies one device's needs by their number."""
  from vit_jax.runtime import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh()
  devices = len(mesh.local_devices)
  assert devices == len(jax.devices()) > 1  # tests/conftest.py: 8
  x = jax.device_put(jnp.ones((devices * 256, 512)),
                     sharding.batch_sharded(mesh))
  step = jax.jit(lambda state, x: (state, jnp.tanh(x) * 2.0))
  one_device = host_memory.needed_bytes(
      step.lower(jnp.zeros(3), x).compile(), 1)
  monkeypatch.setattr(host_memory, "available_bytes",
                      lambda: devices * one_device - 1)
  with pytest.raises(host_memory.HostMemoryError,
                     match=f"on each of {devices} CPU devices"):
    host_memory.check_fits(step, (jnp.zeros(3), x), "train step", "")
  monkeypatch.setattr(host_memory, "available_bytes",
                      lambda: 2 * devices * one_device)
  assert host_memory.check_fits(step, (jnp.zeros(3), x), "train step",
                                "") is None
