r"""Training and inference speed of vit_jax against timm and torchvision.

  pip install -e '.[bench]'
  python benchmarks/throughput.py            # 6-10 minutes on 2 cores
  python benchmarks/throughput.py --growth   # + cost growth, ~15 minutes
  python benchmarks/throughput.py --cpu_devices=0   # vit_jax on one device
  python benchmarks/throughput.py --max_isa=avx2    # as an AVX2-only CPU
  python benchmarks/throughput.py --matmul_dtype=bfloat16   # bf16 products
  python benchmarks/throughput.py --models=ViT-S/16@224,ViT-B/16@224
  python benchmarks/throughput.py --batch=1   # one image at a time

Two models with identical dims in every library, float32 on CPU:
  vit_tiny_cifar   32x32x3, patch 4, width 192, 12 layers, 3 heads, MLP 768
  ViT-Ti/16 @224   224x224x3, patch 16, same width/depth/heads/MLP
Train step = forward + backward + AdamW update (batch 128 / 32); inference =
forward (batch 256 / 64). --models races others instead: ViT-S/16 @224
(width 384, 6 heads, MLP 1536) and ViT-B/16 @224 (the paper's base: width
768, 12 heads, MLP 3072), batches 32 / 64 (45 minutes for both on 2
cores), and ViT-B/16 @384 (577 tokens, the paper's fine-tuning
resolution), batches 8 / 16; the summary's cpu="…" then names them.
--batch replaces every workload's batch (--batch=1: one image at a time,
as an application classifying single photos runs), and the summary's
cpu="…" says so.
vit_jax runs as configs/vit_tiny_cifar.py runs it on a CPU
(config.cpu_devices=-1): a device per core, each taking part of the batch,
or one multi-threaded device where the batch does not split evenly; PyTorch
uses the same cores as intra-op threads.
Every measurement runs in a fresh process
(`--worker`), so compile caches, allocator state and threads start alike,
and takes the median of --steps (5) steps, and more until they have
taken a second (`race_workers.MIN_TIMED_SECONDS`, since 2026-12-04),
after a warm-up step (2 until 2026-11-29: the median of two is their
mean, so one slow step moved a worker's figure; vit_jax's first-round
inference workers read up to a third below their second rounds then).
Round 1 runs every implementation; round 2 runs vit_jax and the fastest
PyTorch variant of each workload again, in the other order, and those two are
compared by the mean of their two rounds (the machine's noise is +-10%).

All workers run with the same environment: main.py's malloc settings
(vit_jax/runtime/host.py: GLIBC_TUNABLES=glibc.malloc.hugetlb=1,
transparent huge pages for large blocks, and LD_PRELOAD of tcmalloc if it is installed, e.g.
`apt-get install libtcmalloc-minimal4`), unless --no-fast_malloc or the
caller set those variables. They speed PyTorch up too, so the comparison is
against the faster PyTorch.

Prints the GEMM rates (and of a Dense layer's three products at each raced
width, jax against torch, each on one thread as the train step runs them, a
device per core, in the race's operand dtype), one table (images/s,
achieved GFLOP/s from XLA's FLOP count of the same model, % of the PyTorch
GEMM rate measured in the same run, compile time (vit_jax's with its Python
trace + lowering share in brackets), peak RSS),
with --growth the cost growth of vit_jax with image size and depth, and ends
with
  summary: train_vs_timm=… infer_vs_timm=… train_gemm_fraction=… compile_s=…
           cpu="…"
where *_vs_timm is the worst ratio over the two models of vit_jax to the
fastest PyTorch variant, train_gemm_fraction the worst training GFLOP/s as a
fraction of the GEMM rate, compile_s the slower train-step compile.
--max_isa=avx2 caps every library at AVX2 + FMA on an x86 CPU with more
(XLA: --xla_cpu_max_isa=AVX2; oneDNN: ONEDNN_MAX_CPU_ISA; PyTorch:
ATEN_CPU_CAPABILITY; MKL: MKL_ENABLE_INSTRUCTIONS; vit_jax's C++ attention
kernel: -march=x86-64-v3), to see which kernels an AVX2-only CPU would get;
its caches, clock and memory are still this CPU's, so it stands in for an
AVX2-only host only as far as the instructions go.
--matmul_dtype=bfloat16 races mixed precision against mixed precision:
vit_jax with config.model.matmul_dtype=bfloat16 (the encoder's products
read bfloat16 operands and accumulate float32) against PyTorch under
torch.autocast("cpu", torch.bfloat16); "% GEMM" is then of PyTorch's
bfloat16 GEMM rate, and the summary's cpu="…" says so.
On an AMD CPU, PyTorch's float32 products run in Intel's MKL, which takes
its AVX2 kernels there whatever the CPU has; the race then says so under
its GEMM rates, and docs/performance.md (*A Zen 5*) gives the LD_PRELOAD
that lets it take its AVX-512 ones, to race that PyTorch too (the printed
command keeps a user's LD_PRELOAD).
torch.compile's first run on a machine compiles cold (up to a minute per
workload; first runs took 12-17 minutes here); later runs load its cache,
kept in ~/.cache/vit_jax/torchinductor unless TORCHINDUCTOR_CACHE_DIR is set.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

# This folder's modules: the workloads and their workers, the Dense
# products' GEMM workers, what a race measured and its report.
import dense_products
import race_report
import race_workers


def spawn(args: list[str], env: dict) -> dict:
  """Runs this script as a worker in a fresh process; returns its JSON.
  Prints a progress line (worker, result, its wall seconds) to stderr."""
  start = time.perf_counter()
  result = race_workers.spawn_worker(__file__, args, env)
  rate = (f"{result['images_per_s']:.1f} images/s"
          if "images_per_s" in result else "GEMM")
  print(f"  {' '.join(a.split('=')[-1] for a in args)}: {rate} "
        f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
  return result


def _model_names(text: str) -> tuple[str, ...]:
  """--models' value: known model names, comma-separated."""
  names = tuple(name.strip() for name in text.split(",") if name.strip())
  unknown = [name for name in names if name not in race_workers.MODELS]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"unknown model(s) {', '.join(unknown) or '(none given)'}; choose "
        f"from {', '.join(race_workers.MODELS)}")
  return names


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--impl", default="vit_jax")
  parser.add_argument("--model", default="vit_tiny_cifar")
  parser.add_argument("--mode", default="train")
  parser.add_argument("--steps", type=int, default=5,
                      help="timed steps per worker (their median counts)")
  parser.add_argument("--image_size", type=int)
  parser.add_argument("--patch_size", type=int)
  parser.add_argument("--batch", type=int,
                      help="every workload's batch in place of the "
                      "model's; 1 times one image at a time (vit_jax then "
                      "runs on one multi-threaded device)")
  parser.add_argument("--num_layers", type=int)
  parser.add_argument("--cpu_devices", type=int, default=-1,
                      help="vit_jax's config.cpu_devices: -1 (as in "
                      "configs/vit_tiny_cifar.py) runs it on a device per "
                      "core, the batch split; 0 on one device")
  parser.add_argument("--no-fast_malloc", dest="fast_malloc",
                      action="store_false",
                      help="workers without main.py's malloc settings")
  parser.add_argument("--max_isa", choices=("native", "avx2"),
                      default="native",
                      help="avx2: every library capped at AVX2 + FMA")
  parser.add_argument("--matmul_dtype", choices=("float32", "bfloat16"),
                      default="float32",
                      help="bfloat16: vit_jax's bfloat16 products against "
                      "PyTorch's CPU autocast")
  parser.add_argument("--models", type=_model_names,
                      default=race_workers.DEFAULT_MODELS,
                      help="comma-separated models to race, of "
                      f"{', '.join(race_workers.MODELS)}")
  parser.add_argument("--growth", action="store_true",
                      help="also the cost-growth table (~4 more minutes)")
  return parser.parse_args(argv)


