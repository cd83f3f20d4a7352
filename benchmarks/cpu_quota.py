r"""In a container's CPU quota: vit_jax sized by the quota, against sized by
the CPUs, and PyTorch.

  python benchmarks/cpu_quota.py --quota=1      # as root: a cgroup of 1 CPU
  python benchmarks/cpu_quota.py --model=vit_tiny_cifar --mode=train --batch=128
  python benchmarks/cpu_quota.py                # inside docker run --cpus=1

Docker's --cpus and Kubernetes' CPU limits give a process a quota of CPU
time a period (100 ms) that can be smaller than the CPUs it may run on.
Threads beyond the quota use it up early in each period, then wait for the
next, so a step that meets the wait takes up to a period longer. vit_jax
sizes its CPU devices and kernel tasks by `cpu_info.cpu_cores`, which
counts the quota, rounded up; PyTorch's workers here take no more threads
than that (`race_workers.TorchStep`). This runs four workers, each a
fresh process with the race's environment:

  vit_jax              sized by the quota (as main.py runs)
  vit_jax (by CPUs)    sized by the CPUs alone, as before 2026-12-05
  timm                 PyTorch's threads sized by the quota
  timm (by CPUs)       PyTorch's default threads

each in a cgroup made for the run with --quota (under the cgroup
filesystem's root, removed afterwards: it needs root) or, without --quota,
in this process's own cgroup. Each times --seconds of steps one by one
after --warmup, for --rounds rounds in alternating order, and reports its
images/s from the mean step (throttling's waits count there; the median
hides them), median and 99th percentile. The summary compares the rounds'
best of each:

  summary: quota=1.00 cores=1 sized_vs_cpus=1.18 p99_sized_vs_cpus=4.60 sized_vs_torch=2.31 cpu="…"

(numbers illustrative); *_vs_*: images/s over images/s, p99 the other's
99th percentile over vit_jax's (above 1: vit_jax sized by the quota wins).
"""

import argparse
import json
import os
import time

# This folder's modules: the CPU's description, the race's steps and
# environment, and the step-by-step statistics.
import latency
import race_report
import race_workers
import throughput

# The workers, in the order of the table: (name, implementation, whether
# sized by the CPUs alone).
WORKERS = (("vit_jax", "vit_jax", False),
           ("vit_jax (by CPUs)", "vit_jax", True),
           ("timm", "timm", False), ("timm (by CPUs)", "timm", True))
# The period of the quota a cgroup made here gets: Linux's default.
PERIOD_US = 100_000


