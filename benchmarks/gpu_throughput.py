r"""vit_jax against timm + torch.compile on one CUDA GPU: ViT-B/16, ViT-L/16.

  python benchmarks/gpu_throughput.py                 # ~5-7 min on one H100
  python benchmarks/gpu_throughput.py --profile=DIR   # + where the ViT-L/16
                                                      #   steps' time goes

Both libraries build the same model (224 px, patch 16, 1000 classes, the
paper's Table 1 widths) and run the same work:
  train  forward + backward + AdamW (lr 1e-3, weight decay 0.05) on a batch
         of 256 (ViT-B/16) or 128 (ViT-L/16); bfloat16 compute, float32
         parameters and optimizer state. vit_jax: its own `train_step`
         (config.model.dtype="bfloat16", attention "auto" = cuDNN's flash
         attention), the state donated. timm: torch.compile(model), bf16
         autocast, SDPA attention (timm's fused_attn), fused AdamW.
  infer  forward on a batch of 512 / 256, bfloat16 parameters and compute.
Every measurement runs in a fresh process (`--worker`). Each times 3 rounds
of 10 steps after 3 warm-up steps and takes the median round.

MFU is the model's FLOPs per image (matmuls only, counted analytically for
the computation vit_jax runs, which skips the last block's work on patch
tokens; training = 3x the forward) times images/s over the dense bf16 GEMM
rate measured in the same run (8192^3, the faster of torch and jax).
Compile time: vit_jax's trace + lower + XLA compile of the step; timm's
first step minus a timed step (dynamo + inductor, cold cache). Peak memory:
the allocator's peak bytes in use on the GPU. Ends with one line

  summary: gpu="…" train_vs_timm=… infer_vs_timm=… train_mfu=… compile_s=…

the ratios vit_jax / timm of the worse model, train_mfu vit_jax's worse
training MFU, compile_s its slower train-step compile (ViT-L/16's).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name: (variant, train batch, inference batch)
MODELS = {"ViT-B/16": (256, 512), "ViT-L/16": (128, 256)}
LIBRARIES = ("vit_jax", "timm")
MODES = ("train", "infer")
IMAGE_SIZE, NUM_CLASSES = 224, 1000
ROUNDS, STEPS_PER_ROUND, WARMUP_STEPS = 3, 10, 3


def model_dims(name: str) -> dict:
  """hidden_size, num_layers, num_heads, mlp_dim, patch_size of a variant."""
  from vit_jax.model import variants  # pylint: disable=import-outside-toplevel
  return dict(variants.VARIANTS[name])


def forward_flops_per_image(name: str, image_size: int = IMAGE_SIZE,
                            num_classes: int = NUM_CLASSES) -> float:
  """Matmul FLOPs of one image's forward pass through vit_jax's ViT
  (class-token classifier): the patch embedding, every block's
  projections, attention products and MLP, the head. The last block
  computes queries, output projection and MLP for the class token only
  (keys and values for every token), as vit_jax does."""
  d = model_dims(name)
  width, mlp, layers = d["hidden_size"], d["mlp_dim"], d["num_layers"]
  patches = (image_size // d["patch_size"]) ** 2
  tokens = patches + 1

  def block(queries: int) -> float:
    return 2 * (queries * width * width        # query projection
                + 2 * tokens * width * width   # key and value projections
                + 2 * queries * tokens * width  # Q K^T and P V
                + queries * width * width      # output projection
                + 2 * queries * width * mlp)   # the MLP's two matmuls

  embed = 2 * patches * d["patch_size"] ** 2 * 3 * width
  return (embed + (layers - 1) * block(tokens) + block(1)
          + 2 * width * num_classes)


def _median_step_seconds(run_steps, synchronize) -> float:
  """Median over ROUNDS of the mean step time of STEPS_PER_ROUND steps run
  back to back (one synchronisation per round)."""
  run_steps(WARMUP_STEPS)
  synchronize()
  rounds = []
  for _ in range(ROUNDS):
    start = time.perf_counter()
    run_steps(STEPS_PER_ROUND)
    synchronize()
    rounds.append((time.perf_counter() - start) / STEPS_PER_ROUND)
  return statistics.median(rounds)


def preprocess(images, key):
  """uint8 images to [-1, 1] float32 (the on-device preprocessing of every
  vit_jax worker here and in gpu_flags.py)."""
  del key
  return (images.astype("float32") - 127.5) / 127.5


def inference_program(model):
  """(the jitted forward pass on uint8 images, the model's parameters in
  bfloat16): vit_jax's side of the inference race."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  params = jax.jit(lambda key: jax.tree.map(
      lambda p: p.astype(jnp.bfloat16), model.init(key, jnp.zeros(
          (1, IMAGE_SIZE, IMAGE_SIZE, 3)))["params"]))(jax.random.PRNGKey(0))
  forward = jax.jit(lambda p, x: model.apply({"params": p},
                                             preprocess(x, None)),
                    compiler_options=library_compiler_options(model))
  return forward, params


