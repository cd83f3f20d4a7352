r"""Step by step: how long each of vit_jax's steps takes, against PyTorch.

  python benchmarks/latency.py        # vit_tiny_cifar inference, one image
  python benchmarks/latency.py --model=ViT-Ti/16@224 --mode=train
  python benchmarks/latency.py --matmul_dtype=bfloat16 --torch=timm+compile

The race (`throughput.py`) compares workers by their median step. An
application classifying photos one at a time also feels the slow steps, so
here every step is timed on its own: each worker (vit_jax's step as the
race runs it, `race_workers.JaxStep`, and each of --torch's,
`race_workers.TorchStep`) is a fresh process with the race's environment
(`race_workers.worker_environment`: malloc, --max_isa, --matmul_dtype),
runs --warmup steps, then times --steps steps one by one. Workers run in
turn for --rounds rounds, the order reversed each round, and each reports
its steps' median, mean, 90th and 99th percentiles and the share of steps
that took 1.3 times the median or longer ("slow"). The table gives every
round; the summary takes each implementation's round with the lower median
and compares vit_jax with the PyTorch variant whose median is lowest:

  summary: median_vs_torch=2.10 p99_vs_torch=1.95 slow_jax=0.011 slow_torch=0.010 cpu="…"

(numbers illustrative). *_vs_torch: PyTorch's milliseconds over vit_jax's (above 1: vit_jax is
faster); slow_*: the share of slow steps. Batch 1 by default (--batch).

--jax_env=NAME=VALUE[,NAME=VALUE] adds a worker, "vit_jax NAME=VALUE", that
runs vit_jax's step with those environment variables too, in the same
rounds (e.g. VIT_JAX_KERNEL_HELPERS=0: the kernels' tasks on XLA's threads
only, csrc/helper_threads.h), and the summary then ends its figures with
variant_vs_jax= (vit_jax's median over the variant's: above 1, the variant
is faster).
"""

import argparse
import json
import os
import statistics

# This folder's modules: the CPU's description, the race's steps and
# environment, and which of PyTorch's packages are missing.
import race_report
import race_workers
import throughput

# A step this many times the median or longer counts as slow.
SLOW_FACTOR = 1.3


