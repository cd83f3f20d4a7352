"""Meshes, the FSDP rule, and training that does not depend on the mesh."""

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from helpers import small_config
from vit_jax import config as config_lib
from vit_jax.checkpoints import orbax_checkpoints
from vit_jax.data import datasets, input_pipeline
from vit_jax.model import variants
from vit_jax.runtime import sharding
from vit_jax.training import optim, steps


def test_mesh_shape_fills_in_minus_one_and_names_bad_sizes():
  assert sharding.mesh_shape({"data": -1, "fsdp": 1}, 8) == {"data": 8,
                                                             "fsdp": 1}
  assert sharding.mesh_shape({"data": 4, "fsdp": -1}, 8) == {"data": 4,
                                                             "fsdp": 2}
  assert sharding.mesh_shape({"data": 1, "fsdp": 1}, 8) == {"data": 1,
                                                            "fsdp": 1}
  with pytest.raises(ValueError, match="do not split into groups of 3"):
    sharding.mesh_shape({"data": -1, "fsdp": 3}, 8)
  with pytest.raises(ValueError, match="needs 16 devices but there are 8"):
    sharding.mesh_shape({"data": 4, "fsdp": 4}, 8)
  with pytest.raises(ValueError, match="at most one axis of size -1"):
    sharding.mesh_shape({"data": -1, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="positive or -1"):
    sharding.mesh_shape({"data": 0, "fsdp": 1}, 8)
  with pytest.raises(ValueError, match="unknown axes"):
    sharding.mesh_shape({"data": 1, "fsdp": 1, "model": 2}, 8)
  config = small_config()
  config.mesh.fsdp = 3
  with pytest.raises(ValueError, match="config.mesh"):
    config_lib.validate_config(config)


def test_mesh_axes_and_devices():
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  assert mesh.axis_names == ("data", "fsdp")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
  assert set(mesh.devices.flat) == set(jax.devices())
  assert sharding.make_mesh({"data": 1, "fsdp": 1}).size == 1
  assert sharding.make_mesh().shape["data"] == jax.device_count()


def test_fsdp_rule_on_vit_b16_parameters():
  """Spot checks written out by hand, then the rule's invariants."""
  config = config_lib.base_config("ViT-B/16")
  model = variants.build_model(config.model, 1000)
  abstract = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3)),
                         train=False))["params"]
  mesh = sharding.make_mesh({"data": 1, "fsdp": 8})
  specs = jax.tree.map(lambda s: s.spec,
                       sharding.state_shardings(mesh, abstract, 1024))
  block = specs["Transformer"]["encoderblock_0"]
  attention = block["MultiHeadDotProductAttention_1"]
  expected = {
      # (1, 197, 768): 768 is the largest dimension divisible by 8.
      "pos_embedding": (specs["Transformer"]["posembed_input"]
                        ["pos_embedding"], P(None, None, "fsdp")),
      "patch kernel (16, 16, 3, 768)": (specs["embedding"]["kernel"],
                                        P(None, None, None, "fsdp")),
      "query kernel (768, 12, 64)": (attention["query"]["kernel"],
                                     P("fsdp", None, None)),
      "out kernel (12, 64, 768)": (attention["out"]["kernel"],
                                   P(None, None, "fsdp")),
      "query bias (12, 64): 768 elements < 1024": (attention["query"]["bias"],
                                                   P()),
      "MLP in kernel (768, 3072)": (block["MlpBlock_3"]["Dense_0"]["kernel"],
                                    P(None, "fsdp")),
      "MLP in bias (3072,)": (block["MlpBlock_3"]["Dense_0"]["bias"],
                              P("fsdp")),
      "LayerNorm scale (768,)": (block["LayerNorm_0"]["scale"], P()),
      "class token (1, 1, 768)": (specs["cls"], P()),
      "head kernel (768, 1000): 1000 > 768": (specs["head"]["kernel"],
                                              P(None, "fsdp")),
  }
  for what, (got, want) in expected.items():
    assert got == want, what
  for x, spec in zip(jax.tree.leaves(abstract), jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, P))):
    sharded = [axis for axis, name in enumerate(spec) if name == "fsdp"]
    if sharded:
      assert len(sharded) == 1 and x.shape[sharded[0]] % 8 == 0
      assert x.shape[sharded[0]] == max(d for d in x.shape if d % 8 == 0)
    else:
      assert x.size < 1024 or all(d % 8 for d in x.shape)
  # fsdp=1: plain data parallelism, everything replicated.
  data_mesh = sharding.make_mesh({"data": 8, "fsdp": 1})
  assert all(s.spec == P() for s in jax.tree.leaves(
      sharding.state_shardings(data_mesh, abstract, 1024)))