def library_compiler_options(model):
  """The per-program XLA options that vit_jax's trainer compiles its steps
  with (on an NVIDIA GPU: cuBLAS, not Triton, for the products)."""
  from vit_jax.kernels import xla_products  # pylint: disable=import-outside-toplevel
  return xla_products.xla_compiler_options(model.matmul_dtype)


def jax_worker(name: str, mode: str, batch: int, profile_dir: str = "",
               attention: str = "auto") -> dict:
  """vit_jax's train_step or apply on random uint8 images, bf16 compute;
  attention: config.model.attention_implementation."""
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from vit_jax.model import variants  # pylint: disable=import-outside-toplevel
  from vit_jax.runtime import sharding
  from vit_jax.training import optim, steps

  model_config = variants.get_variant(name)
  model_config.dtype = "bfloat16"
  model_config.attention_implementation = attention
  model = variants.build_model(model_config, NUM_CLASSES)
  mesh = sharding.make_mesh()
  key = jax.random.PRNGKey(0)
  images = jax.device_put(jax.random.randint(
      key, (batch, IMAGE_SIZE, IMAGE_SIZE, 3), 0, 256).astype(jnp.uint8),
                          sharding.batch_sharded(mesh))
  labels = jax.device_put(jax.random.randint(key, (batch,), 0, NUM_CLASSES),
                          sharding.batch_sharded(mesh))
  start = time.perf_counter()
  if mode == "train":
    state = steps.create_train_state(
        model, (IMAGE_SIZE, IMAGE_SIZE, 3),
        optim.adamw(1e-3, weight_decay=0.05), 0, mesh)
    jax.block_until_ready(state)
    start = time.perf_counter()
    step = jax.jit(functools.partial(
        steps.train_step, preprocess=preprocess, label_smoothing=0.0,
        learning_rate_fn=lambda _: 1e-3), donate_argnums=0,
                   compiler_options=library_compiler_options(model))
    compiled = step.lower(state, images, labels).compile()
    stepper = _TrainSteps(compiled, state, images, labels)
    run_steps, synchronize = stepper.run, stepper.synchronize
  else:
    forward, params = inference_program(model)
    jax.block_until_ready(params)
    start = time.perf_counter()
    compiled = forward.lower(params, images).compile()
    outputs = []

    def run_steps(n):
      outputs[:] = [compiled(params, images) for _ in range(n)][-1:]
    synchronize = lambda: jax.block_until_ready(outputs)
  compile_s = time.perf_counter() - start
  hlo = compiled.as_text()
  seconds = _median_step_seconds(run_steps, synchronize)
  result = {"images_per_s": batch / seconds, "compile_s": compile_s,
            "peak_gib": _jax_peak_gib(jax),
            "cudnn_attention": "__cudnn$fmha" in hlo, "attention": attention,
            "device": jax.devices()[0].device_kind,
            "versions": f"jax {jax.__version__}"}
  if profile_dir:
    result["profile"] = _profile(jax, run_steps, synchronize, profile_dir,
                                 hlo)
  return result


