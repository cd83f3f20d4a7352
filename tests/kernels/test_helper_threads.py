"""The threads the C++ kernels split their calls over (csrc/helper_threads.h,
csrc/parallel_tasks.h, helper_threads.py): whole results from calls made at
once, helpers started only as needed, idle ones asleep, not spinning, none
where $VIT_JAX_KERNEL_HELPERS is 0, and none for a train step's calls."""

import concurrent.futures
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.kernels import cpu_build, cpu_layer_norm
from vit_jax.runtime import cpu_info

from helpers import run_python, small_vit, split_kernel_calls  # pylint: disable=wrong-import-order

needs_kernels = pytest.mark.skipif(
    cpu_build.problem() is not None,
    reason=f"the C++ kernels cannot run: {cpu_build.problem()}")
linux_only = pytest.mark.skipif(
    sys.platform != "linux", reason="reads the threads from /proc (Linux)")

EPSILON = 1e-6
HELPER_NAME = "vit_jax_helper"
_TASKS = pathlib.Path("/proc/self/task")


def _inputs(seed: int, rows: int):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(1, rows, 64)).astype(np.float32),
          rng.normal(size=64).astype(np.float32),
          rng.normal(size=64).astype(np.float32))


def _layer_norm():
  return jax.jit(lambda x, scale, bias: cpu_layer_norm.layer_norm(
      x, scale, bias, EPSILON))


def _helpers() -> list[pathlib.Path]:
  """The /proc entries of this process's helper threads."""
  found = []
  for task in _TASKS.iterdir():
    try:
      if (task / "comm").read_text().strip() == HELPER_NAME:
        found.append(task)
    except FileNotFoundError:  # a thread that ended meanwhile
      pass
  return found


def _cpu_seconds(task: pathlib.Path) -> float:
  """User and system time the thread has run."""
  fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@needs_kernels
def test_calls_made_at_once_from_several_threads_are_whole(monkeypatch):
  """Six threads each normalise their own arrays, 25 times, every call
  split into 4 tasks that share the process's helpers: each result equals
  the same array's in one task (a row's result does not depend on the
  split), so no call returned before its tasks were done or took another
  call's rows."""
  inputs = [_inputs(seed, rows) for seed, rows in enumerate(
      (203, 64, 7, 130, 257, 33))]
  split_kernel_calls(monkeypatch, 1)
  one_task = _layer_norm()
  expected = [np.asarray(one_task(*operands)) for operands in inputs]
  split_kernel_calls(monkeypatch, 4)
  split = _layer_norm()
  for operands in inputs:  # compiled here, not in the threads
    split(*operands).block_until_ready()

  def normalise_repeatedly(index):
    return [np.asarray(split(*inputs[index])) for _ in range(25)]

  with concurrent.futures.ThreadPoolExecutor(len(inputs)) as threads:
    results = list(threads.map(normalise_repeatedly, range(len(inputs))))
  for index, repeats in enumerate(results):
    for result in repeats:
      np.testing.assert_array_equal(result, expected[index])


@needs_kernels
@linux_only
def test_helpers_start_as_needed_and_sleep_when_idle(monkeypatch):
  """After calls split into two tasks, one at a time, there are helpers
  only where the process may run on two CPUs or more, and fewer than its
  CPUs; 50 ms after the last call (the spin is 1 ms) they sleep and use no
  CPU time."""
  split_kernel_calls(monkeypatch, 2)
  norm = _layer_norm()
  operands = _inputs(0, 512)
  for _ in range(20):
    norm(*operands).block_until_ready()
  cpus = cpu_info.cpu_cores()  # a container's quota may hold tasks to 1
  helpers = _helpers()
  if cpus >= 2:
    assert 1 <= len(helpers) <= cpus - 1
  else:
    assert not helpers
  time.sleep(0.05)
  before = [_cpu_seconds(task) for task in helpers]
  time.sleep(0.3)
  after = [_cpu_seconds(task) for task in helpers]
  tick = 1 / os.sysconf("SC_CLK_TCK")
  assert all(b - a <= tick for a, b in zip(before, after)), (before, after)
  # Woken again, they still split the work: the same values.
  split_kernel_calls(monkeypatch, 1)
  np.testing.assert_array_equal(norm(*operands), _layer_norm()(*operands))