def _train(config, mesh, num_steps, state=None):
  """(state, losses) after num_steps from init, or from `state`."""
  dataset = datasets.load(config)
  model = variants.build_model(config.model, dataset.num_classes)
  schedule = optim.learning_rate_schedule(config, 20, 4)
  fresh = steps.create_train_state(model, dataset.image_shape,
                                   optim.make_optimizer(config, schedule),
                                   config.seed, mesh, config.fsdp_min_size)
  start = 0 if state is None else int(state.step)
  state = fresh if state is None else state
  mean, std = dataset.channel_stats()
  flip = config.random_flip is not False
  train_fn = steps.compile_train_step(
      mesh, steps.shardings_of(state), schedule,
      **config_lib.train_step_options(config, mean, std, flip))
  stream = input_pipeline.train_batches(
      dataset.train_images, dataset.train_labels, config.batch_size,
      config.seed, start, mesh)
  losses = []
  for _ in range(num_steps):
    state, metrics = train_fn(state, *next(stream))
    losses.append(float(metrics["loss"]))
  return state, losses


MESHES = {"1 device": ({"data": 1, "fsdp": 1}, 1),
          "data=8": ({"data": 8, "fsdp": 1}, 8),
          "data=2, fsdp=4": ({"data": 2, "fsdp": 4}, 8),
          "fsdp=8": ({"data": 1, "fsdp": 8}, 8)}


