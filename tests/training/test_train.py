"""Training: steps, optimizer, sharding, checkpoints and resume, failures."""

import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from helpers import small_config
from vit_jax import config as config_lib
from vit_jax.checkpoints import pretrained
from vit_jax.data import augment, datasets
from vit_jax.model import variants
from vit_jax.runtime import host_memory, sharding
from vit_jax.training import loop, metric_writer, optim, steps


def _build(config, mesh, total_steps=20, steps_per_epoch=4):
  dataset = datasets.load(config)
  model = variants.build_model(config.model, dataset.num_classes)
  schedule = optim.learning_rate_schedule(config, total_steps,
                                          steps_per_epoch)
  state = steps.create_train_state(model, dataset.image_shape,
                                   optim.make_optimizer(config, schedule),
                                   config.seed, mesh)
  mean, std = dataset.channel_stats()
  train_fn = steps.compile_train_step(
      mesh, steps.shardings_of(state), schedule,
      **config_lib.train_step_options(config, mean, std, True))
  eval_fn = steps.compile_eval_step(
      mesh, steps.shardings_of(state.params),
      **config_lib.eval_step_options(config, model.apply, mean, std))
  return dataset, state, train_fn, eval_fn


def _noise_batch(mesh):
  """16 random 16x16x3 uint8 images and labels, placed on the mesh."""
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (16, 16, 16, 3)).astype(np.uint8)
  labels = rng.integers(0, 10, 16).astype(np.int32)
  return [sharding.to_global_batch(mesh, x) for x in (images, labels)]


