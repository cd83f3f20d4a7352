"""The attention core softmax(Q K^T) V as a C++ kernel for XLA:CPU.

Why: on XLA:CPU the core's batched products (head_dim 64, T = 197) ran at
less than half the rate of the model's dense layers, and the core took 21%
of a ViT-Ti/16 @224 train step for 15% of its FLOPs
(docs/throughput_runs.md, runs 17-19); with this kernel the step is ~10%
faster (docs/performance.md, *The attention core as a C++ kernel*).
`csrc/attention_cpu.cc` computes the forward pass and the gradient one
(batch, head) pair at a time, with its operands in L2, register-blocked
products and a vectorised softmax, and keeps the probabilities for the
backward pass as the einsums do.

The kernel is compiled from source with the system's C++ compiler (`$CXX`,
else `c++`) the first time it is needed on a machine, for that machine's CPU
(-march=native on x86, -mcpu=native on Arm), and cached under
`$VIT_JAX_CACHE_DIR` (default ~/.cache/vit_jax). Without a compiler, or if
the build fails, `problem` says why and the model takes its einsums
("auto") or raises ("cpu_kernel").

`attention_core` is differentiable and shards over batch and heads: under
`jax.jit` with a batch-split mesh each device runs the kernel on its own
part, with no gathering (`_primitive`).
"""

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import batching, mlir

SOURCE = pathlib.Path(__file__).parent / "csrc" / "attention_cpu.cc"
_FLAGS = ("-O3", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC",
          "-w")
# The instruction set the kernel is compiled for: this CPU's by default;
# e.g. "x86-64-v3" (AVX2 + FMA) to measure what an AVX2-only CPU would run
# (benchmarks/throughput.py --max_isa=avx2), or for a cache shared by CPUs
# of several kinds.
MARCH_VARIABLE = "VIT_JAX_KERNEL_MARCH"
_TARGETS = ("VitAttentionForwardForTraining",
            "VitAttentionForwardForInference", "VitAttentionBackward")
LANES = 16  # the kernel's vector width in floats: head_dim must divide by it


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(
      "VIT_JAX_CACHE_DIR", pathlib.Path.home() / ".cache" / "vit_jax"))


