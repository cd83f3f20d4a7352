"""AdamW's update as a C++ kernel (`cpu_adamw`): its values against float64,
`optim.adamw` and clipping through it against XLA's per-parameter updates
and optax, under a batch-split mesh, and where it is taken."""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from vit_jax.kernels import cpu_adamw, cpu_build
from vit_jax.model import vit
from vit_jax.runtime import sharding
from vit_jax.training import optim, steps

needs_kernels = pytest.mark.skipif(
    cpu_build.problem() is not None,
    reason=f"the C++ kernels cannot run: {cpu_build.problem()}")

B1, B2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 0.05
F32_EPS = float(np.finfo(np.float32).eps)


def _leaves(seed: int, shapes) -> list[tuple[np.ndarray, ...]]:
  """(gradient, mu, nu, param) per shape: normal values, nu >= 0 and small
  (late in training), some exact zeros (nu = 0: the update is mu / eps)."""
  rng = np.random.default_rng(seed)
  leaves = []
  for shape in shapes:
    grad, mu, param = (rng.normal(size=shape).astype(np.float32)
                       for _ in range(3))
    nu = (np.abs(rng.normal(size=shape)) * 1e-3).astype(np.float32)
    if grad.size > 3:
      grad.reshape(-1)[:2] = 0.0
      nu.reshape(-1)[:1] = 0.0
      mu.reshape(-1)[:1] = 0.0
    leaves.append((grad, mu, nu, param))
  return leaves


def _float64_reference(grad, mu, nu, param, decayed, c1, c2, step, scale):
  """AdamW's arithmetic in float64 on the float32 constants XLA's and the
  kernel's use; with each result's scale: the sum of its terms' magnitudes,
  which bounds float32's rounding error."""
  f = lambda x: float(np.float32(x))
  g = grad.astype(np.float64) * f(scale)
  terms_mu = (f(1 - B1) * g, f(B1) * mu.astype(np.float64))
  terms_nu = (f(1 - B2) * g * g, f(B2) * nu.astype(np.float64))
  new_mu, new_nu = sum(terms_mu), sum(terms_nu)
  denominator = np.sqrt(new_nu / f(c2)) + f(EPS)
  decay = f(WEIGHT_DECAY) * param.astype(np.float64) if decayed else 0.0
  update = f(step) * (new_mu / f(c1) / denominator + decay)
  mu_scale = np.abs(terms_mu[0]) + np.abs(terms_mu[1])
  update_scale = abs(f(step)) * (mu_scale / f(c1) / denominator
                                 + np.abs(decay))
  return (update, new_mu, new_nu), (update_scale, mu_scale, new_nu)


def _xla_update(grad, mu, nu, param):
  """optim.adamw's first per-parameter update (XLA's fusions) of one leaf
  from moments mu and nu, at a learning rate of 1e-3, decayed."""
  tx = optim.adamw(1e-3, B1, B2, EPS, WEIGHT_DECAY, implementation="xla")
  adam, *others = tx.init(param)
  updates, (adam, *_) = jax.jit(tx.update)(
      grad, (adam._replace(mu=mu, nu=nu), *others), param)
  return updates, adam.mu, adam.nu


@needs_kernels
@pytest.mark.parametrize("tasks,apply", [(1, False), (3, False), (3, True)])
def test_values_match_a_float64_reference(tasks, apply):
  """Leaves that are not whole vectors, scalars, several chunks (70,001
  values), decay on some and off on others, a gradient scale below 1 (as
  clipping gives), spread over `tasks` threads: every result within a few
  float32 roundings of its terms' scale, as XLA's own are; with `apply`
  the first results are the parameters updated."""
  shapes = [(37, 5), (7,), (), (70_001,), (3, 64, 192), (13,)] * 2
  leaves = _leaves(0, shapes)
  decayed = [i % 3 != 1 for i in range(len(shapes))]
  c1, c2, step, scale = 0.19, 0.0019990005, -1e-3, 0.37
  grads, mus, nus, params = (list(part) for part in zip(*leaves))
  results = jax.jit(lambda *trees: cpu_adamw.update(
      *trees, decayed, c1, c2, step, scale, b1=B1, b2=B2, eps=EPS,
      weight_decay=WEIGHT_DECAY, apply=apply, tasks=tasks))(
          grads, mus, nus, params)
  for i, leaf in enumerate(leaves):
    expected, scales = _float64_reference(*leaf, decayed[i], c1, c2, step,
                                          scale)
    if apply:
      param = leaf[3].astype(np.float64)
      expected = (param + expected[0], *expected[1:])
      scales = (np.abs(param) + scales[0], *scales[1:])
    for result, want, bound in zip((r[i] for r in results), expected,
                                   scales):
      assert result.shape == leaf[0].shape and result.dtype == jnp.float32
      error = np.abs(np.asarray(result, np.float64) - want)
      assert np.all(error <= 6 * F32_EPS * bound + 1e-30), (
          shapes[i], float(np.max(error / (bound + 1e-30))))


