"""The benchmark scripts run as documented and print their summary line."""

import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, run_python
from vit_jax.kernels import cpu_build
from vit_jax.model import variants

ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def _run(*args: str, env: dict[str, str] | None = None,
         timeout: int = 600) -> list[str]:
  """Runs `python *args` in the repository and returns its stdout lines;
  the test fails with the script's stderr if it fails."""
  result = run_python(*args, env=env, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout.strip().splitlines()


def _benchmark_module(name: str):
  """benchmarks/<name>.py, imported as the scripts import each other (the
  folder on sys.path while it loads: gpu_throughput imports gpu_profile,
  step_ab race_workers); once per process, as step_ab defines absl flags."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    return importlib.import_module(name)
  finally:
    sys.path.pop(0)


@pytest.mark.slow
def test_fashion_mnist_benchmark_prints_curve_and_summary(tmp_path,
                                                          fashion_mnist_dir):
  del fashion_mnist_dir  # the config finds the Debian files itself
  plot = tmp_path / "curve.png"
  lines = _run(
      "benchmarks/fashion_mnist.py",
      "--config=configs/vit_fashion_mnist_15min.py",
      "--config.max_train_examples=1024", "--config.max_eval_examples=500",
      "--config.num_epochs=2", "--config.eval_every_epochs=1",
      "--config.model.num_layers=1", "--config.eval_batch_size=250",
      f"--workdir={tmp_path / 'run'}", f"--plot={plot}", env=ONE_DEVICE)
  summary = re.fullmatch(r"summary: test_accuracy=(\d\.\d{4}) "
                         r"wall_minutes=(\d+\.\d)", lines[-1])
  assert summary, lines[-1]
  rows = [line for line in lines if re.match(r"\| \d+ \|", line)]
  assert len(rows) == 2  # one evaluation per epoch
  # The summary reports the EMA params (the config keeps them).
  assert rows[-1].split("|")[4].strip() == summary.group(1)
  assert plot.stat().st_size > 10_000


def _forward_flops_of_the_tiny_worker() -> int:
  """Multiply-adds x 2 of the workers' 8 px model below: 1 block, width 192,
  MLP 768, 5 tokens (4 patches + class token). The block is the last, so
  keys and values come from every token, the rest is the class token's."""
  tokens, width, mlp = 5, 192, 768
  return 2 * (2 * tokens * width * width + 2 * width * width
              + 2 * width * mlp + 2 * tokens * width)


@pytest.mark.parametrize("cpu_devices,matmul_dtype",
                         [(0, ""), (2, ""), (2, "bfloat16")])
def test_throughput_worker_measures_the_real_train_step(cpu_devices,
                                                        matmul_dtype):
  """One vit_jax worker of benchmarks/throughput.py, on a tiny image: the
  FLOP count is XLA's for the real train step (all devices' shares) and sits
  between the forward (2 x multiply-adds) and a generous 4x of it plus the
  optimizer's update; the same with bfloat16 products (--matmul_dtype)."""
  env = {"XLA_FLAGS": ""} if cpu_devices else dict(ONE_DEVICE)
  env["VIT_JAX_BENCH_MATMUL_DTYPE"] = matmul_dtype
  measured = json.loads(_run(
      "benchmarks/throughput.py", "--worker", "--impl=vit_jax",
      "--mode=train", "--image_size=8", "--patch_size=4", "--batch=4",
      "--num_layers=1", "--steps=1", f"--cpu_devices={cpu_devices}",
      env=env, timeout=300)[-1])
  if cpu_devices:
    assert (f"--xla_force_host_platform_device_count={cpu_devices}"
            in measured["xla_flags"])
  assert measured["images_per_s"] > 0
  assert measured["matmul_dtype"] == (matmul_dtype or "float32")
  assert 0 < measured["trace_s"] < measured["compile_s"]  # trace, then XLA
  assert measured["peak_rss_mib"] > 0
  assert "--xla_cpu_experimental_ynn_fusion_type=" in measured["xla_flags"]
  tokens, width, mlp = 5, 192, 768
  forward = _forward_flops_of_the_tiny_worker()
  # AdamW's update, shared by the batch of 4: a generous 20 FLOPs/parameter.
  params = (4 * (width * width + width) + 2 * width * mlp + mlp + width +
            4 * width +  # the block
            4 * 4 * 3 * width + width + (tokens + 1) * width +  # embeddings
            2 * width + width * 10 + 10)  # final LayerNorm, head
  optimizer = 20 * params / 4
  assert (2 * forward < measured["flops_per_image"] <
          4 * forward + optimizer), measured


@pytest.mark.slow
def test_scan_remat_benchmark_compares_modes():
  """benchmarks/scan_remat.py on a small model: one row per mode asked for,
  the same state in each, and scan + remat needing less step memory than
  the plain loop (XLA's own memory analysis)."""
  lines = _run("benchmarks/scan_remat.py", "--models=ViT-Mini/7",
               "--modes=plain,scan+remat", "--run=ViT-Mini/7", "--rounds=1",
               "--steps=1", env=ONE_DEVICE, timeout=300)
  rows = {}
  for line in lines:
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells[0] == "ViT-Mini/7":
      rows[cells[2]] = dict(
          temp=float(cells[5].replace(",", "")),
          state=float(cells[6].replace(",", "")), speed=float(cells[7]))
  assert set(rows) == {"plain", "scan+remat"}, lines
  assert len({row["state"] for row in rows.values()}) == 1
  assert rows["scan+remat"]["temp"] < rows["plain"]["temp"]
  assert all(row["speed"] > 0 for row in rows.values())


@pytest.mark.slow
def test_cpu_devices_benchmark_compares_one_device_with_one_per_core():
  """Each setting in its own process, with the device count it asks for."""
  lines = _run("benchmarks/cpu_devices.py", "--rounds=1", "--steps=1",
               "--overrides=--config.model.num_layers=1")
  devices = [int(d) for d in re.findall(r"(\d+) device\(s\)",
                                        "\n".join(lines))]
  from vit_jax.runtime import cpu_info  # pylint: disable=import-outside-toplevel
  assert devices == [1, cpu_info.cpu_cores()], lines
  summary = re.fullmatch(r"summary: per_core_over_one_device=([\d.]+) "
                         r"one_device=([\d.]+) per_core=([\d.]+)", lines[-1])
  assert summary, lines[-1]
  ratio, one, per_core = map(float, summary.groups())
  assert abs(ratio - per_core / one) < 0.01


def test_race_workers_time_steps_until_the_minimum_time_has_passed(
    monkeypatch):
  """time_steps: one warm-up call, then at least `steps` timed calls, and
  more until they have taken min_seconds; their median, not the warm-up's
  (on a fake clock that each call moves on)."""
  race_workers = _benchmark_module("race_workers")
  clock = [0.0]
  monkeypatch.setattr(race_workers.time, "perf_counter", lambda: clock[0])
  durations = iter([0.5] + [0.002] * 9 + [0.004] * 100)
  calls = []

  def run():
    calls.append(None)
    clock[0] += next(durations)

  # 9 calls of 2 ms, then 4 ms ones until 0.045 s: 7 more (0.018 + 0.028).
  assert race_workers.time_steps(run, 3, min_seconds=0.045) == pytest.approx(
      0.002)
  assert len(calls) == 1 + 9 + 7
  calls.clear()
  durations = iter([0.001] * 10)
  # No minimum: 3 calls.
  assert race_workers.time_steps(run, 3) == pytest.approx(0.001)
  assert len(calls) == 1 + 3


def test_throughput_inference_worker_counts_the_forward_pass():
  """The inference worker on two devices (params replicated, batch split):
  XLA's FLOPs per image are the forward's, plus a little elementwise work."""
  measured = json.loads(_run(
      "benchmarks/throughput.py", "--worker", "--impl=vit_jax",
      "--mode=infer", "--image_size=8", "--patch_size=4", "--batch=4",
      "--num_layers=1", "--steps=1", "--cpu_devices=2",
      env={"XLA_FLAGS": ""}, timeout=300)[-1])
  assert measured["images_per_s"] > 0
  forward = _forward_flops_of_the_tiny_worker()
  assert forward < measured["flops_per_image"] < 1.1 * forward, measured


def test_step_ab_takes_another_batch_and_xla_options():
  """benchmarks/step_ab.py --batch replaces the race's batch (the line
  naming the model says so), and a variant's XLA options reach its line."""
  lines = _run("benchmarks/step_ab.py", "--model=vit_tiny_cifar",
               "--a={\"num_layers\": 2}", "--b={\"num_layers\": 2}",
               "--batch=4", "--pairs=1", "--cpu_devices=0",
               "--a_xla_options={\"xla_cpu_experimental_ynn_fusion_type\": "
               "\"\"}", env=dict(ONE_DEVICE, VIT_JAX_NO_REEXEC="1"))
  assert "vit_tiny_cifar, batch 4, 1 device(s)" in lines, lines
  assert any(line.startswith("A: ") and "ynn_fusion_type" in line
             for line in lines), lines
  assert re.fullmatch(r"summary: b_over_a_step=\d+\.\d{3} a_temp_mib=\d+ "
                      r"b_temp_mib=\d+", lines[-1]), lines[-1]


def test_step_ab_compares_two_softmaxes_in_one_process():
  """benchmarks/step_ab.py on a 2-layer vit_tiny_cifar: both variants
  step, the summary line parses, and XLA's scratch with vit_jax's softmax
  is no more than with jax.nn.softmax. Up to JAX 0.12.0 it was one
  (B, heads, T, T) array less, 128 x 3 x 65 x 65 floats for the first
  block (jax.nn.softmax's exp(logits - max) beside its output; the last
  block attends from the class token only); with 0.12.1's XLA the two
  are equal (docs/performance.md, *Newer JAX releases*)."""
  lines = _run("benchmarks/step_ab.py", "--model=vit_tiny_cifar",
               "--a={\"num_layers\": 2}",
               "--b={\"num_layers\": 2, \"attention_implementation\": "
               "\"einsum\"}", "--a_softmax=jax.nn", "--pairs=2", "--cpu_devices=0",
               env=dict(ONE_DEVICE, VIT_JAX_NO_REEXEC="1"))
  summary = re.fullmatch(r"summary: b_over_a_step=(\d+\.\d{3}) "
                         r"a_temp_mib=(\d+) b_temp_mib=(\d+)", lines[-1])
  assert summary, lines[-1]
  assert 0.2 < float(summary.group(1)) < 5
  assert int(summary.group(3)) <= int(summary.group(2)), lines[-1]
  assert any(line.startswith("A: ") and "softmax=jax.nn" in line
             for line in lines)


def test_step_ab_kernel_gradients_agree():
  """step_ab's kernel gradients (vit_jax's, JAX's transpose-rule
  orientation, XLA's product without the bfloat16 kernel) give the same
  inputs^T @ output_grad, narrow and wide, in float32 and from bfloat16
  operands."""
  import jax  # pylint: disable=import-outside-toplevel
  step_ab = _benchmark_module("step_ab")
  rng = np.random.default_rng(0)
  for depth, width in ((6, 20), (20, 6)):
    inputs = rng.normal(size=(30, depth)).astype(np.float32)
    output_grad = rng.normal(size=(30, width)).astype(np.float32)
    expected = inputs.astype(np.float64).T @ output_grad
    for fn in step_ab.KERNEL_GRADIENTS.values():
      np.testing.assert_allclose(jax.jit(fn)(inputs, output_grad), expected,
                                 rtol=1e-5, atol=1e-5)
    rounded = lambda x: np.asarray(jax.numpy.asarray(x, jax.numpy.bfloat16),
                                   np.float64)
    for fn in step_ab.KERNEL_GRADIENTS.values():  # as the train step calls it
      np.testing.assert_allclose(
          jax.jit(fn, static_argnums=(2, 3))(inputs, output_grad, None,
                                             jax.numpy.bfloat16),
          rounded(inputs).T @ rounded(output_grad), rtol=1e-5, atol=1e-5)


def test_step_ab_elementwise_core_takes_the_attention_core_out():
  """step_ab's elementwise attention core: while it is active a ViT's
  gradient traces without the core's (B, heads, T, T) arrays and other
  einsums are the real ones; before and after, the core is there."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  step_ab = _benchmark_module("step_ab")
  from vit_jax.model import vit  # pylint: disable=import-outside-toplevel
  model = vit.VisionTransformer(num_classes=3, patch_size=4, hidden_size=12,
                                   num_layers=2, num_heads=2, mlp_dim=24)
  images = jnp.ones((2, 16, 16, 3))  # 16 patches + the class token
  params = model.init(jax.random.PRNGKey(0), images)["params"]
  loss = lambda params: model.apply({"params": params}, images).sum()
  core_shape = "2x2x17x17xf32"  # (B, heads, T, T)

  def program() -> str:
    return jax.jit(jax.grad(loss)).lower(params).as_text()

  assert core_shape in program()
  with step_ab.elementwise_core():
    assert core_shape not in program()
    lhs, rhs = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(jnp.einsum("ij,jk->ik", lhs, rhs), lhs @ rhs)
  assert core_shape in program()


def test_step_ab_free_parts_take_out_only_their_part():
  """step_ab's --b_free: while a part is made free a ViT traces without
  that part's work (GELU's tanh or kernel, LayerNorm's rsqrt, the
  kernels' gradients over every row) and with the same parameters; before
  and after, the model is whole."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  step_ab = _benchmark_module("step_ab")
  from vit_jax.kernels import xla_products  # pylint: disable=import-outside-toplevel
  from vit_jax.model import vit  # pylint: disable=import-outside-toplevel
  # XLA's products and Flax's LayerNorm: the ones whose kernel gradients
  # and statistics step_ab can replace (it runs such variants so).
  model = vit.VisionTransformer(num_classes=3, patch_size=4, hidden_size=16,
                                num_layers=1, num_heads=1, mlp_dim=32,
                                matmul_implementation="xla",
                                layer_norm_implementation="xla")
  images = jnp.ones((2, 16, 16, 3))
  shapes = lambda: jax.tree.map(jnp.shape, model.init(
      jax.random.PRNGKey(0), images)["params"])
  expected_shapes = shapes()
  params = model.init(jax.random.PRNGKey(0), images)["params"]
  loss = lambda params: model.apply({"params": params}, images).sum()
  program = lambda: str(jax.make_jaxpr(jax.grad(loss))(params))
  whole = program()
  # The GELU is XLA's tanh, or the C++ kernel's call where it builds.
  for part, gone in (("gelu", ("tanh", "VitGelu")), ("layer_norm", ("rsqrt",))):
    assert any(marker in whole for marker in gone)
    with step_ab.free_part(part):
      assert not any(marker in program() for marker in gone), part
      assert shapes() == expected_shapes, part
    assert program() == whole
  with step_ab.free_part("kernel_gradients"):
    assert xla_products.kernel_gradient is not step_ab.OUR_KERNEL_GRADIENT
    rng = np.random.default_rng(0)
    inputs, output_grad = rng.normal(size=(2, 40, 5)).astype(np.float32)
    np.testing.assert_allclose(
        xla_products.kernel_gradient(inputs, output_grad),
        inputs[:16].T @ output_grad[:16], rtol=1e-5)
    assert program() != whole
  assert xla_products.kernel_gradient is step_ab.OUR_KERNEL_GRADIENT
  with step_ab.free_part("none"):
    assert program() == whole


def test_step_ab_float32_attention_kernel_keeps_the_kernel_float32():
  """step_ab's --a_attention_core=float32_kernel: a model with bfloat16
  products traces the C++ kernel's float32 calls while it is active, its
  bfloat16 ones before and after."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  step_ab = _benchmark_module("step_ab")
  from vit_jax.kernels import cpu_attention  # pylint: disable=import-outside-toplevel
  from vit_jax.model import vit  # pylint: disable=import-outside-toplevel
  if cpu_attention.problem(jnp.float32, 16) is not None:
    pytest.skip(f"no CPU attention kernel: {cpu_attention.problem(jnp.float32, 16)}")
  model = vit.VisionTransformer(num_classes=3, patch_size=4, hidden_size=32,
                                num_layers=1, num_heads=2, mlp_dim=32,
                                matmul_dtype="bfloat16")
  images = jnp.ones((2, 16, 16, 3))
  params = model.init(jax.random.PRNGKey(0), images)["params"]
  loss = lambda params: model.apply({"params": params}, images).sum()
  program = lambda: jax.jit(jax.grad(loss)).lower(params).as_text()
  # One layer: the last, where the class token queries alone.
  assert "VitAttentionSplitBackwardBf16" in program()
  with step_ab.float32_attention_kernel():
    float32 = program()
    # The attention kernel's calls; the GELU kernel's stay bfloat16.
    assert not re.search(r"VitAttention\w*Bf16", float32)
    assert "VitAttentionSplitBackward" in float32
  assert "VitAttentionSplitBackwardBf16" in program()


def _small_vit_off_init(image_size: int, scale: float, **fields):
  """(a two-layer ViT with `fields`, two random images, its params with
  every one moved off its init by `scale` x a normal draw: the head's init
  is zero, which would leave every other gradient zero)."""
  import jax  # pylint: disable=import-outside-toplevel
  from vit_jax.model import vit  # pylint: disable=import-outside-toplevel
  model = vit.VisionTransformer(num_classes=3, patch_size=4, hidden_size=12,
                                num_layers=2, num_heads=2, mlp_dim=24,
                                **fields)
  images = jax.random.normal(jax.random.PRNGKey(1),
                             (2, image_size, image_size, 3))
  params = model.init(jax.random.PRNGKey(0), images)["params"]
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  return model, images, treedef.unflatten([
      leaf + scale * jax.random.normal(key, leaf.shape)
      for leaf, key in zip(leaves, keys)])


def test_gpu_flags_jax_matmul_gradients_are_the_same_gradients():
  """gpu_flags' "JAX's matmul gradients": while active a ViT traces
  without vit_jax's custom backward passes and its gradients are the same
  as with them (float32); before and after, they are there. Its halves
  take away the MLP's rules or the other Dense layers'; "MLP keeps the
  GELU's output" puts its own rule in the MLP's, with the same gradients."""
  import jax  # pylint: disable=import-outside-toplevel
  gpu_flags = _benchmark_module("gpu_flags")
  model, images, params = _small_vit_off_init(16, 0.1)
  loss = lambda params: (model.apply({"params": params}, images) ** 2).sum()
  rules = lambda: set(re.findall(  # matmuls' and the MLP's backward rules
      r"bwd=_(matmul_backward_rule|mlp_backward)\b",
      str(jax.make_jaxpr(loss)(params))))
  custom = lambda: bool(rules())

  assert rules() == {"matmul_backward_rule", "mlp_backward"}
  # The variant's halves: each takes away its own layers' rules only.
  for name, kept in (("JAX's gradients outside the MLP", "mlp_backward"),
                     ("JAX's MLP gradients", "matmul_backward_rule")):
    with gpu_flags.model_paths(gpu_flags.VARIANTS[name]):
      assert rules() == {kept}, name
  expected = jax.jit(jax.grad(loss))(params)
  # The MLP's backward pass with the GELU's output kept: its own rule.
  with gpu_flags.model_paths(gpu_flags.VARIANTS["MLP keeps the GELU's "
                                                "output"]):
    assert rules() == {"matmul_backward_rule"}
    assert "bwd=_mlp_kept_backward" in str(jax.make_jaxpr(loss)(params))
    _assert_same_gradients(jax.jit(jax.grad(loss))(params), expected)
  # Jitted, a trace inside the variant and one outside: faster than op by
  # op (15.3 -> 13.3 s for this test).
  with gpu_flags.model_paths(gpu_flags.VARIANTS["JAX's matmul gradients"]):
    assert not custom()
    gradients = jax.jit(jax.grad(loss))(params)
  assert custom()
  _assert_same_gradients(gradients, expected)


def _assert_same_gradients(gradients, expected):
  """Every leaf of gradients equals expected's within float32 rounding,
  and each of expected's (but the keys' biases) is far from zero."""
  import jax  # pylint: disable=import-outside-toplevel
  flat_expected = jax.tree_util.tree_flatten_with_path(expected)[0]
  assert len(jax.tree.leaves(gradients)) == len(flat_expected) > 10
  for got, (path, want) in zip(jax.tree.leaves(gradients), flat_expected):
    # The keys' biases shift every logit of a query alike: no gradient.
    if "'key']['bias']" not in jax.tree_util.keystr(path):
      assert np.abs(want).max() > 1e-4, jax.tree_util.keystr(path)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_gpu_flags_unpadded_variant_stops_the_padding_for_cudnn_only_inside():
  """gpu_flags' "unpadded cuDNN attention": the model pads for cuDNN
  before and after, not while it is active."""
  gpu_flags = _benchmark_module("gpu_flags")
  from vit_jax.kernels import attention  # pylint: disable=import-outside-toplevel
  assert attention.needs_even_tokens("cudnn")
  with gpu_flags.model_paths(gpu_flags.VARIANTS["unpadded cuDNN attention"]):
    assert not attention.needs_even_tokens("cudnn")
  assert attention.needs_even_tokens("cudnn")
  assert not attention.needs_even_tokens("xla")


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_gpu_flags_fused_projections_are_the_same_attention(
    classifier, monkeypatch):
  """gpu_flags' "q/k/v fused", with the tokens padded as for cuDNN (XLA's
  implementation padded here, where no GPU is): one product of width 3 x
  hidden_size in place of the model's three of hidden_size, and the same
  logits and gradients, with the class-token-only last block (10 tokens)
  and a full one (9 tokens, padded to 10)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  gpu_flags = _benchmark_module("gpu_flags")
  from vit_jax.kernels import attention  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(attention, "needs_even_tokens",
                      lambda implementation: implementation == "xla")
  jax.clear_caches()  # blocks traced unpadded by earlier tests trace again
  model, images, params = _small_vit_off_init(
      12, 0.3, classifier=classifier, attention_implementation="xla")
  loss = lambda params: jnp.sum(jnp.sin(model.apply({"params": params},
                                                    images)))
  widths = lambda: set(re.findall(  # the Dense products' output widths
      r"f32\[[\d,]*?,(\d+)\] = (?:custom_vjp_call|dot_general)",
      str(jax.make_jaxpr(loss)(params))))

  assert "36" not in widths() and "12" in widths()  # q, k, v apart
  expected = jax.jit(jax.value_and_grad(loss))(params)
  with gpu_flags.model_paths(gpu_flags.VARIANTS["q/k/v fused"]):
    assert "36" in widths()  # one product for q, k and v
    got = jax.jit(jax.value_and_grad(loss))(params)
  assert "36" not in widths()
  assert abs(float(expected[0])) > 0.1  # not trivially equal
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(expected[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("operand_dtype", [None, "bfloat16"])
def test_dense_products_are_a_dense_layers_forward_and_gradients(
    operand_dtype):
  """The GEMM worker's three products, in jax and in torch, are y = x.W and
  the gradients of sum(y * dy) by x and W that autodiff computes, with the
  operand and result shapes the worker allocates; with bfloat16 operands,
  the products of the rounded operands (jax's results float32, torch's
  bfloat16 as autocast's)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  torch = pytest.importorskip("torch", reason="needs the [torch] extra")
  dense_products = _benchmark_module("dense_products")
  rows, k, n = 12, 5, 7
  rng = np.random.default_rng(0)
  x, w, dy = (rng.normal(size=shape).astype(np.float32)
              for shape in ((rows, k), (k, n), (rows, n)))
  if operand_dtype:  # the values the products see
    x, w, dy = (np.asarray(jnp.asarray(a, operand_dtype), np.float32)
                for a in (x, w, dy))
  dx, dw = jax.grad(lambda x, w: (x @ w * dy).sum(), argnums=(0, 1))(x, w)
  expected = {"x.W": x @ w, "dy.W^T": dx, "x^T.dy": dw}
  operands = {"x.W": (x, w), "dy.W^T": (dy, w), "x^T.dy": (x, dy)}
  put = {"jax": lambda a: jnp.asarray(a, operand_dtype or jnp.float32),
         "torch": lambda a: torch.from_numpy(a).to(
             getattr(torch, operand_dtype or "float32"))}
  result_dtypes = {"jax": "float32", "torch": operand_dtype or "float32"}
  for product in dense_products.DENSE_PRODUCTS:
    lhs, rhs, result = dense_products.dense_product_operands(product, rows,
                                                             k, n)
    assert (lhs, rhs) == tuple(a.shape for a in operands[product])
    assert result == expected[product].shape
    for library in ("jax", "torch"):
      got = dense_products.dense_product_fn(library, product, operand_dtype)(
          *map(put[library], operands[product]))
      assert str(got.dtype).endswith(result_dtypes[library]), library
      got = np.asarray(got.float() if library == "torch" else got)
      # bfloat16 results round to 8 bits.
      tolerance = 1e-5 if result_dtypes[library] == "float32" else 1e-2
      np.testing.assert_allclose(got, expected[product], rtol=tolerance,
                                 atol=tolerance, err_msg=library)


def test_dense_product_rates_weigh_each_width_by_its_flops():
  """Two shapes of width 500 at 100 and 300 GFLOP/s, the second 3x the
  FLOPs: the product's rate is total FLOPs over total time, 1.5e9 x (1 +
  3) / (1.5e9 / 100 + 4.5e9 / 300) = 200; shapes of another width are
  not counted."""
  dense_products = _benchmark_module("dense_products")
  rates = {"x.W 1000x500x1500": 100.0, "x.W 3000x1500x500": 300.0,
           "x.W 1000x192x768": 1.0,  # another width
           "2048x2048x2048": 1.0}  # not a Dense product: not counted
  for product in ("dy.W^T", "x^T.dy"):
    rates.update({f"{product} 10x500x500": 50.0,
                  f"{product} 10x192x768": 7.0})
  result = dense_products.dense_product_rates(rates, 500)
  assert result["x.W"] == pytest.approx(200.0)
  assert result["dy.W^T"] == pytest.approx(50.0)
  assert dense_products.dense_product_rates(rates, 192) == pytest.approx(
      {"x.W": 1.0, "dy.W^T": 7.0, "x^T.dy": 7.0})


def test_dense_product_lines_give_each_raced_width_its_line():
  """One line per width of the raced models, naming them, each product's
  jax / torch rate and ratio; with bfloat16 operands the line says so."""
  dense_products = _benchmark_module("dense_products")
  assert dense_products.dense_shapes(768, 3072) == (
      (768, 2304), (768, 768), (768, 3072), (3072, 768))
  models = ("vit_tiny_cifar", "ViT-Ti/16@224", "ViT-B/16@224")
  assert dense_products.raced_widths(models) == {
      (192, 768): ["vit_tiny_cifar", "ViT-Ti/16@224"],
      (768, 3072): ["ViT-B/16@224"]}
  per_core = {}
  for library, rate in (("jax", 200.0), ("torch", 160.0)):
    per_core[library] = {
        f"{product} {dense_products.DENSE_ROWS}x{k}x{n}": rate * (hidden / 768)
        for hidden, mlp in ((192, 768), (768, 3072))
        for k, n in dense_products.dense_shapes(hidden, mlp)
        for product in dense_products.DENSE_PRODUCTS}
  lines = dense_products.dense_product_lines(per_core, models, "float32")
  assert len(lines) == 2
  assert lines[0].startswith(
      "A Dense layer's products at width 192 (vit_tiny_cifar, "
      "ViT-Ti/16@224), 6304 rows, one core each")
  assert lines[0].endswith("x.W 50 / 40 (1.25), dy.W^T 50 / 40 (1.25), "
                           "x^T.dy 50 / 40 (1.25)")
  assert "width 768 (ViT-B/16@224)" in lines[1]
  assert "x.W 200 / 160 (1.25)" in lines[1]
  assert "bfloat16" not in lines[0]
  bf16_lines = dense_products.dense_product_lines(per_core, models, "bfloat16")
  assert all("bfloat16 operands" in line for line in bf16_lines)


def test_per_core_products_run_xla_and_torch_on_one_thread():
  """The Dense products are compared per core, as the train step runs them
  (a device per core): the per-core worker's XLA_FLAGS keep the caller's
  flags and add single-threaded Eigen, and the worker measures exactly the
  Dense products, not the whole-CPU GEMMs."""
  dense_products = _benchmark_module("dense_products")
  env = dense_products.per_core_environment({"XLA_FLAGS": "--xla_foo=1",
                                             "A": "b"})
  assert env == {"A": "b", "XLA_FLAGS":
                 "--xla_foo=1 --xla_cpu_multi_thread_eigen=false"}
  measured = json.loads(_run(
      "benchmarks/throughput.py", "--worker", "--impl=gemm1-jax",
      env=dense_products.per_core_environment({}), timeout=300)[-1])
  assert sorted(measured) == sorted(
      f"{product} {dense_products.DENSE_ROWS}x{k}x{n}"
      for k, n in dense_products.dense_shapes(192, 768)  # the default race's
      for product in dense_products.DENSE_PRODUCTS)
  assert all(rate > 0 for rate in measured.values())


@pytest.mark.parametrize("name", ["ViT-Ti/16", "ViT-B/16"])
def test_gpu_benchmark_flops_agree_with_xlas_count(name):
  """The analytic matmul FLOPs behind the GPU benchmark's MFU are within 3%
  of XLA's count of the real model's forward pass (which adds the
  elementwise work: softmax, GELU, LayerNorm)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from vit_jax.inspection import introspect  # pylint: disable=import-outside-toplevel
  from vit_jax.model import variants
  gpu_throughput = _benchmark_module("gpu_throughput")
  model = variants.build_model(variants.get_variant(name), 1000)
  params = jax.tree.map(
      lambda s: jnp.zeros(s.shape, s.dtype),
      jax.eval_shape(lambda key: model.init(key, jnp.zeros(
          (1, 224, 224, 3)))["params"], jax.random.PRNGKey(0)))
  counted = introspect.flops_per_image(model, params, (224, 224, 3))
  analytic = gpu_throughput.forward_flops_per_image(name)
  assert 0.97 * counted < analytic <= counted


def test_gpu_benchmark_report_ends_with_the_summary_line():
  gpu_throughput = _benchmark_module("gpu_throughput")
  device = {"device": "NVIDIA H100 80GB HBM3"}
  results = {
      ("ViT-B/16", "train", "vit_jax"): dict(device, images_per_s=1200.0,
                                            compile_s=20.0, peak_gib=30.0),
      ("ViT-B/16", "train", "timm"): dict(device, images_per_s=1000.0,
                                         compile_s=50.0, peak_gib=31.0),
      ("ViT-B/16", "infer", "vit_jax"): dict(device, images_per_s=3000.0,
                                            compile_s=5.0, peak_gib=3.0),
      ("ViT-B/16", "infer", "timm"): {"error": "worker failed"},
  }
  rows = gpu_throughput.report(results, 800.0, ["ViT-B/16"],
                               ["train", "infer"])
  assert any("| timm | failed |" in row for row in rows)
  mfu = 1200.0 * 3 * gpu_throughput.forward_flops_per_image("ViT-B/16") / 8e14
  assert rows[-1] == (f'summary: gpu="NVIDIA H100 80GB HBM3" '
                      f"train_vs_timm=1.20 infer_vs_timm=nan "
                      f"train_mfu={mfu:.2f} compile_s=20.0")


def test_gpu_profile_sums_kernels_of_gpu_streams_by_class(tmp_path):
  """Kernels on the GPU's stream threads count, by class and per step;
  host threads and the GPU's non-stream lines (XLA ops) do not; the busy
  time is the union of overlapping kernels."""
  import gzip  # pylint: disable=import-outside-toplevel
  gpu_profile = _benchmark_module("gpu_profile")
  meta = lambda kind, pid, tid, name: {"ph": "M", "name": kind, "pid": pid,
                                       "tid": tid, "args": {"name": name}}
  kernel = lambda tid, name, ts, dur, pid=2: {
      "ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
  events = [
      meta("process_name", 1, 0, "/host:CPU"),
      meta("process_name", 2, 0, "/device:GPU:0"),
      meta("thread_name", 2, 7, "Stream #7(Compute)"),
      meta("thread_name", 2, 8, "Stream #8(Compute)"),
      meta("thread_name", 2, 9, "XLA Ops"),
      kernel(7, "nvjet_tst_192x192_bf16", 0, 600),
      kernel(8, "cudnn_generated_fort_native_sdpa_sm90", 500, 200),
      kernel(7, "loop_multiply_fusion", 1000, 100),
      kernel(7, "input_reduce_fusion_row_reduction", 1200, 100),
      kernel(9, "fusion.1", 0, 5000),       # an XLA op line, not a kernel
      kernel(0, "PjitFunction", 0, 9000, pid=1),  # the host
      {},
  ]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  summary = gpu_profile.kernel_time_by_class(str(path), num_steps=2)
  assert summary["ms_per_step_by_class"] == {
      "GEMM": 0.3, "attention (cuDNN)": 0.1, "elementwise fusions": 0.05,
      "reduction fusions": 0.05}
  assert summary["gpu_busy_ms_per_step"] == 0.45  # 0-700, 1000-1100, 1200-1300
  assert summary["kernels_per_step"] == 2.0


def test_gpu_profile_names_fused_kernels_by_their_jax_scope(tmp_path):
  """fusion_scopes maps each fusion of a compiled program's HLO text, under
  the name a trace gives its kernel ("." as "_"), to the JAX scope of its
  operation: here two named scopes of a CPU program, each to its own; a
  fusion without metadata of its own takes its fused computation's root's.
  kernel_time_by_class then names the busiest kernels' scopes."""
  import gzip  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  gpu_profile = _benchmark_module("gpu_profile")

  def program(x):
    with jax.named_scope("first_scope"):
      y = jnp.sin(x) * 2 + 1
    with jax.named_scope("second_scope"):
      return jnp.sum(jnp.exp(y) * x, axis=1)

  hlo = jax.jit(program).lower(jnp.ones((64, 256))).compile().as_text()
  scopes = gpu_profile.fusion_scopes(hlo)
  fusions = re.findall(r"%([\w.]+) = \S+ fusion\(", hlo)
  assert fusions and all(name.replace(".", "_") in scopes
                         for name in fusions)
  assert any("second_scope" in scope for scope in scopes.values())
  assert "." not in "".join(scopes)
  synthetic = "\n".join([
      "%fused_computation.3 (param_0: f32[4]) -> f32[4] {",
      "  %param_0 = f32[4]{0} parameter(0)",
      '  ROOT %exp.1 = f32[4]{0} exponential(%param_0), '
      'metadata={op_name="jit(f)/softmax/exp" source_file="a.py"}',
      "}",
      "ENTRY %main (p: f32[4]) -> f32[4] {",
      "  %p = f32[4]{0} parameter(0)",
      "  ROOT %loop_exponential_fusion.7 = f32[4]{0} fusion(%p), "
      "kind=kLoop, calls=%fused_computation.3",
      "}"])
  assert gpu_profile.fusion_scopes(synthetic) == {
      "loop_exponential_fusion_7": "jit(f)/softmax/exp"}
  events = [{"ph": "M", "name": "process_name", "pid": 2, "tid": 0,
             "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7,
             "args": {"name": "Stream #7(Compute)"}},
            {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 50,
             "name": "loop_exponential_fusion_7"},
            {"ph": "X", "pid": 2, "tid": 7, "ts": 60, "dur": 10,
             "name": "nvjet_tst_bf16"}]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  summary = gpu_profile.kernel_time_by_class(str(path), 1, synthetic)
  assert summary["top_kernel_scopes"] == {
      "loop_exponential_fusion_7": "jit(f)/softmax/exp"}
  assert "top_kernel_scopes" not in gpu_profile.kernel_time_by_class(
      str(path), 1)


def test_throughput_benchmark_names_the_cpu_and_its_isa():
  """The CPU model and ISA flags the benchmark prints (and puts in its
  summary line) are /proc/cpuinfo's."""
  model, isa = _benchmark_module("race_report").cpu_description()
  with open("/proc/cpuinfo") as f:
    cpuinfo = f.read()
  assert model and model in cpuinfo
  flags = set(re.findall(r"^(?:flags|Features)\s*:(.*)$", cpuinfo,
                         re.M)[0].split())
  assert isa and set(isa) <= flags


def _git(cwd, *args: str) -> str:
  return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True,
                        text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_benchmarks_name_the_code_they_time_and_warn_of_another_checkouts():
  """code_line names the vit_jax this process imports, with this checkout's
  commit where it is one; timed from a script in another folder (as from a
  clone while an editable install points here), it warns and says how to
  time that folder's code instead."""
  import vit_jax  # pylint: disable=g-import-not-at-top
  race_report = _benchmark_module("race_report")
  package = pathlib.Path(vit_jax.__file__).resolve().parent
  line = race_report.code_line(package.parent)
  assert line.startswith(f"Code: vit_jax from {package}")
  assert "WARNING" not in line
  if (package.parent / ".git").exists():  # a checkout, not an installed copy
    commit = _git(package.parent, "rev-parse", "--short", "HEAD")
    assert f", git {commit}" in line
  elsewhere = race_report.code_line(pathlib.Path("/tmp/another_clone"))
  assert elsewhere.startswith(line)
  assert "WARNING: not this script's checkout (/tmp/another_clone)" in elsewhere
  assert "PYTHONPATH=/tmp/another_clone" in elsewhere


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_state_says_commit_and_changes_only_at_a_checkouts_top(tmp_path):
  """A checkout's top: its commit, then whether tracked files changed
  (untracked ones do not count); a folder inside it (site-packages of a
  venv in a clone) and a folder outside any: nothing."""
  git_state = _benchmark_module("race_report").git_state
  repo = tmp_path / "repo"
  (repo / "inner").mkdir(parents=True)
  assert git_state(repo) == ""
  _git(repo, "init", "-q")
  (repo / "model.py").write_text("x = 1\n")
  _git(repo, "add", "model.py")
  _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
  commit = _git(repo, "rev-parse", "--short", "HEAD")
  (repo / "notes.txt").write_text("untracked\n")
  assert git_state(repo) == f", git {commit}"
  assert git_state(repo / "inner") == ""
  (repo / "model.py").write_text("x = 2\n")
  assert git_state(repo) == f", git {commit}, with uncommitted changes"


def test_throughput_summary_takes_the_worst_workload_against_fastest_torch():
  """The table and summary line of a race, from made-up worker results:
  each ratio is vit_jax's mean over its rounds against the fastest
  PyTorch variant's mean, the summary the worst model's, the GEMM fraction
  the worst training GFLOP/s over the rate, compile the slowest round;
  eager PyTorch, which compiles nothing, shows "-" for it."""
  race_report = _benchmark_module("race_report")
  worker = lambda rate, **extra: {"images_per_s": rate, "compile_s": 1.0,
                                  "peak_rss_mib": 100.0, **extra}
  eager = lambda rate: {"images_per_s": rate, "peak_rss_mib": 100.0}
  speeds = {("vit_tiny_cifar", "train"): (100.0, 60.0, 80.0),
            ("vit_tiny_cifar", "infer"): (300.0, 200.0, 250.0),
            ("ViT-Ti/16@224", "train"): (30.0, 25.0, 20.0),
            ("ViT-Ti/16@224", "infer"): (90.0, 50.0, 100.0)}
  results = {}
  for (model, mode), (jax_rate, timm, tv_compile) in speeds.items():
    flops = 1e9 if model == "vit_tiny_cifar" else 4e9
    results[model, mode, "vit_jax"] = [
        worker(jax_rate * 0.9, flops_per_image=flops, compile_s=2.0),
        worker(jax_rate * 1.1, flops_per_image=flops, compile_s=3.5)]
    results[model, mode, "timm"] = [eager(timm)]
    results[model, mode, "timm+compile"] = [worker(timm * 0.5)]
    results[model, mode, "torchvision"] = [eager(timm * 0.5)]
    results[model, mode, "torchvision+compile"] = [worker(tv_compile),
                                                   worker(tv_compile)]
  race = race_report.Race(
      results, {"torch": {"2048x2048x2048": 200.0,
                          "bf16 2048x2048x2048": 400.0}}, {}, [])
  # "% GEMM" is of PyTorch's rate in the race's operand dtype.
  assert race.gemm_rate("float32") == 200.0
  assert race.gemm_rate("bfloat16") == 400.0
  rows = race_report.results_table(race, gemm_rate=200.0)
  assert len(rows) == 2 + 4 * 5
  cifar_train = next(row for row in rows
                     if row.startswith("| vit_tiny_cifar train | vit_jax"))
  # 100 images/s against torchvision + compile's 80; 100 GFLOP/s of 200.
  assert cifar_train.split(" | ")[1:6] == [
      "vit_jax (2 rounds)", "100.0", "100", "50", "1.25"]
  compile_cells = {row.split(" | ")[1]: row.split(" | ")[6] for row in rows
                   if row.startswith("| vit_tiny_cifar train")}
  assert compile_cells == {"vit_jax (2 rounds)": "2.8", "timm": "-",
                           "timm+compile": "1.0", "torchvision": "-",
                           "torchvision+compile (2 rounds)": "1.0"}
  summary = race_report.summary_line(race, 200.0, "Some CPU")
  # train: min(100/80, 30/25); infer: min(300/250, 90/100); the GEMM
  # fraction: min(100 * 1, 30 * 4) GFLOP/s over 200.
  assert summary == ('summary: train_vs_timm=1.20 infer_vs_timm=0.90 '
                     'train_gemm_fraction=0.50 compile_s=3.5 cpu="Some CPU"')
  assert re.fullmatch(r'summary: train_vs_timm=\d+\.\d\d infer_vs_timm='
                      r'\d+\.\d\d train_gemm_fraction=\d+\.\d\d '
                      r'compile_s=\d+\.\d cpu="[^"]+"', summary)


def test_throughput_says_when_pytorchs_gemm_holds_its_side_back():
  """A float32 race whose PyTorch GEMM runs below 3/4 of jax's says so,
  with its fraction, and on an AMD CPU why (MKL's AVX2 kernels); a race
  with the two rates close, or with bfloat16 products, says nothing."""
  race_report = _benchmark_module("race_report")
  rates = lambda torch, jax: {"torch": {"2048x2048x2048": torch},
                              "jax": {"2048x2048x2048": jax}}
  [amd] = race_report.torch_gemm_lines(rates(233.0, 541.0), "AuthenticAMD",
                                       "float32")
  assert amd.startswith("PyTorch's float32 GEMM runs at 0.43 of jax's")
  assert "MKL" in amd and "AVX2" in amd
  [intel] = race_report.torch_gemm_lines(rates(233.0, 541.0), "GenuineIntel",
                                         "float32")
  assert "0.43" in intel and "MKL" not in intel
  assert race_report.torch_gemm_lines(rates(187.0, 220.0), "AuthenticAMD",
                                      "float32") == []
  assert race_report.torch_gemm_lines(rates(233.0, 541.0), "AuthenticAMD",
                                      "bfloat16") == []


def test_throughput_command_line_reruns_the_race():
  """The printed command is the one that reruns it, options included."""
  race_report = _benchmark_module("race_report")
  throughput = _benchmark_module("throughput")
  assert (race_report.command_line(throughput.parse_args([]))
          == "python benchmarks/throughput.py")
  argv = ["--no-fast_malloc", "--cpu_devices=0", "--steps=3", "--batch=1",
          "--max_isa=avx2", "--matmul_dtype=bfloat16", "--growth"]
  assert (race_report.command_line(throughput.parse_args(argv))
          == "python benchmarks/throughput.py " + " ".join(argv))
  # An LD_PRELOAD of the user's reaches every worker, so it is part of it.
  assert (race_report.command_line(throughput.parse_args([]),
                                   {"LD_PRELOAD": "a.so b.so", "HOME": "/"})
          == "LD_PRELOAD='a.so b.so' python benchmarks/throughput.py")
  assert (race_report.command_line(throughput.parse_args([]), {"HOME": "/"})
          == "python benchmarks/throughput.py")
  # The summary's cpu="…" says what the race changed from the default one.
  assert race_report.summary_cpu(throughput.parse_args([]), "CPU") == "CPU"
  assert race_report.summary_cpu(throughput.parse_args(argv), "CPU") == (
      "CPU capped at AVX2, bfloat16 products vs torch autocast, batch 1")
  assert race_report.summary_cpu(throughput.parse_args(
      ["--models=ViT-B/16@224"]), "CPU") == "CPU, models ViT-B/16@224"


def test_throughput_names_the_missing_pytorch_packages_and_their_extra():
  """Without torch, torchvision or timm the race stops before its first
  worker, naming what is missing and the extra that installs it."""
  throughput = _benchmark_module("throughput")
  assert throughput.missing_packages(
      lambda name: None if name in ("timm", "torch") else object()) == [
          "torch", "timm"]
  assert throughput.missing_packages(lambda name: object()) == []
  # The script itself, with the three blocked from importing.
  result = run_python(
      "-c", "import runpy, sys\n"
      "for name in ('torch', 'torchvision', 'timm'): sys.modules[name] = None\n"
      "sys.argv = ['throughput.py']; sys.path.insert(0, 'benchmarks')\n"
      "runpy.run_path('benchmarks/throughput.py', run_name='__main__')",
      timeout=120)
  assert result.returncode == 1, result.stderr[-2000:]
  assert ("torch, torchvision, timm cannot be imported here: pip install -e "
          "'.[bench]'") in result.stderr


def test_throughput_batch_option_reaches_every_worker():
  """--batch goes to the workers of both libraries (the model's batches
  without it), and each worker reports the batch it timed: a timm worker
  and a vit_jax worker at batch 1 (vit_jax then on one device)."""
  race_workers = _benchmark_module("race_workers")
  throughput = _benchmark_module("throughput")
  default = throughput.parse_args([])
  single = throughput.parse_args(["--batch=1"])
  for impl in ("vit_jax",) + race_workers.TORCH_IMPLS:
    assert not any(arg.startswith("--batch") for arg in
                   throughput.worker_args(default, impl, "vit_tiny_cifar",
                                          "infer"))
    assert "--batch=1" in throughput.worker_args(single, impl,
                                                 "vit_tiny_cifar", "infer")
  for impl in ("timm", "vit_jax"):
    measured = json.loads(_run(
        "benchmarks/throughput.py", "--worker",
        *throughput.worker_args(throughput.parse_args(
            ["--batch=1", "--steps=1"]), impl, "vit_tiny_cifar", "infer"),
        env={"XLA_FLAGS": ""}, timeout=300)[-1])
    assert measured["batch"] == 1 and measured["images_per_s"] > 0, measured
    if impl == "vit_jax":
      assert "device_count" not in measured["xla_flags"], measured


def test_throughput_races_the_models_asked_for(capsys):
  """--models picks the raced models (the default: issue 47's two); the
  command line names them; an unknown name is refused with the choices;
  a race's table and summary cover the models it ran, with the paper's
  Table 1 dims for ViT-B/16."""
  race_report = _benchmark_module("race_report")
  race_workers = _benchmark_module("race_workers")
  throughput = _benchmark_module("throughput")
  assert throughput.parse_args([]).models == ("vit_tiny_cifar",
                                              "ViT-Ti/16@224")
  argv = ["--models=ViT-S/16@224,ViT-B/16@224"]
  args = throughput.parse_args(argv)
  assert args.models == ("ViT-S/16@224", "ViT-B/16@224")
  assert (race_report.command_line(args)
          == "python benchmarks/throughput.py " + argv[0])
  with pytest.raises(SystemExit):
    throughput.parse_args(["--models=ViT-B/16@224,ViT-X/3"])
  assert "unknown model(s) ViT-X/3; choose from" in capsys.readouterr().err
  base = race_workers.MODELS["ViT-B/16@224"]
  assert (base.image_size, base.train_batch, base.infer_batch) == (224, 32,
                                                                   64)
  assert base.dims() == dict(patch_size=16, hidden_size=768, num_layers=12,
                             num_heads=12, mlp_dim=3072)
  for model in race_workers.MODELS.values():  # vit_jax's table, every one
    assert model.dims() == variants.VARIANTS[model.variant], model
  worker = lambda rate: {"images_per_s": rate, "compile_s": 9.0,
                         "peak_rss_mib": 1.0, "flops_per_image": 1e11}
  results = {}
  for mode, jax_rate in (("train", 2.0), ("infer", 6.0)):
    for impl in ("vit_jax",) + race_workers.TORCH_IMPLS:
      results["ViT-B/16@224", mode, impl] = [
          worker(jax_rate if impl == "vit_jax" else 1.6)]
  race = race_report.Race(results, {}, {}, [])
  assert race.models == ["ViT-B/16@224"]
  assert len(race_report.results_table(race, 200.0)) == 2 + 2 * 5
  assert race_report.summary_line(race, 200.0, "CPU, models ViT-B/16@224") == (
      'summary: train_vs_timm=1.25 infer_vs_timm=3.75 '
      'train_gemm_fraction=1.00 compile_s=9.0 '
      'cpu="CPU, models ViT-B/16@224"')


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train", "infer"])
def test_gpu_flags_benchmark_compares_its_variants(mode):
  """benchmarks/gpu_flags.py at a toy size (on a CPU the GPU options
  compile and change nothing): one row per variant, the summary parses."""
  result = run_python(
      "benchmarks/gpu_flags.py", "--model=ViT-Ti/16", "--batch=2",
      "--num_layers=2", f"--mode={mode}", "--rounds=1", "--steps=1",
      "--variants=Triton GEMMs,JAX's matmul gradients,"
      "unpadded cuDNN attention,q/k/v fused", timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert "--num_layers=2" in lines[0]  # the command, as run
  rows = [line for line in lines if line.startswith("| ")][1:]
  # Each mode's own variants only.
  names = ["as is", "Triton GEMMs", {
      "train": "JAX's matmul gradients",
      "infer": "unpadded cuDNN attention"}[mode], "q/k/v fused"]
  assert [row.split("|")[1].strip() for row in rows] == names, lines
  assert float(rows[0].split("|")[4]) == 1.0  # as is against itself
  assert all(float(row.split("|")[6]) > 0 for row in rows)  # scratch MiB
  summary = re.fullmatch(r'summary: best="([^"]+)" best_over_as_is=([\d.]+)',
                         lines[-1])
  assert summary and summary.group(1) in lines[-1], lines[-1]
  assert 0.0 < float(summary.group(2)) <= 1.0


@pytest.mark.slow
def test_input_benchmark_prints_its_summary(tmp_path):
  """benchmarks/input_throughput.py at toy sizes: every part runs and the
  summary line parses; the worker's memory is a light process's (the
  script keeps JAX out of its top level, as the command line does)."""
  result = run_python(
      "benchmarks/input_throughput.py", "--num_images=48", "--workers=1",
      "--rss_files=300", "--batch_size=8", "--steps=1", "--rounds=1",
      f"--cache_dir={tmp_path}", timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  summary = re.fullmatch(r"summary: decode_images_per_s_per_worker=([\d.]+) "
                         r"folder_over_memory=([\d.]+) rss_mib=(\d+)",
                         lines[-1])
  assert summary, lines[-1]
  assert float(summary.group(1)) > 0 and 0.2 < float(summary.group(2)) < 5
  worker_mib = [float(line.split("its worker ")[1].rstrip(")"))
                for line in lines if "its worker" in line]
  assert worker_mib and max(worker_mib) < 450, lines


# A train step's program as XLA:CPU prints it, cut down to one of each kind
# of thunk cpu_profile.py tells apart (the shapes of a (4 -> 6) Dense layer
# on 8 rows).
_TINY_HLO = r"""HloModule jit_train_step, entry_computation_layout={()}

%fused_computation (param_0: f32[8,4], param_1: f32[4,6]) -> f32[8,6] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = f32[4,6]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,6]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/jvp(VisionTransformer)/Transformer/MlpBlock_3/Dense_0/dot_general"}
}

%transpose_computation (param_0.1: f32[4,6]) -> f32[6,4] {
  %param_0.1 = f32[4,6]{1,0} parameter(0)
  ROOT %transpose.1 = f32[6,4]{1,0} transpose(%param_0.1), dimensions={1,0}
}

%wrapped_reduce-window_computation (param_0.2: f32[8,6], param_1.2: f32[]) -> f32[1,6] {
  %param_0.2 = f32[8,6]{1,0} parameter(0)
  %param_1.2 = f32[] parameter(1)
  ROOT %reduce-window.1 = f32[1,6]{1,0} reduce-window(%param_0.2, %param_1.2), window={size=8x1}, to_apply=%add
}

%norm_computation (param_0.3: f32[1,6]) -> f32[1,6] {
  %param_0.3 = f32[1,6]{1,0} parameter(0)
  ROOT %sqrt.1 = f32[1,6]{1,0} sqrt(%param_0.3), metadata={op_name="jit(train_step)/jvp(VisionTransformer)/Transformer/LayerNorm_0/sqrt"}
}

%update_computation (param_0.4: f32[4,6], param_1.4: f32[4,6]) -> f32[4,6] {
  %param_0.4 = f32[4,6]{1,0} parameter(0)
  %param_1.4 = f32[4,6]{1,0} parameter(1)
  ROOT %subtract.1 = f32[4,6]{1,0} subtract(%param_0.4, %param_1.4), metadata={op_name="jit(train_step)/optimizer/jit(leaf_update)/sub"}
}

ENTRY %main.1 (p0: f32[4,6], p1: f32[8,4], p2: f32[8,6]) -> (f32[4,6], f32[1,6]) {
  %p0 = f32[4,6]{1,0} parameter(0), metadata={op_name="state.params[\'Dense_0\'][\'kernel\']"}
  %p1 = f32[8,4]{1,0} parameter(1), metadata={op_name="images"}
  %p2 = f32[8,6]{1,0} parameter(2), metadata={op_name="dy"}
  %c = f32[] constant(0)
  %ynn_fusion.1 = f32[8,6]{1,0} fusion(%p1, %p0), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(train_step)/jvp(VisionTransformer)/Transformer/MlpBlock_3/Dense_0/dot_general"}
  %transpose_copy_fusion = f32[6,4]{1,0} fusion(%p0), kind=kLoop, calls=%transpose_computation
  %dot.2 = f32[8,4]{1,0} dot(%p2, %transpose_copy_fusion), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(VisionTransformer))/Transformer/MlpBlock_3/Dense_0/dot_general"}
  %dot.3 = f32[4,6]{1,0} dot(%p1, %p2), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(VisionTransformer))/Transformer/MlpBlock_3/Dense_0/dot_general"}
  %custom-call = (f32[8,4]{1,0}, f32[8,4]{1,0}) custom-call(%dot.2), custom_call_target="VitAttentionForwardForTraining", metadata={op_name="jit(train_step)/jvp(VisionTransformer)/Transformer/MultiHeadDotProductAttention_1/VitAttentionForwardForTraining"}
  %all-reduce.1 = f32[4,6]{1,0} all-reduce(%dot.3), replica_groups={}, to_apply=%add, metadata={op_name="jit(train_step)/reduce_sum"}
  %wrapped_reduce-window = f32[1,6]{1,0} fusion(%ynn_fusion.1, %c), kind=kLoop, calls=%wrapped_reduce-window_computation
  %bitcast.1 = f32[1,6]{1,0} bitcast(%wrapped_reduce-window)
  %norm_fusion = f32[1,6]{1,0} fusion(%bitcast.1), kind=kLoop, calls=%norm_computation
  %update_fusion = f32[4,6]{1,0} fusion(%p0, %all-reduce.1), kind=kLoop, calls=%update_computation
  ROOT %tuple.1 = (f32[4,6]{1,0}, f32[1,6]{1,0}) tuple(%update_fusion, %norm_fusion)
}
"""


def test_cpu_profile_tells_each_thunk_kind_apart():
  """Each thunk of the cut-down program gets its kind: the forward product
  (a YNNPACK fusion), the input gradient (it reads the weights through a
  transposing copy), the weight gradient (two activations), the kernel,
  the all-reduce, the copy, a reduce-window XLA made without a scope (its
  reader's, LayerNorm), the optimizer's update, oneDNN's three products by
  their custom calls (float32 and bfloat16 operands), the AdamW kernel and
  a sum written as a product with ones; FLOPs 2 x m x n x k."""
  hlo_kinds = _benchmark_module("hlo_kinds")
  module = hlo_kinds.parse_hlo(_TINY_HLO)
  consumers = hlo_kinds.thunk_consumers(module)
  assert consumers["wrapped_reduce-window"] == {"norm_fusion"}  # via bitcast
  assert consumers["dot.3"] == {"all-reduce.1"}

  def kind(name):
    reader = hlo_kinds.reader_op_name(name, module, consumers)
    return hlo_kinds.classify(module.instructions[name], module, reader)

  assert kind("ynn_fusion.1") == ("x.W (forward)", 2 * 8 * 6 * 4)
  assert kind("dot.2") == ("dy.W^T (input gradients)", 2 * 8 * 4 * 6)
  assert kind("dot.3") == ("x^T.dy (weight gradients)", 2 * 4 * 6 * 8)
  assert kind("custom-call")[0] == "attention kernel (C++)"
  transpose = hlo_kinds.Instruction(
      "custom-call.2", "bf16[1,4,8]{2,1,0}", "custom-call", ("p1",),
      'custom_call_target="VitTransposeToBfloat16"', False, -1)
  assert hlo_kinds.classify(transpose, module) == (
      "bfloat16 transposes (C++)", 0.0)
  for target in ("VitAdamW", "VitSumOfSquares"):
    optimizer = transpose._replace(
        attributes=f'custom_call_target="{target}"')
    assert hlo_kinds.classify(optimizer, module) == (
        "optimizer (AdamW, gradient norm)", 0.0)
  # oneDNN's products (kernels/cpu_gemm.py): one group of the 8 rows.
  for name, shape in (("x", "f32[1,8,4]"), ("dy", "f32[1,8,6]")):
    module.instructions[name] = hlo_kinds.Instruction(
        name, shape + "{2,1,0}", "bitcast", (), "", False, -1)
  products = {"VitGemm": (("x", "p0"), "f32[1,8,6]", "x.W (forward)"),
              "VitGemmTransposedRight": (("dy", "p0"), "f32[1,8,4]",
                                         "dy.W^T (input gradients)"),
              "VitGemmOverRows": (("x", "dy"), "f32[1,4,6]",
                                  "x^T.dy (weight gradients)")}
  # Every oneDNN product the kernels register, float32 and bfloat16
  # operands alike (their results are float32).
  targets = [t for t in cpu_build.TARGETS if t.startswith("VitGemm")]
  assert len(targets) == 6
  for target in targets:
    operands, shape, product = products[target.removesuffix("Bf16")]
    call = hlo_kinds.Instruction(
        "custom-call.3", shape + "{2,1,0}", "custom-call", operands,
        f'custom_call_target="{target}"', False, -1)
    assert hlo_kinds.classify(call, module) == (product, 2 * 8 * 4 * 6)
  # The gradients of two kernels side by side, (4, 2) and (4, 4), apart.
  split = hlo_kinds.Instruction(
      "custom-call.4", "(f32[1,4,2]{2,1,0}, f32[1,4,4]{2,1,0})",
      "custom-call", ("x", "dy"), 'custom_call_target="VitGemmOverRows"',
      False, -1)
  assert hlo_kinds.classify(split, module) == (
      "x^T.dy (weight gradients)", 2 * 8 * 4 * 6)
  assert kind("all-reduce.1")[0] == "all-reduce (waiting included)"
  assert kind("transpose_copy_fusion")[0] == "copies and transposes"
  assert kind("wrapped_reduce-window")[0] == "LayerNorm"
  assert kind("update_fusion")[0] == "optimizer (AdamW, gradient norm)"
  # A sum over the batch as a product with ones (the position embedding's
  # gradient, `xla_products.add_to_every_example`): its scope's, no FLOPs.
  module.instructions["ones"] = hlo_kinds.Instruction(
      "ones", "f32[8,1]{1,0}", "fusion", (), 'calls=%broadcast_computation, '
      'metadata={op_name="jit(train_step)/transpose(jvp(VisionTransformer))'
      '/Transformer/Transformer._add_learned_posemb/broadcast_in_dim"}',
      False, -1)
  sum_as_product = module.instructions["dot.3"]._replace(
      name="dot.4", operands=("ones", "p2"), attributes="")
  assert hlo_kinds.classify(sum_as_product, module) == (
      "embedding, head, residual adds", 0.0)


def test_cpu_profile_charges_a_devices_waits_to_the_matmuls_it_waits_on():
  """A device's timeline: an asynchronous dot is launched, the device waits
  until its reader starts (charged to the dot); two outstanding dots share
  a wait by FLOPs; a wait with none outstanding is unexplained."""
  cpu_profile = _benchmark_module("cpu_profile")
  hlo_kinds = _benchmark_module("hlo_kinds")
  module = hlo_kinds.parse_hlo(_TINY_HLO)
  consumers = hlo_kinds.thunk_consumers(module)
  event = cpu_profile.ThunkEvent
  flops = {"dot.2": 1e10, "dot.3": 3e10}
  timeline = [event("ynn_fusion.1", 0.0, 1.0), event("dot.2", 1.0, 1.5),
              event("dot.3", 1.5, 2.0),  # both outstanding until 6
              event("custom-call", 6.0, 7.0),  # reads dot.2
              event("all-reduce.1", 7.0, 8.0),  # reads dot.3
              event("wrapped_reduce-window", 9.0, 10.0)]  # a wait of 1
  waiting, shared, unexplained = cpu_profile.attribute_gaps(
      timeline, module, consumers, flops)
  assert waiting == pytest.approx({"dot.2": 1.0, "dot.3": 3.0})
  assert shared == pytest.approx({"dot.2": 1.0, "dot.3": 3.0})
  assert unexplained == pytest.approx(1.0)
  # A dot that would take 2 s at the slowest rate a dot runs, read only
  # at 5 s: charged the wait within its 2 s, not the one after.
  small = {"dot.2": 2.0 * cpu_profile.SLOWEST_DOT_FLOPS_PER_S, "dot.3": 1.0}
  timeline = [event("dot.2", 0.0, 0.5),  # a wait of 0.5 follows
              event("ynn_fusion.1", 1.0, 1.5),  # then one of 3.5
              event("custom-call", 5.0, 6.0)]  # reads dot.2
  waiting, _, unexplained = cpu_profile.attribute_gaps(
      timeline, module, consumers, small)
  assert waiting == pytest.approx({"dot.2": 0.5})
  assert unexplained == pytest.approx(3.5)


def test_cpu_profile_times_a_real_train_step_by_product(tmp_path):
  """A two-layer MLP's train step, compiled and profiled here: the FLOPs
  found per kind are the step's (forward x.W of both layers, the input
  gradient of the second layer only, both weight gradients), the
  optimizer's scope is found, and the kinds add up to the step's wall
  time. This is what ties the script to this jaxlib's trace format."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  cpu_profile = _benchmark_module("cpu_profile")

  def train_step(params, x):
    def loss(params):
      hidden = jnp.tanh(x @ params["w1"])
      return jnp.sum((hidden @ params["w2"]) ** 2)
    grads = jax.grad(loss)(params)
    with jax.named_scope("optimizer"):
      return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(64, 128)).astype(np.float32),
            "w2": rng.normal(size=(128, 32)).astype(np.float32)}
  x = rng.normal(size=(256, 64)).astype(np.float32)
  compiled = jax.jit(train_step).lower(params, x).compile()

  class Step:
    def __call__(self):
      jax.block_until_ready(compiled(params, x))

  Step()()
  times, trace = cpu_profile.profiled_steps(Step(), 3, str(tmp_path))
  profile = cpu_profile.profile_by_kind(compiled.as_text(), trace,
                                        times.wall_s)
  assert profile.flops["x.W (forward)"] == 2 * 256 * (64 * 128 + 128 * 32)
  assert profile.flops["dy.W^T (input gradients)"] == 2 * 256 * 32 * 128
  assert profile.flops["x^T.dy (weight gradients)"] == (
      2 * 256 * (64 * 128 + 128 * 32))
  assert profile.thunks["optimizer (AdamW, gradient norm)"] >= 1
  assert sum(profile.seconds.values()) == pytest.approx(times.wall_s,
                                                        rel=1e-3)
  assert all(seconds >= 0 for seconds in profile.seconds.values())


def test_cpu_profile_command_prints_its_table_and_summary():
  """The command on a two-layer ViT at 16 px: a row for each of a Dense
  layer's three products, one thunk each per Dense layer (4 a block) plus
  the patch embedding and head, and a summary whose shares cover the
  step."""
  lines = _run("benchmarks/cpu_profile.py", "--image_size=16",
               "--patch_size=4", "--batch=4", "--num_layers=2", "--steps=2",
               env={"XLA_FLAGS": ""}, timeout=300)
  assert lines[0].startswith("python benchmarks/cpu_profile.py")
  assert lines[1].startswith("CPU: ")
  rows = {cells[0].rstrip(" ~"): cells[1:] for cells in (
      [c.strip() for c in line.strip("|").split("|")]
      for line in lines if line.startswith("| "))}
  for product in ("x.W (forward)", "dy.W^T (input gradients)",
                  "x^T.dy (weight gradients)"):
    assert int(rows[product][2]) == 4 * 2 + 2, (product, lines)
  summary = re.fullmatch(
      r"summary: step_ms=(\d+) dense=([\d.]+) attention=([\d.]+) "
      r"elementwise=([\d.]+) optimizer=([\d.]+) copies=([\d.]+) "
      r"all_reduce=([\d.]+) other=([\d.]+) waiting=([\d.]+) "
      r'between_steps=([\d.]+) cpu="[^"]+"', lines[-1])
  assert summary, lines[-1]
  shares = [float(share) for share in summary.groups()[1:]]
  # Nine shares, each rounded to 0.01.
  assert sum(shares) == pytest.approx(1.0, abs=0.05), lines
  assert shares[0] > 0 and shares[3] > 0, lines  # products and optimizer


def test_vector_width_benchmark_times_both_widths_of_the_same_kernels():
  """benchmarks/vector_width.py at toy sizes: its LayerNorm is flax's, its
  GELU gradient JAX's, and both widths give those values; the summary
  parses."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  vector_width = _benchmark_module("vector_width")
  rng = np.random.default_rng(0)
  x, grad = (rng.standard_normal((8, 16), np.float32) for _ in range(2))
  scale, offset = (rng.standard_normal(16, np.float32) for _ in range(2))
  flax_norm = nn.LayerNorm(epsilon=1e-6)
  np.testing.assert_allclose(
      vector_width.layer_norm(x, scale, offset),
      flax_norm.apply({"params": {"scale": scale, "bias": offset}}, x),
      rtol=1e-5, atol=1e-5)
  bias = scale
  for width in vector_width.WIDTHS:
    got = jax.jit(vector_width.gelu_gradient).lower(x, bias, grad).compile(
        compiler_options={"xla_cpu_prefer_vector_width": width})(
            x, bias, grad)
    want = jax.grad(lambda x: (jax.nn.gelu(x + bias) * grad).sum())(x)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want.sum(0), rtol=1e-5, atol=1e-5)

  lines = _run("benchmarks/vector_width.py", "--rows=16", "--repeats=2",
               env=ONE_DEVICE)
  assert lines[0].startswith("Command: python benchmarks/vector_width.py")
  summary = re.fullmatch(r'summary: gelu=([\d.]+) gelu_gradient=([\d.]+) '
                         r'layernorm=([\d.]+) cpu="[^"]+"', lines[-1])
  assert summary, lines[-1]
  assert all(float(ratio) > 0 for ratio in summary.groups())


@pytest.mark.skipif(cpu_build.load() is not None,
                    reason=f"the CPU kernels cannot be built here: "
                    f"{cpu_build.load()}")
@pytest.mark.parametrize("dtype,memory", [("float32", "hot"),
                                          ("bfloat16", "cold")])
def test_attention_pair_benchmark_times_both_trees_at_each_token_count(
    dtype, memory):
  """benchmarks/attention_pair.py builds its C++ harness against two
  kernel trees (here this one twice) and reports each tree at each token
  count, the products' rates consistent with the times, and a summary
  with the two trees' ratios; in float32 with the probabilities in cache
  (the defaults) and with bfloat16 products and the probabilities in
  memory untouched since their last use."""
  options = ([] if (dtype, memory) == ("float32", "hot")
             else [f"--dtype={dtype}", f"--memory={memory}"])
  csrc = str(cpu_build.SOURCES[0].parent)
  lines = _run("benchmarks/attention_pair.py", "--tokens=17,33",
               "--rounds=1", f"--against={csrc}", *options)
  assert lines[0].startswith("Command: python benchmarks/attention_pair.py")
  rows = [re.match(rf"(\d+) tokens, {dtype}, p {memory}, (this|against) "
                   r"tree .*: forward "
                   r"([\d.]+) us \((\d+) GFLOP/s\), backward ([\d.]+) us",
                   line) for line in lines[2:-1]]
  assert [(r.group(1), r.group(2)) for r in rows] == [
      ("17", "this"), ("17", "against"), ("33", "this"), ("33", "against")]
  for row in rows:
    tokens, forward_us = int(row.group(1)), float(row.group(3))
    # Two products, tokens x padded keys x 64 and tokens x 64 x tokens
    # (the keys padded to a multiple of 16). The time is printed to 0.1 us
    # and the rate to 1 GFLOP/s, so the rate must lie between those of the
    # shortest and the longest time that print as this one; a pass of ~1 us
    # leaves 5% either way.
    padded = (tokens + 15) // 16 * 16
    flops = 2 * tokens * padded * 64 + 2 * tokens * 64 * tokens
    fastest = flops / max(forward_us - 0.05, 1e-3) / 1e3
    slowest = flops / (forward_us + 0.05) / 1e3
    assert slowest - 0.5 <= int(row.group(4)) <= fastest + 0.5, row.group(0)
  summary = re.fullmatch(
      r'summary: tokens=17 forward_us=([\d.]+) backward_us=([\d.]+) '
      rf'dtype={dtype} memory={memory} '
      r'forward_ratio=([\d.]+) backward_ratio=([\d.]+) cpu="[^"]+"',
      lines[-1])
  assert summary, lines[-1]
  assert all(float(value) > 0 for value in summary.groups())


def test_latency_stats_take_nearest_rank_percentiles_and_count_slow_steps():
  """Percentiles by the nearest rank (numpy's inverted CDF), the median as
  statistics takes it, and the slow steps' share against 1.3 x the
  median: 98 steps of 1 ms, one of 1.31 ms (slow) and
  one of 10 ms; then random times against numpy."""
  latency = _benchmark_module("latency")
  stats = latency.latency_stats([0.001] * 98 + [0.00131, 0.010])
  assert stats["median_ms"] == pytest.approx(1.0)
  assert stats["mean_ms"] == pytest.approx((98 + 1.31 + 10) / 100)
  assert stats["p90_ms"] == pytest.approx(1.0)
  assert stats["p99_ms"] == pytest.approx(1.31)
  assert stats["slow"] == pytest.approx(0.02) and stats["steps"] == 100
  times = list(np.random.default_rng(0).lognormal(-6, 0.4, 777))
  stats = latency.latency_stats(times)
  for p in (90, 99):
    assert stats[f"p{p}_ms"] == pytest.approx(
        np.percentile(times, p, method="inverted_cdf") * 1e3)
  assert stats["median_ms"] == pytest.approx(np.median(times) * 1e3)
  assert stats["slow"] == pytest.approx(
      np.mean(np.asarray(times) >= 1.3 * np.median(times)))
  with pytest.raises(ValueError, match="at least one"):
    latency.latency_stats([])


def test_latency_benchmark_rejects_unknown_pytorch_variants():
  latency = _benchmark_module("latency")
  assert latency.parse_args([]).torch == ["timm", "timm+compile"]
  with pytest.raises(SystemExit):
    latency.parse_args(["--torch=timm,keras"])
  with pytest.raises(SystemExit):
    latency.parse_args(["--steps=0"])


def test_latency_benchmark_reads_its_variant_environment():
  """--jax_env's NAME=VALUE pairs (a value may hold "="); none by default;
  a pair without a name or "=" is refused."""
  latency = _benchmark_module("latency")
  assert latency.parse_args([]).jax_env == {}
  args = latency.parse_args(["--jax_env=VIT_JAX_KERNEL_HELPERS=0,A=b=c"])
  assert args.jax_env == {"VIT_JAX_KERNEL_HELPERS": "0", "A": "b=c"}
  assert (latency.variant_name(args.jax_env)
          == "vit_jax VIT_JAX_KERNEL_HELPERS=0,A=b=c")
  for bad in ("--jax_env=HELPERS", "--jax_env==0"):
    with pytest.raises(SystemExit):
      latency.parse_args([bad])


def test_latency_report_compares_the_variant_with_vit_jax():
  """With --jax_env the summary's figures end with vit_jax's best median
  over the variant's best median; the rest is as without it."""
  latency = _benchmark_module("latency")
  args = latency.parse_args(["--jax_env=VIT_JAX_KERNEL_HELPERS=0",
                             "--torch=timm"])
  variant = latency.variant_name(args.jax_env)
  stats = lambda median: {"median_ms": median, "mean_ms": median,
                          "p90_ms": median, "p99_ms": 2 * median,
                          "slow": 0.0}
  rounds = [{"vit_jax": stats(5.0), variant: stats(4.4), "timm": stats(9.0)},
            {"vit_jax": stats(4.8), variant: stats(4.0), "timm": stats(9.6)}]
  summary = latency.report(args, rounds)[-1]
  assert re.fullmatch(
      r'summary: median_vs_torch=1\.88 p99_vs_torch=1\.88 slow_jax=0\.000 '
      r'slow_torch=0\.000 variant_vs_jax=1\.20 cpu="[^"]+"', summary), summary


def test_latency_benchmark_times_both_libraries_step_by_step():
  """The command as documented, short: a row per worker and round, each
  with its percentiles in order, and the summary line comparing them."""
  lines = _run("benchmarks/latency.py", "--steps=20", "--warmup=2",
               "--rounds=2", "--torch=timm", env={"XLA_FLAGS": ""},
               timeout=300)
  assert lines[0] == ("Command: python benchmarks/latency.py --steps=20 "
                      "--warmup=2 --rounds=2 --torch=timm")
  assert lines[1].startswith("CPU: ") and " cores; " in lines[1]
  assert lines[2].startswith("Code: vit_jax from ") and "WARNING" not in lines[2]
  rows = [line.split("|")[1:-1] for line in lines
          if re.match(r"\| [12] \| ", line)]
  assert [(r[0].strip(), r[1].strip()) for r in rows] == [
      ("1", "vit_jax"), ("1", "timm"), ("2", "vit_jax"), ("2", "timm")]
  for row in rows:
    median, _, p90, p99 = (float(cell) for cell in row[2:6])
    assert 0 < median <= p90 <= p99, row
  summary = re.fullmatch(
      r'summary: median_vs_torch=(\S+) p99_vs_torch=(\S+) slow_jax=(\S+) '
      r'slow_torch=(\S+) cpu="[^"]+"', lines[-1])
  assert summary, lines[-1]
  assert all(float(value) >= 0 for value in summary.groups())


def test_cpu_quota_benchmark_checks_its_options():
  cpu_quota = _benchmark_module("cpu_quota")
  args = cpu_quota.parse_args([])
  assert (args.quota, args.model, args.mode, args.batch) == (
      None, "ViT-Ti/16@224", "infer", 1)
  for bad in ("--quota=0", "--quota=-1", "--seconds=0", "--rounds=0"):
    with pytest.raises(SystemExit):
      cpu_quota.parse_args([bad])


def test_cpu_quota_report_compares_the_best_rounds():
  """Each worker's best round by images/s; vit_jax sized by the quota
  against sized by the CPUs (images/s, and their p99s the other way
  round) and against the faster PyTorch worker."""
  cpu_quota = _benchmark_module("cpu_quota")

  def worker(images_per_s, p99_ms, cores):
    return {"images_per_s": images_per_s, "mean_ms": 1e3 / images_per_s,
            "median_ms": 0.9e3 / images_per_s, "p99_ms": p99_ms,
            "cores": cores}

  rounds = [{"vit_jax": worker(80, 16, 1), "vit_jax (by CPUs)": worker(
      70, 58, 2), "timm": worker(36, 28, 1), "timm (by CPUs)": worker(
          29, 73, 2)},
            {"vit_jax": worker(88, 15, 1), "vit_jax (by CPUs)": worker(
                66, 50, 2), "timm": worker(30, 30, 1),
             "timm (by CPUs)": worker(40, 70, 2)}]
  lines = cpu_quota.report(rounds, 1.0)
  assert len([line for line in lines if line.startswith("| ")]) == 9
  summary = re.fullmatch(
      r'summary: quota=1\.00 cores=1 sized_vs_cpus=(\S+) '
      r'p99_sized_vs_cpus=(\S+) sized_vs_torch=(\S+) cpu="[^"]+"', lines[-1])
  assert summary, lines[-1]
  assert [float(v) for v in summary.groups()] == [
      round(88 / 70, 2), round(58 / 15, 2), round(88 / 40, 2)]


def test_a_cgroups_quota_is_read_and_sized_by_inside_it():
  """A cgroup with a CPU quota the kernel enforces (`QuotaCgroup`, the
  benchmark's): a process in it reads the quota and sizes its cores by
  it; the cgroup is gone afterwards."""
  cpu_quota = _benchmark_module("cpu_quota")
  if sys.platform != "linux" or os.geteuid() != 0:
    pytest.skip("making a cgroup with a CPU quota needs root on Linux")
  try:
    group = cpu_quota.QuotaCgroup(0.5).__enter__()
  except SystemExit as error:
    pytest.skip(f"no cgroup with a CPU quota can be made here: {error}")
  path = group.path
  try:
    out = subprocess.run(
        [*group.command(), sys.executable, "-c",
         "from vit_jax.runtime import cpu_info; "
         "print(cpu_info.cpu_quota(), cpu_info.cpu_cores())"],
        capture_output=True, text=True, check=True, timeout=120).stdout
  finally:
    group.__exit__()
  assert out.split() == ["0.5", "1"]
  assert not os.path.exists(path)


def test_cpu_quota_benchmark_runs_every_worker():
  """The command without --quota (the process's own cgroup), short: a row
  per worker with the cores it sized itself for, and the summary."""
  lines = _run("benchmarks/cpu_quota.py", "--model=vit_tiny_cifar",
               "--seconds=0.2", "--warmup=1", "--rounds=1",
               env={"XLA_FLAGS": ""}, timeout=300)
  rows = {r[1].strip(): r for r in (line.split("|")[1:-1] for line in lines
                                   if line.startswith("| 1 |"))}
  assert list(rows) == ["vit_jax", "vit_jax (by CPUs)", "timm",
                        "timm (by CPUs)"]
  from vit_jax.runtime import cpu_info  # pylint: disable=import-outside-toplevel
  assert int(rows["vit_jax"][2]) == cpu_info.cpu_cores()
  assert int(rows["vit_jax (by CPUs)"][2]) == len(os.sched_getaffinity(0))
  for row in rows.values():
    assert float(row[3]) > 0 and float(row[5]) <= float(row[6]), row
  assert re.fullmatch(r'summary: quota=\S+ cores=\d+ sized_vs_cpus=\S+ '
                      r'p99_sized_vs_cpus=\S+ sized_vs_torch=\S+ cpu="[^"]+"',
                      lines[-1]), lines[-1]


def test_the_cpu_line_names_smt_and_a_binding_quota(monkeypatch):
  race_report = _benchmark_module("race_report")
  from vit_jax.runtime import cpu_info  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(os, "cpu_count", lambda: 8)
  monkeypatch.setattr(cpu_info, "threads_per_core", lambda: 1)
  monkeypatch.setattr(cpu_info, "binding_cpu_quota", lambda: None)
  assert race_report.cores_description(8) == "8 of 8 cores"
  monkeypatch.setattr(cpu_info, "threads_per_core", lambda: 2)
  monkeypatch.setattr(cpu_info, "binding_cpu_quota", lambda: 1.5)
  assert race_report.cores_description(2) == (
      "2 of 8 cores, 2 threads a core (SMT) (a CPU quota of 1.50: 2 rounded "
      "up)")
