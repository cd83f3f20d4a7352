"""A training run's parts, assembled once: `build_run(config, workdir)`.

The data, the mesh, the model, the train state (restored from the
workdir's latest checkpoint or initialised from pretrained params), the
checkpoint manager, the metric writer and the compiled eval step, held in
a `Run`; `Run.make_phase` compiles the train step for a state and a
learning-rate schedule. `loop.py` trains with them.
"""

import dataclasses
import os
import platform
from typing import Any, Callable, Optional

import jax
import ml_collections
import numpy as np
import optax

from vit_jax import config as config_lib
from vit_jax.checkpoints import orbax_checkpoints, pretrained
from vit_jax.data import augment, datasets
from vit_jax.kernels import cpu_gemm, xla_products
from vit_jax.model import options, variants, vit
from vit_jax.runtime import cpu_info, host_memory, sharding
from vit_jax.training import (budget, budget_tracker, dispatch,
                              metric_writer, optim, steps)

log = metric_writer.log


@dataclasses.dataclass
class Run:
  """What a run is made of, built once by `build_run`."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: jax.sharding.Mesh
  dataset: datasets.Dataset
  spec: config_lib.RunSpec  # the quantities derived from config and data
  mean: np.ndarray
  std: np.ndarray
  flip: bool
  model: vit.VisionTransformer
  manager: Any  # orbax CheckpointManager
  writer: metric_writer.MetricWriter
  eval_fn: Callable[..., dict]

  def make_phase(self, state: steps.TrainState,
                 learning_rate_fn: optax.Schedule, ema_start_step: int = 0,
                 unmasked: bool = False) -> dispatch.Phase:
    """The train step of `state` as it is (its layout, model, optimizer),
    for one step and for config.steps_per_dispatch steps at a time."""
    args = (self.mesh, steps.shardings_of(state), learning_rate_fn)
    options = config_lib.train_step_options(
        self.config, self.mean, self.std, self.flip, ema_start_step,
        crops_on_host=self.dataset.crops_on_host)
    options["compiler_options"] = xla_products.xla_compiler_options(
        self.model.matmul_dtype)
    per_dispatch = self.config.steps_per_dispatch
    fixes = _train_memory_fixes(self.config)
    one_step = memory_checked(self.config, steps.compile_train_step(
        *args, **options), "train step", fixes)
    several_steps = memory_checked(
        self.config, steps.compile_train_steps(*args, per_dispatch,
                                               **options),
        f"dispatch of {per_dispatch} train steps", fixes
    ) if per_dispatch > 1 else None
    return dispatch.Phase(one_step, several_steps, unmasked=unmasked)

  @property
  def unmasked_model(self) -> vit.VisionTransformer:
    """The model without patch dropout: the same params, every patch."""
    return self.model.clone(patch_dropout_rate=0.0)

  def evaluate(self, state: steps.TrainState) -> dict[str, float]:
    """Test metrics of the params, and of their moving average as ema_*."""
    batch_size = self.config.eval_batch_size
    metrics = steps.evaluate(self.eval_fn, state.params, self.dataset,
                             batch_size, self.mesh)
    if state.ema_params is not None:
      ema = steps.evaluate(self.eval_fn, state.ema_params, self.dataset,
                           batch_size, self.mesh)
      metrics.update(ema_loss=ema["loss"], ema_accuracy=ema["accuracy"])
    return metrics


def build_run(config: ml_collections.ConfigDict, workdir: str
              ) -> tuple[Run, steps.TrainState, int, Optional[dict]]:
  """The run's data, model, optimizer and state, restored from `workdir`'s
  latest checkpoint (or initialised from config.init_from). Returns (run,
  state, start step, the time plan saved in workdir or None)."""
  mesh = sharding.make_mesh(config.mesh)
  dataset = datasets.load(config)
  spec = config_lib.run_spec(config, mesh, dataset)
  plan = (budget_tracker.read_plan(workdir) if config.time_budget_minutes
          else None)
  if plan is not None:
    log(f"Time budget: training to step {plan['total_steps']}, as planned "
        f"in {os.path.join(workdir, budget.PLAN_FILE)}.")
  mean, std = augment.pixel_stats(config.normalization, dataset)
  metric_writer.write_model_info(workdir, dataset.name, dataset.class_names,
                                 spec.image_shape, mean, std)
  log(f"Data: {dataset.name} from {dataset.source}: "
      f"{dataset.num_train} train / {dataset.num_test} test "
      f"images of shape {dataset.image_shape}, {dataset.num_classes} "
      "classes.")
  model = variants.build_model(config.model, dataset.num_classes)
  _, learning_rate_fn = schedule(config, spec, plan)
  state = steps.create_train_state(
      model, spec.image_shape, optim.make_optimizer(config, learning_rate_fn),
      config.seed, mesh, config.fsdp_min_size, ema=config.ema_decay > 0)
  _log_model(config, spec, mesh, state, plan)
  manager = orbax_checkpoints.make_manager(workdir, config.keep_checkpoints)
  state, restored_step = orbax_checkpoints.restore_latest(manager, state)
  if restored_step is not None:
    log(f"Resumed from the checkpoint of step {restored_step} in {workdir}.")
  elif config.init_from is not None:
    state = init_from_pretrained(config, state, spec.image_shape[:2])
  start_step = restored_step or 0
  eval_fn = steps.compile_eval_step(
      mesh, steps.shardings_of(state.params),
      xla_products.xla_compiler_options(model.matmul_dtype),
      **config_lib.eval_step_options(config, model.apply, mean, std))
  eval_fn = memory_checked(
      config, eval_fn, "eval step", "Lower --config.eval_batch_size (now "
      f"{config.eval_batch_size}); its scratch grows with it.")
  flip = dataset.flip if config.random_flip is None else config.random_flip
  run = Run(config, workdir, mesh, dataset, spec, mean, std, flip, model,
            manager, metric_writer.MetricWriter(workdir, start_step), eval_fn)
  return run, state, start_step, plan


def memory_checked(config: ml_collections.ConfigDict, jitted: Callable,
                   what: str, fixes: str) -> Callable:
  """`jitted`, checked to fit in the host's memory before its first run on
  a CPU (`host_memory.CheckedOnFirstRun`; `fixes` names the settings that
  lower its memory), unless config.check_host_memory is False. Elsewhere
  `jitted` itself: an accelerator's runtime reports its own memory errors."""
  if not config.check_host_memory or jax.default_backend() != "cpu":
    return jitted
  return host_memory.CheckedOnFirstRun(jitted, what, fixes, log)


