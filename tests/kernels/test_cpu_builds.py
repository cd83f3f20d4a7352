"""How vit_jax's C++ kernels are built (`vit_jax.kernels.cpu_build`): the
cached library and the build's failures; builds for other instruction sets
(AVX2, SSE, AMX and AVX512_FP16), for Arm (cross-compiled, run under qemu)
and by clang++ (macOS's compiler), each checked for values where it can run
here; one attention pair and the bfloat16 tile passes in C++ without JAX.
The kernels' values in this machine's build: test_cpu_attention.py and the
other kernels' files."""

import os
import pathlib
import platform
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

from helpers import run_python
from vit_jax.kernels import cpu_attention, cpu_build
from vit_jax.runtime import cpu_info

pytestmark = pytest.mark.skipif(
    cpu_attention.problem(jnp.float32, 64) is not None,
    reason=f"the CPU kernels cannot be built here: "
    f"{cpu_attention.problem(jnp.float32, 64)}")

CLANG = "clang++"
needs_clang = pytest.mark.skipif(
    not shutil.which(CLANG),
    reason="clang++ is not installed (.ci/run installs it)")


def test_every_kernel_file_is_built_and_keys_the_cached_build(monkeypatch):
  """Every file in csrc is a source compiled into the library or a header
  one includes, and each keys the cached build: editing any of them
  builds a new library."""
  csrc = cpu_build.SOURCES[0].parent
  assert sorted(path.name for path in csrc.iterdir()) == sorted(
      path.name for path in cpu_build.SOURCES + cpu_build.HEADERS)
  key = lambda: cpu_build._library_path("c++", ("-O3",))  # pylint: disable=protected-access
  before = key()
  header = cpu_build.HEADERS[-1]
  text = header.read_text()
  monkeypatch.setattr(type(header), "read_text", lambda path: (
      text + "// edited" if path == header else pathlib.Path.read_bytes(
          path).decode()))
  assert key() != before


def test_without_proc_cpuinfo_the_cached_build_is_keyed_by_the_cpu_model(
    tmp_path, monkeypatch):
  """Where there is no /proc/cpuinfo (macOS), the CPU model that sysctl
  names keys the cached build: an M3 and an M1 sharing a home directory
  each get their own -mcpu=native library (the M3's may use instructions
  the M1 lacks)."""
  monkeypatch.setattr(cpu_info, "CPUINFO", str(tmp_path / "no-cpuinfo"))
  tools = tmp_path / "bin"
  tools.mkdir()
  monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
  sysctl, keys = tools / "sysctl", []
  for model in ("Apple M3 Pro", "Apple M1"):
    sysctl.write_text("#!/bin/sh\n[ \"$2\" = machdep.cpu.brand_string ] && "
                      f"echo '{model}'\n")
    sysctl.chmod(0o755)
    assert model in cpu_build._cpu_signature()  # pylint: disable=protected-access
    keys.append(cpu_build._library_path("c++", ("-O3",)))  # pylint: disable=protected-access
  assert keys[0] != keys[1]


