"""What a race measured, and the report `benchmarks/throughput.py` prints:
the machine and settings, the results table and the `summary:` line."""

import argparse
import dataclasses
import os
import pathlib
import statistics
import subprocess
import sys

import dense_products  # this folder's: the Dense products' lines
import race_workers  # this folder's: the workloads and their settings

# The ISA extensions that decide which kernels XLA and PyTorch run.
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "asimd",
              "sve", "sve2", "bf16", "i8mm")


def cpu_description() -> tuple[str, list[str]]:
  """The CPU's model name and which of `_ISA_FLAGS` it has
  (`vit_jax.runtime.cpu_info`)."""
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  flags = cpu_info.cpu_features()[1]
  return cpu_info.cpu_model(), [flag for flag in _ISA_FLAGS if flag in flags]


# The checkout this script is in: the code a figure should be of.
_CHECKOUT = pathlib.Path(__file__).resolve().parent.parent


def code_line(checkout: pathlib.Path = _CHECKOUT) -> str:
  """Which vit_jax this process (and so every worker it spawns) imports:
  "Code: vit_jax from /clone/vit_jax, git b6db269", with ", with
  uncommitted changes" where its tree differs from that commit. Where it is
  not `checkout`'s (an editable install of another clone, say: a script
  imports the installed package, not its own folder's), a warning says so,
  as the figures are then that other code's, and how to time this one."""
  import vit_jax  # pylint: disable=g-import-not-at-top
  package = pathlib.Path(vit_jax.__file__).resolve().parent
  text = f"Code: vit_jax from {package}{git_state(package.parent)}"
  if package.parent != checkout.resolve():
    text += (f"; WARNING: not this script's checkout ({checkout}), so the "
             f"figures are that code's: PYTHONPATH={checkout} times this one")
  return text


def git_state(root: pathlib.Path) -> str:
  """", git <short commit>[, with uncommitted changes]" where `root` is the
  top of a git checkout; "" elsewhere (an installed wheel, no git)."""
  def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                          text=True, timeout=30, check=True)
    return done.stdout.strip()
  try:
    if pathlib.Path(git("rev-parse", "--show-toplevel")).resolve() != root:
      return ""  # e.g. site-packages in a venv inside some checkout
    commit = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    return ""
  return f", git {commit}" + (", with uncommitted changes" if changed else "")


def header_lines(script: str) -> list[str]:
  """The lines a CPU benchmark's output starts with: the command that reruns
  it (benchmarks/`script` with this process's arguments), the CPU (model,
  cores, ISA flags, load average) and the code it times (`code_line`)."""
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  model, flags = cpu_description()
  return [" ".join(["Command: python", f"benchmarks/{script}", *sys.argv[1:]]),
          f"CPU: {model}, {cores_description(cpu_info.cpu_cores())}; "
          f"{' '.join(flags)}; load {machine_load()}", code_line()]


def cores_description(cores: int) -> str:
  """"2 of 8 cores", the threads a core where there are several (SMT: the
  cores are then hardware threads), and the CPU quota where a cgroup's (a
  container's --cpus) is what holds `cores` (`cpu_info.cpu_cores`) below
  the CPUs."""
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  text = f"{cores} of {os.cpu_count()} cores"
  if (threads := cpu_info.threads_per_core()) > 1:
    text += f", {threads} threads a core (SMT)"
  if (quota := cpu_info.binding_cpu_quota()) is not None:
    text += f" (a CPU quota of {quota:.2f}: {cores} rounded up)"
  return text


def machine_load() -> str:
  """The load average over 1, 5 and 15 minutes."""
  with open("/proc/loadavg") as f:
    return " ".join(f.read().split()[:3])


@dataclasses.dataclass
class Race:
  """What one run measured. results: (model, mode, impl) -> the worker
  results of each round; gemm / per_core: library -> GEMM rates (GFLOP/s)
  on every core / on one (`dense_products.gemm_worker`), the best of two
  workers; loads: the load average at the start, after round 1 and at the
  end."""
  results: dict
  gemm: dict
  per_core: dict
  loads: list

  @property
  def models(self) -> list[str]:
    """The raced models, in the order raced."""
    return list(dict.fromkeys(model for model, _, _ in self.results))

  def rate(self, key) -> float:
    """Mean images/s of a (model, mode, impl)'s rounds."""
    return statistics.mean(r["images_per_s"] for r in self.results[key])

  def gemm_rate(self, matmul_dtype: str) -> float:
    """PyTorch's 2048^3 GEMM rate on every core, of the race's operand
    dtype: what the "% GEMM" column and the summary's fraction are of."""
    shape = "2048x2048x2048"
    return self.gemm["torch"][
        f"bf16 {shape}" if matmul_dtype == "bfloat16" else shape]

  def fastest_torch(self, model: str, mode: str) -> float:
    """The mean images/s of the workload's fastest PyTorch variant."""
    return max(self.rate((model, mode, impl))
               for impl in race_workers.TORCH_IMPLS)


