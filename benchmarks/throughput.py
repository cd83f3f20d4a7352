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
768, 12 heads, MLP 3072), batches 32 / 64; the summary's cpu="…" then
names them (45 minutes for both on 2 cores). --batch replaces every
workload's batch (--batch=1: one image at a time, as an application
classifying single photos runs), and the summary's cpu="…" says so.
vit_jax runs as configs/vit_tiny_cifar.py runs it on a CPU
(config.cpu_devices=-1): a device per core, each taking part of the batch,
or one multi-threaded device where the batch does not split evenly; PyTorch
uses the same cores as intra-op threads.
Every measurement runs in a fresh process
(`--worker`), so compile caches, allocator state and threads start alike,
and takes the median of --steps (5) steps after a warm-up step (2 until
2026-11-29: the median of two is their mean, so one slow step moved a
worker's figure; vit_jax's first-round inference workers read up to a
third below their second rounds then).
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
torch.compile's first run on a machine compiles cold (up to a minute per
workload; first runs took 12-17 minutes here); later runs load its cache,
kept in ~/.cache/vit_jax/torchinductor unless TORCHINDUCTOR_CACHE_DIR is set.
"""

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

@dataclasses.dataclass(frozen=True)
class RacedModel:
  """A model the race runs: its image size, vit_jax's variant, that
  variant's dims (every library builds them; written here so that PyTorch's
  workers need not import JAX, ~120 MiB of their peak RSS, and checked
  against vit_jax's table by tests/test_benchmarks.py) and the batches of a
  train and an inference step."""
  image_size: int
  variant: str
  patch_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  train_batch: int
  infer_batch: int

  def dims(self) -> dict:
    """patch_size, hidden_size, num_layers, num_heads and mlp_dim."""
    return dict(patch_size=self.patch_size, hidden_size=self.hidden_size,
                num_layers=self.num_layers, num_heads=self.num_heads,
                mlp_dim=self.mlp_dim)

  def batch(self, mode: str) -> int:
    return self.train_batch if mode == "train" else self.infer_batch


MODELS = {
    "vit_tiny_cifar": RacedModel(32, "ViT-Ti/4", 4, 192, 12, 3, 768, 128,
                                 256),
    "ViT-Ti/16@224": RacedModel(224, "ViT-Ti/16", 16, 192, 12, 3, 768, 32, 64),
    # Wider models, raced on request (--models): the paper's ViT-B/16 is
    # what most users fine-tune.
    "ViT-S/16@224": RacedModel(224, "ViT-S/16", 16, 384, 12, 6, 1536, 32, 64),
    "ViT-B/16@224": RacedModel(224, "ViT-B/16", 16, 768, 12, 12, 3072, 32,
                               64),
}
# The models of issue 47's targets: the default race and its summary line.
DEFAULT_MODELS = ("vit_tiny_cifar", "ViT-Ti/16@224")
TORCH_IMPLS = ("timm", "timm+compile", "torchvision", "torchvision+compile")
NUM_CLASSES = 10
# --matmul_dtype reaches every worker through this variable.
MATMUL_DTYPE_VARIABLE = "VIT_JAX_BENCH_MATMUL_DTYPE"


def bench_matmul_dtype():
  """None (float32) or "bfloat16": what --matmul_dtype asked for."""
  return os.environ.get(MATMUL_DTYPE_VARIABLE) or None
# The three products of every Dense layer in a train step: forward x.W,
# input gradient dy.W^T, weight gradient x^T.dy. At ViT-Ti's widths XLA:CPU
# runs the weight gradient ~20% below the other two. Here it is a jitted
# product on its own, so XLA turns (768, 192) round to the slow orientation
# whichever way `xla_products.kernel_gradient` writes it; in the data-parallel
# train step it keeps the fast one (docs/performance.md, "The kernels' gradients the
# narrow way round").
DENSE_PRODUCTS = ("x.W", "dy.W^T", "x^T.dy")
DENSE_ROWS = 32 * 197  # a 224 px train batch of 32 x its tokens


def dense_shapes(hidden_size: int, mlp_dim: int) -> tuple:
  """The (in, out) widths of an encoder block's Dense layers: q/k/v in one,
  the attention's output, the MLP's two. The narrower of each is
  hidden_size."""
  return ((hidden_size, 3 * hidden_size), (hidden_size, hidden_size),
          (hidden_size, mlp_dim), (mlp_dim, hidden_size))


def raced_widths(models) -> dict:
  """(hidden_size, mlp_dim) -> the names of `models` of those widths, in
  the order raced: the per-core Dense products are timed once for each."""
  widths = {}
  for name in models:
    model = MODELS[name]
    widths.setdefault((model.hidden_size, model.mlp_dim), []).append(name)
  return widths


def worker_batch(model_name: str, mode: str, batch=None) -> int:
  """The batch a worker times: `batch` if given, else the model's."""
  return batch or MODELS[model_name].batch(mode)


