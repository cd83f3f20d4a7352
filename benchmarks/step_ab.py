r"""Two variants of vit_jax's train step, side by side in one process.

  python benchmarks/step_ab.py --b='{"attention_implementation": "xla"}'
  python benchmarks/step_ab.py --model=vit_tiny_cifar --a_softmax=jax.nn
  python benchmarks/step_ab.py --cpu_devices=0 --pairs=20
  python benchmarks/step_ab.py --a_kernel_gradient=jax --pairs=20
  python benchmarks/step_ab.py --a='{"matmul_dtype": "bfloat16"}' \
      --b='{"matmul_dtype": "bfloat16"}' --a_kernel_gradient=xla
  python benchmarks/step_ab.py --b_attention_core=elementwise
  python benchmarks/step_ab.py --a='{"matmul_dtype": "bfloat16"}' \
      --b='{"matmul_dtype": "bfloat16"}' --a_attention_core=float32_kernel
  python benchmarks/step_ab.py --b_free=kernel_gradients
  python benchmarks/step_ab.py --b='{"attention_implementation": "einsum"}'
  python benchmarks/step_ab.py --a='{"matmul_implementation": "xla"}'
  python benchmarks/step_ab.py \
      --b_xla_options='{"xla_cpu_prefer_vector_width": 512}'
  python benchmarks/step_ab.py --model=vit_tiny_cifar --batch=1 \
      --a_xla_options='{"xla_cpu_experimental_ynn_fusion_type": ""}'

Compiles the train step of benchmarks/throughput.py's vit_jax worker (same
dims, batch unless --batch, AdamW, a device per core unless --cpu_devices
says otherwise, or the batch does not split over them)
for two variants of the model, A and B, each a JSON dict of
`vit.VisionTransformer` fields over those dims, then steps them
alternately (A B, B A, A B, ...). Fresh processes differ by 8-15% on these
machines; alternating steps in one process see the same machine state, so a
difference of a few percent shows. --a_softmax / --b_softmax pick the
einsum attention's softmax: "ours" (`attention.softmax`, which keeps only
its output for the backward pass) or "jax.nn" (`jax.nn.softmax`).
--a_kernel_gradient / --b_kernel_gradient pick how the Dense layers'
backward pass computes the kernels' gradients: "ours"
(`xla_products.kernel_gradient`, the narrower side as the product's rows) or
"jax" (output_grad^T @ inputs, transposed, as JAX's transpose rule does)
or "xla" (`xla_products.xla_kernel_gradient`: with bfloat16 products, the
weight gradient widened to float32 by XLA, as before it went to YNNPACK).
--a_attention_core / --b_attention_core pick the attention core (the
logits product, the softmax and the weighted sum of values): "xla", the
model's, or "elementwise", q * k + v in its place (`elementwise_core`), the
projections and their gradients kept: what the step would take with a core
that cost nothing, the most a faster attention kernel could win; or
"float32_kernel", the C++ kernel's products in float32 even where the
model's products are bfloat16 (`float32_attention_kernel`). A softmax
other than "ours" and the elementwise core replace parts of the einsums,
so they set attention_implementation to "einsum" unless the variant's
fields name one (by default the model runs the C++ attention kernel on a
CPU: `--b='{"attention_implementation": "einsum"}'` compares the two).
A kernel gradient other than "ours" and the free kernel gradients replace
XLA's products, so they set matmul_implementation to "xla" unless the
variant's fields name one (by default the model runs float32 products on
a CPU in oneDNN: `--a='{"matmul_implementation": "xla"}'` compares).
--a_xla_options / --b_xla_options add XLA options (a JSON dict) to the
variant's program, over those the model's matmul_dtype asks for
(`xla_products.xla_compiler_options`). --a_free / --b_free make one part of
the step nearly free, the data flow around it kept (`free_part`):
"kernel_gradients" (each Dense kernel's gradient from 16 rows instead of
all), "gelu" (the identity in its place, the bias kept), "layer_norm" (its
scale and offset without the statistics, in the place of Flax's LayerNorm:
it sets layer_norm_implementation to "xla" unless the variant's fields
name one): the most a faster kernel for
that part could win. Like the elementwise core, they only measure: the
outputs are not the model's.

Prints each variant's XLA scratch (temp) per device, compile seconds and
median step, then
  summary: b_over_a_step=… a_temp_mib=… b_temp_mib=…
where b_over_a_step is the median over pairs of B's step time over A's
(below 1: B is faster). Like main.py it restarts itself once with a faster
malloc (vit_jax/runtime/host.py).
"""

