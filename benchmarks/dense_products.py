"""A Dense layer's three products and the GEMM rates the race compares
against (`benchmarks/throughput.py`'s `--impl=gemm-*` workers).

The race's "% GEMM" column is of PyTorch's 2048^3 GEMM rate on every core;
its Dense-product lines time x.W, dy.W^T and x^T.dy at each raced width on
one core, as each device of vit_jax's train step runs them, jax (the
implementation vit_jax's Dense layers take) against torch.
"""

import numpy as np

import race_workers  # this folder's: the raced models, time_steps


# The three products of every Dense layer in a train step: forward x.W,
# input gradient dy.W^T, weight gradient x^T.dy. At ViT-Ti's widths XLA:CPU
# runs the weight gradient ~20% below the other two. Here it is a jitted
# product on its own, so XLA turns (768, 192) round to the slow orientation
# whichever way `xla_products.kernel_gradient` writes it; in the data-parallel
# train step it keeps the fast one (docs/performance.md, "The kernels' gradients the
# narrow way round").
DENSE_PRODUCTS = ("x.W", "dy.W^T", "x^T.dy")
DENSE_ROWS = 32 * 197  # a 224 px train batch of 32 x its tokens


def dense_shapes(hidden_size: int, mlp_dim: int) -> tuple:
  """The (in, out) widths of an encoder block's Dense layers: q/k/v in one,
  the attention's output, the MLP's two. The narrower of each is
  hidden_size."""
  return ((hidden_size, 3 * hidden_size), (hidden_size, hidden_size),
          (hidden_size, mlp_dim), (mlp_dim, hidden_size))


def raced_widths(models) -> dict:
  """(hidden_size, mlp_dim) -> the names of `models` of those widths, in
  the order raced: the per-core Dense products are timed once for each."""
  widths = {}
  for name in models:
    model = race_workers.MODELS[name]
    widths.setdefault((model.hidden_size, model.mlp_dim), []).append(name)
  return widths


def dense_product_operands(product: str, rows: int, k: int, n: int):
  """Shapes of (lhs, rhs, result) of `product` for a (k -> n) Dense layer
  applied to `rows` rows."""
  return {"x.W": ((rows, k), (k, n), (rows, n)),
          "dy.W^T": ((rows, n), (k, n), (rows, k)),
          "x^T.dy": ((rows, k), (rows, n), (k, n))}[product]


def dense_product_fn(library: str, product: str, operand_dtype=None):
  """(lhs, rhs) -> the product, as the library's train step computes it,
  with operand_dtype (None: float32; "bfloat16": mixed precision) as the
  race runs it: for jax, the implementation vit_jax's Dense layers take
  for it (`matmuls.resolve_implementation`: oneDNN's gemms, one group of
  rows as on each device of the step, or XLA's products, the weight
  gradient as `xla_products.kernel_gradient` orients it), float32 results;
  for torch, its autodiff's transposes, in the operands' dtype (autocast's
  bfloat16 results)."""
  if library == "jax":
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from vit_jax.kernels import cpu_gemm, matmuls, xla_products  # pylint: disable=import-outside-toplevel
    if matmuls.resolve_implementation("auto", jnp.float32,
                                      operand_dtype) == "onednn":
      return jax.jit({
          "x.W": lambda a, b: cpu_gemm.rows_times(a[None], b,
                                                  operand_dtype)[0],
          "dy.W^T": lambda a, b: cpu_gemm.rows_times_transposed(
              a[None], b, operand_dtype)[0],
          "x^T.dy": lambda a, b: cpu_gemm.rows_transposed_times(
              a[None], b[None], operand_dtype),
      }[product])
    if product == "x^T.dy":
      return jax.jit(lambda a, b: xla_products.kernel_gradient(
          a, b, None, operand_dtype))
    lhs_dim, rhs_dim = {"x.W": (1, 0), "dy.W^T": (1, 1)}[product]
    return jax.jit(lambda a, b: xla_products.product(
        a, b, (((lhs_dim,), (rhs_dim,)), ((), ())), None, operand_dtype,
        jnp.float32), compiler_options=xla_products.xla_compiler_options(
            operand_dtype))
  return {"x.W": lambda a, b: a @ b, "dy.W^T": lambda a, b: a @ b.T,
          "x^T.dy": lambda a, b: a.T @ b}[product]