def time_steps(run, steps: int) -> float:
  """Median seconds of `steps` calls of run() after one warm-up call."""
  run()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def preprocess(images, key):
  """uint8 images -> the float inputs the benchmark's models see."""
  del key
  return (images.astype(np.float32) - 127.5) / 64.0


def jit_train_step(compiler_options=None):
  """vit_jax's real train step as the benchmark runs it: AdamW's learning
  rate fixed, no label smoothing, the state donated."""
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from vit_jax.training import steps  # pylint: disable=import-outside-toplevel
  return jax.jit(functools.partial(
      steps.train_step, preprocess=preprocess, label_smoothing=0.0,
      learning_rate_fn=lambda step: 1e-3), donate_argnums=0,
                 compiler_options=compiler_options)


class JaxStep:
  """vit_jax's real train step (or forward pass) on random data, compiled
  as the race runs it; calling it runs one step and waits for it."""

  def __init__(self, model_name: str, mode: str, image_size=None,
               patch_size=None, batch=None, num_layers=None):
    import jax
    import jax.numpy as jnp
    from vit_jax.kernels import xla_products
    from vit_jax.model import inference, vit
    from vit_jax.runtime import prng, sharding
    from vit_jax.training import optim, steps

    dims = MODELS[model_name].dims()
    dims["patch_size"] = patch_size or dims["patch_size"]
    dims["num_layers"] = num_layers or dims["num_layers"]
    size = image_size or MODELS[model_name].image_size
    self.mode, self.image_size, self.patch_size = mode, size, dims[
        "patch_size"]
    self.batch = worker_batch(model_name, mode, batch)
    self.matmul_dtype = bench_matmul_dtype()
    options = xla_products.xla_compiler_options(self.matmul_dtype)
    self.model = vit.VisionTransformer(
        num_classes=NUM_CLASSES, matmul_dtype=self.matmul_dtype, **dims)
    rng = np.random.default_rng(0)
    self.mesh = sharding.make_mesh()  # one device unless --cpu_devices splits
    self.images, self.labels = jax.device_put(
        (rng.integers(0, 256, (self.batch, size, size, 3), np.uint8),
         rng.integers(0, NUM_CLASSES, self.batch).astype(np.int32)),
        sharding.batch_sharded(self.mesh))
    if mode == "train":
      self.state = steps.create_train_state(
          self.model, (size, size, 3), optim.adamw(1e-3, weight_decay=0.05),
          0, self.mesh)
    else:  # no optimizer state to build; the params as inference takes them
      model = self.model
      self.params = inference.inference_params(jax.jit(
          lambda key: model.init(key, jnp.zeros((1, size, size, 3)))[
              "params"], out_shardings=sharding.replicated(self.mesh))(
                  prng.flat_draws(jax.random.PRNGKey(0))), self.matmul_dtype)

    start = time.perf_counter()
    if mode == "train":
      step = jit_train_step(options)
      lowered = step.trace(self.state, self.images, self.labels).lower()
    else:
      step = jax.jit(self._forward, compiler_options=options)
      lowered = step.trace(self.params, self.images).lower()
    self.trace_s = time.perf_counter() - start  # tracing and lowering
    self.compiled = lowered.compile()
    self.compile_s = time.perf_counter() - start

  def _forward(self, params, images):
    return self.model.apply({"params": params}, preprocess(images, None))

  def __call__(self) -> None:
    import jax
    if self.mode == "train":
      self.state, metrics = self.compiled(self.state, self.images,
                                          self.labels)
      jax.block_until_ready(metrics)
    else:
      jax.block_until_ready(self.compiled(self.params, self.images))

  def xla_flops(self) -> float:
    """XLA's FLOP count for the whole batch, of the program in XLA's own
    operations (the einsums' attention, XLA's dots): the compiled one's
    would be one device's share (within 1% of this on one device), and XLA
    counts nothing inside the CPU kernels' custom calls."""
    import jax
    from vit_jax.inspection import introspect
    countable_model = introspect.xla_operations_only(self.model)
    if self.mode == "train":
      traced = jit_train_step().trace(
          self.state.replace(apply_fn=countable_model.apply), self.images,
          self.labels)
    else:
      traced = jax.jit(lambda params, images: countable_model.apply(
          {"params": params}, preprocess(images, None))).trace(
              self.params, self.images)
    return (traced.lower().cost_analysis() or {}).get("flops", float("nan"))


