"""vit_jax's C++ kernels for XLA:CPU: built, loaded, and bound as primitives.

The kernels (`csrc/*.cc`: the attention core in float32 and with bfloat16
operands, `cpu_attention.py`; the bfloat16 transpose, `cpu_transpose.py`;
the Dense layers' products through oneDNN, `cpu_gemm.py`; LayerNorm,
`cpu_layer_norm.py`; the MLP's GELU, `cpu_gelu.py`; AdamW's update,
`cpu_adamw.py`, and the gradients' sum of squares,
`cpu_sum_of_squares.py`; the headers they share) are XLA FFI handlers in one shared
library, compiled from source with the system's C++ compiler (`$CXX`, else
`c++`) the first time one is needed on a machine, for that machine's CPU
(-march=native on x86, -mcpu=native on Arm), and cached under
`$VIT_JAX_CACHE_DIR` (default ~/.cache/vit_jax). Without a compiler, or if
the build fails, `load` says why and each kernel's caller takes its XLA
path instead (or raises, where the user asked for the kernel).

`batch_partitionable` binds a handler as a JAX primitive that shards over
its leading axes: under `jax.jit` with a batch-split mesh each device runs
the kernel on its own part, with no gathering.

Where a device has several cores (one image at a time), a kernel splits a
call into tasks (its `tasks` attribute), on helper threads or XLA's own
(`helper_threads.py` says which and why).
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
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import batching, mlir

from vit_jax.runtime import cpu_info

_CSRC = pathlib.Path(__file__).parent / "csrc"
# The sources as two translation units, compiled at once where there are
# two cores (else as one): the attention kernels, which share most of
# their compile time (their handlers' templates: either alone took 6.4 s
# on a Zen 4 core, both 6.5 s), and the rest (7.5 s). The build took
# 7.6-7.8 s there as two units against 12.1-14.6 s as one.
UNITS = tuple(tuple(_CSRC / name for name in unit) for unit in (
    ("attention_cpu.cc", "attention_bf16_cpu.cc", "transpose_cpu.cc"),
    ("gemm_cpu.cc", "layer_norm_cpu.cc", "gelu_cpu.cc", "adamw_cpu.cc",
     "sum_of_squares_cpu.cc")))
SOURCES = sum(UNITS, ())
HEADERS = tuple(_CSRC / name for name in (
    "attention_core.h", "attention_handlers.h", "bf16_tiles.h",
    "helper_threads.h", "parallel_tasks.h", "side_by_side.h",
    "vector_transpose.h", "vectors.h"))
_FLAGS = ("-O3", "-ffp-contract=fast", "-std=c++17", "-fPIC", "-w")
# The instruction set the kernels are compiled for: this CPU's by default;
# e.g. "x86-64-v3" (AVX2 + FMA) to measure what an AVX2-only CPU would run
# (benchmarks/throughput.py --max_isa=avx2), or for a cache shared by CPUs
# of several kinds.
MARCH_VARIABLE = "VIT_JAX_KERNEL_MARCH"
TARGETS = (*(f"VitAttention{family}{handler}{suffix}"
             for family in ("Packed", "Split")
             for handler in ("ForTraining", "ForInference", "Backward")
             for suffix in ("", "Bf16")),
           "VitTransposeToBfloat16", "VitGemm", "VitGemmTransposedRight",
           "VitGemmOverRows", "VitGemmBf16", "VitGemmTransposedRightBf16",
           "VitGemmOverRowsBf16", "VitLayerNormForward", "VitLayerNormBackward",
           "VitGelu", "VitGeluBackward", "VitGeluBf16", "VitGeluBackwardBf16",
           "VitGeluBackwardRounded")
# Kernels on whole (replicated) operands, not split over a batch axis.
REPLICATED_TARGETS = ("VitAdamW", "VitSumOfSquares")


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(
      "VIT_JAX_CACHE_DIR", pathlib.Path.home() / ".cache" / "vit_jax"))


def _cpu_signature() -> str:
  """What -march=native compiles for: the CPU's model and feature flags.
  Where there are no flags to read (macOS), the model alone: an M1 sharing
  the cache must not load an M3's library, which may use instructions it
  lacks."""
  vendor, flags = cpu_info.cpu_features()
  return " ".join([cpu_info.cpu_model(), vendor, *sorted(flags)])


def target_flags() -> list[tuple[str, ...]]:
  """The flags that pick the kernels' instruction set, to try in turn."""
  if os.environ.get(MARCH_VARIABLE):
    return [(f"-march={os.environ[MARCH_VARIABLE]}",)]
  if platform.machine().lower() in ("arm64", "aarch64"):
    # Arm's compilers take the CPU as -mcpu (clang before 15 rejects
    # -march=native there). Every 64-bit Arm core has NEON, whose 4-float
    # vectors the kernels use, so a build without the flag runs them too.
    return [("-mcpu=native",), ()]
  return [("-march=native",)]