def run_worker(args: argparse.Namespace) -> None:
  """A worker's measurement (`spawn`), printed as one JSON line; exits."""
  if args.impl.startswith(("gemm-", "gemm1-")):
    library = args.impl.split("-", 1)[1]
    per_core = args.impl.startswith("gemm1-")
    if per_core:  # XLA:CPU splits a dot over the cores whatever its flags
      os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    result = dense_products.gemm_worker(library, per_core, args.models)
  elif args.impl == "vit_jax":
    from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
    batch = race_workers.worker_batch(args.model, args.mode, args.batch)
    host.split_cpu_into_devices(args.cpu_devices, (batch,))  # before JAX
    result = race_workers.jax_worker(
        args.model, args.mode, args.steps, args.image_size, args.patch_size,
        args.batch, args.num_layers)
  else:
    result = race_workers.torch_worker(args.impl, args.model, args.mode,
                                       args.steps, args.batch)
  print(json.dumps(result), flush=True)
  os._exit(0)  # skips tearing down torch or JAX: up to ~1.3 s a worker


def _best_gemm(first: dict, second: dict) -> dict:
  return {shape: max(value, second[shape]) for shape, value in first.items()}


def worker_args(args: argparse.Namespace, impl: str, model: str,
                mode: str) -> list[str]:
  """The arguments of the race's worker for one implementation and
  workload."""
  cpu_devices = [f"--cpu_devices={args.cpu_devices}"] * (impl == "vit_jax")
  batch = [f"--batch={args.batch}"] * bool(args.batch)
  return [f"--impl={impl}", f"--model={model}", f"--mode={mode}",
          f"--steps={args.steps}", *cpu_devices, *batch]


