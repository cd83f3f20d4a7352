"""vit_jax on a CUDA GPU: the same numbers as on the CPU, the kernels the
README promises, and a train step that compiles once, checkpoints portably
and repeats exactly with XLA's deterministic ops.

  python -m pytest -m gpu -n 0 tests/test_gpu.py

Every test skips, saying why, where JAX sees no CUDA GPU (CI has none).
The CPU side of each comparison runs on `jax.devices("cpu")` in the same
process.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from vit_jax.checkpoints import orbax_checkpoints
from vit_jax.kernels import xla_products
from vit_jax.model import variants
from vit_jax.runtime import sharding
from vit_jax.training import optim, steps

pytestmark = pytest.mark.gpu

# Relative error ‖x − ref‖ / ‖ref‖ allowed where one side computes in
# bfloat16 (8 bits of mantissa: ~4e-3 per rounding, accumulated over
# 12 blocks) and the reference in float32.
BF16_TOLERANCE = 3e-2


def _relative_error(x, reference) -> float:
  x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
  return float(np.linalg.norm(x - reference) / np.linalg.norm(reference))


@pytest.fixture(scope="module")
def gpu():
  """JAX's first CUDA device; skips where there is none."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError as e:
    pytest.skip(f"no CUDA GPU visible to JAX ({e}); these tests run on a GPU "
                "host: python -m pytest -m gpu -n 0 tests/test_gpu.py")
  if not devices or getattr(devices[0], "compute_capability", None) is None:
    pytest.skip("JAX's GPU is not a CUDA device")
  return devices[0]


def _model(name: str, dtype: str = "float32", **overrides):
  config = variants.get_variant(name)
  config.dtype = dtype
  for key, value in overrides.items():
    config[key] = value
  return variants.build_model(config, num_classes=1000)


def _images(batch: int, size: int = 224, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).normal(
      size=(batch, size, size, 3)).astype(np.float32)


def _init(model, device, size: int = 224):
  """The model's initial params on `device`, with a random head: the
  initial head is zeros, which would make every logit and every gradient
  below it zero."""
  with jax.default_device(device):
    params = jax.jit(model.init)(jax.random.PRNGKey(0),
                                 jnp.zeros((1, size, size, 3)))["params"]
    head = params["head"]["kernel"]
    head = 0.05 * jax.random.normal(jax.random.PRNGKey(1), head.shape)
    return {**params, "head": {**params["head"], "kernel": head}}


def _logits(model, params, images, device):
  params, images = jax.device_put((params, images), device)
  return jax.jit(lambda p, x: model.apply({"params": p}, x))(params, images)


@pytest.mark.parametrize("name", ["ViT-Ti/16", "ViT-B/16"])
def test_float32_logits_equal_the_cpus(gpu, name):
  cpu = jax.devices("cpu")[0]
  model = _model(name)
  params = _init(model, cpu)
  images = _images(4)
  expected = np.asarray(_logits(model, params, images, cpu))
  # "highest": float32 products. JAX's default lets the GPU's matrix units
  # round float32 operands to TF32 (10-bit mantissa).
  with jax.default_matmul_precision("highest"):
    logits = _logits(model, params, images, gpu)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4,
                             rtol=1e-4)


@pytest.mark.parametrize("name", ["ViT-Ti/16", "ViT-B/16"])
def test_bfloat16_logits_follow_float32(gpu, name):
  params = _init(_model(name), gpu)
  images = _images(8, seed=1)
  with jax.default_matmul_precision("highest"):
    expected = _logits(_model(name), params, images, gpu)
  logits = _logits(_model(name, "bfloat16"), params, images, gpu)
  assert logits.dtype == jnp.float32  # logits leave the model in float32
  assert _relative_error(logits, expected) < BF16_TOLERANCE
  assert jax.tree.leaves(params)[0].dtype == jnp.float32