import contextlib
import json
import statistics
import sys
import time
from typing import Any

from absl import app, flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import race_report  # this folder's: which vit_jax the step is of
import race_workers  # this folder's: the worker's model, dims and batch
from vit_jax.kernels import attention, cpu_attention, gelu_matmul, xla_products
from vit_jax.model import vit
from vit_jax.runtime import host, sharding
from vit_jax.training import optim, steps

OUR_SOFTMAX = attention.softmax
OUR_KERNEL_GRADIENT = xla_products.kernel_gradient
# The attention core's two products in self_attention.MultiHeadSelfAttention.
LOGITS_SPEC, WEIGHTED_SUM_SPEC = "bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd"


def jax_kernel_gradient(inputs, output_grad, precision=None,
                        operand_dtype=None):
  """inputs^T @ output_grad the way JAX's transpose of a matmul writes it:
  output_grad^T @ inputs, transposed (operands rounded to operand_dtype,
  if given, as `xla_products.kernel_gradient` rounds them)."""
  rounded = lambda x: x if operand_dtype is None else x.astype(operand_dtype)
  return jax.lax.dot_general(
      rounded(output_grad.astype(inputs.dtype)), rounded(inputs),
      (((0,), (0,)), ((), ())), precision=precision,
      preferred_element_type=inputs.dtype).T


KERNEL_GRADIENTS = {"ours": OUR_KERNEL_GRADIENT, "jax": jax_kernel_gradient,
                    "xla": xla_products.xla_kernel_gradient}


@contextlib.contextmanager
def elementwise_core():
  """While active (around tracing), the model's attention core is q * k + v.

  jnp.einsum passes every other contraction through; the logits product
  returns the queries, the softmax is the identity, and the weighted sum
  returns queries * keys + values (for the queries' tokens), so no
  (B, heads, T, T) array or batched matmul is left while q, k and v and
  their gradients are. Only a measuring device: the outputs are not
  attention.
  """
  real_einsum, real_softmax = jnp.einsum, attention.softmax
  keys = []  # the logits product's keys, for the weighted sum after it

  def einsum(spec, *operands, **kwargs):
    if spec == LOGITS_SPEC:
      query, key = operands
      keys.append(key)
      return query
    if spec == WEIGHTED_SUM_SPEC:
      query, value = operands
      num_queries = query.shape[2]
      return (query * keys.pop()[:, :, :num_queries]
              + value[:, :, :num_queries])
    return real_einsum(spec, *operands, **kwargs)

  # jit caches traced blocks: none traced before may serve inside, and
  # none traced inside may serve after.
  jax.clear_caches()
  jnp.einsum, attention.softmax = einsum, lambda logits: logits
  try:
    yield
  finally:
    jnp.einsum, attention.softmax = real_einsum, real_softmax
    jax.clear_caches()


@contextlib.contextmanager
def float32_attention_kernel():
  """While active (around tracing), the C++ attention kernel's products
  stay float32 whatever the model's matmul_dtype (as before they took
  bfloat16 operands with it)."""
  real = cpu_attention.self_attention, cpu_attention.query_attention
  jax.clear_caches()  # as in elementwise_core
  cpu_attention.self_attention = (
      lambda projections, bias, scale, operand_dtype=None: real[0](
          projections, bias, scale))
  cpu_attention.query_attention = (
      lambda query, keys_values, bias, scale, operand_dtype=None: real[1](
          query, keys_values, bias, scale))
  try:
    yield
  finally:
    cpu_attention.self_attention, cpu_attention.query_attention = real
    jax.clear_caches()


class ScaleAndOffset(nn.Module):
  """In flax.linen.LayerNorm's place: its parameters (same names, shapes
  and initialisers) applied without normalising (`free_part`)."""
  epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    features = (x.shape[-1],)
    scale = self.param("scale", nn.initializers.ones, features,
                       self.param_dtype)
    offset = self.param("bias", nn.initializers.zeros, features,
                        self.param_dtype)
    return x * scale + offset


