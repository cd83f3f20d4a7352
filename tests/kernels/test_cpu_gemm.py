"""The Dense layers' products through oneDNN (`cpu_gemm`), and the model's
choice of them (`matmuls.resolve_implementation`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from vit_jax.kernels import cpu_gemm, gelu_matmul, matmuls, xla_products
from vit_jax.model import vit
from vit_jax.runtime import cpu_info, sharding

from helpers import split_kernel_calls  # pylint: disable=wrong-import-order

needs_onednn = pytest.mark.skipif(
    cpu_gemm.problem() is not None,
    reason=f"the oneDNN products cannot run: {cpu_gemm.problem()}")


# oneDNN's bfloat16 gemm needs AVX-512 (it says "unimplemented" without).
needs_bfloat16_gemm = pytest.mark.skipif(
    "avx512f" not in cpu_info.cpu_features()[1],
    reason="oneDNN's bfloat16 gemm needs AVX-512 (this CPU has none)")


def _normal(seed: int, *shape: int) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@needs_onednn
@pytest.mark.parametrize("tasks", [1, 3])
@pytest.mark.parametrize("groups,rows,depth,width", [
    (1, 197, 64, 192), (2, 37, 20, 50), (3, 16, 1, 17), (1, 5, 40, 3),
    (2, 401, 24, 40), (2, 37, 24, 800), (1, 37, 800, 24)])
def test_the_three_products_match_a_float64_reference(
    monkeypatch, tasks, groups, rows, depth, width):
  """Per group x.W, dy.W^T and x^T.dy (summed over the groups), with each
  product split into `tasks` blocks of rows or columns (sizes that no block
  divides included; x.W and dy.W^T split few rows and 800 columns by
  columns, else by rows)."""
  split_kernel_calls(monkeypatch, tasks)
  x, dy = _normal(0, groups, rows, depth), _normal(1, groups, rows, width)
  kernel = _normal(2, depth, width)
  f64 = lambda a: np.asarray(a, np.float64)
  cases = [
      (cpu_gemm.rows_times, (x, kernel), f64(x) @ f64(kernel)),
      (cpu_gemm.rows_times_transposed, (dy, kernel), f64(dy) @ f64(kernel).T),
      (cpu_gemm.rows_transposed_times, (x, dy),
       np.einsum("grk,grn->kn", f64(x), f64(dy)))]
  for product, operands, expected in cases:
    result = jax.jit(product)(*operands)
    assert result.shape == expected.shape and result.dtype == jnp.float32
    np.testing.assert_allclose(result, expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())


@needs_onednn
@pytest.mark.parametrize("operand_dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("tasks", [1, 2, 3])
@pytest.mark.parametrize("groups,rows,depth,widths", [
    (1, 65, 192, (192, 192, 192)),   # vit_tiny_cifar's q, k, v, one image
    (2, 37, 20, (50, 3)),            # unequal widths, by rows
    (1, 17, 600, (300, 300, 300)),   # few rows: x.W and dy.W^T by columns
    (1, 9, 24, (250, 7, 300, 1)),    # column blocks across the kernels
    (2, 2100, 24, (40, 8, 56))])     # copied together (x.W: 1, 2 tasks)
def test_kernels_side_by_side_are_their_concatenation(
    monkeypatch, operand_dtype, tasks, groups, rows, depth, widths):
  """x.W and dy.W^T with several kernels read side by side give the
  products with their concatenation (the float64 product of the operands
  as the gemms read them), and x^T.dy with `widths` its column blocks
  apart; under every task split, by rows or columns, whose blocks may
  straddle two kernels, and where a task's many rows have the kernels
  copied together (`kJoinRowsPerTask`, 1,024)."""
  if operand_dtype is not None and "avx512f" not in (
      cpu_info.cpu_features()[1]):
    pytest.skip("oneDNN's bfloat16 gemm needs AVX-512 (this CPU has none)")
  split_kernel_calls(monkeypatch, tasks)
  x = _normal(20, groups, rows, depth)
  dy = _normal(21, groups, rows, sum(widths))
  kernels = [_normal(22 + i, depth, width) for i, width in enumerate(widths)]
  joined = np.concatenate(kernels, axis=1)
  options = dict(operand_dtype=operand_dtype)
  rounded = lambda a: np.asarray(jnp.asarray(a).astype(
      operand_dtype or jnp.float32)).astype(np.float64)
  product = jax.jit(lambda x, ks: cpu_gemm.rows_times(x, ks, **options))(
      x, kernels)
  np.testing.assert_allclose(product, rounded(x) @ rounded(joined),
                             rtol=1e-5, atol=1e-4)
  input_grad = jax.jit(lambda dy, ks: cpu_gemm.rows_times_transposed(
      dy, ks, **options))(dy, kernels)
  np.testing.assert_allclose(input_grad, rounded(dy) @ rounded(joined).T,
                             rtol=1e-5, atol=1e-4 * np.sqrt(sum(widths)))
  gradients = jax.jit(lambda x, dy: cpu_gemm.rows_transposed_times(
      x, dy, widths=widths, **options))(x, dy)
  expected = np.einsum("grk,grn->kn", rounded(x), rounded(dy))
  starts = np.cumsum((0,) + widths)
  assert [g.shape for g in gradients] == [(depth, w) for w in widths]
  for gradient, start, width in zip(gradients, starts, widths):
    assert gradient.dtype == jnp.float32
    np.testing.assert_allclose(gradient, expected[:, start:start + width],
                               rtol=1e-5, atol=1e-4 * np.sqrt(rows))
  with pytest.raises(ValueError, match=r"widths \(5,\) do not add up"):
    cpu_gemm.rows_transposed_times(x, dy, widths=(5,))
  with pytest.raises(ValueError, match="kernels of one K"):
    cpu_gemm.rows_times(x, [kernels[0], kernels[0][:-1]])


@needs_onednn
@needs_bfloat16_gemm
@pytest.mark.parametrize("tasks", [1, 3])
@pytest.mark.parametrize("groups,rows,depth,width", [
    (1, 197, 64, 192), (2, 37, 20, 50), (1, 5, 40, 3), (1, 401, 24, 40),
    (1, 37, 24, 800), (1, 37, 800, 24)])
def test_bfloat16_operands_give_the_products_of_the_rounded_values(
    monkeypatch, tasks, groups, rows, depth, width):
  """With operand_dtype=bfloat16 each product reads its operands rounded
  to bfloat16 (float32 or bfloat16 ones) and returns float32: the float64
  product of the rounded values, to float32 accumulation."""
  split_kernel_calls(monkeypatch, tasks)
  x, dy = _normal(10, groups, rows, depth), _normal(11, groups, rows, width)
  kernel = _normal(12, depth, width)
  rounded = lambda a: np.asarray(a, jnp.bfloat16).astype(np.float64)
  cases = [
      (cpu_gemm.rows_times, (x, kernel), rounded(x) @ rounded(kernel)),
      (cpu_gemm.rows_times_transposed, (dy, kernel.astype(jnp.bfloat16)),
       rounded(dy) @ rounded(kernel).T),
      (cpu_gemm.rows_transposed_times, (x.astype(jnp.bfloat16), dy),
       np.einsum("grk,grn->kn", rounded(x), rounded(dy)))]
  for product, operands, expected in cases:
    result = jax.jit(functools.partial(product, operand_dtype=jnp.bfloat16))(
        *operands)
    assert result.shape == expected.shape and result.dtype == jnp.float32
    np.testing.assert_allclose(result, expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
  # Rounding matters: the float32 operands' product differs.
  assert np.abs(cases[0][2] - x.astype(np.float64) @ kernel).max() > 1e-4


def test_tasks_for_elements_splits_only_arrays_that_fill_the_tasks(
    monkeypatch):
  """A task per MIN_ELEMENTS_PER_TASK of a device's share, at least one,
  at most the device's cores (here 4)."""
  monkeypatch.setattr(cpu_gemm, "tasks_per_device", lambda: 4)
  share = cpu_gemm.MIN_ELEMENTS_PER_TASK * jax.local_device_count("cpu")
  elements = (0, share - 1, 2 * share - 1, 2 * share, 3 * share, 100 * share)
  assert [cpu_gemm.tasks_for_elements(n) for n in elements] == [
      1, 1, 1, 2, 3, 4]