def test_the_reference_bound_is_what_xla_meets_and_not_looser():
  """The bound above holds for XLA's per-parameter update too, and a result
  1e-5 off (a wrong constant: 1.0f - 0.999f instead of 0.001f) breaks it."""
  (leaf,) = _leaves(1, [(4096,)])
  # The first step's corrections, as XLA computes them in float32.
  c1, c2 = (np.float32(1) - np.float32(b) for b in (B1, B2))
  expected, scales = _float64_reference(*leaf, True, c1, c2, -1e-3, 1.0)
  xla = _xla_update(*(jnp.asarray(x) for x in leaf))
  for result, want, bound in zip(xla, expected, scales):
    error = np.abs(np.asarray(result, np.float64) - want)
    assert np.all(error <= 6 * F32_EPS * bound + 1e-30)
  off = np.asarray(xla[2], np.float64) * (1 + 1e-5)
  assert np.any(np.abs(off - expected[2]) > 6 * F32_EPS * scales[2])


def _params(seed: int):
  rng = np.random.default_rng(seed)
  tree = {"dense": {"kernel": rng.normal(size=(6, 5)),
                    "bias": rng.normal(size=5)},
          "norm": {"scale": rng.normal(size=5)},
          "other": {"kernel": rng.normal(size=(300, 7))}}
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _run(tx, params, seed: int, steps_: int = 5, grad_size: float = 1.0):
  rng = np.random.default_rng(seed)
  state = tx.init(params)
  for _ in range(steps_):
    grads = jax.tree.map(lambda x: jnp.asarray(
        rng.normal(size=x.shape) * grad_size, jnp.float32), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _assert_close(a, b):
  chex.assert_trees_all_close(a, b, rtol=2e-5, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("schedule,mask,grouped", [
    (False, False, False), (True, True, False), (True, True, True)])
def test_adamw_through_the_kernel_follows_xlas_updates(schedule, mask,
                                                       grouped):
  """optim.adamw with the kernel against its per-parameter updates: the
  same params and state (to float32 rounding) after five steps and the
  same state structure (checkpoints restore with either); with a
  schedule, the decay mask, and optax.multi_transform's frozen group."""
  learning_rate = (optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6)
                   if schedule else 3e-3)
  kwargs = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1,
                mask=optim.weight_decay_mask if mask else None)
  txs = [optim.adamw(learning_rate, **kwargs, implementation=implementation)
         for implementation in ("xla", "cpu_kernel")]
  if grouped:
    labels = lambda tree: {name: jax.tree.map(
        lambda _: "freeze" if name == "other" else "train", branch)
                           for name, branch in tree.items()}
    txs = [optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()},
                                 labels) for tx in txs]
  params = _params(0)
  (xla_params, xla_state), (params_k, state_k) = (_run(tx, params, 1)
                                                  for tx in txs)
  assert jax.tree.structure(xla_state) == jax.tree.structure(state_k)
  _assert_close(xla_params, params_k)
  _assert_close(xla_state, state_k)
  assert not np.allclose(params_k["dense"]["kernel"],
                         params["dense"]["kernel"])
  if grouped:
    chex.assert_trees_all_equal(params_k["other"], params["other"])