def jax_worker(model_name: str, mode: str, num_steps: int, image_size=None,
               patch_size=None, batch=None, num_layers=None) -> dict:
  """vit_jax's real train_step (or apply) on random data; returns metrics."""
  step = JaxStep(model_name, mode, image_size, patch_size, batch, num_layers)
  memory = step.compiled.memory_analysis()
  flops = step.xla_flops()
  seconds = time_steps(step, num_steps)
  return {"images_per_s": step.batch / seconds, "batch": step.batch,
          "flops_per_image": flops / step.batch,
          "compile_s": step.compile_s, "trace_s": step.trace_s,
          "peak_rss_mib": _peak_rss_mib(),
          "xla_temp_mib": memory.temp_size_in_bytes / 2**20 if memory else 0,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "matmul_dtype": step.matmul_dtype or "float32"}


def torch_worker(impl: str, model_name: str, mode: str, steps: int,
                 batch=None) -> dict:
  """timm's or torchvision's ViT with the same dims, eager or compiled."""
  import torch
  size, dims = MODELS[model_name].image_size, MODELS[model_name].dims()
  batch = worker_batch(model_name, mode, batch)
  if impl.startswith("timm"):
    import timm
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=size, patch_size=dims["patch_size"], num_classes=NUM_CLASSES,
        embed_dim=dims["hidden_size"], depth=dims["num_layers"],
        num_heads=dims["num_heads"], mlp_ratio=dims["mlp_dim"] /
        dims["hidden_size"])
  else:
    import torchvision
    model = torchvision.models.VisionTransformer(
        image_size=size, patch_size=dims["patch_size"],
        num_layers=dims["num_layers"], num_heads=dims["num_heads"],
        hidden_dim=dims["hidden_size"], mlp_dim=dims["mlp_dim"],
        num_classes=NUM_CLASSES)
  images = torch.rand(batch, 3, size, size)
  labels = torch.randint(0, NUM_CLASSES, (batch,))
  forward = torch.compile(model) if impl.endswith("+compile") else model
  optimizer = torch.optim.AdamW(model.parameters(), 1e-3, weight_decay=0.05)
  # PyTorch's mixed precision: autocast's bfloat16 ops, float32 params.
  autocast = lambda: torch.autocast(
      "cpu", dtype=torch.bfloat16, enabled=bench_matmul_dtype() is not None)

  def run():
    if mode == "train":
      optimizer.zero_grad(set_to_none=True)
      with autocast():
        loss = torch.nn.functional.cross_entropy(forward(images), labels)
      loss.backward()
      optimizer.step()
    else:
      with torch.inference_mode(), autocast():
        forward(images)

  if mode != "train":
    model.eval()
  start = time.perf_counter()
  run()  # eager warm-up, or torch.compile's compilation
  first = time.perf_counter() - start
  seconds = time_steps(run, steps)
  result = {"images_per_s": batch / seconds, "batch": batch,
            "peak_rss_mib": _peak_rss_mib()}
  if impl.endswith("+compile"):  # eager has nothing to compile
    result["compile_s"] = first - seconds
  return result