def test_the_build_is_cached_and_failures_name_the_compiler(
    tmp_path, monkeypatch):
  """build() compiles once into the cache and finds the library there
  after (a stand-in compiler that logs its calls and writes its -o file:
  the real compilers build from empty caches in the AVX2/SSE and Arm
  tests): each translation unit of the sources (one, or cpu_build.UNITS
  where there are cores for them), then the link of their objects; a
  missing or failing compiler is named, nothing cached."""
  cache, tools = tmp_path / "cache", tmp_path / "bin"
  tools.mkdir()
  monkeypatch.setenv("VIT_JAX_CACHE_DIR", str(cache))
  monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
  calls = tmp_path / "calls"
  logging_compiler = tools / "logging-c++"
  logging_compiler.write_text(
      "#!/bin/sh\necho \"$@\" >> " + str(calls) + "\n"
      "while [ $# -gt 0 ]; do [ \"$1\" = -o ] && echo built > \"$2\"; "
      "shift; done\n")
  logging_compiler.chmod(0o755)
  library = cpu_build.build(logging_compiler.name)
  assert library.parent == cache and library.read_text() == "built\n"
  assert cpu_build.build(logging_compiler.name) == library  # cached
  *compiles, link = calls.read_text().splitlines()  # compiled once
  units = (cpu_build.UNITS if cpu_info.cpu_cores() >= len(cpu_build.UNITS)
           else (cpu_build.SOURCES,))
  assert len(compiles) == len(units) and all(" -c " in c for c in compiles)
  # The units compile at once, so their lines come in either order.
  objects = sorted(c.split(" -o ")[1] for c in compiles)
  assert link.startswith("-shared ") and sorted(link.split()[1:-2]) == objects
  assert [path.name for path in cache.iterdir()] == [library.name]
  with pytest.raises(RuntimeError, match="no C.. compiler 'no-such-c..'"):
    cpu_build.build("no-such-c++")
  # A compiler that fails: its message is passed on, nothing is cached.
  failing = tools / "failing-c++"
  failing.write_text("#!/bin/sh\necho 'fatal: out of cheese' >&2\nexit 1\n")
  failing.chmod(0o755)
  with pytest.raises(RuntimeError, match="(?s)failed to build.*out of cheese"):
    cpu_build.build(failing.name)
  assert [path.name for path in cache.iterdir()] == [library.name]


def _compile_for_errors_only(compiler: str, *flags: str
                             ) -> subprocess.CompletedProcess:
  """cpu_build's one translation unit of every kernel source, checked for
  errors only by compiler with flags (skips where it is not installed)."""
  if not shutil.which(compiler):
    pytest.skip(f"{compiler} is not installed (.ci/run installs it)")
  return subprocess.run(
      [compiler, *flags, "-fsyntax-only", "-std=c++17", "-w",
       f"-I{jax.ffi.include_dir()}", "-x", "c++", "-"],
      input=cpu_build.translation_unit(), capture_output=True, text=True,
      check=False)


@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="x86 instruction sets")
@pytest.mark.parametrize("compiler", [os.environ.get("CXX", "c++"), CLANG])
def test_the_kernels_compile_for_a_cpu_with_amx_and_avx512_fp16(compiler):
  """Every kernel source, as cpu_build's one translation unit, compiles for
  a Sapphire Rapids Xeon (AMX, AVX512_BF16 and AVX512_FP16: the code
  behind those macros, which a build for this machine may leave out), by
  the default compiler and by clang, checked for errors only."""
  result = _compile_for_errors_only(compiler, "-march=sapphirerapids")
  if "sapphirerapids" in result.stderr and "march" in result.stderr:
    pytest.skip(f"{compiler} does not know -march=sapphirerapids")
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(
    platform.machine().lower() in ("arm64", "aarch64")
    or not shutil.which("aarch64-linux-gnu-g++"),
    reason="on an x86 host with Debian's g++-aarch64-linux-gnu (.ci/run "
    "installs it); on Arm the suite builds and runs the Arm library")
@pytest.mark.parametrize("compiler", [
    ["aarch64-linux-gnu-g++"], [CLANG, "--target=aarch64-linux-gnu"]])
def test_every_kernel_compiles_for_arm(compiler):
  """Every kernel source, as cpu_build's one translation unit, compiles
  for a 64-bit Arm CPU (NEON's 4-float vectors, no x86 intrinsics), by g++
  and by clang (Apple's compiler is a clang; with the cross compiler's
  headers); only the attention kernel's Arm build runs, under qemu,
  below."""
  result = _compile_for_errors_only(*compiler, "-march=armv8.2-a")
  assert result.returncode == 0, result.stderr[-3000:]


