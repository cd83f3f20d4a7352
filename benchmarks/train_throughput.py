r"""Train-step throughput, compile time, and input-pipeline overhead.

  python benchmarks/train_throughput.py                      # vit_tiny_cifar
  python benchmarks/train_throughput.py --config=configs/vit_tiny_fashion_mnist.py \
      --batch_size=128 --steps=10 --rounds=3

Builds the config's model and the real jitted train step, then measures in
one process, interleaving the two so machine noise hits both alike:
  * bare:     the step on a batch already on device (the step's own speed);
  * pipeline: the step fed by input_pipeline.train_batches (host gather of
              uint8 images, transfer, on-device augmentation), as in training.
Prints the compile time, images/s (median over steps) of both, and their
ratio: a ratio near 1.00 means the input pipeline is not the bottleneck.
Like main.py it restarts itself once with a faster malloc
(vit_jax/runtime/host.py).
"""

import statistics
import time

from absl import app, flags, logging
from ml_collections import config_flags
import jax
import numpy as np

from vit_jax import config as config_lib
from vit_jax.data import datasets, input_pipeline
from vit_jax.inspection import introspect
from vit_jax.model import variants
from vit_jax.runtime import host, sharding
from vit_jax.training import optim, steps

_CONFIG = config_flags.DEFINE_config_file("config", "configs/vit_tiny_cifar.py",
                                          "Config whose model is measured.")
_BATCH = flags.DEFINE_integer("batch_size", 128, "Global batch size.")
_STEPS = flags.DEFINE_integer("steps", 8, "Timed steps per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")


def main(_):
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  host.split_cpu_into_devices(config.cpu_devices,  # before JAX starts
                             (_BATCH.value,))
  height, width, channels = config_lib.image_shape_of(config)
  num_classes = (datasets.SPECS[config.dataset].num_classes
                 if config.dataset in datasets.SPECS else
                 config.synthetic.num_classes)
  # Random uint8 data of the dataset's shape: the speed does not depend on it.
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (4096, height, width, channels), np.uint8)
  labels = rng.integers(0, num_classes, 4096).astype(np.int32)
  mesh = sharding.make_mesh()
  model = variants.build_model(config.model, num_classes)
  schedule = optim.learning_rate_schedule(config, 10_000, 100)
  state = steps.create_train_state(model, (height, width, channels),
                                   optim.make_optimizer(config, schedule),
                                   0, mesh, ema=config.ema_decay > 0)
  step_for = lambda state: steps.compile_train_step(
      mesh, steps.shardings_of(state), schedule,
      **config_lib.train_step_options(
          config, np.full(channels, 127.0, np.float32),
          np.full(channels, 64.0, np.float32), True))
  train_fn = step_for(state)
  batches = input_pipeline.train_batches(images, labels, _BATCH.value, 0, 0,
                                         mesh)
  fixed = next(batches)

  start = time.perf_counter()
  lowered = train_fn.lower(state, *fixed)
  compiled = lowered.compile()
  compile_seconds = time.perf_counter() - start
  # XLA's count for the whole batch: the compiled program's would be one
  # device's share (within 1% of this on one device). Of the einsums'
  # program: XLA counts nothing inside the CPU attention kernel.
  counted = state.replace(apply_fn=introspect.xla_operations_only(model).apply)
  flops = (step_for(counted).lower(counted, *fixed).cost_analysis()
           or {}).get("flops", float("nan"))
  state, metrics = compiled(state, *fixed)  # first run: allocation, warm-up
  jax.block_until_ready(metrics)

  times = {"bare": [], "pipeline": []}
  for _ in range(_ROUNDS.value):
    for mode in times:
      for _ in range(_STEPS.value):
        start = time.perf_counter()
        batch = fixed if mode == "bare" else next(batches)
        state, metrics = compiled(state, *batch)
        jax.block_until_ready(metrics)
        times[mode].append(time.perf_counter() - start)

  rate = {mode: _BATCH.value / statistics.median(t) for mode, t in
          times.items()}
  print(f"model {config.model.name} on {height}x{width}x{channels}, batch "
        f"{_BATCH.value}, {jax.device_count()} {jax.devices()[0].platform} "
        f"device(s), {_ROUNDS.value} rounds x {_STEPS.value} steps")
  print(f"compile time of the train step: {compile_seconds:.2f} s")
  flops_per_image = flops / _BATCH.value
  print(f"XLA cost analysis: {flops_per_image / 1e9:.3f} GFLOP per image "
        f"(forward + backward + update); achieved "
        f"{flops_per_image * rate['bare'] / 1e9:.1f} GFLOP/s")
  for mode, value in rate.items():
    print(f"{mode:9s} {value:8.1f} images/s  (median step "
          f"{_BATCH.value / value * 1e3:.0f} ms)")
  print(f"summary: images_per_second={rate['bare']:.1f} "
        f"pipeline_over_bare={rate['pipeline'] / rate['bare']:.3f} "
        f"compile_seconds={compile_seconds:.2f}")


if __name__ == "__main__":
  host.default_xla_flags()  # vit_jax's measured XLA:CPU flags, as main.py
  host.reexec_with_fast_malloc()  # as main.py trains
  app.run(main)