@pytest.mark.slow
def test_data_parallel_and_fsdp_train_like_one_device():
  assert jax.device_count() == 8, "conftest sets 8 simulated CPU devices"
  results = {}
  for name, (mesh_config, num_devices) in MESHES.items():
    config = small_config(fsdp_min_size=256)
    config.mesh.update(mesh_config)
    mesh = sharding.make_mesh(config.mesh)
    state, losses = _train(config, mesh, 6)
    assert mesh.size == num_devices
    # Every parameter and every Adam moment is laid out as the rule says.
    expected = sharding.state_shardings(mesh, state, 256)
    for array, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
      assert array.sharding.is_equivalent_to(want, array.ndim), name
    kernel = state.params["Transformer"]["encoderblock_0"]["MlpBlock_3"][
        "Dense_0"]["kernel"]  # (32, 64)
    fsdp = mesh_config["fsdp"]
    assert kernel.addressable_shards[0].data.shape == (32, 64 // fsdp)
    results[name] = (losses, jax.device_get(state.params))
  reference_losses, reference_params = results.pop("1 device")
  for name, (losses, params) in results.items():
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5,
                               err_msg=name)
    # The attention key bias has an exactly-zero true gradient (softmax
    # ignores a per-row shift) and no effect on any output, so Adam turns
    # its float noise, which differs with the reduction order, into
    # updates of ~1e-6..1e-5 of either sign: compared only as being small.
    key_bias = lambda path: [entry.key for entry in path[-2:]] == [
        "key", "bias"]
    for tree in (params, reference_params):
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if key_bias(path):
          assert np.abs(leaf).max() < 1e-4, (name, path)
    others = lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, leaf: np.zeros_like(leaf) if key_bias(path) else leaf,
        tree)
    chex.assert_trees_all_close(others(params), others(reference_params),
                                rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_composes_with_fsdp():
  """accum_steps=4 on data=2 x fsdp=4 == the whole batch on one device."""
  results = []
  for mesh_config, accum_steps in (({"data": 1, "fsdp": 1}, 1),
                                   ({"data": 2, "fsdp": 4}, 4)):
    # No augmentation: its random draws differ per micro-batch.
    config = small_config(fsdp_min_size=256, batch_size=32,
                          accum_steps=accum_steps, optimizer="sgd",
                          learning_rate=0.1, crop_padding=0,
                          random_flip=False)
    config.mesh.update(mesh_config)
    state, losses = _train(config, sharding.make_mesh(config.mesh), 3)
    results.append((losses, jax.device_get(state.params)))
  np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
  chex.assert_trees_all_close(results[1][1], results[0][1], atol=2e-6)


@pytest.mark.slow
def test_scan_and_remat_blocks_train_like_the_plain_loop_under_fsdp():
  """scan_blocks + remat_blocks on data=2 x fsdp=4: same parameter layout
  and shardings, same losses and parameters as the plain loop."""
  results = []
  for scan_and_remat in (False, True):
    config = small_config(fsdp_min_size=256)
    config.mesh.update({"data": 2, "fsdp": 4})
    config.model.scan_blocks = config.model.remat_blocks = scan_and_remat
    mesh = sharding.make_mesh(config.mesh)
    state, losses = _train(config, mesh, 4)
    expected = sharding.state_shardings(mesh, state, 256)
    for array, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
      assert array.sharding.is_equivalent_to(want, array.ndim)
    results.append((losses, jax.device_get(state.params)))
  np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
  chex.assert_trees_all_close(results[1][1], results[0][1], rtol=1e-4,
                              atol=1e-5)


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh(tmp_path):
  """Written with FSDP on 8 devices; restored on 1 device and on 4
  data-parallel devices: identical arrays, then identical training."""
  config = small_config(fsdp_min_size=256)
  config.mesh.update({"data": 2, "fsdp": 4})
  written, _ = _train(config, sharding.make_mesh(config.mesh), 3)
  manager = orbax_checkpoints.make_manager(str(tmp_path), 2)
  orbax_checkpoints.save(manager, written)
  orbax_checkpoints.finish(manager)
  arrays = lambda state: jax.device_get(
      (state.step, state.params, state.opt_state, state.rng))
  expected = arrays(written)
  _, next_losses = _train(config, sharding.make_mesh(config.mesh), 2,
                          state=written)

  for mesh_config in ({"data": 1, "fsdp": 1}, {"data": 4, "fsdp": 1}):
    other = small_config(fsdp_min_size=256)
    other.mesh.update(mesh_config)
    mesh = sharding.make_mesh(other.mesh)
    fresh, _ = _train(other, mesh, 0)
    manager = orbax_checkpoints.make_manager(str(tmp_path), 2)
    restored, step = orbax_checkpoints.restore_latest(manager, fresh)
    manager.close()
    assert step == 3
    chex.assert_trees_all_equal(arrays(restored), expected)
    for array in jax.tree.leaves(restored):
      assert array.sharding.mesh.size == mesh.size
      assert array.sharding.spec == P()  # fsdp=1: replicated
    _, losses = _train(other, mesh, 2, state=restored)
    np.testing.assert_allclose(losses, next_losses, rtol=1e-5)


@flax.struct.dataclass
class _CheckpointedState:
  step: jax.Array
  params: dict
  rng: jax.Array


def test_checkpoints_read_and_are_read_by_orbax_standard_handler(tmp_path):
  """vit_jax saves without Orbax's replica-parallel slicing on CPU; the
  checkpoints of its standard handler (earlier vit_jax, other tools)
  still resume, and its own still read with that handler, on 8 devices."""
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  replicated = jax.sharding.NamedSharding(mesh, P())
  split = jax.sharding.NamedSharding(mesh, P("fsdp"))
  values = _CheckpointedState(
      step=np.int32(7), rng=np.array([3, 11], np.uint32),
      params={"bias": np.arange(24, dtype=np.float32).reshape(2, 12),
              "kernel": np.linspace(-1, 1, 64 * 3, dtype=np.float32
                                    ).reshape(64, 3)})
  state = jax.device_put(values, values.replace(
      step=replicated, rng=replicated,
      params={"bias": replicated, "kernel": split}))
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  standard = ocp.CheckpointManager(str(tmp_path / "standard" / "checkpoints"))
  standard.save(7, args=ocp.args.StandardSave(state))
  standard.wait_until_finished()
  standard.close()
  manager = orbax_checkpoints.make_manager(str(tmp_path / "standard"), 2)
  restored, step = orbax_checkpoints.restore_latest(manager, state)
  manager.close()
  assert step == 7
  chex.assert_trees_all_equal(jax.device_get(restored), values)
  assert restored.params["kernel"].sharding.is_equivalent_to(split, 2)

  manager = orbax_checkpoints.make_manager(str(tmp_path / "ours"), 2)
  orbax_checkpoints.save(manager, state)
  orbax_checkpoints.finish(manager)
  reader = ocp.CheckpointManager(str(tmp_path / "ours" / "checkpoints"))
  chex.assert_trees_all_equal(
      jax.device_get(reader.restore(7, args=ocp.args.StandardRestore(target))),
      values)
  reader.close()


@pytest.mark.slow
def test_vit_l16_initialises_sharded_without_a_full_copy():
  """XLA's own per-device memory figures for the sharded init program."""
  config = config_lib.base_config("ViT-L/16")
  model = variants.build_model(config.model, 1000)
  schedule = optim.learning_rate_schedule(config, 1000, 100)
  optimizer = optim.make_optimizer(config, schedule)

  def init(key):
    params = model.init({"params": key}, jnp.zeros((1, 224, 224, 3)),
                        train=False)["params"]
    return steps.TrainState.create(apply_fn=model.apply, params=params,
                                   tx=optimizer, rng=key)

  key = jax.random.PRNGKey(0)
  abstract = jax.eval_shape(init, key)
  param_bytes = sum(x.size * 4 for x in jax.tree.leaves(abstract.params))
  state_bytes = sum(x.size * x.dtype.itemsize
                    for x in jax.tree.leaves(abstract))
  assert 300e6 < param_bytes / 4 < 310e6  # 304.3 M parameters
  mesh = sharding.make_mesh({"data": 1, "fsdp": 8})
  memory = jax.jit(
      init, out_shardings=sharding.state_shardings(mesh, abstract, 1024)
  ).lower(key).compile().memory_analysis()
  # Each device holds 1/8 of the state (plus small replicated arrays) ...
  assert state_bytes / 8 <= memory.output_size_in_bytes < state_bytes / 7.5
  # ... and never builds a whole copy of the parameters to slice it.
  assert memory.temp_size_in_bytes < param_bytes / 4
