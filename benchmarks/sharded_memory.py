"""Per-device memory of large ViTs, replicated vs FSDP, from XLA itself.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python benchmarks/sharded_memory.py

For each model and mesh it compiles (never runs) the sharded init and one
AdamW train step at 224 px ahead of time and reads `memory_analysis()` of
the compiled programs, which XLA reports per device:
- params / optimizer: bytes of this device's slice of the parameters and
  of the AdamW state, from the shardings the FSDP rule assigns;
- state (init): the init program's output on one device (must equal
  params + optimizer: nothing is replicated that should not be);
- init temp: scratch of the init program (well under one full copy of the
  parameters: the model is never materialised whole on one device);
- step temp: activations, gradients and all-gathered weights of one train
  step, at each --batch_per_device (images per device).
The whole table takes about 6 minutes on 2 cores (compiling, not running);
--models=ViT-L/16 or --notrain_step for a quicker run.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from vit_jax import config as config_lib
from vit_jax.model import variants
from vit_jax.runtime import sharding
from vit_jax.training import optim, steps

_MODELS = flags.DEFINE_list("models", ["ViT-L/16", "ViT-H/14"],
                            "Variants to analyse.")
_BATCHES = flags.DEFINE_list("batch_per_device", ["1", "8"],
                             "Images per device in the train step.")
_STEP = flags.DEFINE_bool("train_step", True,
                          "Also compile a train step (slow for ViT-H/14).")

MIB = 2**20


def _bytes_per_device(tree) -> int:
  """Bytes one device holds of `tree` (abstract arrays with shardings)."""
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def analyse(name: str, mesh_config: dict, batches_per_device: list[int],
            train_step: bool) -> dict:
  config = config_lib.base_config(name)
  config.mesh = mesh_config  # the train step reduces FSDP leaves in place
  model = variants.build_model(config.model, 1000)
  schedule = optim.learning_rate_schedule(config, 10_000, 100)
  optimizer = optim.make_optimizer(config, schedule)
  mesh = sharding.make_mesh(mesh_config)
  shape = (224, 224, 3)

  def init(key):
    params = model.init({"params": key}, jnp.zeros((1,) + shape),
                        train=False)["params"]
    return steps.TrainState.create(apply_fn=model.apply, params=params,
                                   tx=optimizer, rng=key)

  key = jax.random.PRNGKey(0)
  state_shardings = sharding.state_shardings(
      mesh, jax.eval_shape(init, key), config.fsdp_min_size)
  start = time.perf_counter()
  init_compiled = jax.jit(init, out_shardings=state_shardings).lower(
      key).compile()
  init_seconds = time.perf_counter() - start
  abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(init, key), state_shardings)
  init_memory = init_compiled.memory_analysis()
  row = dict(
      model=name, mesh=mesh_config,
      params=sum(x.size for x in jax.tree.leaves(abstract.params)),
      params_mib=_bytes_per_device(abstract.params) / MIB,
      optimizer_mib=_bytes_per_device(abstract.opt_state) / MIB,
      state_mib=init_memory.output_size_in_bytes / MIB,
      init_temp_mib=init_memory.temp_size_in_bytes / MIB,
      init_compile_s=init_seconds)
  train_fn = steps.compile_train_step(
      mesh, state_shardings, schedule,
      **config_lib.train_step_options(config, np.zeros(3, np.float32),
                                      np.ones(3, np.float32), True))
  batch_sharding = sharding.batch_sharded(mesh)
  row["step_temp_mib"], row["step_compile_s"] = [], []
  for batch_per_device in batches_per_device if train_step else []:
    batch = batch_per_device * mesh.size
    images = jax.ShapeDtypeStruct((batch,) + shape, jnp.uint8,
                                  sharding=batch_sharding)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32,
                                  sharding=batch_sharding)
    start = time.perf_counter()
    step_memory = train_fn.lower(abstract, images, labels).compile(
    ).memory_analysis()
    row["step_temp_mib"].append(step_memory.temp_size_in_bytes / MIB)
    row["step_compile_s"].append(time.perf_counter() - start)
  return row


def main(argv):
  del argv
  devices = jax.device_count()
  batches = [int(b) for b in _BATCHES.value] if _STEP.value else []
  print(f"{devices} {jax.devices()[0].platform} devices; MiB per device "
        "(float32 params, AdamW state); train step at 224 px.\n")
  meshes = [dict(data=devices, fsdp=1), dict(data=1, fsdp=devices)]
  step_columns = "".join(f" step temp, {b}/device |" for b in batches)
  print("| model | params | mesh | params | optimizer | state (init) | "
        f"init temp |{step_columns} compile init / steps |")
  print("|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(batches) +
        "---|")
  for name in _MODELS.value:
    for mesh_config in meshes:
      row = analyse(name, mesh_config, batches, _STEP.value)
      mesh = ", ".join(f"{k}={v}" for k, v in mesh_config.items())
      step_cells = "".join(f" {temp:,.0f} |" for temp in row["step_temp_mib"])
      compile_s = " / ".join(f"{t:.0f}" for t in
                             [row["init_compile_s"]] + row["step_compile_s"])
      print(f"| {name} | {row['params'] / 1e6:.1f} M | {mesh} | "
            f"{row['params_mib']:,.0f} | {row['optimizer_mib']:,.0f} | "
            f"{row['state_mib']:,.0f} | {row['init_temp_mib']:,.0f} |"
            f"{step_cells} {compile_s} s |", flush=True)


if __name__ == "__main__":
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  app.run(main)