def _library_path(compiler: str, flags: tuple[str, ...]) -> pathlib.Path:
  """Where the library built by compiler with flags is cached: one file per
  sources, compiler, flags, JAX and CPU."""
  key = hashlib.sha256("\0".join(
      [*(source.read_text() for source in SOURCES + HEADERS), compiler,
       *flags,
       jax.ffi.include_dir(), jax.__version__, platform.machine(),
       _cpu_signature()]).encode()).hexdigest()[:16]
  return cache_dir() / f"cpu_kernels-{key}.so"


def build(compiler: Optional[str] = None) -> pathlib.Path:
  """The kernels' shared library, compiled now unless cached: with the
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


def translation_unit(sources: tuple[pathlib.Path, ...] = SOURCES) -> str:
  """The C++ text of one translation unit of `sources` (default: all). Why
  several sources a unit: XLA's FFI headers, most of a small source's
  compile time, are then parsed once (the build took 20 s this way against
  30 s source by source on an Intel Xeon)."""
  return "".join(f'#include "{source}"\n' for source in sources)


def _compile(compiler: str, flags: tuple[str, ...],
             library: pathlib.Path) -> pathlib.Path:
  """Compiles the kernels into library, a translation unit of `UNITS` a
  core at once, then links them; RuntimeError with the compiler's message
  if it fails. The sources of a unit share one unnamed namespace: their
  internal names must differ."""
  library.parent.mkdir(parents=True, exist_ok=True)
  units = (UNITS if cpu_info.cpu_cores() >= len(UNITS) else (SOURCES,))
  # Built in scratch beside its final name and renamed into place: a
  # concurrent process (another host of a job) never loads a half-written
  # file.
  with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
    objects, compiles = [], []
    for i, unit in enumerate(units):
      source = os.path.join(scratch, f"unit{i}.cc")
      with open(source, "w", encoding="utf-8") as f:
        f.write(translation_unit(unit))
      objects.append(os.path.join(scratch, f"unit{i}.o"))
      compiles.append(subprocess.Popen(
          [compiler, *flags, f"-I{jax.ffi.include_dir()}", "-c", source,
           "-o", objects[-1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True))
    errors = [process.communicate()[1] for process in compiles]  # all done
    for unit, process, message in zip(units, compiles, errors):
      _raise_if_failed(compiler, process.returncode, message, unit)
    partial = os.path.join(scratch, library.name)
    link = subprocess.run([compiler, "-shared", *objects, "-o", partial],
                          capture_output=True, text=True, check=False)
    _raise_if_failed(compiler, link.returncode, link.stderr, SOURCES)
    os.replace(partial, library)
  return library


def _raise_if_failed(compiler: str, returncode: int, errors: str,
                     sources: tuple[pathlib.Path, ...]) -> None:
  if returncode:
    raise RuntimeError(f"{compiler} failed to build the CPU kernels "
                       f"({', '.join(s.name for s in sources)}):\n"
                       f"{errors[-2000:]}")


@functools.cache
def library() -> ctypes.CDLL:
  """The kernels' library, built, loaded and its handlers registered once
  per process. Raises RuntimeError, OSError or AttributeError if it cannot
  be: `load` says so without raising."""
  loaded = ctypes.cdll.LoadLibrary(str(build()))
  for target in TARGETS + REPLICATED_TARGETS:
    jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(getattr(loaded, target)), platform="cpu")
    if target in TARGETS:
      jax.ffi.register_ffi_target_as_batch_partitionable(target)
  return loaded


@functools.cache
def load() -> Optional[str]:
  """Builds and registers the kernels once per process; the problem, or
  None when they are ready."""
  try:
    library()
  except (RuntimeError, OSError, AttributeError) as error:
    logging.warning("vit_jax: the C++ CPU kernels are unavailable, XLA's "
                    "own operations run instead: %s", error)
    return f"its C++ kernel could not be built or loaded: {error}"
  return None


def problem(device: Any = None) -> Optional[str]:
  """Why the kernels cannot run on `device` (default: JAX's first device),
  or None if they can. Builds them on first use."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "cpu":
    return f"it runs on CPUs, and this device is {device.platform!r}"
  return load()


def choose_implementation(setting: str, requested: str,
                          choices: tuple[str, str, str],
                          problem: Callable[[], Optional[str]],
                          kernel_name: str, elsewhere: str) -> str:
  """What `requested`, one of `choices` ("auto", the kernel's name, "xla":
  the values of the setting named `setting`), resolves to: "xla" as asked;
  the kernel where problem() (why it cannot run, or None) is None; for
  "auto" "xla" otherwise, and for the kernel a ValueError naming the
  problem and the fix. kernel_name and elsewhere name the two paths in
  that message."""
  (kernel,) = set(choices) - {"auto", "xla"}
  if requested not in choices:
    raise ValueError(f"Unknown {setting} {requested!r}; choose one of "
                     f"{choices}.")
  if requested == "xla":
    return requested
  reason = problem()
  if reason is None:
    return kernel
  if requested == kernel:
    raise ValueError(f"{setting}={kernel!r} cannot run here: {reason}. Use "
                     f"'auto', which takes {kernel_name} where it can run "
                     f"and {elsewhere} elsewhere.")
  return "xla"


def batch_partitionable(target: str, results: Callable, num_batch_dims: int,
                        static: tuple[str, ...] = ()) -> core.Primitive:
  """A primitive calling `target`; results(*operand avals, **the `static`
  keyword arguments of `bind`) gives its result (shape, dtype) pairs.
  Every operand and result shares its first num_batch_dims axes (the batch
  axes). Keyword arguments of `bind` not named in `static` (ints) are the
  handler's attributes; the static ones (hashable) only shape the results.

  Its custom call is declared batch-partitionable over those axes, with the
  other axes whole: a Shardy sharding rule and the `num_batch_dims`
  attribute that JAX's own linear-algebra calls carry, for a target that
  `load` registers as batch-partitionable. Under a batch-split mesh each
  device then runs the kernel on its part, where the partitioner would
  gather a plain `jax.ffi.ffi_call` onto every device.
  """
  primitive = core.Primitive(target)
  primitive.multiple_results = True

  # Outside jit: compiled on its own (once per set of attributes), as jnp's
  # operations are.
  @functools.cache
  def compiled(attributes: tuple) -> Callable:
    return jax.jit(lambda *operands: primitive.bind(*operands,
                                                    **dict(attributes)))

  primitive.def_impl(lambda *operands, **attributes: compiled(
      tuple(sorted(attributes.items())))(*operands))
  primitive.def_abstract_eval(lambda *avals, **attributes: [
      jax.core.ShapedArray(shape, dtype) for shape, dtype in results(
          *avals, **{name: attributes[name] for name in static})])

  def lowering(ctx, *operands, **attributes):
    handler_attributes = {name: value for name, value in attributes.items()
                          if name not in static}
    extra = {"mhlo.frontend_attributes": mlir.ir.DictAttr.get(
        {"num_batch_dims": mlir.ir.StringAttr.get(str(num_batch_dims))})}
    if jax.config.jax_use_shardy_partitioner:
      extra["sdy.sharding_rule"] = mlir.ir.Attribute.parse(
          _sharding_rule(ctx.avals_in, ctx.avals_out, num_batch_dims))
    return jax.ffi.ffi_lowering(target, extra_attributes=extra)(
        ctx, *operands, **handler_attributes)

  def batch_rule(operands, axes, **attributes):
    # Under jax.vmap the mapped axis joins the first batch axis: one call.
    size = next(operand.shape[axis] for operand, axis in zip(operands, axes)
                if axis is not None)
    merged = []
    for operand, axis in zip(operands, axes):
      operand = (jnp.broadcast_to(operand, (size, *operand.shape))
                 if axis is None  # not mapped
                 else jnp.moveaxis(operand, axis, 0))
      merged.append(operand.reshape(-1, *operand.shape[2:]))
    results = primitive.bind(*merged, **attributes)
    return ([result.reshape(size, -1, *result.shape[1:])
             for result in results], [0] * len(results))

  batching.primitive_batchers[primitive] = batch_rule
  mlir.register_lowering(primitive, lowering, platform="cpu")
  return primitive


def per_group(array: jax.Array, groups: int) -> jax.Array:
  """array (a kernel, a scale) once per group, (groups, *array.shape): every
  operand of a `batch_partitionable` call has the group axis, which the
  partitioner slices. Under a batch-split mesh each device holds one
  copy."""
  return jnp.broadcast_to(array, (groups, *array.shape))


def _factor_name(index: int) -> str:
  """Shardy's factor names: i, j, ..., z, then z_1, z_2, ..."""
  return chr(ord("i") + index) if index < 18 else f"z_{index - 17}"


def _sharding_rule(avals_in, avals_out, num_batch_dims: int) -> str:
  """Shardy's rule for a kernel: the batch axes shared by every operand
  and result; every other axis its own factor, which XLA's partitioner
  keeps whole for a call with `num_batch_dims` (declaring them
  need_replication instead made it gather the batch too)."""
  sizes = list(avals_in[0].shape[:num_batch_dims])

  def factors(aval):
    names = [_factor_name(axis) for axis in range(num_batch_dims)]
    for size in aval.shape[num_batch_dims:]:
      names.append(_factor_name(len(sizes)))
      sizes.append(size)
    return "[" + ", ".join(names) + "]"

  operands = ", ".join(factors(aval) for aval in avals_in)
  results = ", ".join(factors(aval) for aval in avals_out)
  size_list = ", ".join(f"{_factor_name(index)}={size}"
                        for index, size in enumerate(sizes))
  return (f"#sdy.op_sharding_rule<({operands})->({results}) {{{size_list}}}, "
          "custom>")