def dense_product_operands(product: str, rows: int, k: int, n: int):
  """Shapes of (lhs, rhs, result) of `product` for a (k -> n) Dense layer
  applied to `rows` rows."""
  return {"x.W": ((rows, k), (k, n), (rows, n)),
          "dy.W^T": ((rows, n), (k, n), (rows, k)),
          "x^T.dy": ((rows, k), (rows, n), (k, n))}[product]


def dense_product_fn(library: str, product: str, operand_dtype=None):
  """(lhs, rhs) -> the product, as the library's train step computes it,
  with operand_dtype (None: float32; "bfloat16": mixed precision) as the
  race runs it: for jax, the implementation vit_jax's Dense layers take
  for it (`matmuls.resolve_implementation`: oneDNN's gemms, one group of
  rows as on each device of the step, or XLA's products, the weight
  gradient as `xla_products.kernel_gradient` orients it), float32 results;
  for torch, its autodiff's transposes, in the operands' dtype (autocast's
  bfloat16 results)."""
  if library == "jax":
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from vit_jax.kernels import cpu_gemm, matmuls, xla_products  # pylint: disable=import-outside-toplevel
    if matmuls.resolve_implementation("auto", jnp.float32,
                                      operand_dtype) == "onednn":
      return jax.jit({
          "x.W": lambda a, b: cpu_gemm.rows_times(a[None], b,
                                                  operand_dtype)[0],
          "dy.W^T": lambda a, b: cpu_gemm.rows_times_transposed(
              a[None], b, operand_dtype)[0],
          "x^T.dy": lambda a, b: cpu_gemm.rows_transposed_times(
              a[None], b[None], operand_dtype),
      }[product])
    if product == "x^T.dy":
      return jax.jit(lambda a, b: xla_products.kernel_gradient(
          a, b, None, operand_dtype))
    lhs_dim, rhs_dim = {"x.W": (1, 0), "dy.W^T": (1, 1)}[product]
    return jax.jit(lambda a, b: xla_products.product(
        a, b, (((lhs_dim,), (rhs_dim,)), ((), ())), None, operand_dtype,
        jnp.float32), compiler_options=xla_products.xla_compiler_options(
            operand_dtype))
  return {"x.W": lambda a, b: a @ b, "dy.W^T": lambda a, b: a @ b.T,
          "x^T.dy": lambda a, b: a.T @ b}[product]


def gemm_worker(library: str, per_core: bool,
                models=DEFAULT_MODELS) -> dict:
  """GEMM rates, GFLOP/s, on every core: float32 2048^3 and the MLP's
  (8320x192)@(192x768), with --matmul_dtype=bfloat16 also "bf16
  2048x2048x2048" (bfloat16 operands); per_core: on one thread, as
  vit_jax's train step runs each product (a device per core,
  `per_core_environment`), each Dense product at the widths of `models`
  (keys "x.W 6304x192x576" and so on) in the race's operand dtype."""
  if library == "torch" and per_core:
    import torch  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(1)
  matmul_dtype = bench_matmul_dtype()
  if per_core:
    cases = [(product, DENSE_ROWS, k, n, matmul_dtype,
              f"{product} {DENSE_ROWS}x{k}x{n}")
             for hidden, mlp in raced_widths(models)
             for k, n in dense_shapes(hidden, mlp)
             for product in DENSE_PRODUCTS]
  else:
    cases = [("x.W", 2048, 2048, 2048, None, "2048x2048x2048"),
             ("x.W", 8320, 192, 768, None, "8320x192x768")]
    if matmul_dtype:
      cases.append(("x.W", 2048, 2048, 2048, matmul_dtype,
                    "bf16 2048x2048x2048"))
  rates = {}
  for product, m, k, n, dtype, key in cases:
    lhs, rhs, _ = dense_product_operands(product, m, k, n)
    a, b = (_operand(library, shape, dtype) for shape in (lhs, rhs))
    fn = dense_product_fn(library, product, dtype)
    run = ((lambda: fn(a, b).block_until_ready()) if library == "jax"
           else (lambda: fn(a, b)))
    run()
    best = min(time_steps(run, 1) for _ in range(10))  # peak: least noise
    rates[key] = 2 * m * k * n / best / 1e9
  return rates