def _train_memory_fixes(config: ml_collections.ConfigDict) -> str:
  return (f"Its scratch grows with the images per micro-batch "
          f"(--config.batch_size={config.batch_size} over "
          f"--config.accum_steps={config.accum_steps} now): raise "
          "accum_steps (the same update from smaller micro-batches), lower "
          "batch_size, or set --config.model.remat_blocks=True (each "
          "block's activations recomputed in the backward pass).")


def schedule(config, spec: config_lib.RunSpec, plan: Optional[dict]
             ) -> tuple[int, optax.Schedule]:
  """(total steps, learning-rate schedule) of the run: the plan's if there
  is one, else the config's upper bound."""
  if plan is not None:
    return (int(plan["total_steps"]),
            budget.planned_schedule(config, plan, spec.steps_per_epoch))
  return spec.upper_bound, optim.learning_rate_schedule(
      config, spec.upper_bound, spec.steps_per_epoch)


def _log_model(config, spec: config_lib.RunSpec, mesh, state,
               plan: Optional[dict]) -> None:
  dims = config.model  # the name's dims may have been overridden: say them
  rate = dims.patch_dropout_rate
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  patch_dropout = (
      f", trained on {options.num_kept_patches(spec.num_patches, rate)} of its "
      f"{spec.num_patches} patches (patch dropout {rate:g})" if rate else "")
  bound = "at most " if config.time_budget_minutes and not plan else ""
  total_steps = plan["total_steps"] if plan else spec.upper_bound
  log(f"Model: {dims.name} (patch {dims.patch_size}, width {dims.hidden_size}"
      f", {dims.num_layers} layers, {dims.num_heads} heads, MLP "
      f"{dims.mlp_dim}), {num_params:,} parameters{patch_dropout}; "
      f"{mesh.size} device(s) ({jax.devices()[0].platform}) in "
      f"{jax.process_count()} process(es), mesh {dict(mesh.shape)}; "
      f"{bound}{total_steps} steps of batch {config.batch_size} "
      f"({spec.steps_per_epoch} per epoch).")
  for advice in (matmul_dtype_advice(dims.matmul_dtype),
                 matmul_implementation_advice(dims.matmul_implementation,
                                              dims.matmul_dtype, dims.dtype),
                 cpu_devices_advice(config.cpu_devices, mesh.size),
                 cpu_quota_note(),
                 replicated_state_note(len(mesh.local_devices),
                                       mesh.shape[sharding.FSDP_AXIS],
                                       _state_bytes(state))):
    if advice:
      log(advice)


def matmul_dtype_advice(matmul_dtype: Optional[str]) -> Optional[str]:
  """A line for the log where config.model.matmul_dtype does not suit this
  CPU; None where it does, or off a CPU. The note that recommends
  bfloat16 is for x86 CPUs only, where it was measured."""
  if jax.default_backend() != "cpu":
    return None
  dots = xla_products.bfloat16_dot_instructions()
  if matmul_dtype == "bfloat16" and not dots:
    return ("Warning: config.model.matmul_dtype='bfloat16' on a CPU without "
            "bfloat16 dot instructions (AVX512_BF16, AMX, Arm's BF16): the "
            "products widen to float32 and run slower than float32 ones. "
            "Unset it here.")
  if (matmul_dtype is None and dots
      and platform.machine().lower() in ("x86_64", "amd64")):
    return ("Note: this CPU has bfloat16 dot instructions "
            f"({', '.join(dots)}). --config.model.matmul_dtype=bfloat16 "
            "rounds the encoder's matmul operands to bfloat16 (float32 sums "
            "and activations) and "
            "trained 1.15-1.7x faster on such CPUs, with the same accuracy "
            "on Fashion-MNIST (docs/performance.md, *bfloat16 products on a "
            "CPU*); float32 stays the default for its exact numerics.")
  return None


