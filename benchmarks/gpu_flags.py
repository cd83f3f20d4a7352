r"""XLA:GPU compiler options and model paths for vit_jax's train step, side
by side in one process.

  python benchmarks/gpu_flags.py                      # ViT-L/16, batch 128
  python benchmarks/gpu_flags.py --mode=infer         # its forward, batch 256
  python benchmarks/gpu_flags.py --model=ViT-B/16 --batch=256 --rounds=5
  python benchmarks/gpu_flags.py --variants="as is,Triton GEMMs"

The train step of benchmarks/gpu_throughput.py's vit_jax worker (bfloat16
compute, float32 parameters and AdamW state, cuDNN's flash attention), or
with --mode=infer its inference program (bfloat16 parameters, the batch
of gpu_throughput.py's inference race unless --batch says otherwise), is
compiled once per variant below. A variant is a dict of XLA debug options
passed as `compiler_options` to that one compilation, over the options
vit_jax's steps compile with (the process's XLA_FLAGS stay as they are),
or a change to the model: the einsums in place of cuDNN's attention;
(training only) JAX's own gradients for the Dense layers' matmuls in
place of vit_jax's backward passes, which were written for XLA:CPU
(`vit_jax/kernels/matmuls.py`: the kernels' gradients in the orientation
Eigen packs fastest, the GELU recomputed instead of stored), or the MLP's
backward pass with the GELU's output kept but nothing more; (inference
only) cuDNN's attention on the model's odd token counts without the
padding token and mask that its backward pass needs; or, for cuDNN, q,
k and v from one product whose output is padded and cut apart, in place
of the model's three products of the tokens padded once.
Then the variants take turns: --rounds rounds, each variant
--steps steps from the same state in every round, so all of them see the
same GPU state and clocks; a difference of a couple of percent shows. A
variant whose options this XLA does not know is reported as failed, and
the rest run on.

Prints each variant's compile seconds, XLA's scratch memory, its median
step and the as-is step over it (above 1: the variant is faster), then
  summary: best=… best_over_as_is=…
(below 1: the best variant's step is that much shorter). Why these
variants: docs/gpu.md, *Where the ViT-L/16 train step's time goes*.
"""


import argparse
import contextlib
import functools
import statistics
import time
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

# The race's sizes and preprocessing (benchmarks/, beside this file).
from gpu_throughput import (IMAGE_SIZE, MODELS, NUM_CLASSES, inference_program,
                            library_compiler_options, preprocess)
from vit_jax.kernels import attention, gelu_matmul, matmuls
from vit_jax.model import self_attention, variants
from vit_jax.runtime import sharding
from vit_jax.training import optim, steps


class Variant(NamedTuple):
  """One compilation: XLA debug options and the model it compiles."""
  options: dict
  attention: str = "auto"  # config.model.attention_implementation
  # The Dense layers that take JAX's own gradients (training only) in
  # place of vit_jax's backward passes: "dense" (`matmuls`: the
  # attention's projections, the patch embedding, the head) and "mlp"
  # (`gelu_matmul.mlp`: its two layers, the GELU's output kept for the
  # backward pass rather than recomputed).
  jax_gradients: tuple[str, ...] = ()
  # False: cuDNN's attention on the odd token counts themselves, which its
  # forward pass takes (inference only; attention.dot_product_attention).
  pad_for_cudnn: bool = True
  # True: q, k and v for cuDNN from one product, padded and cut apart
  # (`_padded_queries_keys_values_fused`).
  projections_fused: bool = False
  # True (training only): the MLP's backward pass reads the GELU's output
  # kept from the forward pass, not recomputed (`_mlp_keeping_gelu`).
  mlp_keeps_gelu: bool = False

  def trains_only(self) -> bool:
    return bool(self.jax_gradients) or self.mlp_keeps_gelu

  def infers_only(self) -> bool:
    return not self.pad_for_cudnn


