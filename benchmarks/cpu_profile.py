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
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

import throughput

DENSE_KINDS = ("x.W (forward)", "dy.W^T (input gradients)",
               "x^T.dy (weight gradients)")
KIND_GROUPS = {  # summary name -> kinds, in the table's order
    "dense": DENSE_KINDS,
    "attention": ("attention kernel (C++)", "attention products (XLA)"),
    "elementwise": ("LayerNorm", "GELU and MLP bias",
                    "attention's q/k/v split and bias",
                    "embedding, head, residual adds", "loss and input"),
    "optimizer": ("optimizer (AdamW, gradient norm)",),
    "copies": ("copies and transposes",),
    "all_reduce": ("all-reduce (waiting included)",),
    "other": ("other custom calls",),
}
WAITING = "waiting, no matmul outstanding"
BETWEEN_STEPS = "outside the program (dispatch)"
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter",
                "collective-permute", "all-to-all")


class Instruction(NamedTuple):
  """One HLO instruction of the compiled program's text."""
  name: str
  shape: str  # "f32[4160,576]{1,0}", or a tuple "(f32[...], ...)"
  opcode: str
  operands: tuple[str, ...]
  attributes: str  # the rest of the line: dims, calls=, metadata
  is_root: bool
  parameter_number: int  # N of parameter(N), else -1

  @property
  def op_name(self) -> str:
    found = re.search(r'op_name="([^"]*)"', self.attributes)
    return found.group(1) if found else ""

  @property
  def calls(self) -> str:
    found = re.search(r"calls=%?([\w.-]+)", self.attributes)
    return found.group(1) if found else ""


class HloModule(NamedTuple):
  """A compiled program's instructions, by name and by computation."""
  instructions: dict[str, Instruction]
  computations: dict[str, list[Instruction]]
  entry: str  # the entry computation's name: its instructions are thunks



def _split_shape(text: str) -> tuple[str, str]:
  """"(a, b) rest" or "f32[2]{0} rest" -> (shape, rest)."""
  if not text.startswith("("):
    shape, _, rest = text.partition(" ")
    return shape, rest
  depth = 0
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return text[:i + 1], text[i + 1:].lstrip()
  return text, ""


def parse_hlo(text: str) -> HloModule:
  """The instructions of an HLO module's text (`compiled.as_text()`)."""
  instructions, computations = {}, collections.defaultdict(list)
  computation = entry = ""
  for line in text.splitlines():
    header = re.match(r"(ENTRY )?%?([\w.-]+) .*\{\s*$", line)
    if header and not line.startswith(" "):
      computation = header.group(2)
      entry = computation if header.group(1) else entry
      continue
    found = re.match(r"\s+(ROOT )?%([\w.-]+) = (.*)$", line)
    if not found:
      continue
    shape, rest = _split_shape(found.group(3))
    call = re.match(r"([\w-]+)\((.*?)\)(.*)$", rest)
    if not call:
      continue
    number = call.group(2) if call.group(1) == "parameter" else "-1"
    instruction = Instruction(
        found.group(2), shape, call.group(1),
        tuple(re.findall(r"%([\w.-]+)", call.group(2))), call.group(3),
        bool(found.group(1)), int(number) if number.isdigit() else -1)
    instructions[instruction.name] = instruction
    computations[computation].append(instruction)
  return HloModule(instructions, dict(computations), entry)


def dims(shape: str) -> tuple[int, ...]:
  """f32[4160,576]{1,0} -> (4160, 576); the first array of a tuple."""
  found = re.search(r"\w+\[([\d,]*)\]", shape)
  return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def _attribute_dims(attributes: str, key: str) -> tuple[int, ...]:
  found = re.search(key + r"=\{([\d,]*)\}", attributes)
  return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def dot_flops(dot: Instruction, module: HloModule) -> float:
  """2 x output elements x contracted length of a dot instruction."""
  lhs = dims(module.instructions[dot.operands[0]].shape)
  contracted = math.prod(
      lhs[d] for d in _attribute_dims(dot.attributes, "lhs_contracting_dims"))
  return 2.0 * math.prod(dims(dot.shape)) * contracted


def _fused(instruction: Instruction, module: HloModule) -> list[Instruction]:
  """The instructions a fusion's computation runs (nested fusions too)."""
  inner = module.computations.get(instruction.calls, []) if (
      instruction.calls) else []
  return inner + [j for i in inner if i.opcode == "fusion"
                  for j in _fused(i, module)]


# Instructions that move or reshape data without arithmetic.
_VIEWS = frozenset(("parameter", "bitcast", "copy", "transpose", "convert",
                    "reshape", "concatenate", "slice", "broadcast",
                    "get-tuple-element", "tuple"))


