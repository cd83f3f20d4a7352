"""The race's workloads and the workers that time them
(`benchmarks/throughput.py` runs each in a fresh process).

A workload is a model of `MODELS` in one mode: "train" (vit_jax's real
train step: forward, backward and AdamW's update) or "infer" (the forward
pass). `jax_worker` times vit_jax's (`JaxStep`), `torch_worker` timm's
or torchvision's with the same dims, eager or under torch.compile
(`TorchStep`); each returns the median of its steps after a warm-up step
(--steps of them, and more until they take MIN_TIMED_SECONDS).
`benchmarks/latency.py` times the same steps one by one. Every worker runs
with `worker_environment`, so that both libraries get the same malloc,
instruction caps and operand dtype.
"""

import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Sequence

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
    # The paper's fine-tuning resolution (configs/vit_b16_finetune_cifar10.py):
    # 577 tokens, attention ~11% of the products against 4% at 224. Smaller
    # batches: a step of 8 costs about what one of 32 does at 224.
    "ViT-B/16@384": RacedModel(384, "ViT-B/16", 16, 768, 12, 12, 3072, 8,
                               16),
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


def worker_batch(model_name: str, mode: str, batch=None) -> int:
  """The batch a worker times: `batch` if given, else the model's."""
  return batch or MODELS[model_name].batch(mode)


# A worker times at least this many seconds of steps. Why: 5 steps of a
# few milliseconds (one image at a time) are the process's first 20 ms
# after warming up. At --batch=1 with bfloat16 products (Zen 5,
# 2026-12-04) vit_tiny_cifar inference read 234 images/s for vit_jax and
# 291 for timm + compile so, and 327 and 358 (then 293 and 292) over a
# second; at the race's own batches 5 steps already take a second or more.
MIN_TIMED_SECONDS = 1.0


def step_times(run, warmup: int, steps: int,
               min_seconds: float = 0.0) -> list[float]:
  """Seconds of each call of run() after `warmup` calls: `steps` calls,
  and more until they have taken min_seconds."""
  for _ in range(warmup):
    run()
  times, total = [], 0.0
  while len(times) < steps or total < min_seconds:
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
    total += times[-1]
  return times


def time_steps(run, steps: int, min_seconds: float = 0.0) -> float:
  """Median seconds of calls of run() after one warm-up call: `steps`
  calls, and more until they have taken min_seconds."""
  return statistics.median(step_times(run, 1, steps, min_seconds))


def spawn_worker(script: str, args: list[str], env: dict,
                 prefix: Sequence[str] = ()) -> dict:
  """Runs `python script --worker *args` in a fresh process with `env`
  (started by the command `prefix` where given, e.g. one that enters a
  cgroup) and returns the JSON of the last line it printed that starts
  with "{"; raises with the end of its stderr if it fails."""
  out = subprocess.run([*prefix, sys.executable, script, "--worker", *args],
                       env=env, capture_output=True, text=True, check=False)
  lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
  if out.returncode or not lines:
    raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
  return json.loads(lines[-1])


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
  seconds = time_steps(step, num_steps, MIN_TIMED_SECONDS)
  return {"images_per_s": step.batch / seconds, "batch": step.batch,
          "flops_per_image": flops / step.batch,
          "compile_s": step.compile_s, "trace_s": step.trace_s,
          "peak_rss_mib": _peak_rss_mib(),
          "xla_temp_mib": memory.temp_size_in_bytes / 2**20 if memory else 0,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "matmul_dtype": step.matmul_dtype or "float32"}


class TorchStep:
  """timm's or torchvision's ViT with a model's dims, eager or under
  torch.compile ("+compile"), on random data; calling it runs one step
  (with "train" forward, backward and AdamW's update; else the forward
  pass), under torch.autocast's bfloat16 where --matmul_dtype asks."""

  def __init__(self, impl: str, model_name: str, mode: str, batch=None):
    import torch
    size, dims = MODELS[model_name].image_size, MODELS[model_name].dims()
    self.mode, self.batch = mode, worker_batch(model_name, mode, batch)
    # No more threads than vit_jax's devices and kernels use: fewer than
    # PyTorch's default where a container's CPU quota is smaller than the
    # CPUs (its threads then burn the quota and stall; the same elsewhere).
    from vit_jax.runtime import cpu_info
    torch.set_num_threads(min(torch.get_num_threads(), cpu_info.cpu_cores()))
    if impl.startswith("timm"):
      import timm
      model = timm.models.vision_transformer.VisionTransformer(
          img_size=size, patch_size=dims["patch_size"],
          num_classes=NUM_CLASSES, embed_dim=dims["hidden_size"],
          depth=dims["num_layers"], num_heads=dims["num_heads"],
          mlp_ratio=dims["mlp_dim"] / dims["hidden_size"])
    else:
      import torchvision
      model = torchvision.models.VisionTransformer(
          image_size=size, patch_size=dims["patch_size"],
          num_layers=dims["num_layers"], num_heads=dims["num_heads"],
          hidden_dim=dims["hidden_size"], mlp_dim=dims["mlp_dim"],
          num_classes=NUM_CLASSES)
    if mode != "train":
      model.eval()
    self.images = torch.rand(self.batch, 3, size, size)
    self.labels = torch.randint(0, NUM_CLASSES, (self.batch,))
    self.forward = torch.compile(model) if impl.endswith("+compile") else model
    self.optimizer = torch.optim.AdamW(model.parameters(), 1e-3,
                                       weight_decay=0.05)

  def _autocast(self):
    """PyTorch's mixed precision: autocast's bfloat16 ops, float32
    params (a no-op context without --matmul_dtype)."""
    import torch
    return torch.autocast("cpu", dtype=torch.bfloat16,
                          enabled=bench_matmul_dtype() is not None)

  def __call__(self) -> None:
    import torch
    if self.mode == "train":
      self.optimizer.zero_grad(set_to_none=True)
      with self._autocast():
        loss = torch.nn.functional.cross_entropy(self.forward(self.images),
                                                 self.labels)
      loss.backward()
      self.optimizer.step()
    else:
      with torch.inference_mode(), self._autocast():
        self.forward(self.images)


def torch_worker(impl: str, model_name: str, mode: str, steps: int,
                 batch=None) -> dict:
  """`TorchStep`'s images/s (and torch.compile's compile time)."""
  step = TorchStep(impl, model_name, mode, batch)
  start = time.perf_counter()
  step()  # eager warm-up, or torch.compile's compilation
  first = time.perf_counter() - start
  seconds = time_steps(step, steps, MIN_TIMED_SECONDS)
  result = {"images_per_s": step.batch / seconds, "batch": step.batch,
            "peak_rss_mib": _peak_rss_mib()}
  if impl.endswith("+compile"):  # eager has nothing to compile
    result["compile_s"] = first - seconds
  return result


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


def workloads(models) -> list[tuple[str, str]]:
  """(model, mode) pairs: each model's training, then its inference."""
  return [(model, mode) for model in models for mode in ("train", "infer")]