def _kernel_gradient_of_16_rows(inputs, output_grad, precision=None,
                                operand_dtype=None):
  """A kernel's gradient (K, N) from the first 16 of the rows: the same
  shape, operands and dependencies as `xla_products.kernel_gradient`'s, at a
  200th of its work for ViT-Ti/16 @224."""
  del operand_dtype
  return jax.lax.dot_general(inputs[:16], output_grad[:16].astype(
      inputs.dtype), (((0,), (0,)), ((), ())), precision=precision)


@contextlib.contextmanager
def free_part(part: str):
  """While active (around tracing), `part` of the model costs almost
  nothing (the module docstring's --a_free); "none" changes nothing."""
  saved = (xla_products.kernel_gradient, nn.gelu, nn.LayerNorm,
           gelu_matmul._takes_gelu_kernel)  # pylint: disable=protected-access
  jax.clear_caches()  # as in elementwise_core
  if part == "kernel_gradients":
    xla_products.kernel_gradient = _kernel_gradient_of_16_rows
  elif part == "gelu":
    nn.gelu = lambda x, approximate=True: x
    # Flax's GELU, not the C++ one between oneDNN's products.
    gelu_matmul._takes_gelu_kernel = lambda *_: False  # pylint: disable=protected-access
  elif part == "layer_norm":
    nn.LayerNorm = ScaleAndOffset
  try:
    yield
  finally:
    (xla_products.kernel_gradient, nn.gelu, nn.LayerNorm,
     gelu_matmul._takes_gelu_kernel) = saved  # pylint: disable=protected-access
    jax.clear_caches()


_MODEL = flags.DEFINE_enum("model", "ViT-Ti/16@224",
                           list(race_workers.MODELS),
                           "Workload, as in benchmarks/throughput.py.")
_A = flags.DEFINE_string("a", "{}", "Variant A's model fields (JSON).")
_B = flags.DEFINE_string("b", "{}", "Variant B's model fields (JSON).")


def _define_per_variant(name: str, choices: list[str], what: str) -> dict:
  """--a_<name> and --b_<name>, defaulting to choices[0]: {"A": flag,
  "B": flag}."""
  return {variant: flags.DEFINE_enum(f"{variant.lower()}_{name}", choices[0],
                                     choices, f"Variant {variant}'s {what}.")
          for variant in "AB"}


_SOFTMAX = _define_per_variant("softmax", ["ours", "jax.nn"],
                               "attention softmax")
_KERNEL_GRADIENT = _define_per_variant(
    "kernel_gradient", list(KERNEL_GRADIENTS), "Dense kernel gradients")
_ATTENTION_CORE = _define_per_variant("attention_core",
                                      ["xla", "elementwise", "float32_kernel"],
                                      "attention core")
_FREE = _define_per_variant(
    "free", ["none", "kernel_gradients", "gelu", "layer_norm"],
    "part of the step made nearly free")
_XLA_OPTIONS = {variant: flags.DEFINE_string(
    f"{variant.lower()}_xla_options", "{}",
    f"Variant {variant}'s extra XLA compiler options (JSON).")
                for variant in "AB"}
_PAIRS = flags.DEFINE_integer("pairs", 14, "Timed steps of each variant.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", -1, "config.cpu_devices: -1 a device per core, 0 one.")
_BATCH = flags.DEFINE_integer(
    "batch", None, "The train step's batch in place of the race's (1: one "
    "image at a time, on one multi-threaded device as the race runs it).")


