"""vit_jax.kernels.matmuls: the Dense layers' matmuls and their backward
passes."""

import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.kernels import cpu_build, gelu_matmul, matmuls, xla_products
from vit_jax.model import blocks, vit
from vit_jax.runtime import cpu_info, host

_DENSE = (((1,), (0,)), ((), ()))


def _weight_gradient_dots(compiled_text: str) -> dict[str, tuple[int, ...]]:
  """{op name: result shape} of the compiled dots that contract over rows
  (dim 0 of both operands): the kernels' gradients."""
  shapes = {}
  for line in compiled_text.splitlines():
    match = re.search(r"= f32\[([\d,]+)\]\S* dot\(.*lhs_contracting_dims=\{0\}"
                      r", rhs_contracting_dims=\{0\}.*op_name=\"([^\"]*)\"",
                      line)
    if match:
      shapes[match.group(2)] = tuple(int(d) for d in match.group(1).split(","))
  return shapes


@pytest.mark.parametrize("depth,width", [(8, 24), (24, 8), (16, 16)])
def test_kernel_gradient_is_inputs_transposed_times_output_grad(depth, width):
  """inputs^T @ output_grad against float64 NumPy, for a wide, a narrow and
  a square kernel. For a wide kernel XLA's product has the narrower side as
  its rows (JAX's transpose rule gives it (width, depth) rows x columns).
  A narrow kernel's (width, depth) product is transposed, and XLA turns it
  round when the result must be row-major, as here; in a train step the
  optimizer reads it transposed instead (see the MLP test below)."""
  rng = np.random.default_rng(0)
  inputs = rng.normal(size=(40, depth)).astype(np.float32)
  output_grad = rng.normal(size=(40, width)).astype(np.float32)
  fn = jax.jit(xla_products.kernel_gradient)
  got = fn(inputs, output_grad)
  assert got.shape == (depth, width)
  np.testing.assert_allclose(
      got, inputs.astype(np.float64).T @ output_grad, rtol=1e-5, atol=1e-5)
  text = fn.lower(inputs, output_grad).compile().as_text()
  (shape,) = _weight_gradient_dots(text).values()
  if depth <= width:
    assert shape == (depth, width)


@pytest.mark.parametrize("input_shape,kernel_shape,num_contracted", [
    ((12, 6), (6, 10), 1),            # Dense on tokens
    ((3, 4, 6), (6, 5), 1),           # Dense on (batch, tokens, width)
    ((7, 2, 3), (2, 3, 8), 2),        # DenseGeneral over (heads, head_dim)
])
def test_dense_dot_general_values_and_gradients(input_shape, kernel_shape,
                                                num_contracted):
  """Values and both gradients equal the matmul's, computed in float64
  NumPy over the flattened rows and contracted axes."""
  rng = np.random.default_rng(1)
  inputs = rng.normal(size=input_shape).astype(np.float32)
  kernel = rng.normal(size=kernel_shape).astype(np.float32)
  rank = len(input_shape)
  dims = ((tuple(range(rank - num_contracted, rank)),
           tuple(range(num_contracted))), ((), ()))
  output_shape = input_shape[:rank - num_contracted] + kernel_shape[
      num_contracted:]
  output_grad = rng.normal(size=output_shape).astype(np.float32)

  outputs, vjp = jax.vjp(
      lambda x, k: matmuls.dense_dot_general(x, k, dims), inputs, kernel)
  inputs_grad, kernel_grad = vjp(output_grad)

  depth = int(np.prod(kernel_shape[:num_contracted]))
  x = inputs.reshape(-1, depth).astype(np.float64)
  w = kernel.reshape(depth, -1).astype(np.float64)
  g = output_grad.reshape(x.shape[0], -1).astype(np.float64)
  np.testing.assert_allclose(outputs, (x @ w).reshape(output_shape),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(inputs_grad, (g @ w.T).reshape(input_shape),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(kernel_grad, (x.T @ g).reshape(kernel_shape),
                             rtol=1e-5, atol=1e-5)


def test_dense_dot_general_keeps_dtypes_and_falls_back():
  """bfloat16 operands get bfloat16 gradients; dimension numbers other
  than a Dense layer's give lax.dot_general's values and gradients."""
  inputs = jnp.ones((4, 6), jnp.bfloat16)
  kernel = jnp.ones((6, 3), jnp.bfloat16)
  grads = jax.grad(lambda x, k: matmuls.dense_dot_general(
      x, k, _DENSE).astype(jnp.float32).sum(), argnums=(0, 1))(inputs, kernel)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
  np.testing.assert_array_equal(grads[1].astype(np.float32), 4.0)

  rng = np.random.default_rng(2)
  lhs = rng.normal(size=(5, 4)).astype(np.float32)
  rhs = rng.normal(size=(5, 3)).astype(np.float32)
  over_rows = (((0,), (0,)), ((), ()))
  ours = jax.grad(lambda a, b: jnp.sum(jnp.sin(matmuls.dense_dot_general(
      a, b, over_rows))), argnums=(0, 1))(lhs, rhs)
  plain = jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.lax.dot_general(
      a, b, over_rows))), argnums=(0, 1))(lhs, rhs)
  chex.assert_trees_all_close(ours, plain, rtol=1e-6, atol=1e-6)