def test_overfits_a_fixed_batch_of_noise():
  config = small_config(crop_padding=0, label_smoothing=0.0,
                         weight_decay=0.0, learning_rate=3e-3)
  mesh = sharding.make_mesh()
  _, state, train_fn, _ = _build(config, mesh, total_steps=150)
  batch = _noise_batch(mesh)
  losses = []
  for _ in range(150):
    state, metrics = train_fn(state, *batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.1 * losses[0]
  assert float(metrics["accuracy"]) == 1.0
  assert int(state.step) == 150


def _twenty_steps(**model_overrides):
  """(initial params, final state, losses) of twenty steps of the small
  config on one noise batch, with config.model's keys overridden."""
  mesh = sharding.make_mesh()
  batch = _noise_batch(mesh)
  config = small_config(crop_padding=0, random_flip=False, learning_rate=1e-3)
  config.model.update(model_overrides)
  _, state, train_fn, _ = _build(config, mesh, total_steps=20)
  initial = jax.device_get(state.params)
  losses = []
  for _ in range(20):
    state, metrics = train_fn(state, *batch)
    losses.append(float(metrics["loss"]))
  return initial, jax.device_get(state), np.array(losses)


def _assert_follows_float32(reduced, float32):
  """Twenty steps with reduced precision stay on the float32 run's path
  (bfloat16 keeps 8 bits of mantissa, so not bit-identical): same init,
  losses within 0.5%, updates pointing the same way, state float32."""
  (initial, state, losses), (initial32, state32, losses32) = reduced, float32
  chex.assert_trees_all_equal(initial, initial32)
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  assert not np.array_equal(losses, losses32)  # bfloat16 really computed
  np.testing.assert_allclose(losses, losses32, rtol=5e-3)
  flat = lambda tree: np.concatenate(
      [np.ravel(x) for x in jax.tree.leaves(tree)])
  update = flat(state.params) - flat(initial)
  update32 = flat(state32.params) - flat(initial)
  cosine = update @ update32 / np.linalg.norm(update) / np.linalg.norm(
      update32)
  assert cosine > 0.99, cosine


@pytest.mark.slow  # 35-40 s here: keeps the default run near 10 minutes
def test_bfloat16_compute_trains_like_float32_with_float32_state():
  """Mixed precision: bfloat16 matmuls, float32 params and AdamW moments."""
  _assert_follows_float32(_twenty_steps(dtype="bfloat16"), _twenty_steps())


@pytest.mark.slow  # ~20 s
def test_bfloat16_matmuls_train_like_float32():
  """config.model.matmul_dtype=bfloat16: bfloat16 operands, float32
  accumulation, everything else float32."""
  _assert_follows_float32(_twenty_steps(matmul_dtype="bfloat16"),
                          _twenty_steps())


@pytest.mark.parametrize("machine,matmul_dtype,has_dots,says", [
    ("x86_64", "bfloat16", False,
     "Warning: config.model.matmul_dtype='bfloat16'"),
    ("x86_64", None, True, "instructions (AVX512_BF16). "
     "--config.model.matmul_dtype=bfloat16"),
    ("x86_64", "bfloat16", True, None), ("x86_64", None, False, None),
    ("aarch64", "bfloat16", False,
     "Warning: config.model.matmul_dtype='bfloat16'"),
    ("aarch64", None, True, None)])  # unmeasured there: no recommendation
def test_the_log_advises_on_matmul_dtype_by_the_cpus_dot_instructions(
    monkeypatch, machine, matmul_dtype, has_dots, says):
  """bfloat16 products where the CPU has no bfloat16 dots get a warning
  (they run slower); float32 where an x86 CPU has them, a note naming the
  option; a suited setting, nothing."""
  import platform  # pylint: disable=import-outside-toplevel
  from vit_jax.kernels import xla_products  # pylint: disable=import-outside-toplevel
  from vit_jax.training import run  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(xla_products, "bfloat16_dot_instructions",
                      lambda: ("AVX512_BF16",) if has_dots else ())
  monkeypatch.setattr(platform, "machine", lambda: machine)
  advice = run.matmul_dtype_advice(matmul_dtype)
  if says is None:
    assert advice is None
  else:
    assert advice.startswith(("Warning", "Note")) and says in advice


def test_the_log_advises_a_device_per_fast_core_on_a_hybrid_cpu(monkeypatch):
  """A device per core on a CPU with cores of two speeds gets a note naming
  the fast cores' count as cpu_devices; anything else, nothing."""
  from vit_jax.runtime import cpu_info  # pylint: disable=import-outside-toplevel
  from vit_jax.training import run  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(cpu_info, "core_kinds", lambda: (8, 4))
  note = run.cpu_devices_advice(-1, 12)
  assert note.startswith("Note: this CPU has 8 fast and 4 slower cores")
  assert "--config.cpu_devices=8" in note
  assert run.cpu_devices_advice(0, 1) is None  # one device: nothing to wait on
  assert run.cpu_devices_advice(8, 8) is None  # the user chose a count
  monkeypatch.setattr(cpu_info, "core_kinds", lambda: None)
  assert run.cpu_devices_advice(-1, 2) is None


def test_the_log_notes_a_cpu_quota_below_the_cpus(monkeypatch):
  """A container's quota below the CPUs this process may run on gets a
  note with both and the cores vit_jax sizes itself for; a quota at or
  above them, or none, nothing."""
  from vit_jax.runtime import cpu_info  # pylint: disable=import-outside-toplevel
  from vit_jax.training import run  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)),
                      raising=False)
  monkeypatch.setattr(cpu_info, "cpu_quota", lambda: 2.5)
  note = run.cpu_quota_note()
  assert note.startswith("Note: a CPU quota")
  assert "2.50 CPUs' worth of time on its 8 CPUs" in note
  assert "sized for 3 (" in note
  for quota in (8.0, 16.0, None):
    monkeypatch.setattr(cpu_info, "cpu_quota", lambda q=quota: q)
    assert run.cpu_quota_note() is None


