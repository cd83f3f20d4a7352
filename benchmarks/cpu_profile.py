r"""Where vit_jax's CPU train step spends its time, by kind of operation.

  python benchmarks/cpu_profile.py                   # ViT-Ti/16 @224 training
  python benchmarks/cpu_profile.py --model=vit_tiny_cifar --mode=infer
  python benchmarks/cpu_profile.py --max_isa=avx2    # as an AVX2-only CPU

Runs the step that `benchmarks/throughput.py` races (same model, batch,
devices, malloc settings and XLA flags; `--max_isa`, `--matmul_dtype` and
`--cpu_devices` as there) in a fresh process and profiles a few steps with
`jax.profiler`. XLA:CPU records every thunk it runs (one instruction of the
compiled program: a fusion, a dot, a custom call, an all-reduce) as a trace
event tagged with the instruction, the device and the execution; the
compiled HLO says what each one is. Kinds:
  x.W, dy.W^T, x^T.dy   the Dense layers' three products (forward, input
                        gradient, weight gradient), with their GFLOP/s
  attention kernel      vit_jax's C++ attention (forward and backward)
  attention products    the einsums' batched dots, where they run instead
  LayerNorm, GELU and MLP bias, attention's q/k/v split and bias,
  embedding, head, residual adds, loss and input   XLA's elementwise and
                        reduction fusions, by the scope they come from
  optimizer             AdamW, the gradient norm, the parameter update
  copies and transposes layout changes
  all-reduce            the gradients' sum over devices, waiting included
  waiting               a device with nothing to run and no matmul due
  outside the program   the step's wall time before a device's first
                        thunk and after its last (dispatch)
XLA:CPU runs a `dot` (Eigen's matmul) asynchronously on its thread pool,
its event timing only the launch: a device's wait for it, until a reader
of the result starts, is the matmul's time. Where a device waits on
several matmuls at once (a weight gradient and an input gradient), the
wait is split between them by FLOPs; the table marks those rows "~".
Times are per device and step, shares of the step's wall time. Ends with
  summary: step_ms=… dense=… attention=… elementwise=… optimizer=…
           copies=… all_reduce=… other=… waiting=… between_steps=… cpu="…"
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import hlo_kinds
import race_report
import race_workers

WAITING = "waiting, no matmul outstanding"
# No dot runs slower than this (a hundredth of one core's float32 rate):
# the longest a dot can leave its device waiting is its FLOPs at this rate.
SLOWEST_DOT_FLOPS_PER_S = 1e9
BETWEEN_STEPS = "outside the program (dispatch)"


class ThunkEvent(NamedTuple):
  name: str
  start: float  # seconds
  end: float


def device_timelines(trace_path: str) -> list[list[ThunkEvent]]:
  """The thunk events of each (execution, device), in order of start.

  XLA:CPU's thunk executor tags every event with the HLO instruction
  (`hlo_op`), the device and the execution (`run_id`)."""
  opener = gzip.open if trace_path.endswith(".gz") else open
  with opener(trace_path, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  timelines = collections.defaultdict(list)
  for event in events:
    tags = event.get("args") or {}
    if event.get("ph") == "X" and "hlo_op" in tags and "dur" in event:
      start = event["ts"] * 1e-6
      timelines[tags.get("run_id"), tags.get("device_ordinal")].append(
          ThunkEvent(tags["hlo_op"], start, start + event["dur"] * 1e-6))
  return [sorted(timeline, key=lambda e: e.start)
          for timeline in timelines.values()]


def _gaps(timeline: list[ThunkEvent]) -> list[tuple[float, float]]:
  """The stretches of a device's timeline in which no thunk ran."""
  gaps, cursor = [], timeline[0].start
  for event in timeline:
    if event.start > cursor:
      gaps.append((cursor, event.start))
    cursor = max(cursor, event.end)
  return gaps