def test_mlp_kernel_gradients_have_the_narrow_side_as_rows():
  """In the compiled gradient of an MlpBlock (64 -> 256 -> 64) the first
  kernel's gradient is a (64, 256) product, not JAX's (256, 64) one, and
  the gradients equal those of Dense -> GELU -> Dense. (XLA's products:
  oneDNN's take the rows as they are, test_cpu_gemm.py.)"""
  mlp = blocks.MlpBlock(mlp_dim=256, matmul_implementation="xla")
  x = jax.random.normal(jax.random.PRNGKey(0), (300, 64))
  params = mlp.init(jax.random.PRNGKey(1), x, deterministic=True)

  def loss(params, x):
    return jnp.sum(jnp.sin(mlp.apply(params, x, deterministic=True)))

  def reference_loss(params, x):
    p = params["params"]
    hidden = nn.gelu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return jnp.sum(jnp.sin(hidden @ p["Dense_1"]["kernel"]
                           + p["Dense_1"]["bias"]))

  grad = jax.jit(jax.grad(loss))
  chex.assert_trees_all_close(grad(params, x),
                              jax.grad(reference_loss)(params, x),
                              rtol=1e-4, atol=1e-4)
  # As in a data-parallel train step: the rows split between two devices,
  # the gradients summed over them and read by an update. XLA then reads a
  # product's result transposed rather than turn the product round.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  x = jax.device_put(x, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")))
  params = jax.device_put(params, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  sgd = jax.jit(lambda params, x: jax.tree.map(
      lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x)))
  text = sgd.lower(params, x).compile().as_text()
  dots = _weight_gradient_dots(text)
  (first,) = [shape for name, shape in dots.items() if "Dense_0" in name]
  assert first == (64, 256), dots


# ---------------------------------------------- bfloat16 operands (CPU speed)
def _rounded(x):
  """x rounded to bfloat16, as float64: what the products read."""
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