@pytest.mark.parametrize("implementation", ["xla", "cpu_kernel"])
@pytest.mark.parametrize("grad_size", [1e-3, 10.0])
def test_clipping_into_adamw_is_optaxs_chain(implementation, grad_size):
  """clip_by_global_norm_into(adamw) against optax.chain(optax's clipping,
  optax.adamw): the same state structure and values, whether the norm is
  under the limit (grad_size 1e-3) or clipped (10)."""
  if implementation == "cpu_kernel" and cpu_build.problem() is not None:
    pytest.skip(f"the C++ kernels cannot run: {cpu_build.problem()}")
  kwargs = dict(weight_decay=0.1, mask=optim.weight_decay_mask)
  reference = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.chain(optax.adamw(1e-2, **kwargs),
                                      optim.scale_by_layer(1.0)))
  ours = optim.clip_by_global_norm_into(
      optax.chain(optim.adamw(1e-2, **kwargs, implementation=implementation),
                  optim.scale_by_layer(1.0)), 1.0)
  params = _params(2)
  (ref_params, ref_state), (our_params, our_state) = (
      _run(tx, params, 3, grad_size=grad_size) for tx in (reference, ours))
  assert jax.tree.structure(ref_state) == jax.tree.structure(our_state)
  _assert_close(ref_params, our_params)
  _assert_close(ref_state, our_state)


