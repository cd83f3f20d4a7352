"""Joining JAX's distributed runtime when one run spans several processes.

Each process runs the same `main.py` command; `initialize` connects it to
the others before JAX touches a device. Afterwards `jax.devices()` lists
the devices of every process, the mesh spans them all, and the rest of the
trainer needs nothing more: each process feeds its block of every batch
(`input_pipeline`), process 0 writes logs and metrics, and Orbax saves and
restores checkpoints collectively. On CPU the processes exchange data with
gloo over TCP (JAX's default CPU collectives).

Where the run's shape comes from, first match wins:
- explicit values (main.py's --coordinator_address, --num_processes,
  --process_id), else the environment variables JAX_COORDINATOR_ADDRESS
  (read by JAX itself), JAX_NUM_PROCESSES and JAX_PROCESS_ID;
- `auto=True` (main.py --multihost): JAX detects SLURM, Open MPI, Cloud TPU
  pod slices and Kubernetes jobs and reads their variables.
Without any of these the run is a single process and nothing is started.
"""

import os
from typing import Optional

import jax


def initialize(coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None,
               process_id: Optional[int] = None, auto: bool = False) -> bool:
  """Starts the distributed runtime if this is a multi-process run.

  Returns whether it did. Must run before any other JAX call that touches
  devices.
  """
  coordinator_address = (coordinator_address or
                         os.environ.get("JAX_COORDINATOR_ADDRESS"))
  if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in os.environ:
    process_id = int(os.environ["JAX_PROCESS_ID"])
  explicit = (coordinator_address, num_processes, process_id)
  if not auto and all(value is None for value in explicit):
    return False
  if not auto and None in explicit:
    raise ValueError(
        "A multi-process run needs all of --coordinator_address (host:port "
        "of process 0), --num_processes and --process_id (or the variables "
        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); got "
        f"coordinator_address={coordinator_address}, "
        f"num_processes={num_processes}, process_id={process_id}. On SLURM, "
        "Open MPI or a TPU pod slice, --multihost detects them instead.")
  if num_processes is not None and process_id is not None and not (
      0 <= process_id < num_processes):
    raise ValueError(f"--process_id={process_id} must be in [0, "
                     f"{num_processes}).")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)
  return True