@pytest.mark.parametrize("with_gelu", [False, True])
def test_bfloat16_operands_give_float32_products_of_the_rounded_operands(
    with_gelu):
  """Every product of a Dense layer with operand_dtype=bfloat16, forward
  and backward, equals the float64 product of its operands rounded to
  bfloat16 (float32 accumulation: ~1e-6 relative), and differs from the
  float32 layer by bfloat16's rounding; so do the MLP's second product's
  (`gelu_matmul.mlp`, its first layer the identity)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(96, 48)).astype(np.float32)
  kernel = rng.normal(size=(48, 80)).astype(np.float32) / 7
  weights = rng.normal(size=(96, 80)).astype(np.float32)  # loss = <w, y>
  bias = rng.normal(size=48).astype(np.float32)  # the GELU's input's
  dims = (((1,), (0,)), ((), ()))
  if with_gelu:  # the MLP, its first layer the identity: exact on x
    x = _rounded(x).astype(np.float32)  # in bfloat16
    identity = np.eye(48, dtype=np.float32)
    dot = lambda x, k, dims: gelu_matmul.mlp(x, identity, bias, k,
                                             operand_dtype=jnp.bfloat16)
  else:
    dot = functools.partial(matmuls.dense_dot_general,
                            operand_dtype=jnp.bfloat16)
  loss = lambda x, k: jnp.sum(dot(x, k, dims) * weights)
  out = jax.jit(lambda x, k: dot(x, k, dims))(x, kernel)
  x_grad, kernel_grad = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, kernel)
  assert out.dtype == x_grad.dtype == kernel_grad.dtype == jnp.float32

  gelu = lambda v: np.asarray(nn.gelu(jnp.asarray(v, jnp.float32)),
                              np.float64)
  act = gelu(x + bias) if with_gelu else x.astype(np.float64)
  np.testing.assert_allclose(out, _rounded(act) @ _rounded(kernel),
                             rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(kernel_grad, _rounded(act).T @ _rounded(weights),
                             rtol=2e-5, atol=2e-4)
  act_grad = _rounded(weights) @ _rounded(kernel).T
  tolerance = 2e-5
  if with_gelu:  # the chain rule through the GELU, in float32, and then
    # the identity's product of that rounded to bfloat16
    _, gelu_vjp = jax.vjp(nn.gelu, jnp.asarray(x + bias))
    act_grad = np.asarray(gelu_vjp(jnp.asarray(act_grad, jnp.float32))[0])
    tolerance = 2.0**-8
  np.testing.assert_allclose(x_grad, act_grad, rtol=tolerance, atol=2e-4)
  exact = act @ kernel.astype(np.float64)
  assert 1e-4 < np.max(np.abs(out - exact)) / np.max(np.abs(exact)) < 2e-2


def _bfloat16_model(implementation: str) -> vit.VisionTransformer:
  return vit.VisionTransformer(num_classes=7, patch_size=4, hidden_size=32,
                               num_layers=2, num_heads=2, mlp_dim=64,
                               matmul_dtype=jnp.bfloat16,
                               matmul_implementation=implementation)


def test_bfloat16_operands_reach_every_product_of_a_train_step_gradient():
  """In the gradient of a ViT with matmul_dtype=bfloat16 and XLA's
  products, every product of the encoder's Dense layers reads bfloat16 and
  writes float32 (the head's and the position embedding gradient's stay
  float32), and the parameters and their gradients are float32."""
  model = _bfloat16_model("xla")
  images = jnp.ones((2, 8, 8, 3))
  params = model.init(jax.random.PRNGKey(0), images)["params"]
  grad_fn = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(
      {"params": p}, images) ** 2)))
  dots = re.findall(r"stablehlo.dot_general[^\n]*?: \(tensor<([^>]*)>, "
                    r"tensor<([^>]*)>\) -> tensor<([^>]*)>",
                    grad_fn.lower(params).as_text())
  head = [d for d in dots if "7" in "".join(d).split("x")]
  # The position embedding's gradient: ones (B,) . output_grad, float32.
  position = [d for d in dots if d[0] == "2xf32"]
  encoder = [d for d in dots if d not in head + position]
  assert len(head) == 3 and len(encoder) >= 18, dots  # forward + backward
  assert position == [("2xf32", "2x5x32xf32", "5x32xf32")], dots
  assert all(a.endswith("bf16") and b.endswith("bf16") and out.endswith("f32")
             for a, b, out in encoder), encoder
  grads = grad_fn(params)
  assert {leaf.dtype for leaf in jax.tree.leaves((params, grads))} == {
      jnp.dtype(jnp.float32)}


@pytest.mark.skipif(
    matmuls.cpu_gemm.problem() is not None
    or matmuls.cpu_gemm.bfloat16_problem() is not None,
    reason="bfloat16 operands do not take oneDNN's products on this CPU")
def test_bfloat16_operands_take_onednn_where_the_cpu_has_avx512_bf16():
  """On a CPU with AVX512_BF16 and no AMX, "auto" puts every encoder Dense
  product of the bfloat16 train step in oneDNN's bfloat16 gemm, with the
  loss and gradients of XLA's bfloat16 products."""
  images = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 8, 3)),
                       jnp.float32)
  results = {}
  for implementation in ("auto", "xla"):
    model = _bfloat16_model(implementation)
    params = _bfloat16_model("xla").init(jax.random.PRNGKey(0), images)
    step = jax.jit(jax.value_and_grad(lambda p, model=model: jnp.mean(
        model.apply(p, images) ** 2)))
    program = step.lower(params).as_text()
    calls = re.findall(r'VitGemm\w*', program)
    # 2 blocks x 4 Dense layers x 3 products, less the last block's
    # query-only projection.
    assert (len(calls) >= 20 and all(c.endswith("Bf16") for c in calls)
            if implementation == "auto" else not calls), calls
    results[implementation] = step(params)
  (loss, grads), (loss_ref, grads_ref) = results["auto"], results["xla"]
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-2)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g_ref, rtol=0.1,
                               atol=2e-2 * np.abs(g_ref).max())