def _run_applied(tx, params, seed: int, steps_: int = 5):
  """_run through optim.apply_gradients, jitted with the params and state
  donated as the train step's are."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(jnp.copy, params)  # the caller's are not donated
  state = tx.init(params)
  step = jax.jit(functools.partial(optim.apply_gradients, tx),
                 donate_argnums=(1, 2))
  for _ in range(steps_):
    grads = jax.tree.map(lambda x: jnp.asarray(
        rng.normal(size=x.shape), jnp.float32), params)
    params, state = step(grads, state, params)
  return params, state


@pytest.mark.parametrize("implementation", ["xla", "cpu_kernel"])
@pytest.mark.parametrize("form", ["adamw", "clipped", "chained", "grouped"])
def test_apply_gradients_is_update_then_apply_updates(implementation, form):
  """optim.apply_gradients gives what tx.update and optax.apply_updates
  give: through AdamW's `apply` (adamw alone or clipped into) the kernel
  adds the updates itself; a chain or multi_transform around it takes the
  two steps."""
  if implementation == "cpu_kernel" and cpu_build.problem() is not None:
    pytest.skip(f"the C++ kernels cannot run: {cpu_build.problem()}")
  tx = optim.adamw(1e-2, weight_decay=0.1, mask=optim.weight_decay_mask,
                   implementation=implementation)
  if form == "clipped":
    tx = optim.clip_by_global_norm_into(tx, 1.0,
                                        implementation=implementation)
  elif form == "chained":
    tx = optim.clip_by_global_norm_into(
        optax.chain(tx, optim.scale_by_layer(1.0)), 1.0,
        implementation=implementation)
  elif form == "grouped":
    tx = optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()},
                               lambda tree: {name: jax.tree.map(
                                   lambda _: "freeze" if name == "other"
                                   else "train", branch)
                                             for name, branch in tree.items()})
  params = _params(4)
  applied = _run_applied(tx, params, 5)
  reference = _run(tx, params, 5)
  assert jax.tree.structure(applied) == jax.tree.structure(reference)
  _assert_close(applied, reference)
  hlo = jax.jit(functools.partial(optim.apply_gradients, tx)).lower(
      params, tx.init(params), params).as_text()
  by_kernel = implementation == "cpu_kernel"
  assert ("VitAdamW" in hlo) == by_kernel
  assert ("apply = true" in hlo) == (by_kernel and form in ("adamw",
                                                            "clipped"))


@needs_kernels
def test_in_a_train_step_on_a_mesh_the_kernel_adds_no_communication():
  """The train step on a batch-split mesh (8 devices): with the kernels
  (AdamW's and the gradients' norm), the same loss, gradient norm and
  params as with XLA's after three steps, and no more collectives in the
  compiled program (every device updates its whole replica)."""
  mesh = sharding.make_mesh()
  model = vit.VisionTransformer(num_classes=10, patch_size=4, hidden_size=32,
                                num_layers=2, num_heads=2, mlp_dim=64)
  rng = np.random.default_rng(0)
  images = jax.device_put(rng.integers(0, 256, (16, 16, 16, 3), np.uint8),
                          sharding.batch_sharded(mesh))
  labels = jax.device_put(rng.integers(0, 10, 16).astype(np.int32),
                          sharding.batch_sharded(mesh))
  results, collectives = [], []
  for implementation in ("xla", "cpu_kernel"):
    tx = optim.clip_by_global_norm_into(
        optim.adamw(1e-3, weight_decay=0.05, implementation=implementation),
        1.0, implementation=implementation)
    state = steps.create_train_state(model, (16, 16, 3), tx, 0, mesh)
    step = jax.jit(functools.partial(
        steps.train_step, preprocess=lambda x, _: x.astype(jnp.float32) / 255,
        label_smoothing=0.0, learning_rate_fn=lambda _: 1e-3,
        global_norm=functools.partial(optim.global_norm,
                                      implementation=implementation)),
                   donate_argnums=0)
    hlo = step.lower(state, images, labels).compile().as_text()
    for kernel in ("VitAdamW", "VitSumOfSquares"):
      assert (kernel in hlo) == (implementation == "cpu_kernel")
    collectives.append(sum(hlo.count(f" {op}(") for op in (
        "all-reduce", "all-gather", "all-to-all", "collective-permute",
        "reduce-scatter")))
    for _ in range(3):
      state, metrics = step(state, images, labels)
    results.append((state.params, metrics["loss"], metrics["grad_norm"]))
  assert collectives[1] <= collectives[0]
  # atol: the attention's key bias has no gradient but rounding noise,
  # which AdamW turns into steps of either sign (its updates' values are
  # checked above).
  chex.assert_trees_all_close(results[0], results[1], rtol=1e-4, atol=1e-5)


def test_the_implementation_resolves_and_says_why_not():
  f32, bf16 = jnp.zeros(3), jnp.zeros(3, jnp.bfloat16)
  assert cpu_adamw.resolve_implementation("xla", [f32]) == "xla"
  assert cpu_adamw.resolve_implementation("auto", [bf16]) == "xla"
  with pytest.raises(ValueError, match="float32 parameters.*'auto'"):
    cpu_adamw.resolve_implementation("cpu_kernel", [f32, bf16])
  with pytest.raises(ValueError, match="Unknown optimizer_implementation"):
    cpu_adamw.resolve_implementation("fused", [f32])
  if cpu_build.problem() is None:
    assert cpu_adamw.resolve_implementation("auto", [f32]) == "cpu_kernel"


def test_fsdp_takes_xlas_updates_and_refuses_the_kernel():
  """Under FSDP each device holds a slice of a parameter: "auto" takes
  XLA's updates there, "cpu_kernel" is refused naming the fix."""
  config = ml_collections.ConfigDict({
      "optimizer_implementation": "auto",
      "mesh": {"data": -1, "fsdp": 2}})
  assert optim.optimizer_implementation(config) == "xla"
  config.optimizer_implementation = "cpu_kernel"
  with pytest.raises(ValueError, match="mesh.fsdp=1"):
    optim.optimizer_implementation(config)
  config.mesh.fsdp = 1
  assert optim.optimizer_implementation(config) == "cpu_kernel"


@needs_kernels
def test_operands_are_checked_and_named():
  grad = jnp.zeros((3, 4))
  with pytest.raises(ValueError, match=r"float32\[3, 5\]"):
    cpu_adamw.update([grad], [grad], [jnp.zeros((3, 5))], [grad], [True],
                     0.1, 0.1, -1.0, b1=B1, b2=B2, eps=EPS, weight_decay=0.0)
  with pytest.raises(ValueError, match="as many"):
    cpu_adamw.update([grad], [grad], [grad], [grad], [], 0.1, 0.1, -1.0,
                     b1=B1, b2=B2, eps=EPS, weight_decay=0.0)