def test_the_log_notes_the_state_copied_onto_each_cpu_device():
  """CPU devices that each hold a copy of the train state get a note with
  its size and the one-device alternative once the extra copies reach 512
  MiB; one device, FSDP (which splits the state) or less, nothing. The
  state's size is its arrays' bytes."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from vit_jax.training import run  # pylint: disable=import-outside-toplevel
  gib = 2**30
  note = run.replicated_state_note(2, 1, gib)
  assert note.startswith("Note: each of this host's 2 CPU devices holds")
  assert "(1,024 MiB), 2,048 MiB in all" in note
  assert "--config.cpu_devices=0" in note
  assert run.replicated_state_note(1, 1, 10 * gib) is None
  assert run.replicated_state_note(8, 2, gib) is None
  assert run.replicated_state_note(4, 1, 100 * 2**20) is None  # 300 MiB
  assert run.replicated_state_note(8, 1, 100 * 2**20) is not None  # 700
  state = {"params": jnp.zeros((4, 8)), "step": jnp.zeros((), jnp.int32),
           "name": "not an array"}
  assert run._state_bytes(state) == 4 * 8 * 4 + 4  # pylint: disable=protected-access


def test_the_log_names_why_onednn_cannot_run_where_auto_would_take_it(
    monkeypatch):
  from vit_jax.kernels import cpu_gemm  # pylint: disable=import-outside-toplevel
  from vit_jax.training import run  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(cpu_gemm, "problem",
                      lambda device=None: "oneDNN is not installed: pip")
  advice = run.matmul_implementation_advice("auto", None)
  assert advice.startswith("Note") and "not installed: pip" in advice
  assert run.matmul_implementation_advice("xla", None) is None
  assert run.matmul_implementation_advice("auto", "bfloat16") is None
  assert run.matmul_implementation_advice("auto", None, "bfloat16") is None
  monkeypatch.setattr(cpu_gemm, "problem", lambda device=None: None)
  assert run.matmul_implementation_advice("auto", None) is None


def test_eval_step_ignores_padding():
  config = small_config()
  mesh = sharding.make_mesh()
  dataset, state, _, eval_fn = _build(config, mesh)
  images = dataset.test_images[:16]
  labels = dataset.test_labels[:16]
  mask = np.array([1.0] * 5 + [0.0] * 11, np.float32)
  put = lambda x: sharding.to_global_batch(mesh, x)
  masked = eval_fn(state.params, put(images), put(labels), put(mask))
  garbage = images.copy()
  garbage[5:] = 255 - garbage[5:]
  other_labels = labels.copy()
  other_labels[5:] = (labels[5:] + 1) % 10
  masked_garbage = eval_fn(state.params, put(garbage), put(other_labels),
                           put(mask))
  chex.assert_trees_all_close(masked, masked_garbage)
  assert float(masked["count"]) == 5


def test_eval_flip_average_classifies_by_the_mean_logits_of_image_and_mirror():
  mesh = sharding.make_mesh()
  put = lambda x: sharding.to_global_batch(mesh, x)
  config = small_config(eval_flip_average=True)
  dataset, state, _, eval_fn = _build(config, mesh)
  # The classifier starts at zero (all logits equal): give it random weights.
  head = state.params["head"]
  random_head = {"kernel": jax.random.normal(jax.random.PRNGKey(1),
                                             head["kernel"].shape),
                 "bias": head["bias"]}
  params = dict(state.params, head=jax.device_put(
      random_head, jax.tree.map(lambda x: x.sharding, head)))
  images, labels = dataset.test_images[:16], dataset.test_labels[:16]
  mask = np.ones(16, np.float32)
  sums = eval_fn(params, put(images), put(labels), put(mask))

  model = variants.build_model(config.model, dataset.num_classes)
  mean, std = dataset.channel_stats()
  host_params = jax.device_get(params)
  logits_of = lambda pixels: np.asarray(model.apply(
      {"params": host_params}, (pixels.astype(np.float32) - mean) / std))
  logits = (logits_of(images) + logits_of(images[:, :, ::-1])) / 2
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  np.testing.assert_allclose(  # evaluation loss: no label smoothing
      float(sums["loss_sum"]), -log_probs[np.arange(16), labels].sum(),
      rtol=1e-5)
  assert int(sums["correct"]) == (logits.argmax(-1) == labels).sum()
  assert np.abs(logits - logits_of(images)).max() > 1e-3  # mirrors differ


def test_weight_decay_mask_spares_biases_norms_and_embeddings():
  config = small_config()
  model = variants.build_model(config.model, 10)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))
  mask = optim.weight_decay_mask(params["params"])
  assert mask["cls"] is False
  assert mask["Transformer"]["posembed_input"]["pos_embedding"] is False
  block = mask["Transformer"]["encoderblock_0"]
  assert block["LayerNorm_0"] == {"scale": False, "bias": False}
  assert block["MlpBlock_3"]["Dense_0"] == {"kernel": True, "bias": False}
  assert block["MultiHeadDotProductAttention_1"]["query"]["kernel"] is True
  assert mask["embedding"]["kernel"] is True
  # Shifted patches' norm and locality attention's temperatures likewise.
  config.model.shifted_patches = config.model.locality_attention = True
  model = variants.build_model(config.model, 10)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))
  mask = optim.weight_decay_mask(params["params"])
  assert mask["embedding_norm"] == {"scale": False, "bias": False}
  assert mask["embedding"] == {"kernel": True, "bias": False}
  assert mask["Transformer"]["encoderblock_1"][
      "MultiHeadDotProductAttention_1"]["temperature"] is False


def _gradient_like_tree():
  """A params-shaped tree of random values (a kernel, a bias, a scalar)."""
  rng = np.random.default_rng(0)
  return {"block": {"kernel": rng.normal(size=(48, 64)).astype(np.float32),
                    "bias": rng.normal(size=(64,)).astype(np.float32)},
          "head": {"kernel": rng.normal(size=(64, 10)).astype(np.float32),
                   "temperature": np.float32(3.0)}}


@pytest.mark.parametrize("schedule,mask,grouped", [
    (False, False, False), (True, False, False), (False, True, False),
    (True, True, False), (True, True, True)])
def test_adamw_matches_optax_bit_for_bit(schedule, mask, grouped):
  """optim.adamw's XLA path (one jitted update per parameter; the CPU
  kernel's: tests/kernels/test_cpu_adamw.py) against optax.adamw:
  equal updates, params and state after several steps, and the same state
  structure, so checkpoints restore with either; grouped: inside
  optax.multi_transform with a frozen group (config.trainable="head")."""
  rng = np.random.default_rng(0)
  params = {"dense": {"kernel": rng.normal(size=(6, 5)), "bias":
                      rng.normal(size=5)},
            "norm": {"scale": rng.normal(size=5)},
            "other": {"kernel": rng.normal(size=(6, 5))}}
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  learning_rate = (optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6)
                   if schedule else 3e-3)
  kwargs = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1,
                mask=optim.weight_decay_mask if mask else None)
  reference = optax.adamw(learning_rate, **kwargs)
  ours = optim.adamw(learning_rate, **kwargs, implementation="xla")
  if grouped:
    labels = lambda tree: {name: jax.tree.map(
        lambda _: "freeze" if name == "other" else "train", branch)
                           for name, branch in tree.items()}
    reference, ours = (optax.multi_transform(
        {"train": tx, "freeze": optax.set_to_zero()}, labels)
                       for tx in (reference, ours))
  states = [reference.init(params), ours.init(params)]
  assert (jax.tree.structure(states[0]) == jax.tree.structure(states[1]))
  both = [params, params]
  for _ in range(5):
    grads = jax.tree.map(lambda x: jnp.asarray(
        rng.normal(size=x.shape), jnp.float32), params)
    for i, tx in enumerate((reference, ours)):
      updates, states[i] = jax.jit(tx.update)(grads, states[i], both[i])
      both[i] = optax.apply_updates(both[i], updates)
  chex.assert_trees_all_equal(both[0], both[1])
  chex.assert_trees_all_equal(states[0], states[1])
  assert not np.allclose(both[1]["dense"]["kernel"], params["dense"]["kernel"])
  if grouped:
    chex.assert_trees_all_equal(both[1]["other"], params["other"])


@pytest.mark.parametrize("sharded,implementation",
                         [(False, "auto"), (False, "xla"), (True, "auto")])
def test_global_norm_and_clipping_match_optax(sharded, implementation):
  tree = _gradient_like_tree()
  expected = np.sqrt(sum(np.sum(np.square(leaf.astype(np.float64)))
                         for leaf in jax.tree.leaves(tree)))
  norm = jax.jit(optim.global_norm, static_argnums=(1, 2))(
      tree, sharded, implementation)
  np.testing.assert_allclose(norm, expected, rtol=1e-6)
  np.testing.assert_allclose(norm, optax.global_norm(tree), rtol=1e-6)
  assert float(optim.global_norm({}, sharded)) == 0.0
  for max_norm in (expected / 3, expected * 2):  # clipped, then kept
    ours = optim.clip_by_global_norm(max_norm, sharded, implementation)
    theirs = optax.clip_by_global_norm(max_norm)
    # No state, as optax's: checkpoints restore across the two.
    assert jax.tree.leaves(ours.init(tree)) == jax.tree.leaves(
        theirs.init(tree)) == []
    clipped, _ = ours.update(tree, ours.init(tree))
    reference, _ = theirs.update(tree, theirs.init(tree))
    chex.assert_trees_all_close(clipped, reference, rtol=1e-6)
    np.testing.assert_allclose(optim.global_norm(clipped),
                               min(max_norm, expected), rtol=1e-5)


def test_sharded_global_norm_gathers_no_parameter():
  """Over FSDP-split leaves each device reduces its own shards: no
  all-gather. The concatenating path would gather (which is why the
  trainer picks by config.mesh)."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 8})
  tree = jax.tree.map(jnp.asarray, _gradient_like_tree())
  placed = sharding.put(tree, sharding.state_shardings(mesh, tree, 64))
  assert not placed["block"]["kernel"].sharding.is_fully_replicated

  def hlo(sharded):
    return jax.jit(optim.global_norm, static_argnums=1).lower(
        placed, sharded).compile().as_text()

  assert "all-gather" not in hlo(True)
  assert "all-gather" in hlo(False)
  np.testing.assert_allclose(optim.global_norm(placed, True),
                             optax.global_norm(tree), rtol=1e-6)
  config = small_config()
  assert not optim.shards_params(config)
  config.mesh.fsdp = 8
  assert optim.shards_params(config)