def attribute_gaps(timeline: list[ThunkEvent], module: hlo_kinds.HloModule,
                   consumers: dict[str, set[str]], flops: dict[str, float]
                   ) -> tuple[dict[str, float], dict[str, float], float]:
  """Seconds of the timeline's gaps spent waiting on each asynchronous dot;
  how much of that came from gaps shared with other dots; and the gap
  seconds with no dot outstanding.

  A dot is outstanding from its launch until a reader of its result starts,
  or until a dot launched after it is done (the thread pool takes them
  first come, first served), and at most as long as it would take at
  `SLOWEST_DOT_FLOPS_PER_S`: a small dot read only at the step's end (the
  head's weight gradient, where YNNPACK runs every other product) would
  otherwise collect every idle gap after its launch. A gap with several
  outstanding is split between them by FLOPs: their sum is measured, the
  split is not.
  """
  dots = [(i, event) for i, event in enumerate(timeline)
          if module.instructions[event.name].opcode == "dot"]
  done, bound = {}, timeline[-1].end
  for i, event in reversed(dots):
    readers = consumers.get(event.name, ())
    read = next((later.start for later in timeline[i + 1:]
                 if later.name in readers), timeline[-1].end)
    bound = done[event.name] = min(
        read, bound, event.start + flops[event.name] / SLOWEST_DOT_FLOPS_PER_S)
  waiting, shared = collections.Counter(), collections.Counter()
  unexplained = 0.0
  for gap_start, gap_end in _gaps(timeline):
    outstanding = [event.name for _, event in dots
                   if event.start <= gap_start and done[event.name] >= gap_end]
    total = sum(flops[name] for name in outstanding)
    if not total:
      unexplained += gap_end - gap_start
    for name in outstanding:
      share = (gap_end - gap_start) * flops[name] / total
      waiting[name] += share
      shared[name] += share if len(outstanding) > 1 else 0.0
  return waiting, shared, unexplained


class StepTimes(NamedTuple):
  """Per step: wall seconds, the process's CPU seconds (all threads), and
  the cores it may run on."""
  wall_s: float
  cpu_s: float
  cores: int


class Profile(NamedTuple):
  """Per device and step: seconds and dense FLOPs by kind, thunks by
  kind, and the slowest thunks."""
  seconds: dict[str, float]
  flops: dict[str, float]
  thunks: dict[str, float]
  estimated: frozenset[str]  # kinds >10% of whose time is a FLOP-split
  top: list[tuple[float, str, str, str]]  # seconds, thunk, kind, op_name