def cpu_devices_advice(cpu_devices: int, devices: int) -> Optional[str]:
  """A line for the log where a device per core (config.cpu_devices=-1)
  runs on a CPU with cores of two speeds; None elsewhere. Each device takes
  the same share of the batch, so a step waits on the slower cores."""
  if jax.default_backend() != "cpu" or cpu_devices != -1 or devices < 2:
    return None
  kinds = cpu_info.core_kinds()
  if kinds is None:
    return None
  fast, slow = kinds
  return (f"Note: this CPU has {fast} fast and {slow} slower cores "
          "(performance and efficiency cores). With a device per core "
          "(config.cpu_devices=-1) each takes the same share of the batch, so "
          "every step waits on the slower cores; "
          f"--config.cpu_devices={fast}, a device per fast core, may train "
          "faster. Neither has been measured on such a CPU: `python "
          "benchmarks/cpu_devices.py --config=...` times them here.")


def cpu_quota_note() -> Optional[str]:
  """A line for the log where a cgroup's CPU quota, not the CPUs this
  process may run on, sets how many cores vit_jax uses; None elsewhere."""
  quota = cpu_info.binding_cpu_quota()
  if jax.default_backend() != "cpu" or quota is None:
    return None
  return (f"Note: a CPU quota (a container's --cpus, a Kubernetes CPU limit) "
          f"gives this process {quota:.2f} CPUs' worth of time on its "
          f"{cpu_info.allowed_cpus()} CPUs; the CPU devices and kernel threads are sized for "
          f"{cpu_info.cpu_cores()} (docs/performance.md, *Containers' CPU "
          "quotas*).")


def _state_bytes(state) -> int:
  """Bytes of the train state's arrays: one device's copy where they are
  replicated."""
  return sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))


# Copies of the state on one host's CPU devices beyond the first worth a
# note: a ViT-B/16's parameters and AdamW moments are ~1 GB.
_NOTED_EXTRA_STATE_BYTES = 2**29


def replicated_state_note(local_devices: int, fsdp: int, state_bytes: int
                          ) -> Optional[str]:
  """A line for the log where this host's CPU devices each hold a copy of
  a train state (state_bytes each) whose extra copies add up to 512 MiB
  or more; None elsewhere (one device, FSDP, or off a CPU)."""
  extra = (local_devices - 1) * state_bytes
  if (jax.default_backend() != "cpu" or fsdp > 1
      or extra < _NOTED_EXTRA_STATE_BYTES):
    return None
  return (f"Note: each of this host's {local_devices} CPU devices holds its "
          f"own copy of the parameters and optimizer state "
          f"({state_bytes / 2**20:,.0f} MiB), "
          f"{local_devices * state_bytes / 2**20:,.0f} MiB in "
          f"all. --config.cpu_devices=0 (one multi-threaded device) holds it "
          f"once: for ViT-B/16 on 2 cores of a Zen 4 that trained 4-5% "
          f"slower with ~1.2 GB less memory (docs/performance.md).")


def matmul_implementation_advice(requested: str,
                                 matmul_dtype: Optional[str],
                                 dtype: str = "float32") -> Optional[str]:
  """A line for the log where "auto" would run the Dense layers' float32
  products on a CPU through oneDNN but cannot (not installed, or it failed
  to load): why, which names the fix; None otherwise."""
  if (jax.default_backend() != "cpu" or requested != "auto"
      or matmul_dtype is not None or dtype != "float32"):
    return None
  problem = cpu_gemm.problem()
  if problem is None:
    return None
  return ("Note: the Dense layers' products run in XLA's own dots, which "
          "trained ~7% slower than oneDNN's on an Intel Xeon "
          f"(kernels/cpu_gemm.py); oneDNN cannot run here: {problem}.")


def init_from_pretrained(config: ml_collections.ConfigDict,
                         state: steps.TrainState,
                         image_size: tuple[int, int]) -> steps.TrainState:
  """`state` with params from config.init_from, fitted to the model."""
  loaded, settings = pretrained.load_params(config.init_from,
                                            config.model.num_heads)
  pretrained.check_settings(settings, config.model)
  grid = (image_size[0] // config.model.patch_size,
          image_size[1] // config.model.patch_size)
  params, report = pretrained.adapt_params(
      loaded, sharding.to_host(state.params), grid,
      method=config.posemb_resize)
  log(f"Initialised from {config.init_from} ({settings['source']}): "
      + "; ".join(report) + ".")
  return state.replace(
      params=sharding.put(params, steps.shardings_of(state.params)))
