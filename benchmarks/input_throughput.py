r"""Streaming input pipeline: decode rate, feeding the step, memory.

  python benchmarks/input_throughput.py
  python benchmarks/input_throughput.py --num_images=2048 --workers=1,2,4 \
      --rss_files=50000
  # a GPU host: the ViT-B/16 step (bf16) fed by a worker per spare core
  python benchmarks/input_throughput.py --model=ViT-B/16 --dtype=bfloat16 \
      --batch_size=256 --num_images=2048 --workers=4,8,15 --feed_workers=15 \
      --rss_files=0

Writes ImageNet-like JPEGs (about 500x375, quality 90, natural-image-like
content: 1/f colour noise with a few shaded shapes on it) to --cache_dir
once, then measures in this process:
  1. decode: the training pipeline alone (Inception crop to 224 px in
     grain workers, as streaming.py runs it), images/s per worker for each
     --workers count;
  2. memory: resident memory of this process (JAX started, no model yet)
     and its worker while streaming folders of 2,000 and --rss_files small
     (64x48) files: it must not grow with the file count. This file
     imports JAX only inside functions, as vit_jax/cli.py does, so the
     worker's figure is what a worker of the command line costs.
  3. feed: the --model train step at 224 px (default ViT-Ti/16, float32)
     fed from the folder (--feed_workers workers) against the same images
     decoded beforehand and fed from memory, the two interleaved over
     --rounds; folder_over_memory near 1.0 means the step never waits for
     data;
--rss_files=0 leaves out the memory check (rss_mib=nan).
Ends with `summary: decode_images_per_s_per_worker=… folder_over_memory=…
rss_mib=…` (per worker at the largest worker count that is at most the
cores; RSS of the --rss_files folder).
"""

import multiprocessing
import os
import platform
import statistics
import time

from absl import app, flags, logging
import numpy as np
from PIL import Image

# JAX and the trainer are imported in main(), not here: grain's workers
# start with `spawn`, which imports this file again in each of them, and
# the memory figure should be what a worker of the command line costs.