def profile_by_kind(hlo_text: str, trace_path: str, step_wall_s: float
                    ) -> Profile:
  """Each device's step time by kind of thunk, averaged over devices and
  steps.

  A thunk's time is its event's, less any part of it during which an
  earlier-started thunk of the device still ran. XLA:CPU runs a `dot`
  instruction (Eigen's matmul; YNNPACK's are fusions) asynchronously on
  the thread pool, its event covering the launch: the device's wait for
  it (the gaps in its timeline until a reader of the result starts) is
  added to the dot's kind. Gaps with no dot outstanding are WAITING; the
  step's wall time outside the device's first and last thunk is
  BETWEEN_STEPS.
  """
  module = hlo_kinds.parse_hlo(hlo_text)
  consumers = hlo_kinds.thunk_consumers(module)
  kinds, flops = {}, {}
  for instruction in module.computations[module.entry]:
    reader = hlo_kinds.reader_op_name(instruction.name, module, consumers)
    kinds[instruction.name], flops[instruction.name] = hlo_kinds.classify(
        instruction, module, reader)
  timelines = [[e for e in timeline if e.name in kinds]
               for timeline in device_timelines(trace_path)]
  timelines = [timeline for timeline in timelines if timeline]
  runs = len(timelines)
  seconds, dense, thunks = (collections.Counter() for _ in range(3))
  per_thunk, shared_seconds = collections.Counter(), collections.Counter()
  for timeline in timelines:
    waiting, shared, unexplained = attribute_gaps(timeline, module,
                                                  consumers, flops)
    for name, share in shared.items():
      shared_seconds[kinds[name]] += share / runs
    seconds[WAITING] += unexplained / runs
    seconds[BETWEEN_STEPS] += (step_wall_s - (timeline[-1].end -
                                              timeline[0].start)) / runs
    cursor = timeline[0].start
    for event in timeline:
      # XLA's thunk executor may run independent thunks at once (a custom
      # call beside a fusion): each instant of the device's time is charged
      # to the thunk that started first.
      own = max(0.0, event.end - max(event.start, cursor))
      cursor = max(cursor, event.end)
      busy = own + waiting.pop(event.name, 0.0)
      seconds[kinds[event.name]] += busy / runs
      per_thunk[event.name] += busy / runs
      dense[kinds[event.name]] += flops[event.name] / runs
      thunks[kinds[event.name]] += 1 / runs
  # A step longer than the mean spans more than step_wall_s; on average
  # the spans fit, up to the trace's and perf_counter's clocks.
  seconds[BETWEEN_STEPS] = max(0.0, seconds[BETWEEN_STEPS])
  top = sorted(((busy, name, kinds[name], module.instructions[name].op_name)
                for name, busy in per_thunk.items()), reverse=True)
  estimated = frozenset(kind for kind, share in shared_seconds.items()
                        if share > 0.1 * seconds[kind])
  return Profile(dict(seconds), dict(dense), dict(thunks), estimated, top)


def format_profile(profile: Profile, times: StepTimes, top: int
                   ) -> list[str]:
  """The table (and the `top` slowest thunks) as printable lines."""
  lines = ["| kind | ms per step | share | thunks | GFLOP/s |",
           "|---|---:|---:|---:|---:|"]
  kinds = [k for group in hlo_kinds.KIND_GROUPS.values() for k in group]
  for kind in kinds + [WAITING, BETWEEN_STEPS]:
    seconds = profile.seconds.get(kind, 0.0)
    if seconds > 0:
      rate = profile.flops.get(kind, 0.0) / seconds / 1e9
      mark = " ~" if kind in profile.estimated else ""
      lines.append(f"| {kind}{mark} | {seconds * 1e3:.1f} | "
                   f"{seconds / times.wall_s:.1%} | "
                   f"{profile.thunks.get(kind, 0):.0f} | "
                   f"{f'{rate:.0f}' if rate else ''} |")
  if profile.estimated:
    together = sorted(profile.estimated)
    seconds = sum(profile.seconds[k] for k in together)
    rate = sum(profile.flops.get(k, 0.0) for k in together) / seconds / 1e9
    lines.append(
        f"~ Eigen's matmuls run asynchronously, and these overlapped: "
        f"together {seconds * 1e3:.1f} ms at {rate:.0f} GFLOP/s, split "
        "between them by FLOPs.")
  lines.append(f"\nThe {top} slowest thunks (ms per step, kind, scope):")
  for seconds, name, kind, op_name in profile.top[:top]:
    scope = re.sub(r"jit\(\w+\)/", "", op_name)[-80:]
    lines.append(f"  {seconds * 1e3:7.2f}  {name:24s} {kind:26s} {scope}")
  return lines


def summary_line(profile: Profile, times: StepTimes, cpu: str) -> str:
  """Each group's share of a device's step."""
  shares = {group: sum(profile.seconds.get(k, 0.0) for k in kinds)
            / times.wall_s for group, kinds in hlo_kinds.KIND_GROUPS.items()}
  shares["waiting"] = profile.seconds.get(WAITING, 0.0) / times.wall_s
  shares["between_steps"] = (profile.seconds.get(BETWEEN_STEPS, 0.0)
                             / times.wall_s)
  return (f"summary: step_ms={times.wall_s * 1e3:.0f} " + " ".join(
      f"{group}={share:.2f}" for group, share in shares.items()) +
          f' cpu="{cpu}"')


