r"""One train step per dispatch against several (config.steps_per_dispatch),
side by side in one process.

  python benchmarks/dispatch.py                       # the GPU recipe's model
  python benchmarks/dispatch.py --config=configs/vit_fashion_mnist_60min.py \
      --steps_per_dispatch=10 --batch_size=128

Builds the config's model, optimizer and train step (EMA, patch dropout,
augmentation: what the trainer runs), then times rounds of `--steps` train
steps alternately with one step per dispatch and with --steps_per_dispatch
(default: the config's, else 18) per dispatch, each batch gathered from a
host array and placed on the devices as the trainer's input pipeline does.
The state of hundreds of arrays crosses from the host once per dispatch:
what several steps per dispatch save is that host work, which sets the pace
of a small model on a GPU.

Prints the device, each round's ms per step, and
  summary: steps_per_dispatch=… single_ms=… multi_ms=…
           multi_over_single=…
(medians over the rounds; below 1: several steps per dispatch are faster).
"""

import statistics
import sys
import time

from absl import app, flags
import jax
import numpy as np
from ml_collections import config_flags

from vit_jax import config as config_lib
from vit_jax.model import variants
from vit_jax.runtime import host, sharding
from vit_jax.training import optim, steps

config_flags.DEFINE_config_file(
    "config", "configs/vit_fashion_mnist_gpu.py", "The trainer's config.")
flags.DEFINE_integer("steps_per_dispatch", 0,
                     "Steps per dispatch to compare with one (0: the "
                     "config's, or 18 if it has 1).")
flags.DEFINE_integer("batch_size", 0, "0: the config's.")
flags.DEFINE_integer("steps", 180, "Steps per round (a multiple of "
                     "--steps_per_dispatch).")
flags.DEFINE_integer("rounds", 5, "Rounds of each, alternating.")
FLAGS = flags.FLAGS


class Stepper:
  """The config's train step over `mesh`, fed from random host batches."""

  def __init__(self, config, batch_size: int, per_dispatch: int):
    shape = config_lib.image_shape_of(config)
    num_classes = config_lib.num_classes_of(config)
    self.mesh = sharding.make_mesh(config.mesh)
    model = variants.build_model(config.model, num_classes)
    schedule = optim.learning_rate_schedule(config, 10_000, 100)
    self.state = steps.create_train_state(
        model, shape, optim.make_optimizer(config, schedule), config.seed,
        self.mesh, config.fsdp_min_size, ema=config.ema_decay > 0)
    mean = np.full(shape[-1], 128.0, np.float32)
    std = np.full(shape[-1], 64.0, np.float32)
    options = config_lib.train_step_options(config, mean, std, True)
    layout = steps.shardings_of(self.state)
    self.single = steps.compile_train_step(self.mesh, layout, schedule,
                                           **options)
    self.multi = steps.compile_train_steps(self.mesh, layout, schedule,
                                           per_dispatch, **options)
    rng = np.random.default_rng(0)
    self.images = rng.integers(0, 256, (4 * batch_size,) + shape, np.uint8)
    self.labels = rng.integers(0, num_classes, 4 * batch_size, np.int32)
    self.batch_size, self.per_dispatch = batch_size, per_dispatch
    self.position = 0

  def _batch(self):
    self.position = (self.position + self.batch_size) % len(self.images)
    rows = slice(self.position, self.position + self.batch_size)
    return (sharding.to_global_batch(self.mesh, self.images[rows]),
            sharding.to_global_batch(self.mesh, self.labels[rows]))

  def round(self, num_steps: int, several: bool) -> float:
    """Seconds per step of num_steps steps, one or several per dispatch."""
    start = time.perf_counter()
    for _ in range(num_steps // (self.per_dispatch if several else 1)):
      if several:
        images, labels = zip(*[self._batch()
                               for _ in range(self.per_dispatch)])
        self.state, metrics = self.multi(self.state, images, labels)
      else:
        self.state, metrics = self.single(self.state, *self._batch())
    jax.block_until_ready((self.state, metrics))
    return (time.perf_counter() - start) / num_steps


def main(argv):
  del argv
  config = FLAGS.config
  per_dispatch = (FLAGS.steps_per_dispatch or
                  (config.steps_per_dispatch if config.steps_per_dispatch > 1
                   else 18))
  batch_size = FLAGS.batch_size or config.batch_size
  host.split_cpu_into_devices(config.cpu_devices, (batch_size,))  # as main.py
  num_steps = FLAGS.steps - FLAGS.steps % per_dispatch
  print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()}; "
        f"{config.model.name}, batch {batch_size}, "
        f"{per_dispatch} steps per dispatch against 1, {num_steps} steps "
        f"a round")
  stepper = Stepper(config, batch_size, per_dispatch)
  for several in (False, True):  # compile and warm up both
    stepper.round(per_dispatch, several)
  times = {False: [], True: []}
  for index in range(FLAGS.rounds):
    for several in ((False, True) if index % 2 == 0 else (True, False)):
      times[several].append(stepper.round(num_steps, several))
    print(f"round {index}: 1 per dispatch {times[False][-1] * 1e3:.3f} ms "
          f"a step, {per_dispatch} per dispatch "
          f"{times[True][-1] * 1e3:.3f} ms")
  single, multi = (statistics.median(times[k]) for k in (False, True))
  print(f"\nCommand: python benchmarks/dispatch.py {' '.join(sys.argv[1:])}")
  print(f"summary: steps_per_dispatch={per_dispatch} "
        f"single_ms={single * 1e3:.3f} multi_ms={multi * 1e3:.3f} "
        f"multi_over_single={multi / single:.3f}")


if __name__ == "__main__":
  host.reexec_with_fast_malloc()
  app.run(main)