@needs_onednn
def test_wrong_operands_are_named():
  with pytest.raises(ValueError, match=r"\(G, rows, columns\) float32"):
    cpu_gemm.rows_times(jnp.ones((4, 8)), jnp.ones((8, 2)))
  with pytest.raises(ValueError, match=r"bfloat16\[1, 4, 8\]"):
    cpu_gemm.rows_transposed_times(jnp.ones((1, 4, 8), jnp.bfloat16),
                                   jnp.ones((1, 4, 2)))
  with pytest.raises(ValueError, match=r"bfloat16 or float32 arrays.*"
                     r"float16\[1, 4, 8\]"):
    cpu_gemm.rows_times(jnp.ones((1, 4, 8), jnp.float16), jnp.ones((8, 2)),
                        jnp.bfloat16)
  with pytest.raises(ValueError, match="to bfloat16 or not at all, not to "
                     "float16"):
    cpu_gemm.rows_times(jnp.ones((1, 4, 8)), jnp.ones((8, 2)), jnp.float16)


@needs_onednn
@pytest.mark.parametrize("input_shape,kernel_shape,axes", [
    ((2, 48, 24), (24, 40), 1),        # per_token's groups
    ((96, 24), (24, 40), 1),           # flat rows: groups by the devices
    ((2, 30, 3, 8), (3, 8, 16), 2)])   # DenseGeneral over (heads, head_dim)