def _operand(library: str, shape: tuple, dtype):
  """A random operand of `shape` in the library's arrays, of `dtype`
  (None: float32), on the library's CPU device."""
  values = np.random.rand(*shape).astype(np.float32)
  if library == "jax":
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    return jnp.asarray(values, dtype or jnp.float32)
  import torch  # pylint: disable=import-outside-toplevel
  tensor = torch.from_numpy(values)
  return tensor.to(getattr(torch, dtype)) if dtype else tensor


def dense_product_rates(rates: dict, hidden_size: int) -> dict:
  """FLOP-weighted GFLOP/s of each Dense product over the shapes of one
  width (those whose narrower side is hidden_size, `dense_shapes`), from a
  per-core gemm worker's rates."""
  result = {}
  for product in DENSE_PRODUCTS:
    flops = seconds = 0.0
    for key, rate in rates.items():
      if key.startswith(product + " "):
        m, k, n = map(int, key.split()[1].split("x"))
        if min(k, n) == hidden_size:
          flops += 2 * m * k * n
          seconds += 2 * m * k * n / rate
    result[product] = flops / seconds
  return result


def per_core_environment(env: dict) -> dict:
  """env for a per-core gemm worker, which also pins itself to one core:
  XLA's Eigen on one thread, as on each of the train step's devices
  (torch's worker sets its own threads)."""
  flags = f"{env.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false"
  return dict(env, XLA_FLAGS=flags.strip())


def spawn(args: list[str], env: dict) -> dict:
  """Runs this script as a worker in a fresh process; returns its JSON.
  Prints a progress line (worker, result, its wall seconds) to stderr."""
  start = time.perf_counter()
  out = subprocess.run([sys.executable, __file__, "--worker", *args], env=env,
                       capture_output=True, text=True, check=False)
  lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
  if out.returncode or not lines:
    raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
  result = json.loads(lines[-1])
  rate = (f"{result['images_per_s']:.1f} images/s"
          if "images_per_s" in result else "GEMM")
  print(f"  {' '.join(a.split('=')[-1] for a in args)}: {rate} "
        f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
  return result


# The ISA extensions that decide which kernels XLA and PyTorch run.
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "asimd",
              "sve", "sve2", "bf16", "i8mm")


# What --max_isa=avx2 sets for every worker (and XLA's --xla_cpu_max_isa).
AVX2_ONLY_ENVIRONMENT = {
    "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2", "VIT_JAX_KERNEL_MARCH": "x86-64-v3"}


def worker_environment(fast_malloc: bool, max_isa: str,
                       matmul_dtype: str) -> dict:
  """The environment every worker runs with: main.py's malloc settings
  (unless not fast_malloc), --max_isa's caps and --matmul_dtype."""
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  env = dict(os.environ)
  if fast_malloc:
    env.update(host.fast_malloc_environment(env, host.find_tcmalloc()))
  # torch.compile's cache beside vit_jax's XLA cache, not in /tmp (which
  # machines clean): the first run compiles cold (~1 min per workload),
  # later runs load.
  env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
      os.path.dirname(host.default_cache_dir()), "torchinductor"))
  if max_isa == "avx2":
    env.update(AVX2_ONLY_ENVIRONMENT,
               XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} "
               "--xla_cpu_max_isa=AVX2".strip())
  env[MATMUL_DTYPE_VARIABLE] = matmul_dtype if matmul_dtype != "float32" else ""
  return env


def cpu_description() -> tuple[str, list[str]]:
  """The CPU's model name and which of `_ISA_FLAGS` it has
  (`vit_jax.runtime.cpu_info`)."""
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  flags = cpu_info.cpu_features()[1]
  return cpu_info.cpu_model(), [flag for flag in _ISA_FLAGS if flag in flags]


def machine_load() -> str:
  with open("/proc/loadavg") as f:
    return " ".join(f.read().split()[:3])