def _loss_fn(model, images, labels):
  def loss(params):
    logits = model.apply({"params": params}, images)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
  return loss


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_auto_takes_cudnn_flash_attention_in_bfloat16(gpu, classifier):
  """197 tokens with the class token (padded to 198 for cuDNN, and the last
  block's single query to 2), 196 without."""
  auto = _model("ViT-B/16", "bfloat16", classifier=classifier)
  einsum = _model("ViT-B/16", "bfloat16", classifier=classifier,
                  attention_implementation="einsum")
  params = _init(auto, gpu)
  images = jax.device_put(_images(8, seed=2), gpu)
  labels = jax.device_put(jnp.arange(8) % 1000, gpu)
  programs = {}
  results = {}
  for label, model in (("auto", auto), ("einsum", einsum)):
    step = jax.jit(jax.value_and_grad(_loss_fn(model, images, labels)))
    programs[label] = step.lower(params).compile().as_text()
    results[label] = step(params)
  # cuDNN's fused attention is a custom call in the compiled program, in the
  # forward and the backward pass; the einsums' program has none.
  assert programs["auto"].count("__cudnn$fmha") >= 2 * 12
  assert "__cudnn$fmha" not in programs["einsum"]
  (loss, grads), (einsum_loss, einsum_grads) = results["auto"], \
      results["einsum"]
  assert abs(float(loss) - float(einsum_loss)) < BF16_TOLERANCE * abs(
      float(einsum_loss))
  for path in (("Transformer", "encoderblock_0",
                "MultiHeadDotProductAttention_1", "query", "kernel"),
               ("Transformer", "encoderblock_11", "MlpBlock_3", "Dense_0",
                "kernel"), ("embedding", "kernel")):
    grad, reference = grads, einsum_grads
    for key in path:
      grad, reference = grad[key], reference[key]
    assert _relative_error(grad, reference) < 2 * BF16_TOLERANCE, path


def test_auto_keeps_the_einsums_in_float32(gpu):
  """cuDNN's flash attention computes in bfloat16 or float16 only."""
  model = _model("ViT-Ti/16", "float32")
  params = _init(model, gpu)
  images = jax.device_put(_images(2), gpu)
  step = jax.jit(jax.value_and_grad(_loss_fn(model, images, jnp.arange(2))))
  program = step.lower(params).compile().as_text()
  assert "__cudnn$fmha" not in program


def test_products_take_cublas_not_xlas_triton_gemm_fusions(gpu):
  """The steps' per-program options (`xla_products.xla_compiler_options`)
  give every product of ViT-B/16's bfloat16 forward and backward passes to
  cuBLAS: none is a Triton GEMM fusion (docs/gpu.md, 2026-12-04); the
  same loss as XLA's own choice."""
  model = _model("ViT-B/16", "bfloat16")
  params = _init(model, gpu)
  images = jax.device_put(_images(8), gpu)
  loss_and_grads = jax.value_and_grad(_loss_fn(model, images, jnp.arange(8)))
  options = xla_products.xla_compiler_options(model.matmul_dtype)
  assert options == {"xla_gpu_enable_triton_gemm": False}
  compiled = jax.jit(loss_and_grads, compiler_options=options).lower(
      params).compile()
  program = compiled.as_text()
  assert "__triton_gemm" not in program and "__cublas" in program
  loss, _ = compiled(params)
  reference, _ = jax.jit(loss_and_grads)(params)
  assert abs(float(loss) - float(reference)) < BF16_TOLERANCE * abs(
      float(reference))


def test_train_step_compiles_once(gpu, tmp_path, caplog):
  del gpu  # the trainer runs on JAX's default device, the GPU
  config = helpers.small_config(num_epochs=2)
  metrics, compiled = helpers.train_counting_compiles(config, str(tmp_path),
                                                      caplog)
  assert compiled.count("jit(train_step)") == 1, compiled
  assert np.isfinite(metrics["loss"])


def _small_state(mesh, **model_overrides):
  model = helpers.small_vit(**model_overrides)
  return model, steps.create_train_state(
      model, (16, 16, 3), optim.adamw(1e-3, weight_decay=0.05), 0, mesh)


def _jitted_train_step():
  return jax.jit(
      lambda state, images, labels: steps.train_step(
          state, images, labels, preprocess=lambda x, _: x / 255.0,
          label_smoothing=0.0, learning_rate_fn=lambda _: 1e-3),
      donate_argnums=0)


def test_train_step_donates_the_state(gpu):
  mesh = sharding.make_mesh(devices=[gpu])
  _, state = _small_state(mesh)
  images = jax.device_put(jnp.ones((8, 16, 16, 3), jnp.uint8) * 100, gpu)
  labels = jax.device_put(jnp.arange(8) % 10, gpu)
  step = _jitted_train_step()
  new_state, _ = step(state, images, labels)
  jax.block_until_ready(new_state)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))
  assert step._cache_size() == 1  # pylint: disable=protected-access
  step(new_state, images, labels)
  assert step._cache_size() == 1  # pylint: disable=protected-access