@pytest.mark.parametrize("operand_dtype", [
    None, pytest.param(jnp.bfloat16, marks=needs_bfloat16_gemm)])
def test_dense_products_match_xlas_values_and_gradients(
    input_shape, kernel_shape, axes, operand_dtype):
  """Dense products and (over one axis) the MLP's two with the GELU
  between them (`gelu_matmul.mlp`), values and every operand's gradient, in
  oneDNN as in XLA's products; with bfloat16 operands both round every
  product's operands (XLA's then accumulate in another order)."""
  x, kernel = _normal(3, *input_shape), _normal(4, *kernel_shape)
  numbers = ((tuple(range(x.ndim - axes, x.ndim)), tuple(range(axes))),
             ((), ()))
  depth = x.shape[-1]
  layers = {"dense": ((x, kernel), lambda impl, x, kernel:
                      matmuls.dense_dot_general(
                          x, kernel, numbers, implementation=impl,
                          operand_dtype=operand_dtype))}
  if axes == 1:  # the MLP's first layer (depth, depth), its bias, the second
    first = _normal(5, depth, depth) / depth**0.5
    layers["mlp"] = ((x, first, _normal(6, depth), kernel),
                     lambda impl, *operands: gelu_matmul.mlp(
                         *operands, implementation=impl,
                         operand_dtype=operand_dtype))
  for name, (operands, layer) in layers.items():
    def loss(operands, impl, layer=layer):
      y = layer(impl, *operands)
      return (jnp.sin(y) * y).sum(), y
    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
    gradients, y = grad(operands, "onednn")
    expected_gradients, y_ref = grad(operands, "xla")
    # bfloat16: an operand rounded on one side of a tie, 2^-8 relative.
    tolerance = 1e-5 if operand_dtype is None else 1e-2
    for result, expected in zip((y, *gradients), (y_ref, *expected_gradients)):
      assert result.shape == expected.shape and result.dtype == expected.dtype
      np.testing.assert_allclose(result, expected, rtol=10 * tolerance,
                                 atol=tolerance * np.abs(expected).max(),
                                 err_msg=name)


