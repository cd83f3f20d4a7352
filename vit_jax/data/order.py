"""The order in which training visits the examples: a pure function of
(seed, step), shared by the in-memory and the streaming pipelines.

Epoch e visits the examples in permutation `rng([seed, e])`; step s takes
the s-th slice of batch_size of it (the last partial batch of an epoch is
dropped). Resuming at step s therefore continues with exactly the batch an
uninterrupted run would have seen, with no iterator state to save. No JAX
here: the streaming pipeline's worker processes import this.
"""

import functools

import numpy as np


# Cached: a permutation of 60,000 examples takes ~1.5 ms, 4% of a 35 ms
# train step if drawn again for every batch of the epoch.
@functools.lru_cache(maxsize=2)
def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The order in which epoch `epoch` visits the examples (read-only)."""
  order = np.random.default_rng([seed, epoch]).permutation(num_examples)
  order.flags.writeable = False
  return order


def train_batch_indices(num_examples: int, batch_size: int, seed: int,
                        step: int) -> np.ndarray:
  """Indices of the global batch used at `step` (last partial batch dropped)."""
  steps_per_epoch = num_examples // batch_size
  epoch, position = divmod(step, steps_per_epoch)
  order = epoch_permutation(num_examples, seed, epoch)
  return order[position * batch_size:(position + 1) * batch_size]