def test_learning_rate_warms_up_then_decays_by_cosine():
  config = small_config(learning_rate=1.0, end_learning_rate=0.0,
                         warmup_epochs=2.0)
  schedule = optim.learning_rate_schedule(config, total_steps=100,
                                          steps_per_epoch=10)
  np.testing.assert_allclose([schedule(0), schedule(10), schedule(20)],
                             [0.0, 0.5, 1.0], atol=1e-6)
  np.testing.assert_allclose(schedule(60), 0.5, atol=1e-6)  # cosine midpoint
  np.testing.assert_allclose(schedule(100), 0.0, atol=1e-6)


def _read_checkpoint(workdir, step):
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  tree = manager.restore(step, args=ocp.args.StandardRestore())
  manager.close()
  return tree


def test_resume_continues_exactly(tmp_path):
  config = small_config(num_train_steps=8, checkpoint_every_steps=4)
  config.model.dropout_rate = 0.1  # the dropout RNG must resume too
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(config, workdir)
  uninterrupted = _read_checkpoint(workdir, 8)
  records = metric_writer.read_metrics(workdir)

  # "Kill" the run after step 4: only the step-4 checkpoint survives.
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  final = loop.train_and_evaluate(config, workdir)
  resumed = _read_checkpoint(workdir, 8)
  chex.assert_trees_all_equal(resumed["params"], uninterrupted["params"])
  chex.assert_trees_all_equal(resumed["opt_state"],
                              uninterrupted["opt_state"])
  assert int(resumed["step"]) == 8
  drop_time = lambda rs: [{k: v for k, v in r.items()
                           if k not in ("time", "images_per_second")}
                          for r in rs]
  assert drop_time(metric_writer.read_metrics(workdir)) == drop_time(records)
  assert final["num_examples"] == 40


