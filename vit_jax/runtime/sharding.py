"""Where arrays live: a (data, fsdp) device mesh and the rules that place
the train state and the batches on it.

The mesh comes from `config.mesh`: `data` devices each see a different part
of the batch; within each data group, `fsdp` devices also split every large
parameter and its optimizer state (fully sharded data parallelism), so a
model that does not fit one device fits `fsdp` of them. Batches are split
over every device (both axes). Everything else is declared once, as
`jax.jit` in/out shardings: XLA inserts the all-gathers of parameters and
the reductions of gradients. There is no pmap and no hand-written
collective, and the same code runs on one CPU, simulated CPU devices, a GPU
node, a GPU cluster or a TPU pod slice.
"""

from typing import Any, Mapping, Optional, Sequence

import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
MESH_AXES = (DATA_AXIS, FSDP_AXIS)


def default_mesh_config() -> ml_collections.ConfigDict:
  """Pure data parallelism over every device."""
  return ml_collections.ConfigDict({DATA_AXIS: -1, FSDP_AXIS: 1})


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int
               ) -> dict[str, int]:
  """Axis sizes with the one -1 (if any) filled in from `num_devices`.

  Sizes whose product is below `num_devices` use only the first devices
  (e.g. data=1 trains on one device); the product may not exceed it.
  """
  sizes = {axis: int(mesh_config[axis]) for axis in MESH_AXES}
  unknown = set(mesh_config) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"config.mesh has unknown axes {sorted(unknown)}; the "
                     f"axes are {MESH_AXES}.")
  if any(size == 0 or size < -1 for size in sizes.values()):
    raise ValueError(f"config.mesh sizes must be positive or -1 (all the "
                     f"remaining devices), got {sizes}.")
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f"config.mesh may have at most one axis of size -1, got "
                     f"{sizes}.")
  fixed = int(np.prod([size for size in sizes.values() if size != -1]))
  if free:
    if num_devices % fixed:
      raise ValueError(
          f"config.mesh={sizes}: {num_devices} devices do not split into "
          f"groups of {fixed}; choose sizes whose product divides "
          f"{num_devices}.")
    sizes[free[0]] = num_devices // fixed
  elif fixed > num_devices:
    raise ValueError(
        f"config.mesh={sizes} needs {fixed} devices but there are "
        f"{num_devices}; use sizes whose product is at most {num_devices}, "
        f"or -1 for one axis (--config.mesh.{DATA_AXIS}=-1).")
  return sizes


def make_mesh(mesh_config: Optional[Mapping[str, int]] = None,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A ("data", "fsdp") mesh over `devices` (default: every device).

  With several processes, devices are ordered by process so that each
  process's devices hold a contiguous block of every batch (the block it
  feeds) and `fsdp` groups stay within a host where they fit.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(mesh_config or default_mesh_config(), len(devices))
  shape = tuple(sizes[axis] for axis in MESH_AXES)
  count = int(np.prod(shape))
  if count < len(devices) and jax.process_count() > 1:
    raise ValueError(f"config.mesh={sizes} leaves devices unused, which "
                     "several processes cannot do; use every device.")
  if jax.process_count() > 1:
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.asarray(ordered[:count]).reshape(shape)
  else:
    # Topology-aware order on TPU (neighbours on the fsdp axis); a plain
    # reshape on CPU and GPU.
    grid = mesh_utils.create_device_mesh(shape, devices[:count],
                                         allow_split_physical_axes=True)
  return Mesh(grid, MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over every device of the mesh."""
  return NamedSharding(mesh, PartitionSpec(MESH_AXES))


def fsdp_spec(shape: Sequence[int], dtype, fsdp_size: int,
              min_size: int) -> PartitionSpec:
  """The FSDP rule for one array.

  Floating arrays of at least `min_size` elements are split along their
  largest dimension divisible by `fsdp_size` (the first such on ties);
  everything else (scalars, counters, RNG keys, small biases, or arrays
  with no divisible dimension) is replicated.
  """
  if (fsdp_size == 1 or not jax.numpy.issubdtype(dtype, np.floating) or
      int(np.prod(shape)) < min_size):
    return PartitionSpec()
  divisible = [(size, -axis) for axis, size in enumerate(shape)
               if size % fsdp_size == 0]
  if not divisible:
    return PartitionSpec()
  _, negative_axis = max(divisible)
  spec = [None] * len(shape)
  spec[-negative_axis] = FSDP_AXIS
  return PartitionSpec(*spec)


def state_shardings(mesh: Mesh, abstract_tree: Any, min_size: int) -> Any:
  """NamedShardings for every leaf of `abstract_tree` by the FSDP rule.

  Applied alike to parameters and optimizer state (Adam's moments have the
  parameters' shapes, so they are split the same way). On a mesh with
  fsdp=1 everything is replicated: plain data parallelism.
  """
  fsdp_size = mesh.shape[FSDP_AXIS]
  return jax.tree.map(
      lambda x: NamedSharding(mesh, fsdp_spec(x.shape, x.dtype, fsdp_size,
                                              min_size)), abstract_tree)


def check_batch_size(batch_size: int, mesh: Mesh, name: str) -> None:
  """Raises unless `batch_size` splits evenly over the devices."""
  devices = mesh.size
  if batch_size % devices:
    raise ValueError(
        f"config.{name}={batch_size} is not divisible by the {devices} "
        f"devices of the mesh; use a multiple of {devices}, e.g. "
        f"--config.{name}={max(devices, batch_size - batch_size % devices)}.")


def to_global_batch(mesh: Mesh, local_rows: np.ndarray) -> jax.Array:
  """This process's rows of a batch -> one global array split over devices."""
  return jax.make_array_from_process_local_data(batch_sharded(mesh),
                                                local_rows)


def to_host(tree: Any) -> Any:
  """The full value of every array as numpy, on every process.

  Arrays split across processes are gathered (a collective: every process
  must call this); arrays already whole on this process are just copied.
  """
  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
  return jax.tree.map(fetch, tree)


def put(tree: Any, shardings: Any) -> Any:
  """Host arrays (the same on every process) -> arrays laid out as
  `shardings`; each device receives only its own slice."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(
          np.shape(x), s, lambda index: np.asarray(x)[index]),
      tree, shardings)