class _TrainSteps:
  """A compiled, state-donating train step run n times on one batch; the
  state and the last metrics are kept for the next run and to wait on."""

  def __init__(self, compiled, state, images, labels):
    self._compiled, self._batch = compiled, (images, labels)
    self._state, self._metrics = state, None

  def run(self, n: int) -> None:
    for _ in range(n):
      self._state, self._metrics = self._compiled(self._state, *self._batch)

  def synchronize(self) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    jax.block_until_ready((self._state, self._metrics))


def _jax_peak_gib(jax) -> float:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", 0) / 2**30


def _profile(jax, run_steps, synchronize, profile_dir: str,
             hlo_text: str) -> dict:
  """Traces 5 steps; returns GPU time per kernel class (ms per step) and
  the busiest kernels' JAX scopes. The compiled program's HLO text goes
  beside the trace (optimized_hlo.txt.gz), to name any other kernel."""
  import glob  # pylint: disable=import-outside-toplevel
  import gzip  # pylint: disable=import-outside-toplevel
  os.makedirs(profile_dir, exist_ok=True)
  with gzip.open(os.path.join(profile_dir, "optimized_hlo.txt.gz"),
                 "wt") as f:
    f.write(hlo_text)
  synchronize()
  start = time.perf_counter()
  with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
    run_steps(5)
    synchronize()
  wall_ms = (time.perf_counter() - start) * 1e3 / 5
  traces = glob.glob(os.path.join(profile_dir, "**", "*perfetto_trace*"),
                     recursive=True)
  if not traces:
    return {"error": f"no perfetto trace under {profile_dir}"}
  import gpu_profile  # pylint: disable=import-outside-toplevel
  summary = gpu_profile.kernel_time_by_class(traces[0], num_steps=5,
                                             hlo_text=hlo_text)
  summary["wall_ms_per_step_under_trace"] = wall_ms
  summary["trace_file"] = traces[0]
  return summary


def torch_worker(name: str, mode: str, batch: int) -> dict:
  """timm's VisionTransformer, torch.compile'd, bf16 autocast, fused AdamW."""
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  d = model_dims(name)
  device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke test
  torch.backends.cuda.matmul.allow_tf32 = True  # as JAX's default precision
  torch.backends.cudnn.allow_tf32 = True
  synchronize = (torch.cuda.synchronize if device == "cuda" else
                 lambda: None)
  model = timm.models.vision_transformer.VisionTransformer(
      img_size=IMAGE_SIZE, patch_size=d["patch_size"],
      num_classes=NUM_CLASSES, embed_dim=d["hidden_size"],
      depth=d["num_layers"], num_heads=d["num_heads"],
      mlp_ratio=d["mlp_dim"] / d["hidden_size"]).to(device)
  images = torch.randint(0, 256, (batch, 3, IMAGE_SIZE, IMAGE_SIZE),
                         dtype=torch.uint8, device=device)
  labels = torch.randint(0, NUM_CLASSES, (batch,), device=device)
  forward = torch.compile(model)
  if mode == "train":
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3,
                                  weight_decay=0.05, fused=device == "cuda")

    def step():
      optimizer.zero_grad(set_to_none=True)
      with torch.autocast(device, dtype=torch.bfloat16):
        logits = forward((images.float() - 127.5) / 127.5)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
      loss.backward()
      optimizer.step()
  else:
    model.eval().to(torch.bfloat16)

    def step():
      with torch.inference_mode():
        forward((images.to(torch.bfloat16) - 127.5) / 127.5)

  run_steps = lambda n: [step() for _ in range(n)]
  start = time.perf_counter()
  step()
  synchronize()
  first = time.perf_counter() - start
  seconds = _median_step_seconds(run_steps, synchronize)
  cuda = device == "cuda"
  return {"images_per_s": batch / seconds, "compile_s": first - seconds,
          "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0,
          "device": torch.cuda.get_device_name() if cuda else "cpu",
          "versions": f"torch {torch.__version__}, timm {timm.__version__}",
          "fused_attn": bool(model.blocks[0].attn.fused_attn)}