def command_line(args: argparse.Namespace, environ=None) -> str:
  """The command that reruns this race; with `environ` (the user's
  environment), an LD_PRELOAD set there goes before it, as it reaches every
  worker (e.g. a shim that changes what PyTorch's MKL runs)."""
  options = [
      "" if args.fast_malloc else " --no-fast_malloc",
      "" if args.cpu_devices == -1 else f" --cpu_devices={args.cpu_devices}",
      "" if args.steps == 5 else f" --steps={args.steps}",
      f" --batch={args.batch}" if args.batch else "",
      " --max_isa=avx2" if args.max_isa == "avx2" else "",
      " --matmul_dtype=bfloat16" if args.matmul_dtype == "bfloat16" else "",
      "" if args.models == race_workers.DEFAULT_MODELS
      else f" --models={','.join(args.models)}",
      " --growth" if args.growth else ""]
  preload = (environ or {}).get("LD_PRELOAD")
  prefix = f"LD_PRELOAD='{preload}' " if preload else ""
  return prefix + "python benchmarks/throughput.py" + "".join(options)


def setting_lines(args: argparse.Namespace, env: dict, race: Race,
                  cpu_model: str, isa: list[str], cores: int,
                  cpu_vendor: str = "") -> list[str]:
  """What the race ran on and with: the CPU, the GEMM rates, the flags."""
  gemm = race.gemm
  # The cores this process may use: `taskset -c 0,1` races two cores of a
  # larger CPU, as vit_jax's devices and PyTorch's threads both follow the
  # affinity mask.
  lines = [f"CPU: {cpu_model}, {cores_description(cores)}; "
           f"ISA: {' '.join(isa)}", code_line()]
  if args.max_isa == "avx2":
    lines.append("Every library capped at AVX2 + FMA: " + " ".join(
        f"{k}={v}" for k, v in race_workers.AVX2_ONLY_ENVIRONMENT.items())
                 + " XLA_FLAGS+=--xla_cpu_max_isa=AVX2")
  if args.matmul_dtype == "bfloat16":
    lines.append(f"GEMM bf16 GFLOP/s, 2048^3 (the % GEMM column's; jax as "
                 f"vit_jax's Dense layers run it): torch "
                 f"{gemm['torch']['bf16 2048x2048x2048']:.0f}, jax "
                 f"{gemm['jax']['bf16 2048x2048x2048']:.0f}")
  lines.append(
      f"GEMM fp32 GFLOP/s, best of 2x10 (2048^3 | 8320x192x768; jax with "
      f"vit_jax's flags): torch {gemm['torch']['2048x2048x2048']:.0f} | "
      f"{gemm['torch']['8320x192x768']:.0f}, jax "
      f"{gemm['jax']['2048x2048x2048']:.0f} | "
      f"{gemm['jax']['8320x192x768']:.0f}")
  lines += torch_gemm_lines(gemm, cpu_vendor, args.matmul_dtype)
  lines += dense_products.dense_product_lines(race.per_core, race.models,
                                              args.matmul_dtype)
  first_jax = race.results[race.models[0], "train", "vit_jax"][0]
  lines.append(f"vit_jax's XLA flags (vit_jax/runtime/host.py): "
               f"{first_jax['xla_flags']}")
  lines.append(f"malloc, every worker: GLIBC_TUNABLES="
               f"{env.get('GLIBC_TUNABLES', '')} "
               f"LD_PRELOAD={env.get('LD_PRELOAD', '')}")
  lines.append(f"load average (1/5/15 min) at start / after round 1 / end: "
               f"{' ; '.join(race.loads)}")
  return lines


# Below this fraction of jax's GEMM rate, PyTorch's products are said to
# hold its side of the race back.
_SLOW_TORCH_GEMM = 0.75


