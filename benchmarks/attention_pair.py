r"""One attention pair's forward and backward pass on one core, in C++.

  python benchmarks/attention_pair.py                      # 197 and 65 tokens
  python benchmarks/attention_pair.py --tokens=197 \
      --against=/tmp/old/vit_jax/kernels/csrc              # two trees' kernels
  python benchmarks/attention_pair.py --dtype=bfloat16 --memory=cold

Builds benchmarks/attention_pair_timing.cc against the attention kernels'
sources (this checkout's; with --against, another tree's too, e.g. a clone
of an earlier commit), with the flags `cpu_build` builds the kernels with,
and runs each build pinned to one core, the builds in turns, --rounds
times. Each run prints the best of 7 x 200 calls of each pass and the
products' GFLOP/s. --dtype=bfloat16 times the passes with bfloat16 products
(on the engine this CPU takes: AMX, AVX512_BF16's dot instruction, or
float32 products of the rounded operands). --memory=cold gives each call
probabilities in memory untouched since its last use, as a train step's
forward pass writes them and its backward pass reads them; "hot" (the
default) keeps them in the core's cache. What it times is the kernel's own
work (the products, the softmax and its gradient, the transposes and
roundings), not what the train step adds around it: threads, the copies
out of the projections with their bias, the bias's gradient
(`cpu_profile.py` shows those).

Ends with `summary: tokens=… forward_us=… backward_us=… dtype=…
memory=… cpu="…"`, the medians over rounds at the first --tokens, and with
--against `forward_ratio=… backward_ratio=…` before `cpu`: this tree's time
over the other's (below 1: this tree faster).
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import jax

import race_report  # this folder's: the CPU's model and ISA flags
from vit_jax.kernels import cpu_build

HARNESS = pathlib.Path(__file__).with_name("attention_pair_timing.cc")


def build(sources: pathlib.Path, program: pathlib.Path) -> None:
  """The harness against the kernel sources in `sources`."""
  flags = cpu_build._FLAGS  # pylint: disable=protected-access
  subprocess.run(
      [os.environ.get("CXX", "c++"), *flags, *cpu_build.target_flags()[0],
       f"-I{jax.ffi.include_dir()}", f"-I{sources}", str(HARNESS), "-o",
       str(program)], check=True)


def run(program: pathlib.Path, tokens: int, head_dim: int, dtype: str,
        memory: str) -> dict:
  """One run of a build, on one core: its fields as numbers."""
  core = min(os.sched_getaffinity(0))
  line = subprocess.run(
      [str(program), str(tokens), str(head_dim), dtype, memory], check=True,
      capture_output=True, text=True,
      preexec_fn=lambda: os.sched_setaffinity(0, {core})).stdout
  return {key: float(value) for key, value in
          (field.split("=") for field in line.split())}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", default="197,65",
                      help="comma-separated token counts (ViT-Ti/16 @224: "
                      "197; vit_tiny_cifar: 65)")
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--against", type=pathlib.Path,
                      help="another tree's vit_jax/kernels/csrc to compare")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                      default="float32", help="the products' operands")
  parser.add_argument("--memory", choices=("hot", "cold"), default="hot",
                      help="where each call's probabilities are")
  args = parser.parse_args()
  token_counts = [int(t) for t in args.tokens.split(",")]
  trees = {"this": cpu_build.SOURCES[0].parent}
  if args.against:
    trees["against"] = args.against
  model, isa = race_report.cpu_description()
  print(f"Command: python benchmarks/attention_pair.py {' '.join(sys.argv[1:])}")
  print(f"CPU: {model}, one core; {' '.join(isa)}")
  with tempfile.TemporaryDirectory() as scratch:
    programs = {name: pathlib.Path(scratch) / name for name in trees}
    for name, program in programs.items():
      build(trees[name], program)
    medians = {}
    for tokens in token_counts:
      runs = {name: [] for name in programs}
      for _ in range(args.rounds):
        for name, program in programs.items():
          runs[name].append(run(program, tokens, args.head_dim, args.dtype,
                                args.memory))
      for name, results in runs.items():
        median = {key: statistics.median(r[key] for r in results)
                  for key in ("forward_us", "backward_us", "forward_gflops",
                              "backward_gflops")}
        medians[tokens, name] = median
        print(f"{tokens} tokens, {args.dtype}, p {args.memory}, {name} tree "
              f"({trees[name]}): forward "
              f"{median['forward_us']:.1f} us ({median['forward_gflops']:.0f}"
              f" GFLOP/s), backward {median['backward_us']:.1f} us "
              f"({median['backward_gflops']:.0f} GFLOP/s), medians of "
              f"{args.rounds}")
  first = medians[token_counts[0], "this"]
  summary = (f"tokens={token_counts[0]} forward_us={first['forward_us']:.1f}"
             f" backward_us={first['backward_us']:.1f} dtype={args.dtype}"
             f" memory={args.memory}")
  if args.against:
    other = medians[token_counts[0], "against"]
    summary += (f" forward_ratio={first['forward_us'] / other['forward_us']:.3f}"
                f" backward_ratio="
                f"{first['backward_us'] / other['backward_us']:.3f}")
  print(f'summary: {summary} cpu="{model}"')


if __name__ == "__main__":
  main()