VARIANTS = {
    "as is": Variant({}),
    # XLA's Triton GEMM fusions for the products it would give them, where
    # vit_jax's steps take cuBLAS (`xla_products.xla_compiler_options`).
    "Triton GEMMs": Variant({"xla_gpu_enable_triton_gemm": True}),
    # cuDNN's LayerNorm kernels for XLA's LayerNorm reductions.
    "cuDNN LayerNorm": Variant({"xla_gpu_enable_cudnn_layer_norm": True}),
    # cuDNN's GEMM fusions (a product with its elementwise neighbours).
    "cuDNN GEMM fusions": Variant({"xla_gpu_cudnn_gemm_fusion_level": 2}),
    "cuBLASLt": Variant({"xla_gpu_enable_cublaslt": True}),
    # What cuDNN's flash attention buys over the einsums.
    "einsum attention": Variant({}, attention="einsum"),
    # What the CPU-tuned backward passes cost or save on a GPU, where
    # memory is plentiful and cuBLAS takes either orientation.
    "JAX's matmul gradients": Variant({}, jax_gradients=("dense", "mlp")),
    # ... split in two: the 2026-12-04 H200 run found the whole 4% faster
    # with 8.7 GiB more scratch (docs/gpu.md); which part pays for which?
    "JAX's gradients outside the MLP": Variant({}, jax_gradients=("dense",)),
    "JAX's MLP gradients": Variant({}, jax_gradients=("mlp",)),
    # The 2026-12-04 second run: JAX's MLP gradients trained 2.8% faster for
    # 8.7 GiB more scratch (the GELU's output and its tanh kept). Keeping
    # the output alone (~4.6 GiB at ViT-L/16, batch 128) spares the
    # recomputation's pass over the hidden layer, which may be all of it.
    "MLP keeps the GELU's output": Variant({}, mlp_keeps_gelu=True),
    # The padded token and cuDNN's padding mask, where nothing needs them.
    "unpadded cuDNN attention": Variant({}, pad_for_cudnn=False),
    # The model's path until the 2026-12-04 H200 run, where cutting k and v
    # out of the fused product, padded for cuDNN, took 153 us a block of
    # ViT-L/16's 65 ms forward pass; three products of the tokens padded
    # once inferred 3-7% faster and trained level (docs/gpu.md).
    "q/k/v fused": Variant({}, projections_fused=True),
}


def _padded_queries_keys_values_fused(self, x, projections,
                                      num_query_tokens, fused, products):
  """`MultiHeadSelfAttention._padded_queries_keys_values` as it was up to
  2026-12-04: q, k and v from one product (k and v from one where only
  some tokens query), its output padded to an even token count and cut
  apart."""
  def padded_and_split(tokens, names):
    stacked = self._project(  # pylint: disable=protected-access
        tokens, [projections[name] for name in names], products)
    return self._split(attention.pad_to_even(stacked), fused)  # pylint: disable=protected-access
  if num_query_tokens is None:
    return padded_and_split(x, ("query", "key", "value"))
  return (padded_and_split(x[:, :num_query_tokens], ("query",)) +
          padded_and_split(x, ("key", "value")))


def _jax_dense_dot_general(inputs, kernel, dimension_numbers, precision=None,
                           preferred_element_type=None, operand_dtype=None,
                           implementation="xla"):
  """`matmuls.dense_dot_general` without its backward pass (and with XLA's
  products wherever it runs)."""
  del implementation
  assert operand_dtype is None, "a GPU step computes in its dtype"
  return jax.lax.dot_general(inputs, kernel, dimension_numbers,
                             precision=precision,
                             preferred_element_type=preferred_element_type)


def _jax_mlp(inputs, kernel0, bias0, kernel1, approximate=True,
             operand_dtype=None, implementation="xla"):
  """`gelu_matmul.mlp` without its backward pass."""
  del implementation
  assert operand_dtype is None, "a GPU step computes in its dtype"
  hidden = inputs @ kernel0
  return nn.gelu(hidden + bias0, approximate=approximate) @ kernel1