def _cpu_signature() -> str:
  """What -march=native compiles for: the CPU's model and feature flags."""
  try:
    with open("/proc/cpuinfo") as cpuinfo:
      lines = [line for line in cpuinfo
               if line.startswith(("model name", "flags", "Features"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def target_flags() -> list[tuple[str, ...]]:
  """The flags that pick the kernel's instruction set, to try in turn."""
  if os.environ.get(MARCH_VARIABLE):
    return [(f"-march={os.environ[MARCH_VARIABLE]}",)]
  if platform.machine().lower() in ("arm64", "aarch64"):
    # Arm's compilers take the CPU as -mcpu (clang before 15 rejects
    # -march=native there). Every 64-bit Arm core has NEON, whose 4-float
    # vectors the kernel uses, so a build without the flag runs it too.
    return [("-mcpu=native",), ()]
  return [("-march=native",)]


def _library_path(compiler: str, flags: tuple[str, ...]) -> pathlib.Path:
  """Where the kernel built by compiler with flags is cached: one file per
  source, compiler, flags, JAX and CPU."""
  key = hashlib.sha256("\0".join(
      [SOURCE.read_text(), compiler, *flags, jax.ffi.include_dir(),
       jax.__version__, platform.machine(), _cpu_signature()]).encode()
                      ).hexdigest()[:16]
  return cache_dir() / f"attention_cpu-{key}.so"


def build(compiler: Optional[str] = None) -> pathlib.Path:
  """The kernel's shared library, compiled now unless cached: with the
  first of `target_flags` that the compiler takes. Raises RuntimeError
  naming the problem if it cannot be built."""
  compiler = compiler or os.environ.get("CXX", "c++")
  if shutil.which(compiler) is None:
    raise RuntimeError(f"no C++ compiler {compiler!r} on PATH (set CXX or "
                       "install g++ or clang++)")
  flag_sets = [(*_FLAGS, *target) for target in target_flags()]
  libraries = [_library_path(compiler, flags) for flags in flag_sets]
  cached = [library for library in libraries if library.exists()]
  if cached:
    return cached[0]
  failures = []
  for flags, library in zip(flag_sets, libraries):
    try:
      return _compile(compiler, flags, library)
    except RuntimeError as error:
      failures.append(str(error))
  raise RuntimeError("\n".join(failures))


def _compile(compiler: str, flags: tuple[str, ...],
             library: pathlib.Path) -> pathlib.Path:
  """Compiles the kernel into library; RuntimeError with the compiler's
  message if it fails."""
  library.parent.mkdir(parents=True, exist_ok=True)
  # Built beside its final name and renamed into place: a concurrent
  # process (another host of a job) never loads a half-written file.
  handle, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
  os.close(handle)
  try:
    result = subprocess.run(
        [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o",
         partial], capture_output=True, text=True, check=False)
    if result.returncode:
      raise RuntimeError(f"{compiler} failed to build {SOURCE.name}:\n"
                         f"{result.stderr[-2000:]}")
    os.replace(partial, library)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return library


@functools.cache
def _load() -> Optional[str]:
  """Builds and registers the kernel once per process; the problem, or
  None when it is ready."""
  try:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target in _TARGETS:
      jax.ffi.register_ffi_target(
          target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
      jax.ffi.register_ffi_target_as_batch_partitionable(target)
  except (RuntimeError, OSError, AttributeError) as error:
    logging.warning("vit_jax: the CPU attention kernel is unavailable, the "
                    "einsums run instead: %s", error)
    return f"its C++ kernel could not be built or loaded: {error}"
  return None


def problem(dtype: Any, head_dim: int, device: Any = None) -> Optional[str]:
  """Why the kernel cannot run this attention on `device` (default: JAX's
  first device), or None if it can. Builds the kernel on first use."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "cpu":
    return f"it runs on CPUs, and this device is {device.platform!r}"
  if jnp.dtype(dtype) != jnp.float32:
    return (f"it computes in float32, and the model computes in "
            f"{jnp.dtype(dtype).name} (config.model.dtype)")
  if head_dim % LANES:
    return (f"it needs head_dim (hidden_size / num_heads) a multiple of "
            f"{LANES}, and it is {head_dim}")
  return _load()


def padded_keys(num_keys: int) -> int:
  """The kernel's probabilities rows: num_keys rounded up to whole
  vectors."""
  return -(-num_keys // LANES) * LANES


def _primitive(target: str, results) -> core.Primitive:
  """A primitive calling `target` on (B, H, ...) float32 arrays; results(
  *operand avals) gives its result (shape, dtype) pairs.

  Its custom call is declared batch-partitionable over B and H, with the
  other axes whole: a Shardy sharding rule and the `num_batch_dims`
  attribute that JAX's own linear-algebra calls carry, for a target that
  `_load` registers as batch-partitionable. Under a batch-split mesh each
  device then runs the kernel on its part, where the partitioner would
  gather a plain `jax.ffi.ffi_call` onto every device.
  """
  primitive = core.Primitive(target)
  primitive.multiple_results = True
  # Outside jit: compiled on its own, as jnp's operations are.
  primitive.def_impl(jax.jit(lambda *operands: primitive.bind(*operands)))
  primitive.def_abstract_eval(lambda *avals: [
      jax.core.ShapedArray(shape, dtype) for shape, dtype in results(*avals)])

  def lowering(ctx, *operands):
    attributes = {"mhlo.frontend_attributes": mlir.ir.DictAttr.get(
        {"num_batch_dims": mlir.ir.StringAttr.get("2")})}
    if jax.config.jax_use_shardy_partitioner:
      attributes["sdy.sharding_rule"] = mlir.ir.Attribute.parse(
          _sharding_rule(ctx.avals_in, ctx.avals_out))
    return jax.ffi.ffi_lowering(target, extra_attributes=attributes)(
        ctx, *operands)

  def batch_rule(operands, axes):
    # Under jax.vmap the mapped axis joins the batch axis: one call.
    size = next(operand.shape[axis] for operand, axis in zip(operands, axes)
                if axis is not None)
    merged = []
    for operand, axis in zip(operands, axes):
      operand = (jnp.broadcast_to(operand, (size, *operand.shape))
                 if axis is None  # not mapped
                 else jnp.moveaxis(operand, axis, 0))
      merged.append(operand.reshape(-1, *operand.shape[2:]))
    results = primitive.bind(*merged)
    return ([result.reshape(size, -1, *result.shape[1:])
             for result in results], [0] * len(results))

  batching.primitive_batchers[primitive] = batch_rule
  mlir.register_lowering(primitive, lowering, platform="cpu")
  return primitive


def _factor_name(index: int) -> str:
  """Shardy's factor names: i, j, ..., z, then z_1, z_2, ..."""
  return chr(ord("i") + index) if index < 18 else f"z_{index - 17}"


def _sharding_rule(avals_in, avals_out) -> str:
  """Shardy's rule for the kernel: axes 0 and 1 (batch, heads) shared by
  every operand and result; every other axis its own factor, which XLA's
  partitioner keeps whole for a call with `num_batch_dims` (declaring them
  need_replication instead made it gather the batch too)."""
  sizes = [avals_in[0].shape[0], avals_in[0].shape[1]]

  def factors(aval):
    names = [_factor_name(0), _factor_name(1)]
    for size in aval.shape[2:]:
      names.append(_factor_name(len(sizes)))
      sizes.append(size)
    return "[" + ", ".join(names) + "]"

  operands = ", ".join(factors(aval) for aval in avals_in)
  results = ", ".join(factors(aval) for aval in avals_out)
  size_list = ", ".join(f"{_factor_name(index)}={size}"
                        for index, size in enumerate(sizes))
  return (f"#sdy.op_sharding_rule<({operands})->({results}) {{{size_list}}}, "
          "custom>")


def _same(*avals):
  return [(aval.shape, aval.dtype) for aval in avals]


_inference = _primitive(_TARGETS[1], lambda query, key, value: _same(query))
_training = _primitive(_TARGETS[0], lambda query, key, value: [
    (query.shape, query.dtype),
    (query.shape[:3] + (padded_keys(key.shape[2]),), query.dtype)])
_gradient = _primitive(_TARGETS[2], lambda query, key, value, *_: _same(
    query, key, value))


@jax.custom_vjp
def attention_core(query: jax.Array, key: jax.Array, value: jax.Array
                   ) -> jax.Array:
  """softmax(query key^T) value over the last two axes, float32 on CPU.

  query (B, heads, Tq, head_dim), already scaled by 1/sqrt(head_dim); key
  and value (B, heads, Tk, head_dim). Returns (B, heads, Tq, head_dim).
  Needs `problem(...)` to be None.
  """
  (output,) = _inference.bind(query, key, value)
  return output


def _core_forward(query, key, value):
  output, probabilities = _training.bind(query, key, value)
  return output, (query, key, value, probabilities)


def _core_backward(residuals, output_grad):
  return tuple(_gradient.bind(*residuals, output_grad))


attention_core.defvjp(_core_forward, _core_backward)