def test_nan_loss_stops_training_and_saves_nothing(tmp_path, monkeypatch):
  monkeypatch.setattr(augment, "train_preprocess",
                      lambda images, key, **_: jnp.full(images.shape, jnp.nan))
  config = small_config(num_train_steps=4, checkpoint_every_steps=2)
  with pytest.raises(FloatingPointError, match="loss became nan at step 1"):
    loop.train_and_evaluate(config, str(tmp_path))
  assert os.listdir(tmp_path / "checkpoints") == []


def test_nan_batch_update_is_skipped_when_configured(tmp_path, capsys):
  """One poisoned batch (step 3 of 6): its update is skipped, the others
  train, and the result equals training without that step's update."""
  real_preprocess = augment.train_preprocess

  def poisoned(images, key, **kwargs):
    out = real_preprocess(images, key, **kwargs)
    # The RNG key of step 2 (0-based) is recognisable by its value (the
    # step's keys are typed, runtime/prng.py: compared by their data).
    return jnp.where(jnp.all(jax.random.key_data(key) == poisoned.key),
                     jnp.nan, out)

  config = small_config(num_train_steps=6, checkpoint_every_steps=3,
                        skip_nonfinite_steps=True, log_every_steps=3)
  state_key = jax.random.split(jax.random.PRNGKey(config.seed))[1]
  poisoned.key = jax.random.split(jax.random.fold_in(state_key, 2))[0]
  monkeypatch = pytest.MonkeyPatch()
  monkeypatch.setattr(augment, "train_preprocess", poisoned)
  try:
    metrics = loop.train_and_evaluate(config, str(tmp_path))
  finally:
    monkeypatch.undo()
  assert "Skipped the update of step(s) [3]" in capsys.readouterr().out
  assert np.isfinite(metrics["loss"])
  params, _ = pretrained.load_params(str(tmp_path), 2)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))
  records = metric_writer.read_metrics(str(tmp_path))
  assert all(np.isfinite(r["loss"]) for r in records)