# Normalises rows split into 2 tasks and into 1, 20 calls each, in a fresh
# process (the helpers' switch is read once a process); prints how many
# helper threads it then has and whether the two results are equal.
_SPLIT_CALLS = f"""
import pathlib
import jax
import numpy as np
from vit_jax.kernels import cpu_build, cpu_gemm, cpu_layer_norm
assert cpu_build.load() is None, cpu_build.load()  # registers the handlers
rng = np.random.default_rng(0)
x, scale, bias = (rng.normal(size=shape).astype(np.float32)
                  for shape in ((1, 512, 64), (64,), (64,)))
def normalise(tasks):
  cpu_gemm.tasks_per_device = lambda: tasks
  cpu_gemm.tasks_for_elements = lambda _: tasks
  jax.clear_caches()
  norm = jax.jit(lambda *a: cpu_layer_norm.layer_norm(*a, {EPSILON}))
  return [np.asarray(norm(x, scale, bias)) for _ in range(20)][-1]
split, whole = normalise(2), normalise(1)
helpers = sum((task / "comm").read_text().strip() == "{HELPER_NAME}"
              for task in pathlib.Path("/proc/self/task").iterdir())
print(helpers, bool(np.array_equal(split, whole)))
"""


@needs_kernels
@linux_only
@pytest.mark.skipif(cpu_info.cpu_cores() < 2,
                    reason="one CPU: the kernels start no helpers anyway")
def test_helpers_switched_off_leave_every_task_to_xla_threads():
  """With VIT_JAX_KERNEL_HELPERS=0 calls split into two tasks start no
  helper thread and give the same values as one task; without it the same
  calls start one."""
  for setting, expect_helpers in (("0", False), ("", True)):
    result = run_python("-c", _SPLIT_CALLS,
                        env={"VIT_JAX_KERNEL_HELPERS": setting}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    helpers, equal = result.stdout.split()
    assert (int(helpers) > 0) == expect_helpers, (setting, helpers)
    assert equal == "True"


def _helpers_attributes(jaxpr, found: list) -> list:
  """(primitive name, its `helpers` attribute) of every kernel call in
  jaxpr and the jaxprs inside it (scan bodies, jitted blocks)."""
  for eqn in jaxpr.eqns:
    if "helpers" in eqn.params:
      found.append((eqn.primitive.name, eqn.params["helpers"]))
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (list, tuple)) else [value]):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          _helpers_attributes(inner, found)
  return found


@needs_kernels
@pytest.mark.parametrize("remat,scan", [(False, False), (True, False),
                                        (True, True)])
def test_only_calls_outside_a_train_step_may_take_helpers(remat, scan):
  """A ViT's products, GELU and LayerNorm kernels are bound with
  helpers=True for inference and helpers=False in its gradient (the custom
  VJPs' rules, the rematerialised blocks' recomputation included), traced
  in turn in one process: the jitted blocks' trace cache, shared by both,
  does not carry one's attribute into the other."""
  model = small_vit(hidden_size=64, num_layers=3, remat_blocks=remat,
                    scan_blocks=scan)
  images = jnp.ones((2, 16, 16, 3))
  params = model.init(jax.random.PRNGKey(0), images, train=False)
  infer = lambda p: model.apply(p, images, train=False)
  gradient = jax.grad(lambda p: jnp.sum(model.apply(p, images, train=False)))
  for function, helpers in ((infer, True), (gradient, False),
                            (infer, True)):
    calls = _helpers_attributes(jax.make_jaxpr(function)(params).jaxpr, [])
    names = {name for name, _ in calls}
    assert {"VitGemm", "VitGelu", "VitLayerNormForward"} <= names, names
    if not helpers:
      assert {"VitGemmOverRows", "VitGemmTransposedRight"} <= names, names
    assert {flag for _, flag in calls} == {helpers}, calls