def gemm_worker(library: str, size: int = 8192) -> dict:
  """Dense bf16 GEMM rate (TFLOP/s) of a size^3 product on random data,
  rotating over 3 operand pairs; median of 20 after warm-up."""
  if library == "torch":
    import torch  # pylint: disable=import-outside-toplevel
    pairs = [(torch.randn(size, size, device="cuda", dtype=torch.bfloat16),
              torch.randn(size, size, device="cuda", dtype=torch.bfloat16))
             for _ in range(3)]
    product, synchronize = torch.matmul, torch.cuda.synchronize
    outputs = []
  else:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    pairs = [(jax.random.normal(keys[2 * i], (size, size), jnp.bfloat16),
              jax.random.normal(keys[2 * i + 1], (size, size), jnp.bfloat16))
             for i in range(3)]
    product = jax.jit(jnp.matmul)
    outputs = []
    synchronize = lambda: jax.block_until_ready(outputs)

  def run_steps(n):
    outputs[:] = [product(*pairs[i % 3]) for i in range(n)][-1:]

  seconds = _median_step_seconds(run_steps, synchronize)
  return {"tflops": 2 * size ** 3 / seconds / 1e12}


def spawn(args: list[str]) -> dict:
  """This script as a worker in a fresh process; its JSON result (or the
  error) and a progress line on stderr."""
  start = time.perf_counter()
  out = subprocess.run([sys.executable, __file__, "--worker", *args],
                       capture_output=True, text=True, check=False)
  lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
  wall = time.perf_counter() - start
  if out.returncode or not lines:
    print(f"  {' '.join(args)}: FAILED ({wall:.0f} s)\n{out.stderr[-4000:]}",
          file=sys.stderr, flush=True)
    return {"error": out.stderr[-500:]}
  result = json.loads(lines[-1])
  print(f"  {' '.join(args)}: {json.dumps(result)[:300]} ({wall:.0f} s)",
        file=sys.stderr, flush=True)
  return result


def _batch(name: str, mode: str) -> int:
  train_batch, infer_batch = MODELS[name]
  return train_batch if mode == "train" else infer_batch


def run_worker(args) -> dict:
  if args.worker_kind.startswith("gemm-"):
    return gemm_worker(args.worker_kind[5:])
  batch = args.batch or _batch(args.model, args.mode)
  if args.worker_kind == "vit_jax":
    return jax_worker(args.model, args.mode, batch, args.profile,
                      args.attention)
  return torch_worker(args.model, args.mode, batch)