def _value_tests_pass_with_a_build_of_their_own(
    cache: pathlib.Path, env: dict[str, str]) -> pathlib.Path:
  """Runs the attention kernel's value and gradient tests and the
  LayerNorm, GELU, AdamW and sum-of-squares kernels' in a fresh process (a process loads
  one build) with env, building the kernels into the empty cache; asserts
  they passed, none skipped. Returns the library built."""
  result = run_python(
      "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
      "tests/kernels/test_cpu_attention.py",
      "tests/kernels/test_cpu_layer_norm.py", "tests/kernels/test_cpu_gelu.py",
      "tests/kernels/test_cpu_adamw.py",
      "tests/kernels/test_cpu_sum_of_squares.py", "-k",
      "float64_reference or extreme_logits or batch_split or vmap"
      " or ones_rounded",
      env={**env, "VIT_JAX_CACHE_DIR": str(cache)})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout
  (library,) = cache.glob("cpu_kernels-*.so")  # its own build
  return library


@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason="x86 instruction sets")
# SSE-only and clang builds take ~30 s each (a build and a fresh process):
# the slow suite runs them; the default one keeps AVX2, the commoner class.
@pytest.mark.parametrize(
    "march", ["x86-64-v3", pytest.param("x86-64-v2", marks=pytest.mark.slow)])
def test_the_avx2_and_sse_builds_match_the_reference_too(tmp_path, march):
  """The kernels built for AVX2 (8-float vectors) or SSE (4-float vectors),
  as on CPUs without AVX-512 (VIT_JAX_KERNEL_MARCH, which throughput.py
  --max_isa=avx2 sets), pass this file's value and gradient tests and the
  LayerNorm, GELU, AdamW and sum-of-squares kernels' (run in a fresh process: a process
  loads one build), from a library of their own."""
  library = _value_tests_pass_with_a_build_of_their_own(
      tmp_path, {cpu_build.MARCH_VARIABLE: march})
  if march == "x86-64-v3" and shutil.which("objdump"):
    # AVX2's 8-float registers, no AVX-512 instruction (no zmm register),
    # whatever this CPU has; the suite's native build uses them where the
    # CPU has AVX-512.
    assert "%ymm" in _disassembly(library)
    assert "%zmm" not in _disassembly(library)
    with open("/proc/cpuinfo") as cpuinfo:
      if " avx512f " in cpuinfo.read():
        assert "%zmm" in _disassembly(cpu_build.build())


def _disassembly(library: pathlib.Path) -> str:
  return subprocess.run(["objdump", "-d", str(library)], capture_output=True,
                        text=True, check=True).stdout


@needs_clang
@pytest.mark.slow
def test_the_clang_build_matches_the_reference_too(tmp_path):
  """Built by clang++ (CXX), as on macOS, whose C++ compiler is Apple's
  clang, the kernels pass the same value tests. (clang rejects narrowing
  conversions in braces that g++ takes: with one in the GELU kernel, every
  kernel failed to build there and XLA's operations ran instead.)"""
  library = _value_tests_pass_with_a_build_of_their_own(
      tmp_path, {"CXX": CLANG})
  assert b"clang version" in library.read_bytes()  # the compiler's mark


ARM_COMPILER = "aarch64-linux-gnu-g++"
needs_arm_tools = pytest.mark.skipif(
    platform.machine().lower() in ("arm64", "aarch64")
    or not (shutil.which(ARM_COMPILER) and shutil.which("qemu-aarch64")),
    reason="on an x86 host with Debian's g++-aarch64-linux-gnu and qemu-user "
    "(.ci/run installs them); on Arm the other tests run the Arm build")


@needs_arm_tools
def test_on_arm_the_build_takes_the_cpu_flag_or_builds_without_it(
    tmp_path, monkeypatch):
  """On Arm the kernel is built with -mcpu=native, and where the compiler
  rejects that (clang before 15, or this cross compiler, which has no
  native CPU) without a CPU flag: an aarch64 library either way, cached."""
  monkeypatch.setenv("VIT_JAX_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv(cpu_build.MARCH_VARIABLE, raising=False)
  monkeypatch.setattr(platform, "machine", lambda: "aarch64")
  assert cpu_build.target_flags() == [("-mcpu=native",), ()]
  library = cpu_build.build(ARM_COMPILER)
  with open(library, "rb") as f:
    header = f.read(20)
  assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20],
                                                     "little") == 183  # AArch64
  assert cpu_build.build(ARM_COMPILER) == library  # found, not rebuilt
  assert [path.name for path in tmp_path.iterdir()] == [library.name]