def profiled_steps(step: "race_workers.JaxStep", steps: int, trace_dir: str
                   ) -> tuple[StepTimes, str]:
  """Runs `steps` steps under jax.profiler; their times and the trace."""
  import jax  # pylint: disable=import-outside-toplevel
  from vit_jax.runtime import cpu_info  # pylint: disable=import-outside-toplevel
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
      step()
    times = StepTimes((time.perf_counter() - wall) / steps,
                      (time.process_time() - cpu) / steps,
                      cpu_info.cpu_cores())
  trace_path = max(glob.glob(os.path.join(
      trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")),
                   key=os.path.getmtime)
  return times, trace_path


def worker(args) -> None:
  """Compiles the step, profiles `args.steps` of it, prints the table."""
  step = race_workers.JaxStep(args.model, args.mode, args.image_size,
                              args.patch_size, args.batch, args.num_layers)
  unprofiled_s = race_workers.time_steps(step, args.steps)
  with tempfile.TemporaryDirectory() as scratch:
    times, trace_path = profiled_steps(step, args.steps,
                                       args.trace_dir or scratch)
    hlo_text = step.compiled.as_text()
    if args.trace_dir:  # beside the trace, to read with it
      with open(os.path.join(args.trace_dir, "step.hlo.txt"), "w") as f:
        f.write(hlo_text)
    profile = profile_by_kind(hlo_text, trace_path, times.wall_s)
  model, flags = race_report.cpu_description()
  print(f"CPU: {model}, {race_report.cores_description(times.cores)}; "
        f"{', '.join(flags)}")
  print(race_report.code_line())
  print(f"{args.model} {args.mode}: {step.image_size} px, patch "
        f"{step.patch_size}, {step.model.num_layers} layers, batch "
        f"{step.batch}, on {step.mesh.devices.size} device(s); XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')}")
  print(f"A step: {unprofiled_s * 1e3:.0f} ms (median of {args.steps}), "
        f"{times.wall_s * 1e3:.0f} ms profiled, using "
        f"{times.cpu_s / times.wall_s:.2f} cores\n")
  print("\n".join(format_profile(profile, times, args.top)))
  print(summary_line(profile, times, model), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--model", default="ViT-Ti/16@224",
                      choices=tuple(race_workers.MODELS))
  parser.add_argument("--mode", default="train", choices=("train", "infer"))
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--image_size", type=int)
  parser.add_argument("--patch_size", type=int)
  parser.add_argument("--batch", type=int)
  parser.add_argument("--num_layers", type=int)
  parser.add_argument("--cpu_devices", type=int, default=-1)
  parser.add_argument("--max_isa", choices=("native", "avx2"),
                      default="native")
  parser.add_argument("--matmul_dtype", choices=("float32", "bfloat16"),
                      default="float32")
  parser.add_argument("--no-fast_malloc", dest="fast_malloc",
                      action="store_false")
  parser.add_argument("--top", type=int, default=12,
                      help="how many of the slowest thunks to list")
  parser.add_argument("--trace_dir", default="",
                      help="keep the trace there (Perfetto UI, TensorBoard) "
                      "with the compiled HLO (step.hlo.txt)")
  args = parser.parse_args()
  if args.worker:
    from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
    host.default_xla_flags()
    host.split_cpu_into_devices(args.cpu_devices, (
        race_workers.worker_batch(args.model, args.mode, args.batch),))
    worker(args)
    sys.stdout.flush()
    os._exit(0)  # skips tearing down JAX
  print("python " + " ".join(sys.argv), flush=True)
  env = race_workers.worker_environment(args.fast_malloc, args.max_isa,
                                        args.matmul_dtype)
  done = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]],
                        env=env, check=False)
  sys.exit(done.returncode)


if __name__ == "__main__":
  main()