def latency_stats(times: list[float]) -> dict:
  """Milliseconds: median, mean, p90 and p99 (the nearest rank) of `times`
  (seconds); "slow": the share of them SLOW_FACTOR times the median or
  longer."""
  if not times:
    raise ValueError("latency_stats needs at least one step's time")
  ordered = sorted(times)
  median = statistics.median(ordered)

  def percentile(p: float) -> float:
    rank = max(1, -(-len(ordered) * p // 100))  # ceil(n p / 100), from 1
    return ordered[int(rank) - 1] * 1e3

  return {"median_ms": median * 1e3, "mean_ms": statistics.mean(ordered) * 1e3,
          "p90_ms": percentile(90), "p99_ms": percentile(99),
          "slow": sum(t >= SLOW_FACTOR * median for t in ordered) / len(ordered),
          "steps": len(ordered)}


def run_worker(args: argparse.Namespace) -> None:
  """Builds one implementation's step, times it, prints its JSON."""
  if args.impl == "vit_jax":
    from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
    # As the race: a device per core where the batch splits over them.
    host.split_cpu_into_devices(-1, (race_workers.worker_batch(
        args.model, args.mode, args.batch),))
    step = race_workers.JaxStep(args.model, args.mode, batch=args.batch)
  else:
    step = race_workers.TorchStep(args.impl, args.model, args.mode,
                                  args.batch)
  stats = latency_stats(race_workers.step_times(step, args.warmup,
                                               args.steps))
  print(json.dumps(stats), flush=True)
  os._exit(0)  # skips tearing down torch or JAX


def spawn(args: argparse.Namespace, impl: str, env: dict) -> dict:
  """One worker in a fresh process: its JSON."""
  return race_workers.spawn_worker(__file__, [
      f"--impl={impl}", f"--model={args.model}", f"--mode={args.mode}",
      f"--batch={args.batch}", f"--steps={args.steps}",
      f"--warmup={args.warmup}"], env)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--impl", default="vit_jax", help=argparse.SUPPRESS)
  parser.add_argument("--model", default="vit_tiny_cifar",
                      choices=sorted(race_workers.MODELS))
  parser.add_argument("--mode", default="infer", choices=("train", "infer"))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--steps", type=int, default=2000,
                      help="steps timed by each worker")
  parser.add_argument("--warmup", type=int, default=50)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--torch", default="timm,timm+compile",
                      help="PyTorch variants, comma-separated, from "
                      f"{', '.join(race_workers.TORCH_IMPLS)}")
  parser.add_argument("--matmul_dtype", default="float32",
                      choices=("float32", "bfloat16"))
  parser.add_argument("--max_isa", default="native",
                      choices=("native", "avx2"))
  parser.add_argument("--jax_env", default="",
                      help="NAME=VALUE[,NAME=VALUE]: also time vit_jax "
                      "with these environment variables (its own worker)")
  args = parser.parse_args(argv)
  args.jax_env = _variables(parser, args.jax_env)
  args.torch = [impl for impl in args.torch.split(",") if impl]
  unknown = sorted(set(args.torch) - set(race_workers.TORCH_IMPLS))
  if unknown or not args.torch:
    parser.error(f"--torch: unknown variant(s) {unknown or '(none given)'}; "
                 f"choose from {', '.join(race_workers.TORCH_IMPLS)}")
  for name in ("batch", "steps", "rounds"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be at least 1")
  return args


def _variables(parser: argparse.ArgumentParser, text: str) -> dict:
  """--jax_env's NAME=VALUE pairs as a dict (empty if none given)."""
  pairs = [item.split("=", 1) for item in text.split(",") if item]
  if any(len(pair) != 2 or not pair[0] for pair in pairs):
    parser.error(f"--jax_env: expected NAME=VALUE[,NAME=VALUE], got {text!r}")
  return dict(pairs)


def variant_name(jax_env: dict) -> str:
  """The --jax_env worker's name in the table."""
  return "vit_jax " + ",".join(f"{k}={v}" for k, v in jax_env.items())


def round_rows(rounds: list[dict], cells) -> list[str]:
  """A table row for each worker of each round (rounds: worker name ->
  its JSON): "| round | name | " and then cells(its JSON)."""
  return [f"| {number} | {name} | {cells(result)} |"
          for number, results in enumerate(rounds, 1)
          for name, result in results.items()]


def best_rounds(rounds: list[dict], key: str, pick=min) -> dict:
  """Each worker's round with the lowest (pick=min) or highest `key`."""
  return {name: pick((results[name] for results in rounds),
                     key=lambda result: result[key]) for name in rounds[0]}


def report(args: argparse.Namespace, rounds: list[dict]) -> list[str]:
  """The table of every round's workers, and the summary line."""
  lines = ["| round | implementation | median ms | mean ms | p90 ms | p99 ms "
           "| slow (>= 1.3x median) |", "|---|---|---:|---:|---:|---:|---:|"]
  lines += round_rows(rounds, lambda r: (
      f"{r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['p90_ms']:.3f} | "
      f"{r['p99_ms']:.3f} | {r['slow']:.1%}"))
  best = best_rounds(rounds, "median_ms")
  torch = min((best[impl] for impl in args.torch),
              key=lambda r: r["median_ms"])
  jax = best["vit_jax"]
  cpu = race_report.cpu_description()[0]
  variant = ""
  if args.jax_env:
    other = best[variant_name(args.jax_env)]
    variant = f"variant_vs_jax={jax['median_ms'] / other['median_ms']:.2f} "
  lines.append(
      f"summary: median_vs_torch={torch['median_ms'] / jax['median_ms']:.2f} "
      f"p99_vs_torch={torch['p99_ms'] / jax['p99_ms']:.2f} "
      f"slow_jax={jax['slow']:.3f} slow_torch={torch['slow']:.3f} "
      f'{variant}cpu="{cpu}"')
  return lines


def main():
  args = parse_args()
  if args.worker:
    run_worker(args)
  throughput.require_raced_packages("latency.py")
  env = race_workers.worker_environment(True, args.max_isa, args.matmul_dtype)
  print("\n".join(race_report.header_lines("latency.py")))
  print(f"{args.model} {args.mode}, batch {args.batch}, {args.matmul_dtype} "
        f"products, {args.steps} steps a worker after {args.warmup}")
  # Each worker's name: the implementation it runs and its environment.
  workers = {"vit_jax": ("vit_jax", env)}
  if args.jax_env:
    workers[variant_name(args.jax_env)] = ("vit_jax", {**env, **args.jax_env})
  workers.update((impl, (impl, env)) for impl in args.torch)
  names = list(workers)
  rounds = []
  for number in range(args.rounds):
    order = names if number % 2 == 0 else names[::-1]
    results = {name: spawn(args, *workers[name]) for name in order}
    rounds.append({name: results[name] for name in names})
  print("\n".join(report(args, rounds)))


if __name__ == "__main__":
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  main()