def _mlp_keeping_gelu(inputs, kernel0, bias0, kernel1, approximate=True,
                      operand_dtype=None, implementation="xla"):
  """`gelu_matmul.mlp` whose backward pass reads the GELU's output kept
  from the forward pass (for the second layer's kernel gradient) where
  vit_jax's recomputes it from the hidden layer; the GELU's derivative is
  computed from the hidden layer, as there."""
  del implementation
  assert operand_dtype is None, "a GPU step computes in its dtype"
  return _mlp_kept(inputs, kernel0, bias0, kernel1, approximate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mlp_kept(inputs, kernel0, bias0, kernel1, approximate):
  return _jax_mlp(inputs, kernel0, bias0, kernel1, approximate)


def _mlp_kept_forward(inputs, kernel0, bias0, kernel1, approximate):
  hidden = inputs @ kernel0
  activations = nn.gelu(hidden + bias0, approximate=approximate)
  return activations @ kernel1, (inputs, kernel0, hidden, bias0,
                                 activations, kernel1)


def _mlp_kept_backward(approximate, residuals, output_grad):
  inputs, kernel0, hidden, bias0, activations, kernel1 = residuals
  rows = lambda array: array.reshape(-1, array.shape[-1])
  kernel1_grad = rows(activations).T @ rows(output_grad)
  _, gelu_vjp = jax.vjp(
      lambda h, b: nn.gelu(h + b, approximate=approximate), hidden, bias0)
  hidden_grad, bias0_grad = gelu_vjp(output_grad @ kernel1.T)
  kernel0_grad = rows(inputs).T @ rows(hidden_grad)
  return hidden_grad @ kernel0.T, kernel0_grad, bias0_grad, kernel1_grad


_mlp_kept.defvjp(_mlp_kept_forward, _mlp_kept_backward)


@contextlib.contextmanager
def model_paths(variant: Variant):
  """While active (around tracing), the model's Dense layers take the
  variant's matmul gradients (`Variant.jax_gradients`, or the MLP's with
  the GELU's output kept), its attention pads for cuDNN or not, and takes
  q, k and v from one product or three."""
  attention_module = self_attention.MultiHeadSelfAttention
  real = (matmuls.dense_dot_general, gelu_matmul.mlp,
          attention.needs_even_tokens,
          attention_module._padded_queries_keys_values)  # pylint: disable=protected-access
  if "dense" in variant.jax_gradients:
    matmuls.dense_dot_general = _jax_dense_dot_general
  if "mlp" in variant.jax_gradients:
    gelu_matmul.mlp = _jax_mlp
  if variant.mlp_keeps_gelu:
    gelu_matmul.mlp = _mlp_keeping_gelu
  if not variant.pad_for_cudnn:
    attention.needs_even_tokens = lambda implementation: False
  if variant.projections_fused:
    attention_module._padded_queries_keys_values = (  # pylint: disable=protected-access
        _padded_queries_keys_values_fused)
  jax.clear_caches()  # jit caches traced blocks: none may serve across
  try:
    yield
  finally:
    (matmuls.dense_dot_general, gelu_matmul.mlp,
     attention.needs_even_tokens,
     attention_module._padded_queries_keys_values) = real  # pylint: disable=protected-access
    jax.clear_caches()


def _program(model_name: str, attention: str, mode: str, images, labels,
             num_layers: Optional[int] = None):
  """(the jitted program, its arguments): the model's train step (no
  donation: every variant steps from the same state) with (state, images,
  labels), or its bfloat16 forward pass with (params, images). num_layers:
  the model's, unless given."""
  model_config = variants.get_variant(model_name)
  model_config.dtype = "bfloat16"
  model_config.num_layers = num_layers or model_config.num_layers
  model_config.attention_implementation = attention
  model = variants.build_model(model_config, NUM_CLASSES)
  if mode == "infer":
    forward, params = inference_program(model)
    return forward, (params, images)
  state = steps.create_train_state(
      model, (IMAGE_SIZE, IMAGE_SIZE, 3),
      optim.adamw(1e-3, weight_decay=0.05), 0, sharding.make_mesh())
  step = jax.jit(functools.partial(
      steps.train_step, preprocess=preprocess, label_smoothing=0.0,
      learning_rate_fn=lambda _: 1e-3),
      compiler_options=library_compiler_options(model))
  return step, (state, images, labels)


def _compile(program, arguments, variant: Variant):
  start = time.perf_counter()
  with model_paths(variant):
    lowered = program.lower(*arguments)
  compiled = lowered.compile(compiler_options=variant.options)
  return compiled, time.perf_counter() - start


def _compile_all(chosen: list[str], args, images, labels) -> dict:
  """{variant name: (compiled, arguments, compile s)} for those that
  compile; one model (and train state) per attention implementation."""
  programs, compiled_variants = {}, {}
  for name in chosen:
    variant = VARIANTS[name]
    if variant.attention not in programs:
      programs[variant.attention] = _program(args.model, variant.attention,
                                             args.mode, images, labels,
                                             args.num_layers)
    program, arguments = programs[variant.attention]
    try:
      compiled, seconds = _compile(program, arguments, variant)
    except Exception as error:  # pylint: disable=broad-except
      print(f"{name}: failed to compile: {str(error)[:300]}")
      continue
    compiled_variants[name] = (compiled, arguments, seconds)
    print(f"{name}: compiled in {seconds:.1f} s", flush=True)
  return compiled_variants


def _timed_round(compiled, arguments, num_steps: int) -> float:
  """Seconds per step of num_steps steps run back to back."""
  jax.block_until_ready(compiled(*arguments))  # warm, and after a switch
  start = time.perf_counter()
  for _ in range(num_steps):  # only the last output kept: one new state
    output = compiled(*arguments)
  jax.block_until_ready(output)
  return (time.perf_counter() - start) / num_steps


def _scratch_mib(compiled) -> float:
  memory = compiled.memory_analysis()
  return memory.temp_size_in_bytes / 2**20 if memory else float("nan")


def _parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="ViT-L/16")
  parser.add_argument("--mode", choices=("train", "infer"), default="train")
  parser.add_argument("--batch", type=int,
                      help="default: gpu_throughput.py's for the model and "
                      "mode (ViT-L/16: 128 train, 256 infer)")
  parser.add_argument("--num_layers", type=int,
                      help="fewer layers than the model's, for a quick check "
                      "of the script")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="comma-separated names from VARIANTS; 'as is' "
                      "always runs; those for the other mode are left out")
  args = parser.parse_args()
  unknown = set(args.variants.split(",")) - set(VARIANTS)
  if unknown:
    parser.error(f"unknown variants {sorted(unknown)}; choose from "
                 f"{list(VARIANTS)}")
  if args.batch is None:
    train_batch, infer_batch = MODELS.get(args.model, (128, 256))
    args.batch = train_batch if args.mode == "train" else infer_batch
  return args