def gemm_worker(library: str, per_core: bool,
                models=race_workers.DEFAULT_MODELS) -> dict:
  """GEMM rates, GFLOP/s, on every core: float32 2048^3 and the MLP's
  (8320x192)@(192x768), with --matmul_dtype=bfloat16 also "bf16
  2048x2048x2048" (bfloat16 operands); per_core: on one thread, as
  vit_jax's train step runs each product (a device per core,
  `per_core_environment`), each Dense product at the widths of `models`
  (keys "x.W 6304x192x576" and so on) in the race's operand dtype."""
  if library == "torch" and per_core:
    import torch  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(1)
  matmul_dtype = race_workers.bench_matmul_dtype()
  if per_core:
    cases = [(product, DENSE_ROWS, k, n, matmul_dtype,
              f"{product} {DENSE_ROWS}x{k}x{n}")
             for hidden, mlp in raced_widths(models)
             for k, n in dense_shapes(hidden, mlp)
             for product in DENSE_PRODUCTS]
  else:
    cases = [("x.W", 2048, 2048, 2048, None, "2048x2048x2048"),
             ("x.W", 8320, 192, 768, None, "8320x192x768")]
    if matmul_dtype:
      cases.append(("x.W", 2048, 2048, 2048, matmul_dtype,
                    "bf16 2048x2048x2048"))
  rates = {}
  for product, m, k, n, dtype, key in cases:
    lhs, rhs, _ = dense_product_operands(product, m, k, n)
    a, b = (_operand(library, shape, dtype) for shape in (lhs, rhs))
    fn = dense_product_fn(library, product, dtype)
    run = ((lambda: fn(a, b).block_until_ready()) if library == "jax"
           else (lambda: fn(a, b)))
    run()
    # The best of ten: a product's peak, least disturbed by noise.
    best = min(race_workers.time_steps(run, 1) for _ in range(10))
    rates[key] = 2 * m * k * n / best / 1e9
  return rates


def _operand(library: str, shape: tuple, dtype):
  """A random operand of `shape` in the library's arrays, of `dtype`
  (None: float32), on the library's CPU device."""
  values = np.random.rand(*shape).astype(np.float32)
  if library == "jax":
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    return jnp.asarray(values, dtype or jnp.float32)
  import torch  # pylint: disable=import-outside-toplevel
  tensor = torch.from_numpy(values)
  return tensor.to(getattr(torch, dtype)) if dtype else tensor


def dense_product_rates(rates: dict, hidden_size: int) -> dict:
  """FLOP-weighted GFLOP/s of each Dense product over the shapes of one
  width (those whose narrower side is hidden_size, `dense_shapes`), from a
  per-core gemm worker's rates."""
  result = {}
  for product in DENSE_PRODUCTS:
    flops = seconds = 0.0
    for key, rate in rates.items():
      if key.startswith(product + " "):
        m, k, n = map(int, key.split()[1].split("x"))
        if min(k, n) == hidden_size:
          flops += 2 * m * k * n
          seconds += 2 * m * k * n / rate
    result[product] = flops / seconds
  return result


def per_core_environment(env: dict) -> dict:
  """env for a per-core gemm worker, which also pins itself to one core:
  XLA's Eigen on one thread, as on each of the train step's devices
  (torch's worker sets its own threads)."""
  flags = f"{env.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false"
  return dict(env, XLA_FLAGS=flags.strip())


def dense_product_lines(per_core: dict, models, matmul_dtype: str
                        ) -> list[str]:
  """A line per width of the raced models: a Dense layer's three products
  on one core each, jax against torch (`per_core`: library -> the per-core
  gemm workers' rates)."""
  operands = ("" if matmul_dtype == "float32" else
              "; bfloat16 operands, jax's results float32, torch's bfloat16 "
              "as autocast's")
  lines = []
  for (hidden, mlp), names in raced_widths(models).items():
    dense = {lib: dense_product_rates(rates, hidden)
             for lib, rates in per_core.items()}
    lines.append(
        f"A Dense layer's products at width {hidden} ({', '.join(names)}), "
        f"{DENSE_ROWS} rows, one core each as the train step runs them "
        f"(GFLOP/s over {len(dense_shapes(hidden, mlp))} shapes, jax / "
        f"torch{operands}): " + ", ".join(
            f"{product} {dense['jax'][product]:.0f} / "
            f"{dense['torch'][product]:.0f} "
            f"({dense['jax'][product] / dense['torch'][product]:.2f})"
            for product in DENSE_PRODUCTS))
  return lines