def test_scan_and_remat_blocks_give_the_same_loss(gpu):
  images = jax.device_put(_images(8, size=16, seed=3), gpu)
  labels = jax.device_put(jnp.arange(8) % 10, gpu)
  base = helpers.small_vit(num_layers=4)
  params = _init(base, gpu, size=16)
  results = {}
  with jax.default_matmul_precision("highest"):
    for scan in (False, True):
      for remat in (False, True):
        model = base.clone(scan_blocks=scan, remat_blocks=remat)
        results[scan, remat] = jax.jit(jax.value_and_grad(_loss_fn(
            model, images, labels)))(params)
  loss, grads = results[False, False]
  for key, (other_loss, other_grads) in results.items():
    np.testing.assert_allclose(float(other_loss), float(loss), rtol=1e-6,
                               err_msg=str(key))
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                 atol=1e-6, err_msg=str(key))


def _save(state, workdir):
  manager = orbax_checkpoints.make_manager(str(workdir), max_to_keep=1)
  orbax_checkpoints.save(manager, state)
  orbax_checkpoints.finish(manager)


def _restore(fresh_state, workdir):
  manager = orbax_checkpoints.make_manager(str(workdir), max_to_keep=1)
  restored, step = orbax_checkpoints.restore_latest(manager, fresh_state)
  manager.close()
  assert step is not None
  return restored


def _assert_bit_exact(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def test_checkpoint_moves_between_gpu_and_cpu_bit_exactly(gpu, tmp_path):
  cpu = jax.devices("cpu")[0]
  gpu_mesh = sharding.make_mesh(devices=[gpu])
  cpu_mesh = sharding.make_mesh(devices=[cpu])
  _, state = _small_state(gpu_mesh)
  images = jax.device_put(jnp.ones((8, 16, 16, 3), jnp.uint8) * 50, gpu)
  labels = jax.device_put(jnp.arange(8) % 10, gpu)
  state, _ = _jitted_train_step()(state, images, labels)  # moments non-zero
  _save(state, tmp_path / "from_gpu")
  fresh_cpu = _small_state(cpu_mesh)[1]
  on_cpu = _restore(fresh_cpu, tmp_path / "from_gpu")
  assert {d.platform for x in jax.tree.leaves(on_cpu)
          for d in x.devices()} == {"cpu"}
  _assert_bit_exact(on_cpu, state)
  _save(on_cpu, tmp_path / "from_cpu")
  back = _restore(_small_state(gpu_mesh)[1], tmp_path / "from_cpu")
  assert {d.platform for x in jax.tree.leaves(back)
          for d in x.devices()} == {"gpu"}
  _assert_bit_exact(back, state)


_DETERMINISM_SCRIPT = """
import json, jax, jax.numpy as jnp
import helpers
from vit_jax.runtime import sharding
from vit_jax.training import optim, steps
model = helpers.small_vit(num_layers=4, hidden_size=64, mlp_dim=128,
                          drop_path_rate=0.1, dropout_rate=0.1)
state = steps.create_train_state(model, (32, 32, 3), optim.adamw(1e-3), 0,
                                 sharding.make_mesh())
step = jax.jit(lambda s, x, y: steps.train_step(
    s, x, y, preprocess=lambda x, _: x / 255.0, label_smoothing=0.1,
    learning_rate_fn=lambda _: 1e-3), donate_argnums=0)
key = jax.random.PRNGKey(1)
images = jax.random.randint(key, (256, 32, 32, 3), 0, 256).astype(jnp.uint8)
labels = jax.random.randint(key, (256,), 0, 10)
losses = []
for _ in range(10):
  state, metrics = step(state, images, labels)
  losses.append(float(metrics["loss"]))
print(json.dumps({"losses": losses, "param_sum": float(sum(
    jnp.sum(jnp.abs(p)) for p in jax.tree.leaves(state.params)))}))
"""


def test_deterministic_ops_repeat_the_losses_exactly(gpu):
  del gpu
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                      + " --xla_gpu_deterministic_ops=true").strip()
  runs = []
  for _ in range(2):
    out = helpers.run_python("-c", _DETERMINISM_SCRIPT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  assert runs[0] == runs[1]
  assert len(set(runs[0]["losses"])) > 1  # it trained