def main():
  args = _parse_args()
  chosen = [name for name, variant in VARIANTS.items()
            if (name == "as is" or name in args.variants.split(","))
            and not (variant.trains_only() if args.mode == "infer"
                     else variant.infers_only())]
  layers = f" --num_layers={args.num_layers}" if args.num_layers else ""
  print(f"Command: python benchmarks/gpu_flags.py --model={args.model} "
        f"--mode={args.mode} --batch={args.batch}{layers} "
        f"--rounds={args.rounds} --steps={args.steps} "
        f"--variants=\"{args.variants}\"")
  print(f"Device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
  key = jax.random.PRNGKey(0)
  images = jax.random.randint(key, (args.batch, IMAGE_SIZE, IMAGE_SIZE, 3),
                              0, 256).astype(jnp.uint8)
  labels = jax.random.randint(key, (args.batch,), 0, NUM_CLASSES)
  programs = _compile_all(chosen, args, images, labels)
  times = {name: [] for name in programs}
  for _ in range(args.rounds):
    for name, (compiled, arguments, _) in programs.items():
      times[name].append(_timed_round(compiled, arguments, args.steps))
  base = statistics.median(times["as is"])
  print("\n| variant | ms a step (median) | images/s | vs as is | "
        "compile s | scratch MiB |")
  print("|---|---:|---:|---:|---:|---:|")
  for name, rounds in times.items():
    median = statistics.median(rounds)
    compiled, _, seconds = programs[name]
    print(f"| {name} | {1e3 * median:.1f} | {args.batch / median:.0f} | "
          f"{base / median:.3f} | {seconds:.1f} | "
          f"{_scratch_mib(compiled):.0f} |")
  best = min(times, key=lambda name: statistics.median(times[name]))
  print(f"summary: best=\"{best}\" best_over_as_is="
        f"{statistics.median(times[best]) / base:.3f}")


if __name__ == "__main__":
  main()
