"""Where a GPU step's time goes, from a JAX profile's perfetto trace.

  python benchmarks/gpu_profile.py TRACE.json.gz --steps=5 [--hlo=HLO.txt.gz]

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes the trace as
Chrome trace-event JSON: processes named "/device:GPU:<i>" hold one thread
per CUDA stream ("Stream #<n>(...)"), whose complete ("X") events are the
kernels, named by the kernel (cuBLAS/CUTLASS GEMMs, cuDNN's attention,
XLA's fused kernels). This sums their durations by kind of kernel, per step.

XLA:GPU runs a step's kernels inside command buffers (CUDA graphs), so the
trace names a fused kernel but not the model code it came from. Given the
compiled program's HLO text (`compiled.as_text()`, which
`gpu_throughput.py --profile` writes beside its traces), the busiest
fusions also get the JAX scope of their operation (its `op_name`, e.g.
".../encoderblock_3/LayerNorm_2/reduce_sum"), `fusion_scopes`.
"""

import argparse
import collections
import gzip
import json
import re

# First match wins: attention before GEMM (cuDNN's flash kernels are GEMMs
# too), GEMM before the generic fusions (XLA's Triton GEMMs are fusions).
KERNEL_CLASSES = (
    ("attention (cuDNN)", r"fmha|sdpa|flash|cudnn"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|cublas|wgmma|hgmma|\bdot"),
    ("copy / transpose", r"memcpy|memset|copy|transpose"),
    ("reduction fusions", r"reduc|row_reduction|column_reduction"),
    ("elementwise fusions", r""),
)


def kernel_class(name: str) -> str:
  lowered = name.lower()
  for label, pattern in KERNEL_CLASSES:
    if re.search(pattern, lowered):
      return label
  return KERNEL_CLASSES[-1][0]


def _read_text(path: str) -> str:
  """A file's text, gunzipped if its name ends in .gz."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return f.read()


def _load_events(path: str) -> list[dict]:
  data = json.loads(_read_text(path))
  return data["traceEvents"] if isinstance(data, dict) else data


_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?\b'
                          r'(?:fusion|custom-call)\(')
_CALLS = re.compile(r'\bcalls=%([\w.\-]+)')
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_COMPUTATION = re.compile(r'^\s*(?:ENTRY\s+)?%([\w.\-]+) .*\{\s*$')


def fusion_scopes(hlo_text: str) -> dict:
  """{kernel name as a trace writes it: the JAX op_name} for the fusions
  and custom calls of an HLO module's text. The trace's names are the
  instructions' with "." as "_" (`%input_reduce_fusion.8` runs as
  `input_reduce_fusion_8`). A fusion without an op_name of its own takes
  its fused computation's root's."""
  root_op_names, computation = {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
    op_name = _OP_NAME.search(line)
    if computation and op_name and line.lstrip().startswith("ROOT "):
      root_op_names[computation] = op_name.group(1)
  scopes = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    op_name, called = _OP_NAME.search(line), _CALLS.search(line)
    scope = (op_name.group(1) if op_name else
             root_op_names.get(called.group(1), "") if called else "")
    if scope:
      scopes[match.group(1).replace(".", "_")] = scope
  return scopes


def kernel_time_by_class(path: str, num_steps: int,
                         hlo_text: str = "") -> dict:
  """GPU kernel milliseconds per step by class, the busiest kernels, and
  the GPU's busy time (the union of kernel intervals) per step; with the
  program's HLO text, the busiest kernels' JAX scopes too."""
  events = _load_events(path)
  process_names, thread_names = {}, {}
  for event in events:
    if event.get("ph") == "M" and event.get("name") == "process_name":
      process_names[event["pid"]] = event.get("args", {}).get("name", "")
    if event.get("ph") == "M" and event.get("name") == "thread_name":
      thread_names[event["pid"], event["tid"]] = event.get("args", {}).get(
          "name", "")
  gpu_pids = {pid for pid, name in process_names.items() if "GPU" in name}
  stream_threads = {key for key, name in thread_names.items()
                    if key[0] in gpu_pids and name.startswith("Stream")}
  kernels = [e for e in events if e.get("ph") == "X" and "dur" in e
             and (e["pid"], e["tid"]) in stream_threads]
  by_class, by_name = collections.Counter(), collections.Counter()
  for event in kernels:
    by_class[kernel_class(event["name"])] += event["dur"]
    by_name[event["name"][:120]] += event["dur"]
  intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
  busy, end = 0.0, float("-inf")
  for start, stop in intervals:
    if stop > end:
      busy += stop - max(start, end)
      end = stop
  per_step = lambda microseconds: round(microseconds / 1e3 / num_steps, 3)
  summary = {"gpu_busy_ms_per_step": per_step(busy),
             "kernels_per_step": len(kernels) / num_steps,
             "ms_per_step_by_class": {k: per_step(v)
                                      for k, v in by_class.most_common()},
             "top_kernels_ms_per_step": {k: per_step(v)
                                         for k, v in by_name.most_common(15)},
             "streams": sorted(thread_names[key] for key in stream_threads)}
  if hlo_text:
    scopes = fusion_scopes(hlo_text)
    summary["top_kernel_scopes"] = {
        name: scopes[name] for name in summary["top_kernels_ms_per_step"]
        if name in scopes}
  return summary


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("trace")
  parser.add_argument("--steps", type=int, default=1)
  parser.add_argument("--hlo", default="",
                      help="the compiled program's HLO text (.gz too)")
  args = parser.parse_args()
  hlo_text = _read_text(args.hlo) if args.hlo else ""
  print(json.dumps(kernel_time_by_class(args.trace, args.steps, hlo_text),
                   indent=1))


if __name__ == "__main__":
  main()