def run_race(args: argparse.Namespace, env: dict) -> race_report.Race:
  """GEMM workers, round 1 (every implementation), round 2 (vit_jax and
  the fastest PyTorch variant, the other way round), GEMM workers again."""
  models = f"--models={','.join(args.models)}"  # the per-core widths
  gemm_runs = lambda: (
      {lib: spawn([f"--impl=gemm-{lib}"], env) for lib in ("torch", "jax")},
      {lib: spawn([f"--impl=gemm1-{lib}", models],
                  dense_products.per_core_environment(env))
       for lib in ("torch", "jax")})
  loads = [race_report.machine_load()]
  gemm, per_core = gemm_runs()
  results = {}
  for model, mode in race_workers.workloads(args.models):
    for impl in ("vit_jax",) + race_workers.TORCH_IMPLS:
      results[model, mode, impl] = [
          spawn(worker_args(args, impl, model, mode), env)]
  loads.append(race_report.machine_load())
  for model, mode in race_workers.workloads(args.models):
    fastest = max(race_workers.TORCH_IMPLS,
                  key=lambda impl, m=model, o=mode:
                  results[m, o, impl][0]["images_per_s"])
    for impl in (fastest, "vit_jax"):
      results[model, mode, impl].append(
          spawn(worker_args(args, impl, model, mode), env))
  loads.append(race_report.machine_load())
  gemm_again, per_core_again = gemm_runs()
  return race_report.Race(
      results,
      {lib: _best_gemm(gemm[lib], gemm_again[lib]) for lib in gemm},
      {lib: _best_gemm(per_core[lib], per_core_again[lib])
       for lib in per_core}, loads)


def growth_lines(env: dict) -> list[str]:
  """vit_jax's train step on one device at growing image sizes and
  depths: images/s, GFLOP/image, XLA's scratch and peak RSS."""
  lines = ["vit_jax cost growth (train step on one device, batch 2 at each "
           "image size / batch 32 at each depth; XLA temp = the step's "
           "scratch memory):",
           "| setting | tokens | images/s | GFLOP/image | XLA temp MiB | "
           "peak RSS MiB |", "|---|---|---|---|---|---|"]
  settings = [(f"{size} px, 12 layers", size, 2, 12)
              for size in (32, 64, 128, 224)]
  settings += [(f"32 px, {depth} layers", 32, 32, depth) for depth in (6, 24)]
  for label, size, batch, depth in settings:
    r = spawn(["--impl=vit_jax", "--mode=train", "--steps=1",
               "--cpu_devices=0", f"--image_size={size}", "--patch_size=4",
               f"--batch={batch}", f"--num_layers={depth}"], env)
    lines.append(f"| {label} | {(size // 4) ** 2 + 1} | "
                 f"{r['images_per_s']:.1f} | "
                 f"{r['flops_per_image'] / 1e9:.2f} | "
                 f"{r['xla_temp_mib']:.0f} | {r['peak_rss_mib']:.0f} |")
  return lines


# What the PyTorch side of the race imports: the `bench` extra.
RACED_PACKAGES = ("torch", "torchvision", "timm")


def missing_packages(find_spec=importlib.util.find_spec) -> list[str]:
  """The packages of RACED_PACKAGES that this Python cannot import."""
  return [name for name in RACED_PACKAGES if find_spec(name) is None]


def require_raced_packages(script: str) -> None:
  """Exits, saying what to install, where benchmarks/`script` (which times
  PyTorch's ViTs) could not import them: before any worker starts."""
  if missing := missing_packages():
    sys.exit(f"benchmarks/{script} times PyTorch's ViTs, and "
             f"{', '.join(missing)} cannot be imported here: pip install -e "
             f"'.[bench]' (from the repository's root)")


def main():
  args = parse_args()
  if args.worker:
    run_worker(args)
  require_raced_packages("throughput.py")  # before minutes of GEMM workers
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  env = race_workers.worker_environment(args.fast_malloc, args.max_isa,
                                        args.matmul_dtype)
  started = time.perf_counter()
  race = run_race(args, env)
  cpu_model, isa = race_report.cpu_description()
  print(f"\nCommand: {race_report.command_line(args, os.environ)}")
  print("\n".join(race_report.setting_lines(
      args, env, race, cpu_model, isa, cpu_info.cpu_cores(),
      cpu_info.cpu_features()[0])) + "\n")
  gemm_rate = race.gemm_rate(args.matmul_dtype)
  print("\n".join(race_report.results_table(race, gemm_rate)))
  if args.growth:
    print("\n" + "\n".join(growth_lines(env)))
  print(f"\nwall time {(time.perf_counter() - started) / 60:.1f} min")
  print(race_report.summary_line(race, gemm_rate,
                                 race_report.summary_cpu(args, cpu_model)))


if __name__ == "__main__":
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  main()