def torch_gemm_lines(gemm: dict, cpu_vendor: str,
                     matmul_dtype: str) -> list[str]:
  """A line when a float32 race's PyTorch GEMM (2048^3) runs well below
  jax's: the ratios then say as much about the two GEMM libraries as about
  the models. On an AMD CPU, say why (measured on a Zen 5:
  docs/performance.md, *A Zen 5*)."""
  if matmul_dtype != "float32":  # bfloat16 products: oneDNN's on both sides
    return []
  fraction = (gemm["torch"]["2048x2048x2048"]
              / gemm["jax"]["2048x2048x2048"])
  if fraction >= _SLOW_TORCH_GEMM:
    return []
  line = (f"PyTorch's float32 GEMM runs at {fraction:.2f} of jax's here, "
          f"so the ratios below are largely the GEMM libraries'.")
  if cpu_vendor == "AuthenticAMD":
    line += (" PyTorch's x86 wheels do float32 products in Intel's MKL, "
             "which picks its kernels by the CPU's vendor: on an AMD CPU its "
             "AVX2 ones, whatever the CPU has (docs/performance.md, *A Zen "
             "5*, races a PyTorch whose MKL takes its AVX-512 kernels).")
  return [line]


def _compile_cell(runs: list[dict]) -> str:
  """Mean compile seconds ("-" for eager PyTorch); for vit_jax, of them
  Python's trace + lower."""
  if "compile_s" not in runs[0]:
    return "-"
  mean = lambda name: statistics.mean(r[name] for r in runs)
  trace = f" (trace {mean('trace_s'):.1f})" if "trace_s" in runs[0] else ""
  return f"{mean('compile_s'):.1f}{trace}"


def results_table(race: Race, gemm_rate: float) -> list[str]:
  """The race's table: each workload's implementations, images/s, GFLOP/s
  and its fraction of `gemm_rate`, the ratio to the fastest PyTorch,
  compile seconds and peak RSS."""
  header = ("| workload | impl | images/s | GFLOP/s | % GEMM | vs fastest "
            "PyTorch | compile s | peak RSS MiB |")
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for model, mode in race_workers.workloads(race.models):
    flops = race.results[model, mode, "vit_jax"][0]["flops_per_image"]
    for impl in ("vit_jax",) + race_workers.TORCH_IMPLS:
      key = (model, mode, impl)
      runs = race.results[key]
      gflops = race.rate(key) * flops / 1e9
      rounds = "" if len(runs) == 1 else f" ({len(runs)} rounds)"
      lines.append(
          f"| {model} {mode} | {impl}{rounds} | {race.rate(key):.1f} | "
          f"{gflops:.0f} | {100 * gflops / gemm_rate:.0f} | "
          f"{race.rate(key) / race.fastest_torch(model, mode):.2f} | "
          f"{_compile_cell(runs)} | "
          f"{max(r['peak_rss_mib'] for r in runs):.0f} |")
  return lines


def summary_line(race: Race, gemm_rate: float, cpu_model: str) -> str:
  """The line scripts read: the worst ratio to the fastest PyTorch over
  the models for training and for inference, the worst training GEMM
  fraction and the slowest vit_jax train-step compile."""
  ratios = {mode: min(race.rate((model, mode, "vit_jax"))
                      / race.fastest_torch(model, mode)
                      for model in race.models)
            for mode in ("train", "infer")}
  trains = [(model, "train", "vit_jax") for model in race.models]
  gemm_fraction = min(race.rate(key) * race.results[key][0]["flops_per_image"]
                      / 1e9 / gemm_rate for key in trains)
  compile_s = max(r["compile_s"] for key in trains
                  for r in race.results[key])
  return (f"summary: train_vs_timm={ratios['train']:.2f} "
          f"infer_vs_timm={ratios['infer']:.2f} "
          f"train_gemm_fraction={gemm_fraction:.2f} "
          f"compile_s={compile_s:.1f} cpu=\"{cpu_model}\"")


def summary_cpu(args: argparse.Namespace, cpu_model: str) -> str:
  """The summary's cpu="…": the CPU's model, and what the race changed from
  the default one (a cap on its instructions, bfloat16 products, other
  models, another batch)."""
  if args.max_isa == "avx2":
    cpu_model += " capped at AVX2"
  if args.matmul_dtype == "bfloat16":
    cpu_model += ", bfloat16 products vs torch autocast"
  if args.models != race_workers.DEFAULT_MODELS:
    cpu_model += f", models {' '.join(args.models)}"
  if args.batch:
    cpu_model += f", batch {args.batch}"
  return cpu_model