def _model_names(text: str) -> tuple[str, ...]:
  """--models' value: known model names, comma-separated."""
  names = tuple(name.strip() for name in text.split(",") if name.strip())
  unknown = [name for name in names if name not in MODELS]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"unknown model(s) {', '.join(unknown) or '(none given)'}; choose "
        f"from {', '.join(MODELS)}")
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
                      default=DEFAULT_MODELS,
                      help="comma-separated models to race, of "
                      f"{', '.join(MODELS)}")
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
    result = gemm_worker(library, per_core, args.models)
  elif args.impl == "vit_jax":
    from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
    host.split_cpu_into_devices(  # before JAX starts
        args.cpu_devices, (worker_batch(args.model, args.mode, args.batch),))
    result = jax_worker(args.model, args.mode, args.steps, args.image_size,
                        args.patch_size, args.batch, args.num_layers)
  else:
    result = torch_worker(args.impl, args.model, args.mode, args.steps,
                          args.batch)
  print(json.dumps(result), flush=True)
  os._exit(0)  # skips tearing down torch or JAX: up to ~1.3 s a worker


def workloads(models) -> list[tuple[str, str]]:
  """(model, mode) pairs: each model's training, then its inference."""
  return [(model, mode) for model in models for mode in ("train", "infer")]


@dataclasses.dataclass
class Race:
  """What one run measured. results: (model, mode, impl) -> the worker
  results of each round; gemm / per_core: library -> GEMM rates (GFLOP/s)
  on every core / on one (`gemm_worker`), the best of two workers; loads:
  the load average at the start, after round 1 and at the end."""
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

  def fastest_torch(self, model: str, mode: str) -> float:
    return max(self.rate((model, mode, impl)) for impl in TORCH_IMPLS)


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


def run_race(args: argparse.Namespace, env: dict) -> Race:
  """GEMM workers, round 1 (every implementation), round 2 (vit_jax and
  the fastest PyTorch variant, the other way round), GEMM workers again."""
  models = f"--models={','.join(args.models)}"  # the per-core widths
  gemm_runs = lambda: (
      {lib: spawn([f"--impl=gemm-{lib}"], env) for lib in ("torch", "jax")},
      {lib: spawn([f"--impl=gemm1-{lib}", models], per_core_environment(env))
       for lib in ("torch", "jax")})
  loads = [machine_load()]
  gemm, per_core = gemm_runs()
  results = {}
  for model, mode in workloads(args.models):
    for impl in ("vit_jax",) + TORCH_IMPLS:
      results[model, mode, impl] = [
          spawn(worker_args(args, impl, model, mode), env)]
  loads.append(machine_load())
  for model, mode in workloads(args.models):
    fastest = max(TORCH_IMPLS, key=lambda impl, m=model, o=mode:
                  results[m, o, impl][0]["images_per_s"])
    for impl in (fastest, "vit_jax"):
      results[model, mode, impl].append(
          spawn(worker_args(args, impl, model, mode), env))
  loads.append(machine_load())
  gemm_again, per_core_again = gemm_runs()
  return Race(results,
              {lib: _best_gemm(gemm[lib], gemm_again[lib]) for lib in gemm},
              {lib: _best_gemm(per_core[lib], per_core_again[lib])
               for lib in per_core}, loads)


def command_line(args: argparse.Namespace) -> str:
  """The command that reruns this race."""
  options = [
      "" if args.fast_malloc else " --no-fast_malloc",
      "" if args.cpu_devices == -1 else f" --cpu_devices={args.cpu_devices}",
      "" if args.steps == 5 else f" --steps={args.steps}",
      f" --batch={args.batch}" if args.batch else "",
      " --max_isa=avx2" if args.max_isa == "avx2" else "",
      " --matmul_dtype=bfloat16" if args.matmul_dtype == "bfloat16" else "",
      "" if args.models == DEFAULT_MODELS
      else f" --models={','.join(args.models)}",
      " --growth" if args.growth else ""]
  return "python benchmarks/throughput.py" + "".join(options)