class QuotaCgroup:
  """A cgroup with a CPU quota, made under the root of a mounted cgroup
  hierarchy that can hold one (v1's "cpu", or v2's with its cpu
  controller) and removed on exit; `command` runs a program in it."""

  def __init__(self, quota: float):
    self.quota, self.path = quota, None

  def __enter__(self) -> "QuotaCgroup":
    from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
    with open("/proc/self/cgroup") as f, open("/proc/self/mountinfo") as g:
      tops = [top for _, top in cpu_info.cpu_cgroup_dirs(f.read(), g.read())]
    errors = []
    for top in tops:
      path = os.path.join(top, f"vit_jax_cpu_quota_{os.getpid()}")
      try:
        if os.path.exists(os.path.join(top, "cgroup.controllers")):
          with open(os.path.join(top, "cgroup.subtree_control"), "w") as f:
            f.write("+cpu")
        os.mkdir(path)
        self.path = path
        self._write_quota()
        return self
      except OSError as error:
        errors.append(f"{path}: {error}")
        self.__exit__()
    raise SystemExit(
        "benchmarks/cpu_quota.py --quota makes a cgroup, which needs root "
        "and a cgroup filesystem with a CPU controller (tried: "
        f"{'; '.join(errors) or 'none mounted'}). Without --quota it runs in "
        "this process's own cgroup: e.g. in `docker run --cpus=1`.")

  def _write_quota(self) -> None:
    limit = round(self.quota * PERIOD_US)
    if os.path.exists(os.path.join(self.path, "cpu.max")):
      files = {"cpu.max": f"{limit} {PERIOD_US}"}
    else:
      files = {"cpu.cfs_period_us": str(PERIOD_US),
               "cpu.cfs_quota_us": str(limit)}
    for name, value in files.items():
      with open(os.path.join(self.path, name), "w") as f:
        f.write(value)

  def __exit__(self, *exc) -> None:
    if self.path and os.path.isdir(self.path):
      os.rmdir(self.path)  # its workers have exited: it is empty
    self.path = None

  def command(self) -> list[str]:
    """A prefix that moves the program it starts into this cgroup."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"',
            self.path]


def run_worker(args: argparse.Namespace) -> None:
  """Builds one worker's step, times it, prints its JSON."""
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  if args.by_cpus:  # the sizing before quotas counted: the CPUs alone
    cpu_info.cpu_quota = lambda: None
  if args.impl == "vit_jax":
    from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
    host.split_cpu_into_devices(-1, (race_workers.worker_batch(
        args.model, args.mode, args.batch),))
    step = race_workers.JaxStep(args.model, args.mode, batch=args.batch)
  else:
    step = race_workers.TorchStep(args.impl, args.model, args.mode,
                                  args.batch)
  times = race_workers.step_times(step, args.warmup, 1, args.seconds)
  stats = latency.latency_stats(times)
  stats.update(images_per_s=step.batch * 1e3 / stats["mean_ms"],
               cores=cpu_info.cpu_cores())
  print(json.dumps(stats), flush=True)
  os._exit(0)  # skips tearing down torch or JAX


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--impl", default="vit_jax", help=argparse.SUPPRESS)
  parser.add_argument("--by_cpus", action="store_true",
                      help=argparse.SUPPRESS)
  parser.add_argument("--quota", type=float,
                      help="CPUs' worth of time a period for a cgroup made "
                      "for the run (root); none: this process's cgroup")
  parser.add_argument("--model", default="ViT-Ti/16@224",
                      choices=sorted(race_workers.MODELS))
  parser.add_argument("--mode", default="infer", choices=("train", "infer"))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seconds", type=float, default=6.0,
                      help="seconds of steps each worker times (a quota's "
                      "period is 0.1 s)")
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args(argv)
  if args.quota is not None and args.quota <= 0:
    parser.error("--quota must be above 0 (CPUs, e.g. 1 or 1.5)")
  for name in ("batch", "rounds", "seconds"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be above 0")
  return args


def run_rounds(args: argparse.Namespace, prefix: list[str]) -> list[dict]:
  """Every worker in every round (alternating order): name -> its JSON."""
  env = race_workers.worker_environment(True, "native", "float32")
  options = [f"--model={args.model}", f"--mode={args.mode}",
             f"--batch={args.batch}", f"--seconds={args.seconds}",
             f"--warmup={args.warmup}"]
  rounds = []
  for number in range(args.rounds):
    order = WORKERS if number % 2 == 0 else WORKERS[::-1]
    results = {name: race_workers.spawn_worker(
        __file__, [f"--impl={impl}", *options,
                   *(["--by_cpus"] if by_cpus else [])], env, prefix)
               for name, impl, by_cpus in order}
    rounds.append({name: results[name] for name, _, _ in WORKERS})
  return rounds


def report(rounds: list[dict], quota) -> list[str]:
  """The table of every round's workers, and the summary line."""
  lines = ["| round | worker | cores | images/s | mean ms | median ms | "
           "p99 ms |", "|---|---|---:|---:|---:|---:|---:|"]
  lines += latency.round_rows(rounds, lambda r: (
      f"{r['cores']} | {r['images_per_s']:.1f} | {r['mean_ms']:.2f} | "
      f"{r['median_ms']:.2f} | {r['p99_ms']:.2f}"))
  best = latency.best_rounds(rounds, "images_per_s", max)
  jax, by_cpus = best["vit_jax"], best["vit_jax (by CPUs)"]
  torch = max(best["timm"], best["timm (by CPUs)"],
              key=lambda r: r["images_per_s"])
  quota_text = "none" if quota is None else f"{quota:.2f}"
  lines.append(
      f"summary: quota={quota_text} cores={jax['cores']} "
      f"sized_vs_cpus={jax['images_per_s'] / by_cpus['images_per_s']:.2f} "
      f"p99_sized_vs_cpus={by_cpus['p99_ms'] / jax['p99_ms']:.2f} "
      f"sized_vs_torch={jax['images_per_s'] / torch['images_per_s']:.2f} "
      f'cpu="{race_report.cpu_description()[0]}"')
  return lines


def main():
  args = parse_args()
  if args.worker:
    run_worker(args)
  throughput.require_raced_packages("cpu_quota.py")
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  print("\n".join(race_report.header_lines("cpu_quota.py")))
  print(f"{args.model} {args.mode}, batch {args.batch}, {args.seconds:g} s "
        f"of steps a worker after {args.warmup}")
  start = time.perf_counter()
  if args.quota is None:
    quota = cpu_info.cpu_quota()
    print(f"Workers in this process's cgroup: a CPU quota of {quota}")
    rounds = run_rounds(args, [])
  else:
    quota = args.quota
    with QuotaCgroup(quota) as group:
      print(f"Workers in {group.path}: a CPU quota of {quota:g} "
            f"({round(quota * PERIOD_US)} us of every {PERIOD_US})")
      rounds = run_rounds(args, group.command())
  print(f"{time.perf_counter() - start:.0f} s of workers")
  print("\n".join(report(rounds, quota)))


if __name__ == "__main__":
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  main()