@pytest.mark.parametrize("rows", [7, 24])
@pytest.mark.parametrize("depth,width", [(48, 16), (16, 48)])
def test_bfloat16_kernel_gradient_runs_in_ynnpack_in_one_group_or_several(
    rows, depth, width):
  """kernel_gradient with bfloat16 operands, compiled as the train step is
  (YNNPACK's dots): the float64 product of the rounded operands, for a wide
  and a narrow kernel, with the rows in one group (7 rows on the suite's 8
  devices: what every one-device run has) and in several; every compiled
  product contracts its left operand over its last axis, the form YNNPACK
  takes. One group and a wide input once made XLA fold a transpose back
  into the product, which then failed to run ("Unsupported element type
  for DotThunk")."""
  options = xla_products.xla_compiler_options(jnp.bfloat16)
  if options is None:
    pytest.skip("YNNPACK's bfloat16 dots are XLA:CPU's (jaxlib 0.10-0.12)")
  rng = np.random.default_rng(rows + depth)
  x = rng.normal(size=(rows, depth)).astype(np.float32)
  dy = rng.normal(size=(rows, width)).astype(np.float32)
  gradient = functools.partial(xla_products.kernel_gradient,
                               operand_dtype=jnp.bfloat16)
  compiled = jax.jit(gradient, compiler_options=options).lower(x, dy).compile()
  np.testing.assert_allclose(compiled(x, dy), _rounded(x).T @ _rounded(dy),
                             rtol=1e-5, atol=1e-5)
  for line in compiled.as_text().splitlines():
    if " dot(" in line:  # (G, K, M) or (K, M) contracted over M
      batch = re.search(r"lhs_batch_dims=\{([\d,]*)\}", line)
      last = len(batch.group(1).split(",")) + 1 if batch else 1
      assert f"lhs_contracting_dims={{{last}}}" in line, line


def test_xla_compiler_options_turn_on_ynnpack_dots_only_for_bfloat16():
  """On XLA:CPU, YNNPACK's dots for bfloat16 products only, and its
  reductions wherever the C++ kernels run; nothing elsewhere."""
  options = xla_products.xla_compiler_options(jnp.bfloat16)
  float32 = xla_products.xla_compiler_options(None)
  assert xla_products.xla_compiler_options(jnp.float32) == float32
  if jax.default_backend() == "gpu":  # test_gpu.py checks what they do
    assert options == float32  # whatever the dtype
    return
  if (jax.default_backend() != "cpu"
      or host.jaxlib_release() not in ("0.10", "0.11", "0.12")):
    assert options is None and float32 is None
    return
  kernels = cpu_build.problem() is None
  flag = "xla_cpu_experimental_ynn_fusion_type"
  assert float32 == ({flag: "LIBRARY_FUSION_TYPE_REDUCE"} if kernels
                     else None)
  assert options == {flag: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT" + (
      ",LIBRARY_FUSION_TYPE_REDUCE" if kernels else "")}
  a = jax.random.normal(jax.random.PRNGKey(0), (64, 48))
  b = jax.random.normal(jax.random.PRNGKey(1), (48, 32))
  product = lambda a, b: matmuls.dense_dot_general(
      a, b, (((1,), (0,)), ((), ())), operand_dtype=jnp.bfloat16)
  compiled = jax.jit(product, compiler_options=options).lower(a, b).compile()
  assert "ynn_fusion" in compiled.as_text()  # YNNPACK runs the product
  np.testing.assert_allclose(compiled(a, b), jax.jit(product)(a, b),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device_kind, options", [
    ("NVIDIA H200", {"xla_gpu_enable_triton_gemm": False}),
    ("AMD Instinct MI300X", None)])
def test_xla_compiler_options_give_an_nvidia_gpus_products_to_cublas(
    monkeypatch, device_kind, options):
  """On an NVIDIA GPU, whatever the products' dtype, cuBLAS rather than
  XLA's Triton GEMM fusions; no option on other GPUs, where it was not
  measured (and no XLA:CPU option off a CPU)."""
  class FakeGpu:  # jax.devices()[0] as the options read it
    pass
  FakeGpu.device_kind = device_kind
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *_: [FakeGpu()])
  for dtype in (None, jnp.float32, jnp.bfloat16):
    assert xla_products.xla_compiler_options(dtype) == options, dtype