@needs_onednn
def test_under_a_batch_split_mesh_each_device_multiplies_its_own_rows():
  mesh = sharding.make_mesh()
  count = mesh.devices.size
  rows = NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES))
  x = jax.device_put(_normal(5, count, 24, 40), rows)
  dy = jax.device_put(_normal(6, count, 24, 16), rows)
  kernel = _normal(7, 40, 16)
  forward = jax.jit(cpu_gemm.rows_times)
  program = forward.lower(x, kernel).compile().as_text()
  assert "all-gather" not in program and "VitGemm" in program
  y = forward(x, kernel)
  assert {shard.data.shape for shard in y.addressable_shards} == {(1, 24, 16)}
  np.testing.assert_allclose(y, np.asarray(x) @ kernel, rtol=1e-5, atol=1e-4)
  gradient = jax.jit(cpu_gemm.rows_transposed_times)
  program = gradient.lower(x, dy).compile().as_text()
  assert "all-gather" not in program and "all-reduce" in program
  np.testing.assert_allclose(
      gradient(x, dy), np.einsum("grk,grn->kn", x, dy), rtol=1e-5, atol=1e-4)


_DIMS = dict(num_classes=10, patch_size=4, hidden_size=64, num_layers=2,
             num_heads=4, mlp_dim=128)


@needs_onednn
def test_the_model_takes_the_cpu_kernels_with_xlas_values():
  """"auto" on a CPU: every encoder Dense product in oneDNN, both
  LayerNorms of every block in the C++ kernel (`cpu_layer_norm`) and the
  MLP's GELU in another (`cpu_gelu`), on each device's rows; the loss and
  every parameter's gradient as with XLA's products and LayerNorms."""
  mesh = sharding.make_mesh()
  images = jax.device_put(
      _normal(8, 16, 16, 16, 3),
      NamedSharding(mesh, PartitionSpec(sharding.MESH_AXES)))
  models = {"auto": vit.VisionTransformer(**_DIMS),
            "xla": vit.VisionTransformer(**_DIMS, matmul_implementation="xla",
                                         layer_norm_implementation="xla")}
  params = models["xla"].init(jax.random.key(0), images[:2], train=False)
  leaves, tree = jax.tree.flatten(params)
  params = jax.tree.unflatten(tree, [  # a head that is not all zeros
      leaf + 0.05 * _normal(i, *leaf.shape) for i, leaf in enumerate(leaves)])
  results = {}
  for impl, model in models.items():
    step = jax.jit(jax.value_and_grad(lambda p, model=model: jnp.mean(
        model.apply(p, images, train=False) ** 2)))
    program = step.lower(params).compile().as_text()
    # 2 blocks x 4 Dense layers x 3 products, less the last block's
    # query-only projection gradients' sharing: at least 20 calls; the
    # blocks' 4 LayerNorms forward and backward (the final one is Flax's),
    # their 2 GELUs.
    calls = [program.count(f'custom_call_target="{target}"') for target in (
        "VitLayerNormForward", "VitLayerNormBackward", "VitGelu",
        "VitGeluBackward")]
    calls.append(program.count('custom_call_target="VitGemm'))
    # The GELU kernel runs with XLA's products too (its own values:
    # tests/kernels/test_cpu_gelu.py).
    assert ((calls[:4] == [4, 4, 2, 2] and calls[4] >= 20) if impl == "auto"
            else calls == [0, 0, 2, 2, 0]), calls
    assert "all-gather" not in program
    results[impl] = step(params)
  (loss, grads), (loss_ref, grads_ref) = results["auto"], results["xla"]
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_ref))
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5 * scale)