def compile_variant(fields: dict, softmax: str, kernel_gradient: str,
                    attention_core: str, xla_options: dict, free: str,
                    size: int, dims: dict, images, labels, mesh):
  """(compiled train step, its train state, seconds of trace + lowering +
  compilation) for one variant."""
  # The blocks are traced once and cached by jit: a new softmax or kernel
  # gradient needs a new trace.
  attention.softmax = (OUR_SOFTMAX if softmax == "ours"
                       else lambda logits: jax.nn.softmax(logits, axis=-1))
  xla_products.kernel_gradient = KERNEL_GRADIENTS[kernel_gradient]
  jax.clear_caches()
  if softmax != "ours" or attention_core == "elementwise":
    # Both replace parts of the einsums, which "auto" skips on a CPU with
    # the C++ kernel.
    fields = dict({"attention_implementation": "einsum"}, **fields)
  if kernel_gradient != "ours" or free == "kernel_gradients":
    # Both replace XLA's weight-gradient products, which "auto" replaces
    # with oneDNN's on a CPU where it loads.
    fields = dict({"matmul_implementation": "xla"}, **fields)
  if free == "layer_norm":  # replaces Flax's LayerNorm, not the C++ kernel
    fields = dict({"layer_norm_implementation": "xla"}, **fields)
  model = vit.VisionTransformer(num_classes=race_workers.NUM_CLASSES,
                                **dict(dims, **fields))
  state = steps.create_train_state(model, (size, size, 3), optim.adamw(
      1e-3, weight_decay=0.05), 0, mesh)
  # The trainer's options: YNNPACK's dots for bfloat16 products, and its
  # reductions beside the C++ kernels.
  step = race_workers.jit_train_step(dict(
      xla_products.xla_compiler_options(fields.get("matmul_dtype")) or {},
      **xla_options) or None)
  start = time.perf_counter()
  with contextlib.ExitStack() as patches:
    if attention_core == "elementwise":
      patches.enter_context(elementwise_core())
    if attention_core == "float32_kernel":
      patches.enter_context(float32_attention_kernel())
    patches.enter_context(free_part(free))
    lowered = step.trace(state, images, labels).lower()
  compiled = lowered.compile()
  return compiled, state, time.perf_counter() - start


def main(argv):
  del argv
  raced = race_workers.MODELS[_MODEL.value]
  size, batch = raced.image_size, _BATCH.value or raced.train_batch
  # Before JAX starts its backend (importing it does not).
  host.split_cpu_into_devices(_CPU_DEVICES.value, (batch,))
  mesh = sharding.make_mesh()
  rng = np.random.default_rng(0)
  images, labels = jax.device_put(
      (rng.integers(0, 256, (batch, size, size, 3), np.uint8),
       rng.integers(0, race_workers.NUM_CLASSES, batch).astype(np.int32)),
      sharding.batch_sharded(mesh))
  variants = {}
  settings = {name: (fields.value, _SOFTMAX[name].value,
                     _KERNEL_GRADIENT[name].value,
                     _ATTENTION_CORE[name].value, _XLA_OPTIONS[name].value,
                     _FREE[name].value)
              for name, fields in (("A", _A), ("B", _B))}
  for name, (fields, softmax, kernel_gradient, attention_core,
             xla_options, free) in settings.items():
    compiled, state, compile_s = compile_variant(
        json.loads(fields), softmax, kernel_gradient, attention_core,
        json.loads(xla_options), free, size, raced.dims(), images, labels,
        mesh)
    variants[name] = dict(compiled=compiled, state=state,
                          compile_s=compile_s, times=[],
                          temp_mib=compiled.memory_analysis()
                          .temp_size_in_bytes / 2**20)

  def step(variant):
    start = time.perf_counter()
    variant["state"], metrics = variant["compiled"](variant["state"],
                                                    images, labels)
    jax.block_until_ready(metrics)
    return time.perf_counter() - start

  for variant in variants.values():  # warm-up: first runs fault memory in
    step(variant)
  for pair in range(_PAIRS.value):
    order = "AB" if pair % 2 == 0 else "BA"
    for name in order:
      variants[name]["times"].append(step(variants[name]))

  print(f"\nCommand: python benchmarks/step_ab.py {' '.join(sys.argv[1:])}")
  print(race_report.code_line())
  print(f"{_MODEL.value}, batch {batch}, {len(jax.devices())} device(s)")
  for name, variant in variants.items():
    fields, softmax, kernel_gradient, attention_core, xla_options, free = (
        settings[name])
    print(f"{name}: {fields} softmax={softmax} kernel_gradient="
          f"{kernel_gradient} attention_core={attention_core} xla_options="
          f"{xla_options} free={free}: median step "
          f"{statistics.median(variant['times']):.3f} s, scratch "
          f"{variant['temp_mib']:.0f} MiB per device, compile "
          f"{variant['compile_s']:.1f} s")
  ratios = [b / a for a, b in zip(variants["A"]["times"],
                                  variants["B"]["times"])]
  print(f"summary: b_over_a_step={statistics.median(ratios):.3f} "
        f"a_temp_mib={variants['A']['temp_mib']:.0f} "
        f"b_temp_mib={variants['B']['temp_mib']:.0f}")


if __name__ == "__main__":
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  host.reexec_with_fast_malloc()
  app.run(main)
