r"""What `scan_blocks` and `remat_blocks` cost and save, from XLA itself.

  python benchmarks/scan_remat.py          # ~8 minutes on 2 cores
  python benchmarks/scan_remat.py --models=ViT-L/16 --batch=8 --run=

For each model and each way of running the encoder blocks (plain loop,
`scan_blocks`, `remat_blocks`, both), on one device, float32, 224 px (the
small-image variants at their own 32 or 28 px; batch 32, or 128 there):
- trace s, compile s: `jit(train_step).lower()` and `.compile()` of the real
  train step (AdamW, the `config_lib.base_config` recipe);
- step temp: XLA's scratch memory of that step (activations, gradients),
  from `memory_analysis()` of the compiled program, which is never run;
- state: parameters + AdamW state, the same for every mode;
- images/s: only for models in --run (small enough to run here), measured
  in this process with the modes interleaved round by round.
The parameter tree is the same in every mode, so checkpoints move freely
between them.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from vit_jax import config as config_lib
from vit_jax.model import variants
from vit_jax.runtime import sharding
from vit_jax.training import optim, steps

_MODELS = flags.DEFINE_list("models", ["ViT-Ti/4", "ViT-L/16", "ViT-H/14"],
                            "Variants to analyse.")
_RUN = flags.DEFINE_list("run", ["ViT-Ti/4"],
                         "Variants whose train step is also timed.")
_BATCH = flags.DEFINE_integer(
    "batch", None, "Images per train step; default 128 at 32 px, 32 at 224.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved timing rounds.")
_STEPS = flags.DEFINE_integer("steps", 4, "Timed steps per mode and round.")

MODES = {"plain": (False, False), "scan": (True, False),
         "remat": (False, True), "scan+remat": (True, True)}
_MODES = flags.DEFINE_list("modes", list(MODES), "Modes to compare.")
MIB = 2**20


def image_size_and_batch(name: str) -> tuple[int, int]:
  """224 px, batch 32; the small-image variants at 32 (or 28) px, batch 128."""
  patch_size = variants.VARIANTS[name]["patch_size"]
  if patch_size >= 8:
    return 224, 32
  return (32 if 32 % patch_size == 0 else 28), 128


def compile_step(name: str, scan_blocks: bool, remat_blocks: bool,
                 batch: int) -> dict:
  """AOT-compiles one train step of `name` on abstract inputs."""
  config = config_lib.base_config(name)
  config.model.scan_blocks = scan_blocks
  config.model.remat_blocks = remat_blocks
  size, _ = image_size_and_batch(name)
  shape = (size, size, 3)
  model = variants.build_model(config.model, 1000)
  schedule = optim.learning_rate_schedule(config, 10_000, 100)
  optimizer = optim.make_optimizer(config, schedule)
  mesh = sharding.make_mesh()
  state = jax.eval_shape(lambda: steps.create_train_state(
      model, shape, optimizer, 0, mesh))
  train_fn = steps.compile_train_step(
      mesh, steps.shardings_of(state), schedule,
      **config_lib.train_step_options(config, np.zeros(3, np.float32),
                                      np.ones(3, np.float32), True))
  images = jax.ShapeDtypeStruct((batch,) + shape, jnp.uint8)
  labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
  start = time.perf_counter()
  lowered = train_fn.lower(state, images, labels)
  traced = time.perf_counter()
  compiled = lowered.compile()
  done = time.perf_counter()
  memory = compiled.memory_analysis()
  return dict(compiled=compiled, shape=shape, model=model,
              optimizer=optimizer, trace_s=traced - start,
              compile_s=done - traced,
              temp_mib=memory.temp_size_in_bytes / MIB,
              state_mib=sum(x.size * x.dtype.itemsize
                            for x in jax.tree.leaves(state)) / MIB)


def time_modes(rows: dict, batch: int) -> dict:
  """Images/s of each mode's compiled step, modes interleaved per round."""
  rng = np.random.default_rng(0)
  inputs, states = {}, {}
  for mode, row in rows.items():
    images = rng.integers(0, 256, (batch,) + row["shape"], np.uint8)
    labels = rng.integers(0, 1000, batch).astype(np.int32)
    inputs[mode] = (jnp.asarray(images), jnp.asarray(labels))
    states[mode] = steps.create_train_state(
        row["model"], row["shape"], row["optimizer"], 0, sharding.make_mesh())
    states[mode], metrics = row["compiled"](states[mode], *inputs[mode])
    jax.block_until_ready(metrics)  # first run: allocation
  times = {mode: [] for mode in rows}
  for _ in range(_ROUNDS.value):
    for mode, row in rows.items():
      for _ in range(_STEPS.value):
        start = time.perf_counter()
        states[mode], metrics = row["compiled"](states[mode], *inputs[mode])
        jax.block_until_ready(metrics)
        times[mode].append(time.perf_counter() - start)
  return {mode: batch / statistics.median(t) for mode, t in times.items()}


def main(argv):
  del argv
  print(f"train step, 1 {jax.devices()[0].platform} device, float32; "
        "memory in MiB.\n")
  print("| model | batch | mode | trace s | compile s | step temp | state | "
        "images/s |")
  print("|---|---:|---|---:|---:|---:|---:|---:|")
  for name in _MODELS.value:
    batch = _BATCH.value or image_size_and_batch(name)[1]
    rows = {mode: compile_step(name, *MODES[mode], batch)
            for mode in _MODES.value}
    speed = time_modes(rows, batch) if name in _RUN.value else {}
    for mode, row in rows.items():
      rate = f"{speed[mode]:.1f}" if mode in speed else "-"
      print(f"| {name} | {batch} | {mode} | {row['trace_s']:.1f} | "
            f"{row['compile_s']:.1f} | {row['temp_mib']:,.0f} | "
            f"{row['state_mib']:,.0f} | {rate} |", flush=True)


if __name__ == "__main__":
  from vit_jax.runtime import host  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  app.run(main)