def _reads_weights(name: str, module: HloModule,
                   fusion: Optional[Instruction] = None, depth: int = 8
                   ) -> bool:
  """Whether instruction `name` (inside `fusion`, if given) is the model's
  weights seen through copies, transposes and other views."""
  instruction = module.instructions[name]
  if depth == 0:
    return False
  if instruction.opcode == "parameter":
    if fusion is not None:  # the fusion's argument of that number
      return _reads_weights(fusion.operands[instruction.parameter_number],
                            module, None, depth - 1)
    return "params[" in instruction.op_name  # not the batch or AdamW's
  inner = _fused(instruction, module)
  if instruction.opcode == "fusion" and all(
      i.opcode in _VIEWS for i in inner):
    return any(_reads_weights(o, module, fusion, depth - 1)
               for o in instruction.operands)
  if instruction.opcode in _VIEWS:
    return any(_reads_weights(o, module, fusion, depth - 1)
               for o in instruction.operands)
  return False


def _dense_kind(dot: Instruction, op_name: str, module: HloModule,
                fusion: Optional[Instruction]) -> str:
  """Which of a Dense layer's products a dot is (`fusion`: the fusion it
  is inside, if it is)."""
  if _attribute_dims(dot.attributes, "lhs_batch_dims"):
    return "attention products (XLA)"
  if "transpose(" not in op_name:  # JAX's name for the backward pass
    return DENSE_KINDS[0]
  # The input gradient multiplies by the weights; the weight gradient
  # multiplies two activations.
  if any(_reads_weights(o, module, fusion) for o in dot.operands):
    return DENSE_KINDS[1]
  return DENSE_KINDS[2]


def _scope_kind(op_name: str) -> str:
  scopes = op_name.split("/")
  if "optimizer" in scopes:
    return "optimizer (AdamW, gradient norm)"
  if not any("VisionTransformer" in scope for scope in scopes):
    return "loss and input"
  if any(s.startswith(("LayerNorm", "encoder_norm")) for s in scopes):
    return "LayerNorm"
  if any(s.startswith("MlpBlock") for s in scopes):
    return "GELU and MLP bias"
  if any(s.startswith("MultiHeadDotProductAttention") for s in scopes):
    return "attention's q/k/v split and bias"
  return "embedding, head, residual adds"


def classify(instruction: Instruction, module: HloModule,
             reader_op_name: str = "") -> tuple[str, float]:
  """(kind, dense FLOPs) of one thunk's instruction. reader_op_name: the
  scope of a thunk that reads its result, for instructions XLA made
  without one (a reduction it split into a reduce-window)."""
  if instruction.opcode == "custom-call":
    is_attention = 'custom_call_target="VitAttention' in instruction.attributes
    return ("attention kernel (C++)" if is_attention
            else "other custom calls"), 0.0
  if instruction.opcode in _COLLECTIVES:
    return "all-reduce (waiting included)", 0.0
  inner = _fused(instruction, module)
  dots = [i for i in [instruction] + inner if i.opcode == "dot"]
  if dots:
    kind = _dense_kind(
        dots[0], dots[0].op_name or instruction.op_name or reader_op_name,
        module, None if dots[0] is instruction else instruction)
    return kind, sum(dot_flops(dot, module) for dot in dots)
  root = next((i for i in inner if i.is_root), instruction)
  if {instruction.opcode, root.opcode} & {"copy", "transpose"}:
    return "copies and transposes", 0.0
  # XLA's wrapped single ops keep their op_name inside.
  return _scope_kind(instruction.op_name or root.op_name
                     or reader_op_name), 0.0


# Entry instructions that run no thunk: views of other buffers.
_NO_THUNK = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple")


def thunk_consumers(module: HloModule) -> dict[str, set[str]]:
  """For each thunk of the entry computation, the thunks that read its
  output (through bitcasts and tuples, which run nothing)."""
  entry = {i.name: i for i in module.computations[module.entry]}

  def producers(name: str) -> set[str]:
    instruction = entry.get(name)
    if instruction is None or instruction.opcode in ("parameter", "constant"):
      return set()
    if instruction.opcode not in _NO_THUNK:
      return {name}
    return set().union(*(producers(o) for o in instruction.operands))

  consumers = collections.defaultdict(set)
  for instruction in entry.values():
    if instruction.opcode not in _NO_THUNK:
      for operand in instruction.operands:
        for producer in producers(operand):
          consumers[producer].add(instruction.name)
  return consumers


def _reader_op_name(name: str, module: HloModule,
                    consumers: dict[str, set[str]], depth: int = 3) -> str:
  """The op_name of the nearest thunk downstream of `name` that has one."""
  for reader in sorted(consumers.get(name, ())):
    instruction = module.instructions[reader]
    inner = _fused(instruction, module)
    found = instruction.op_name or next(
        (i.op_name for i in inner if i.is_root), "")
    if not found and depth:
      found = _reader_op_name(reader, module, consumers, depth - 1)
    if found:
      return found
  return ""


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


