"""One device mesh over every device; batches split along "data".

Parameters and optimizer state are replicated, batches are sharded along the
`data` axis, and `jax.jit` inserts the gradient all-reduce itself. The same
code runs on one CPU, simulated CPU devices, a GPU node or a TPU slice.
"""

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A 1-D mesh named "data" over `devices` (default: every device)."""
  return Mesh(np.asarray(jax.devices() if devices is None else devices),
              (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over the data axis, the rest whole."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def check_batch_size(batch_size: int, mesh: Mesh, name: str) -> None:
  """Raises unless `batch_size` splits evenly over the devices."""
  devices = mesh.shape[DATA_AXIS]
  if batch_size % devices:
    raise ValueError(
        f"config.{name}={batch_size} is not divisible by the {devices} "
        f"devices of the mesh; use a multiple of {devices}, e.g. "
        f"--config.{name}={max(devices, batch_size - batch_size % devices)}.")


def to_global_batch(mesh: Mesh, local_rows: np.ndarray) -> jax.Array:
  """This process's rows of a batch -> one global array sharded on "data"."""
  return jax.make_array_from_process_local_data(batch_sharded(mesh),
                                                local_rows)