def setting_lines(args: argparse.Namespace, env: dict, race: Race,
                  cpu_model: str, isa: list[str], cores: int) -> list[str]:
  """What the race ran on and with: the CPU, the GEMM rates, the flags."""
  gemm = race.gemm
  # The cores this process may use: `taskset -c 0,1` races two cores of a
  # larger CPU, as vit_jax's devices and PyTorch's threads both follow the
  # affinity mask.
  lines = [f"CPU: {cpu_model}, {cores} of {os.cpu_count()} cores; "
           f"ISA: {' '.join(isa)}"]
  if args.max_isa == "avx2":
    lines.append("Every library capped at AVX2 + FMA: " + " ".join(
        f"{k}={v}" for k, v in AVX2_ONLY_ENVIRONMENT.items())
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
  lines += dense_product_lines(race.per_core, race.models, args.matmul_dtype)
  first_jax = race.results[race.models[0], "train", "vit_jax"][0]
  lines.append(f"vit_jax's XLA flags (vit_jax/runtime/host.py): "
               f"{first_jax['xla_flags']}")
  lines.append(f"malloc, every worker: GLIBC_TUNABLES="
               f"{env.get('GLIBC_TUNABLES', '')} "
               f"LD_PRELOAD={env.get('LD_PRELOAD', '')}")
  lines.append(f"load average (1/5/15 min) at start / after round 1 / end: "
               f"{' ; '.join(race.loads)}")
  return lines


def dense_product_lines(per_core: dict, models, matmul_dtype: str
                        ) -> list[str]:
  """A line per width of the raced models: a Dense layer's three products
  on one core each, jax against torch (`per_core`: library -> the per-core
  gemm workers' rates)."""
  operands = ("" if matmul_dtype == "float32" else
              "; bfloat16 operands, jax's results float32, torch's bfloat16 "
              "as autocast's")
  lines = []
  for (hidden, mlp), names in raced_widths(models).items():
    dense = {lib: dense_product_rates(rates, hidden)
             for lib, rates in per_core.items()}
    lines.append(
        f"A Dense layer's products at width {hidden} ({', '.join(names)}), "
        f"{DENSE_ROWS} rows, one core each as the train step runs them "
        f"(GFLOP/s over {len(dense_shapes(hidden, mlp))} shapes, jax / "
        f"torch{operands}): " + ", ".join(
            f"{product} {dense['jax'][product]:.0f} / "
            f"{dense['torch'][product]:.0f} "
            f"({dense['jax'][product] / dense['torch'][product]:.2f})"
            for product in DENSE_PRODUCTS))
  return lines


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
  for model, mode in workloads(race.models):
    flops = race.results[model, mode, "vit_jax"][0]["flops_per_image"]
    for impl in ("vit_jax",) + TORCH_IMPLS:
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


def main():
  args = parse_args()
  if args.worker:
    run_worker(args)
  from vit_jax.runtime import cpu_info  # pylint: disable=g-import-not-at-top
  env = worker_environment(args.fast_malloc, args.max_isa, args.matmul_dtype)
  started = time.perf_counter()
  race = run_race(args, env)
  cpu_model, isa = cpu_description()
  print(f"\nCommand: {command_line(args)}")
  print("\n".join(setting_lines(args, env, race, cpu_model, isa,
                                cpu_info.cpu_cores())) + "\n")
  gemm_rate = race.gemm["torch"]["2048x2048x2048"]
  if args.max_isa == "avx2":
    cpu_model += " capped at AVX2"
  if args.matmul_dtype == "bfloat16":  # the fraction of the bf16 rate
    gemm_rate = race.gemm["torch"]["bf16 2048x2048x2048"]
    cpu_model += ", bfloat16 products vs torch autocast"
  if args.models != DEFAULT_MODELS:
    cpu_model += f", models {' '.join(args.models)}"
  if args.batch:
    cpu_model += f", batch {args.batch}"
  print("\n".join(results_table(race, gemm_rate)))
  if args.growth:
    print("\n" + "\n".join(growth_lines(env)))
  print(f"\nwall time {(time.perf_counter() - started) / 60:.1f} min")
  print(summary_line(race, gemm_rate, cpu_model))


if __name__ == "__main__":
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  main()
