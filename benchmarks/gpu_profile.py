"""Where a GPU step's time goes, from a JAX profile's perfetto trace.

  python benchmarks/gpu_profile.py TRACE.json.gz --steps=5

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes the trace as
Chrome trace-event JSON: processes named "/device:GPU:<i>" hold one thread
per CUDA stream ("Stream #<n>(...)"), whose complete ("X") events are the
kernels, named by the kernel (cuBLAS/CUTLASS GEMMs, cuDNN's attention,
XLA's fused kernels). This sums their durations by kind of kernel, per step.
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


def _load_events(path: str) -> list[dict]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def kernel_time_by_class(path: str, num_steps: int) -> dict:
  """GPU kernel milliseconds per step by class, the busiest kernels, and
  the GPU's busy time (the union of kernel intervals) per step."""
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
  return {"gpu_busy_ms_per_step": per_step(busy),
          "kernels_per_step": len(kernels) / num_steps,
          "ms_per_step_by_class": {k: per_step(v)
                                   for k, v in by_class.most_common()},
          "top_kernels_ms_per_step": {k: per_step(v)
                                      for k, v in by_name.most_common(15)},
          "streams": sorted(thread_names[key] for key in stream_threads)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("trace")
  parser.add_argument("--steps", type=int, default=1)
  args = parser.parse_args()
  print(json.dumps(kernel_time_by_class(args.trace, args.steps), indent=1))


if __name__ == "__main__":
  main()