_NUM_IMAGES = flags.DEFINE_integer("num_images", 1024, "JPEGs to decode.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "Worker counts.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Train step batch size.")
_STEPS = flags.DEFINE_integer("steps", 6, "Timed train steps per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved feed rounds.")
_RSS_FILES = flags.DEFINE_integer("rss_files", 50_000,
                                  "Files in the memory check's big folder.")
_MODEL = flags.DEFINE_string("model", "ViT-Ti/16", "The fed step's variant.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "The fed step's compute dtype.")
_FEED_WORKERS = flags.DEFINE_integer("feed_workers", 1,
                                     "Workers decoding for the fed step.")
_CACHE = flags.DEFINE_string("cache_dir", "/tmp/vit_jax_input_benchmark",
                             "Where the generated images are kept.")
NUM_CLASSES = 10


def natural_image(rng: np.random.Generator, width: int, height: int
                  ) -> np.ndarray:
  """1/f-spectrum colour noise (the statistics of photos) with shapes."""
  fy = np.fft.fftfreq(height)[:, None]
  fx = np.fft.rfftfreq(width)[None, :]
  amplitude = 1.0 / np.maximum(np.hypot(fx, fy), 1.0 / max(width, height))
  channels = []
  for _ in range(3):
    phase = rng.uniform(0, 2 * np.pi, amplitude.shape)
    field = np.fft.irfft2(amplitude * np.exp(1j * phase), (height, width))
    channels.append((field - field.mean()) / (field.std() + 1e-9))
  image = np.stack(channels, -1) @ rng.normal(0, 1, (3, 3)) * 40 + 120
  y, x = np.mgrid[0:height, 0:width]
  for _ in range(rng.integers(2, 5)):  # objects: shaded ellipses
    cy, cx = rng.uniform(0, height), rng.uniform(0, width)
    ry, rx = rng.uniform(20, height / 2), rng.uniform(20, width / 2)
    inside = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2 < 1
    shade = (1 - (y - cy) / (2 * ry))[..., None]
    image = np.where(inside[..., None], rng.uniform(0, 255, 3) * shade, image)
  return np.clip(image, 0, 255).astype(np.uint8)


def _write_image(job: tuple) -> None:
  """One JPEG of write_folder, from its own seed (so any process can)."""
  path, size, quality, seed = job
  rng = np.random.default_rng(seed)
  width = int(size[0] * rng.uniform(0.85, 1.0))
  height = int(size[1] * rng.uniform(0.85, 1.0))
  Image.fromarray(natural_image(rng, width, height)).save(path,
                                                          quality=quality)


def write_folder(root: str, count: int, size=(500, 375), quality=90,
                 seed=0) -> str:
  """root/train/class_k/*.jpg, `count` images, made on every core; reused
  when complete."""
  marker = os.path.join(root, f".complete_{count}")
  if os.path.exists(marker):
    return root
  jobs = []
  for index in range(count):
    folder = os.path.join(root, "train", f"class_{index % NUM_CLASSES}")
    os.makedirs(folder, exist_ok=True)
    jobs.append((os.path.join(folder, f"{index:06d}.jpg"), size, quality,
                 (seed, index)))
  # fork: this file keeps JAX out of its top level, so nothing to inherit
  # but NumPy and PIL.
  with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
    pool.map(_write_image, jobs, chunksize=16)
  open(marker, "w").close()
  return root


def _stream(root: str, workers: int, size: int = 224):
  from vit_jax.data import examples, image_folder, streaming  # pylint: disable=g-import-not-at-top
  folder = image_folder.scan(root, holdout_fraction=0.01)
  files = examples.FolderExamples(folder.train.paths, folder.train.labels)
  return streaming.StreamingDataset(
      name="bench", train=files, test=files, num_classes=NUM_CLASSES,
      class_names=list(folder.class_names), flip=True, source=root,
      image_size=size, channels=3, random_crop=True, workers=workers)


def decode_rate(root: str, workers: int, mesh) -> float:
  """Images/s of the training pipeline alone (after its first batch)."""
  import jax  # pylint: disable=g-import-not-at-top
  dataset = _stream(root, workers)
  batch = min(64, dataset.num_train) // jax.device_count() * jax.device_count()
  batches = dataset.train_batches(batch, 0, 0, mesh, prefetch=0)
  jax.block_until_ready(next(batches))  # workers started, first batch
  count = max(2, dataset.num_train // batch - 1)
  start = time.perf_counter()
  for _ in range(count):
    jax.block_until_ready(next(batches))
  rate = count * batch / (time.perf_counter() - start)
  batches.close()
  return rate


def _rss_mib(pid: int) -> tuple[float, float]:
  """Resident memory of `pid` and of all its descendants, MiB."""
  total, pending = {}, [pid]
  children = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          parent = int(f.read().rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
      except OSError:
        pass
  while pending:
    current = pending.pop()
    pending.extend(children.get(current, []))
    try:
      with open(f"/proc/{current}/status") as f:
        for line in f:
          if line.startswith("VmRSS:"):
            total[current] = int(line.split()[1]) / 1024
    except OSError:
      pass
  own = total.pop(pid, 0.0)
  return own, sum(total.values())


def streaming_rss(root: str, mesh, batches: int = 20
                  ) -> tuple[float, float]:
  """Peak (this process, its workers) resident MiB while streaming."""
  import jax  # pylint: disable=g-import-not-at-top
  dataset = _stream(root, workers=1, size=64)
  stream = dataset.train_batches(64, 0, 0, mesh)
  peak = (0.0, 0.0)
  for _ in range(batches):
    jax.block_until_ready(next(stream))
    peak = max(peak, _rss_mib(os.getpid()), key=sum)
  stream.close()
  return peak


def feed_ratio(root: str, mesh) -> tuple[float, float]:
  """(folder images/s, memory images/s) of the --model step at 224 px."""
  # pylint: disable=g-import-not-at-top
  import jax
  from vit_jax import config as config_lib
  from vit_jax.data import examples, input_pipeline
  from vit_jax.model import variants
  from vit_jax.training import optim, steps
  config = config_lib.base_config(_MODEL.value)
  config.model.dtype = _DTYPE.value
  stream = _stream(root, workers=_FEED_WORKERS.value)
  model = variants.build_model(config.model, NUM_CLASSES)
  schedule = optim.learning_rate_schedule(config, 10_000, 100)
  state = steps.create_train_state(model, (224, 224, 3),
                                   optim.make_optimizer(config, schedule),
                                   0, mesh)
  train_fn = steps.compile_train_step(
      mesh, steps.shardings_of(state), schedule,
      **config_lib.train_step_options(
          config, np.full(3, 127.5, np.float32), np.full(3, 127.5,
                                                         np.float32),
          True, crops_on_host=True))
  memory_images = np.stack([examples.Transform(224, 3, True)(
      stream.train.read(i)[0], "", np.random.default_rng(i))
                            for i in range(stream.num_train)])
  sources = {
      "folder": stream.train_batches(_BATCH.value, 0, 0, mesh),
      "memory": input_pipeline.train_batches(
          memory_images, stream.train.labels, _BATCH.value, 0, 0, mesh)}
  for batches in sources.values():  # compile; workers started and ahead
    for _ in range(2):
      state, metrics = train_fn(state, *next(batches))
      jax.block_until_ready(metrics)
  times = {name: [] for name in sources}
  for _ in range(_ROUNDS.value):
    for name, batches in sources.items():
      for _ in range(_STEPS.value):
        start = time.perf_counter()
        state, metrics = train_fn(state, *next(batches))
        jax.block_until_ready(metrics)
        times[name].append(time.perf_counter() - start)
  sources["folder"].close()
  return tuple(_BATCH.value / statistics.median(times[name])
               for name in ("folder", "memory"))


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def main(_):
  logging.set_verbosity(logging.WARNING)
  cores = os.cpu_count() or 1
  print(f"Command: python benchmarks/input_throughput.py "
        f"--num_images={_NUM_IMAGES.value} --workers="
        f"{','.join(_WORKERS.value)} --rss_files={_RSS_FILES.value} "
        f"--model={_MODEL.value} --dtype={_DTYPE.value} --batch_size="
        f"{_BATCH.value} --feed_workers={_FEED_WORKERS.value}")
  print(f"CPU: {_cpu()}, {cores} cores; load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  tick = time.perf_counter()
  photos = write_folder(os.path.join(_CACHE.value, "photos"),
                        _NUM_IMAGES.value)
  print(f"{_NUM_IMAGES.value} ImageNet-like JPEGs in {photos} "
        f"({time.perf_counter() - tick:.0f} s to make or find)")
  from vit_jax.runtime import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh()
  per_worker = {}
  for workers in (int(w) for w in _WORKERS.value):
    rate = decode_rate(photos, workers, mesh)
    per_worker[workers] = rate / workers
    print(f"decode + Inception crop to 224, {workers} worker(s): "
          f"{rate:7.1f} images/s, {rate / workers:7.1f} per worker")
  rss = {_RSS_FILES.value: float("nan")}
  for count in (2000, _RSS_FILES.value) if _RSS_FILES.value else ():
    root = write_folder(os.path.join(_CACHE.value, f"small_{count}"), count,
                        size=(64, 48))
    own, workers = streaming_rss(root, mesh)
    rss[count] = own + workers
    print(f"streaming a folder of {count:,} files: resident memory "
          f"{rss[count]:.0f} MiB (this process {own:.0f}, its worker "
          f"{workers:.0f})")
  folder_rate, memory_rate = feed_ratio(photos, mesh)
  print(f"{_MODEL.value} @224 train step ({_DTYPE.value}), batch "
        f"{_BATCH.value}, {_FEED_WORKERS.value} worker(s): fed from the "
        f"folder {folder_rate:.1f} images/s, from memory {memory_rate:.1f} "
        f"({folder_rate / memory_rate:.3f})")
  fitting = [w for w in per_worker if w <= cores] or list(per_worker)
  print(f"summary: decode_images_per_s_per_worker="
        f"{per_worker[max(fitting)]:.1f} folder_over_memory="
        f"{folder_rate / memory_rate:.3f} rss_mib={rss[_RSS_FILES.value]:.0f}")


if __name__ == "__main__":
  from vit_jax.runtime import host  # no JAX  # pylint: disable=g-import-not-at-top
  host.default_xla_flags()
  host.reexec_with_fast_malloc()
  app.run(main)