@pytest.mark.parametrize("overrides,message", [
    (dict(batch_size=12), "batch_size=12 is not divisible by the 8 devices"),
    (dict(dataset="cifar10"), "patch_size=3 does not divide the 32x32"),
    (dict(dataset="imagenet"), "neither a folder nor a TFDS dataset"),
    (dict(label_smoothing=1.5), "label_smoothing=1.5"),
])
def test_bad_config_fails_before_loading_data(tmp_path, overrides, message):
  config = small_config(raw_data_dir=str(tmp_path / "absent"),
                         data_source="raw")
  config.model.patch_size = 4 if "dataset" not in overrides else 3
  config.synthetic.image_size = 16
  for key, value in overrides.items():
    config[key] = value
  with pytest.raises(ValueError, match=message):
    loop.train_and_evaluate(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


def test_locked_config_rejects_unknown_keys():
  config = config_lib.base_config()
  with pytest.raises(AttributeError, match="batch_sise"):
    config.batch_sise = 64
  with pytest.raises(AttributeError):
    config.model.hiden_size = 64


def test_a_step_too_large_for_the_host_stops_before_training(tmp_path,
                                                             monkeypatch):
  """On a CPU the step's memory is checked against what the host has
  (vit_jax/runtime/host_memory.py) before its first run: too little stops
  the run with the settings that lower it, where the system would kill the
  process partway; config.check_host_memory=False runs it regardless."""
  monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**16)
  config = small_config(num_train_steps=2, checkpoint_every_steps=1)
  with pytest.raises(host_memory.HostMemoryError,
                     match=r"The train step needs .* GiB of host memory.*"
                     r"--config.batch_size=16 over --config.accum_steps=1"):
    loop.train_and_evaluate(config, str(tmp_path / "checked"))
  assert os.listdir(tmp_path / "checked" / "checkpoints") == []
  config.check_host_memory = False
  final = loop.train_and_evaluate(config, str(tmp_path / "unchecked"))
  assert final["num_examples"] == 40