def _attribute_gaps(timeline: list[ThunkEvent], module: HloModule,
                    consumers: dict[str, set[str]], flops: dict[str, float]
                    ) -> tuple[dict[str, float], dict[str, float], float]:
  """Seconds of the timeline's gaps spent waiting on each asynchronous dot;
  how much of that came from gaps shared with other dots; and the gap
  seconds with no dot outstanding.

  A dot is outstanding from its launch until a reader of its result starts,
  or until a dot launched after it is done (the thread pool takes them
  first come, first served). A gap with several outstanding is split
  between them by FLOPs: their sum is measured, the split is not.
  """
  dots = [(i, event) for i, event in enumerate(timeline)
          if module.instructions[event.name].opcode == "dot"]
  done, bound = {}, timeline[-1].end
  for i, event in reversed(dots):
    readers = consumers.get(event.name, ())
    read = next((later.start for later in timeline[i + 1:]
                 if later.name in readers), timeline[-1].end)
    bound = done[event.name] = min(read, bound)
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

  A thunk's time is its event's. XLA:CPU runs a `dot` instruction (Eigen's
  matmul; YNNPACK's are fusions) asynchronously on the thread pool, its
  event covering the launch: the device's wait for it (the gaps in its
  timeline until a reader of the result starts) is added to the dot's
  kind. Gaps with no dot outstanding are WAITING; the step's wall time
  outside the device's first and last thunk is BETWEEN_STEPS.
  """
  module = parse_hlo(hlo_text)
  consumers = thunk_consumers(module)
  kinds, flops = {}, {}
  for instruction in module.computations[module.entry]:
    kinds[instruction.name], flops[instruction.name] = classify(
        instruction, module, _reader_op_name(instruction.name, module,
                                             consumers))
  timelines = [[e for e in timeline if e.name in kinds]
               for timeline in device_timelines(trace_path)]
  timelines = [timeline for timeline in timelines if timeline]
  runs = len(timelines)
  seconds, dense, thunks = (collections.Counter() for _ in range(3))
  per_thunk, shared_seconds = collections.Counter(), collections.Counter()
  for timeline in timelines:
    waiting, shared, unexplained = _attribute_gaps(timeline, module,
                                                   consumers, flops)
    for name, share in shared.items():
      shared_seconds[kinds[name]] += share / runs
    seconds[WAITING] += unexplained / runs
    seconds[BETWEEN_STEPS] += (step_wall_s - (timeline[-1].end -
                                              timeline[0].start)) / runs
    for event in timeline:
      busy = event.end - event.start + waiting.pop(event.name, 0.0)
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
  kinds = [k for group in KIND_GROUPS.values() for k in group]
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
            / times.wall_s for group, kinds in KIND_GROUPS.items()}
  shares["waiting"] = profile.seconds.get(WAITING, 0.0) / times.wall_s
  shares["between_steps"] = (profile.seconds.get(BETWEEN_STEPS, 0.0)
                             / times.wall_s)
  return (f"summary: step_ms={times.wall_s * 1e3:.0f} " + " ".join(
      f"{group}={share:.2f}" for group, share in shares.items()) +
          f' cpu="{cpu}"')


def _profiled_steps(step: "throughput.JaxStep", steps: int, trace_dir: str
                    ) -> tuple[StepTimes, str]:
  """Runs `steps` steps under jax.profiler; their times and the trace."""
  import jax  # pylint: disable=import-outside-toplevel
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
      step()
    times = StepTimes((time.perf_counter() - wall) / steps,
                      (time.process_time() - cpu) / steps,
                      len(os.sched_getaffinity(0)))
  trace_path = max(glob.glob(os.path.join(
      trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")),
                   key=os.path.getmtime)
  return times, trace_path


def worker(args) -> None:
  """Compiles the step, profiles `args.steps` of it, prints the table."""
  step = throughput.JaxStep(args.model, args.mode, args.image_size,
                            args.patch_size, args.batch, args.num_layers)
  unprofiled_s = throughput._time_steps(step, args.steps)  # pylint: disable=protected-access
  with tempfile.TemporaryDirectory() as scratch:
    times, trace_path = _profiled_steps(step, args.steps,
                                        args.trace_dir or scratch)
    hlo_text = step.compiled.as_text()
    if args.trace_dir:  # beside the trace, to read with it
      with open(os.path.join(args.trace_dir, "step.hlo.txt"), "w") as f:
        f.write(hlo_text)
    profile = profile_by_kind(hlo_text, trace_path, times.wall_s)
  model, flags = throughput.cpu_description()
  print(f"CPU: {model}, {times.cores} of {os.cpu_count()} cores; "
        f"{', '.join(flags)}")
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
                      choices=tuple(throughput.MODELS))
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
        throughput.worker_batch(args.model, args.mode, args.batch),))
    worker(args)
    sys.stdout.flush()
    os._exit(0)  # skips tearing down JAX
  print("python " + " ".join(sys.argv), flush=True)
  env = throughput.worker_environment(args.fast_malloc, args.max_isa,
                                      args.matmul_dtype)
  done = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]],
                        env=env, check=False)
  sys.exit(done.returncode)


if __name__ == "__main__":
  main()