def test_auto_takes_onednn_for_float32_products_and_bfloat16_operands(
    monkeypatch):
  """oneDNN for float32 products on a CPU, and for bfloat16 operands
  where `cpu_gemm.bfloat16_problem` finds none; XLA's otherwise."""
  monkeypatch.setattr(cpu_gemm, "problem", lambda device=None: None)
  monkeypatch.setattr(cpu_gemm, "bfloat16_problem", lambda: None)
  resolve = matmuls.resolve_implementation
  assert resolve("auto", jnp.float32) == "onednn"
  assert resolve("auto", jnp.float32, jnp.bfloat16) == "onednn"
  assert resolve("auto", jnp.bfloat16) == "xla"
  assert resolve("auto", jnp.float32, jnp.float16) == "xla"
  assert resolve("xla", jnp.float32) == "xla"
  with pytest.raises(ValueError, match="computes float32 products.*bfloat16"):
    resolve("onednn", jnp.bfloat16)
  amx = "this CPU has AMX, which XLA's YNNPACK products use"
  monkeypatch.setattr(cpu_gemm, "bfloat16_problem", lambda: amx)
  assert resolve("auto", jnp.float32, jnp.bfloat16) == "xla"
  assert resolve("auto", jnp.float32) == "onednn"
  with pytest.raises(ValueError, match="bfloat16 operands take XLA's "
                     "products here: this CPU has AMX"):
    resolve("onednn", jnp.float32, jnp.bfloat16)
  with pytest.raises(ValueError, match="Unknown matmul_implementation 'mkl'"):
    resolve("mkl", jnp.float32)
  monkeypatch.setattr(cpu_gemm, "problem",
                      lambda device=None: "oneDNN is not installed")
  assert resolve("auto", jnp.float32) == "xla"
  with pytest.raises(ValueError, match="cannot run here: oneDNN is not "
                     "installed. Use 'auto'"):
    resolve("onednn", jnp.float32)


@pytest.mark.parametrize("instructions,cap,problem", [
    (("AVX512_BF16",), None, None),
    (("AVX512_BF16",), "avx512_core_bf16", None),
    (("AVX512_BF16",), "ALL", None),
    # --max_isa=avx2's cap: oneDNN's bfloat16 gemm is unimplemented there.
    (("AVX512_BF16",), "AVX2", "ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN"),
    (("AVX512_BF16",), "AVX512_CORE", "ONEDNN_MAX_CPU_ISA=AVX512_CORE"),
    (("AMX-BF16", "AVX512_BF16"), None, "AMX"),
    ((), None, "no AVX512_BF16"),
    (("BF16",), None, "no AVX512_BF16")])  # Arm's: oneDNN's x86 wheel only
def test_bfloat16_operands_take_onednn_on_avx512_bf16_without_amx(
    monkeypatch, instructions, cap, problem):
  monkeypatch.setattr(xla_products, "bfloat16_dot_instructions",
                      lambda: instructions)
  if cap is None:
    monkeypatch.delenv(cpu_gemm.ISA_CAP_VARIABLE, raising=False)
  else:
    monkeypatch.setenv(cpu_gemm.ISA_CAP_VARIABLE, cap)
  found = cpu_gemm.bfloat16_problem()
  assert found is None if problem is None else problem in found


def test_a_missing_onednn_names_the_fix(monkeypatch):
  monkeypatch.setattr(cpu_gemm, "library_path", lambda: None)
  problem = cpu_gemm.load.__wrapped__()  # not the process's cached answer
  if "C++" in (problem or ""):
    pytest.skip(f"the kernels cannot be built here: {problem}")
  assert "pip install 'onednn-cpu-gomp'" in problem
  assert cpu_gemm.LIBRARY_VARIABLE in problem


def test_the_library_comes_from_the_variable_or_the_wheel(monkeypatch,
                                                         tmp_path):
  monkeypatch.setenv(cpu_gemm.LIBRARY_VARIABLE, str(tmp_path / "x.so"))
  assert cpu_gemm.library_path() == str(tmp_path / "x.so")
  monkeypatch.delenv(cpu_gemm.LIBRARY_VARIABLE)
  path = cpu_gemm.library_path()
  assert path is None or path.endswith(cpu_gemm.LIBRARY)


def test_an_unknown_implementation_is_named_at_the_model():
  with pytest.raises(ValueError, match="Unknown matmul_implementation"):
    vit.VisionTransformer(**_DIMS, matmul_implementation="blas").init(
        jax.random.key(0), jnp.ones((1, 16, 16, 3)), train=False)