def report(results: dict, gemm_tflops: float, models, modes) -> list[str]:
  """The table's rows and the summary line."""
  rows = ["| workload | library | images/s | vs timm | MFU | compile s | "
          "peak GiB |", "|---|---|---:|---:|---:|---:|---:|"]
  ratios = {mode: [] for mode in modes}
  mfus, compiles = [], []
  for name in models:
    for mode in modes:
      flops = forward_flops_per_image(name) * (3 if mode == "train" else 1)
      reference = results.get((name, mode, "timm"), {}).get("images_per_s")
      for library in LIBRARIES:
        r = results.get((name, mode, library), {})
        if "images_per_s" not in r:
          rows.append(f"| {name} {mode} | {library} | failed | | | | |")
          continue
        mfu = r["images_per_s"] * flops / (gemm_tflops * 1e12)
        ratio = r["images_per_s"] / reference if reference else float("nan")
        rows.append(f"| {name} {mode} (batch {_batch(name, mode)}) | "
                    f"{library} | {r['images_per_s']:.0f} | {ratio:.2f} | "
                    f"{100 * mfu:.1f}% | {r['compile_s']:.1f} | "
                    f"{r['peak_gib']:.1f} |")
        if library == "vit_jax":
          ratios[mode].append(ratio)
          if mode == "train":
            mfus.append(mfu)
            compiles.append(r["compile_s"])
  worst = lambda values: min(values) if values else float("nan")
  device = next((r["device"] for r in results.values() if "device" in r), "?")
  rows.append(f"summary: gpu=\"{device}\" "
              f"train_vs_timm={worst(ratios.get('train', [])):.2f} "
              f"infer_vs_timm={worst(ratios.get('infer', [])):.2f} "
              f"train_mfu={worst(mfus):.2f} "
              f"compile_s={max(compiles) if compiles else float('nan'):.1f}")
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--worker_kind", default="vit_jax",
                      help=argparse.SUPPRESS)
  parser.add_argument("--model", default="ViT-B/16", help=argparse.SUPPRESS)
  parser.add_argument("--mode", default="train", help=argparse.SUPPRESS)
  parser.add_argument("--attention", default="auto", help=argparse.SUPPRESS)
  parser.add_argument("--batch", type=int, default=0,
                      help="a worker's batch instead of the model's (smoke "
                      "tests of the script on a CPU)")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--profile", default="",
                      help="folder for JAX profiles of the ViT-L/16 (or "
                      "last model's) train and inference steps (DIR/train, "
                      "DIR/infer), with a per-kernel-class summary")
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(run_worker(args)), flush=True)
    os._exit(0)  # skip tearing down torch / JAX

  started = time.perf_counter()
  models, modes = args.models.split(","), args.modes.split(",")
  gemm = {lib: spawn([f"--worker_kind=gemm-{lib}"]) for lib in ("torch", "jax")}
  gemm_tflops = max(g.get("tflops", 0.0) for g in gemm.values())
  results = {}
  for name in models:
    for mode in modes:
      for library in LIBRARIES:
        profile = (args.profile and library == "vit_jax"
                   and name == ("ViT-L/16" if "ViT-L/16" in models
                                else models[-1]))
        worker = ([f"--worker_kind={library}", f"--model={name}",
                   f"--mode={mode}"]
                  + ([f"--profile={os.path.join(args.profile, mode)}"]
                     if profile else []))
        results[name, mode, library] = spawn(worker)
        if library == "vit_jax" and "error" in results[name, mode, library]:
          # Measured all the same, and the table says with which kernel.
          results[name, mode, library] = spawn(worker + ["--attention=einsum"])
  print("\nCommand: python benchmarks/gpu_throughput.py"
        + (f" --models={args.models}" if args.models != ",".join(MODELS)
           else "") + (f" --modes={args.modes}" if args.modes != ",".join(
               MODES) else "") + (f" --profile={args.profile}"
                                  if args.profile else ""))
  versions = sorted({r["versions"] for r in results.values()
                     if "versions" in r})
  print(f"Software: {'; '.join(versions)}")
  print("Dense bf16 GEMM 8192^3, TFLOP/s: " + ", ".join(
      f"{lib} {g.get('tflops', float('nan')):.0f}" for lib, g in gemm.items()))
  for key, r in results.items():
    if "cudnn_attention" in r:
      print(f"vit_jax {' '.join(key[:2])}: attention_implementation="
            f"{r['attention']!r}, cuDNN flash attention in the compiled "
            f"program: {r['cudnn_attention']}")
    if "profile" in r:
      print(f"Profile of vit_jax {' '.join(key[:2])}: "
            f"{json.dumps(r['profile'])}")
  print()
  print("\n".join(report(results, gemm_tflops, models, modes)))
  print(f"wall time {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
  main()