def _pair_check(compiler: str, flags: list[str], runner: list[str],
                tmp_path) -> list[str]:
  """tests/kernels/attention_pair_check.cc built by compiler with flags and
  run (under runner): its output lines, after asserting it passed."""
  check = os.path.join(os.path.dirname(__file__), "attention_pair_check.cc")
  program = tmp_path / "attention_pair_check"
  subprocess.run(
      [compiler, "-O3", "-ffp-contract=fast", "-std=c++17", "-w", *flags,
       f"-I{jax.ffi.include_dir()}", f"-I{cpu_build.SOURCES[0].parent}",
       check, "-o", str(program)], check=True, capture_output=True)
  result = subprocess.run([*runner, str(program)], capture_output=True,
                          text=True, check=False, timeout=300)
  lines = result.stdout.splitlines()
  assert result.returncode == 0 and len(lines) == 6, result.stdout
  assert all(line.startswith("ok ") for line in lines), result.stdout
  return lines


def test_one_pair_matches_double_precision_without_jax(tmp_path):
  """The kernel's arithmetic for one (batch, head) pair, built for this CPU
  as `build` builds it, against double precision
  (tests/kernels/attention_pair_check.cc: 197, 65 and odd token counts)."""
  lines = _pair_check(os.environ.get("CXX", "c++"),
                      list(cpu_build.target_flags()[0]), [], tmp_path)
  assert all("tile=6x" in line for line in lines)


@pytest.mark.parametrize("engine,flag,macro", [
    ("amx", "amx_bf16", "__AMX_BF16__"),
    ("dot", "avx512_bf16", "__AVX512BF16__")])
def test_the_bfloat16_tiled_passes_give_the_rounded_values(
    tmp_path, engine, flag, macro):
  """tests/kernels/bf16_tiles_check.cc, built for this CPU: the bfloat16
  kernel's forward and backward passes on AMX tiles and on AVX512_BF16's
  dot instruction give the values of the passes without bfloat16
  instructions (the same rounded operands) to 1e-4 of the largest,
  written to their rows of token-major arrays and nowhere else; the
  AMX passes restore the tile configuration another library left on the
  thread."""
  if platform.machine() != "x86_64" or flag not in open(
      "/proc/cpuinfo").read().split():
    pytest.skip(f"the {engine} passes run on an x86 CPU with {flag}")
  compiler = os.environ.get("CXX", "c++")
  macros = subprocess.run([compiler, "-march=native", "-dM", "-E", "-"],
                          input="", capture_output=True, text=True).stdout
  if macro not in macros:
    pytest.skip(f"{compiler} does not target {flag} with -march=native "
                f"(the kernel then builds without its {engine} passes)")
  check = os.path.join(os.path.dirname(__file__), "bf16_tiles_check.cc")
  program = tmp_path / "bf16_tiles_check"
  subprocess.run(
      [compiler, "-O3", "-ffp-contract=fast",
       "-std=c++17", "-w", "-march=native", f"-I{jax.ffi.include_dir()}",
       f"-I{cpu_build.SOURCES[0].parent}", check, "-o", str(program)],
      check=True, capture_output=True)
  result = subprocess.run([str(program), engine], capture_output=True,
                          text=True, check=False, timeout=120)
  lines = result.stdout.splitlines()
  assert result.returncode == 0 and len(lines) == 4, result.stdout
  assert all(line.startswith("ok ") for line in lines), result.stdout


@needs_arm_tools
def test_the_arm_build_matches_double_precision_under_qemu(tmp_path):
  """The same for aarch64 (NEON: 4-float vectors in 6 x 4 tiles, which no
  x86 build compiles), cross-compiled and run under qemu."""
  lines = _pair_check(ARM_COMPILER, ["-static"], ["qemu-aarch64"], tmp_path)
  assert all("lanes=4 tile=6x4" in line for line in lines)
