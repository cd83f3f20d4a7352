"""Batches of in-memory uint8 arrays, placed on the mesh ahead of time.

Training order is a pure function of (seed, step) (order.py): resuming at
step s continues with exactly the batch an uninterrupted run would have
seen, with no iterator state to save.

With several processes, every process computes the same global batch
indices and gathers only its own contiguous block of them (the rows its
devices hold); `sharding.to_global_batch` joins the blocks into one global
array without any transfer between hosts.
"""

import collections
from typing import Iterator

import jax
import numpy as np

from vit_jax.data import order
from vit_jax.runtime import sharding


def _process_slice(global_batch: int) -> slice:
  """The rows of a global batch this process feeds (all of it on one host)."""
  per_process = global_batch // jax.process_count()
  start = jax.process_index() * per_process
  return slice(start, start + per_process)


def train_batches(images: np.ndarray, labels: np.ndarray, batch_size: int,
                  seed: int, start_step: int, mesh: jax.sharding.Mesh,
                  prefetch: int = 2) -> Iterator[tuple[jax.Array, jax.Array]]:
  """Yields (images, labels) global batches for steps start_step, +1, ...

  `prefetch` batches are transferred ahead, so the host gather and the copy
  overlap with the running step.
  """
  rows = _process_slice(batch_size)

  def batch(step):
    indices = order.train_batch_indices(len(images), batch_size, seed, step)[rows]
    return (sharding.to_global_batch(mesh, images[indices]),
            sharding.to_global_batch(mesh, labels[indices]))

  queue = collections.deque()
  step = start_step
  while True:
    while len(queue) <= prefetch:
      queue.append(batch(step))
      step += 1
    yield queue.popleft()


def eval_batches(images: np.ndarray, labels: np.ndarray, batch_size: int,
                 mesh: jax.sharding.Mesh
                 ) -> Iterator[tuple[jax.Array, jax.Array, jax.Array]]:
  """Yields (images, labels, mask) covering every example exactly once.

  The last batch is padded with zeros to `batch_size`; `mask` is 1 for real
  examples and 0 for padding, so metrics weigh each example once.
  """
  rows = _process_slice(batch_size)
  for start in range(0, len(images), batch_size):
    chunk_images = images[start:start + batch_size]
    chunk_labels = labels[start:start + batch_size]
    count = len(chunk_images)
    mask = np.zeros((batch_size,), np.float32)
    mask[:count] = 1.0
    if count < batch_size:
      pad = batch_size - count
      chunk_images = np.concatenate(
          [chunk_images, np.zeros((pad,) + images.shape[1:], images.dtype)])
      chunk_labels = np.concatenate([chunk_labels,
                                     np.zeros((pad,), labels.dtype)])
    yield tuple(sharding.to_global_batch(mesh, array[rows])
                for array in (chunk_images, chunk_labels, mask))