needs_ynnpack_reductions = pytest.mark.skipif(
    jax.default_backend() != "cpu" or cpu_build.problem() is not None
    or host.jaxlib_release() not in ("0.10", "0.11", "0.12"),
    reason="YNNPACK's reductions are vit_jax's options for XLA:CPU with the "
    "C++ kernels, on jaxlib 0.10-0.12")


@needs_ynnpack_reductions
def test_a_bias_gradients_sum_runs_in_ynnpack_not_a_reduce_window():
  """A Dense bias's gradient over (batch, tokens), summed beside another
  use of the output gradient as in the train step: with vit_jax's process
  flags alone (tests/conftest.py: YNNPACK's fusions off) XLA rewrites the
  sum into a reduce-window padded to 32 rows; with the steps' options,
  float32 or bfloat16, YNNPACK sums it; the same sums either way."""
  def bias_and_input_gradients(a, b, kernel):
    output_grad = a + b  # the residual stream's gradient
    return jnp.sum(output_grad, axis=(0, 1)), output_grad @ kernel.T

  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  operands = [jax.random.normal(keys[0], (4, 197, 64)),
              jax.random.normal(keys[1], (4, 197, 64)),
              jax.random.normal(keys[2], (32, 64))]
  compile_with = lambda options: jax.jit(bias_and_input_gradients).lower(
      *operands).compile(options)
  assert "reduce-window(" in compile_with(None).as_text()
  for dtype in (None, jnp.bfloat16):
    compiled = compile_with(xla_products.xla_compiler_options(dtype))
    assert ("reduce-window(" not in compiled.as_text()
            and "ynn" in compiled.as_text()), dtype
    np.testing.assert_allclose(compiled(*operands)[0],
                               compile_with(None)(*operands)[0],
                               rtol=1e-5, atol=1e-4)


@needs_ynnpack_reductions
def test_add_to_every_examples_gradient_is_a_product_not_ynnpacks_sum():
  """x + shared, shared's gradient the sum over the batch: as `x + shared`
  (the premise) YNNPACK takes that sum under the steps' options, as
  `add_to_every_example` a product does; the same values and gradients,
  float32 and bfloat16, with the batch on one device or split over two."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(keys[0], (4, 197, 64))
  shared = jax.random.normal(keys[1], (1, 197, 64))
  output_grad = jax.random.normal(keys[2], (4, 197, 64))
  options = xla_products.xla_compiler_options(None)

  def compiled(add, x, shared):
    def value_and_gradients(x, shared):
      value, vjp = jax.vjp(lambda a, b: jnp.sin(add(a, b)), x, shared)
      return value, vjp(jnp.cos(output_grad).astype(value.dtype))
    return jax.jit(value_and_gradients).lower(x, shared).compile(options)

  ynnpack = '"kind":"__ynn_fusion"'
  assert ynnpack in compiled(jnp.add, x, shared).as_text()
  assert ynnpack not in compiled(xla_products.add_to_every_example, x,
                                 shared).as_text()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  for dtype, tolerance in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
    operands = (x.astype(dtype), shared.astype(dtype))
    expected = compiled(jnp.add, *operands)(*operands)
    for placed in (operands, (jax.device_put(operands[0], split),
                              operands[1])):
      chex.assert_trees_all_close(
          compiled(xla_products.add_to_every_example, *placed)(*placed),
          expected, rtol=tolerance, atol=tolerance)
  with pytest.raises(ValueError, match="shared"):
    xla_products.add_to_every_example(x, x)


@pytest.mark.parametrize("key,flags,expected", [
    ("flags", "fpu avx2 fma avx512f avx512_bf16 avx512_vnni",
     ("AVX512_BF16",)),  # Zen 4
    ("flags", "fpu avx2 avx512_bf16 amx_bf16 amx_tile",
     ("AMX-BF16", "AVX512_BF16")),  # Sapphire Rapids
    ("flags", "fpu avx2 fma avx512f avx512bw", ()),
    ("Features", "fp asimd sve i8mm bf16 svebf16", ("BF16",)),  # Neoverse V1
    ("Features", "fp asimd evtstrm aes crc32 atomics", ())])  # N1
def test_bfloat16_dot_instructions_reads_the_cpu_flags(monkeypatch, tmp_path,
                                                       key, flags, expected):
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\n"
                     f"{key}\t\t: {flags}\n\n")
  monkeypatch.setattr(cpu_info, "CPUINFO", str(cpuinfo))
  assert xla_products.bfloat16_dot_instructions() == expected
