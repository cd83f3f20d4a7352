"""Start from a pretrained checkpoint: load, resize, re-head (`init_from`).

`load_params(path)` reads an official/big_vision `.npz`, a vit_jax Orbax
checkpoint (a workdir, its `checkpoints/` folder or one step folder), or a
torchvision/timm/Hugging Face state dict. `adapt_params` fits the result to
a freshly initialised target model the way the paper fine-tunes: the
position embedding is interpolated to the new patch grid, the head is
replaced (zero-initialised) when the number of classes differs, and a
pre-logits layer the target lacks is dropped. Anything else that does not
fit is an error naming the first mismatching key and both shapes.
"""

import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath  # orbax's path type; installed with orbax
from flax import traverse_util

from vit_jax.checkpoints import npz, state_dict_files, torch_state_dicts
from vit_jax.checkpoints.npz import CheckpointFormatError

RESIZE_METHODS = ("bilinear", "bicubic")
_TORCH_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
# Official .npz and Orbax checkpoints: the numerics of this package.
_JAX_SETTINGS = dict(approximate_gelu=True, layer_norm_epsilon=1e-6)


def _orbax_params(path: str) -> dict:
  """The params of the latest step under `path` (workdir, folder or step)."""
  for candidate in (path, os.path.join(path, "checkpoints")):
    if not os.path.isdir(candidate):
      continue
    steps = [int(d) for d in os.listdir(candidate) if d.isdigit()]
    if steps and os.path.isdir(os.path.join(candidate, str(max(steps)))):
      path = os.path.join(candidate, str(max(steps)))
      break
  item = os.path.join(path, "default")
  if not os.path.isdir(item):
    raise CheckpointFormatError(
        f"{path} is not a vit_jax Orbax checkpoint (no {item}). Pass a "
        "workdir, its checkpoints/ folder or one step folder.")
  try:
    # Restored as host numpy arrays, so a checkpoint written on any mesh,
    # device count or number of hosts reads anywhere. Read by the handler: a
    # Checkpointer would look for the step's _CHECKPOINT_METADATA inside the
    # item folder and warn that it is absent.
    handler = ocp.PyTreeCheckpointHandler()
    try:
      stored = handler.metadata(epath.Path(item)).tree
      as_numpy = jax.tree.map(
          lambda _: ocp.RestoreArgs(restore_type=np.ndarray), stored)
      restored = handler.restore(
          epath.Path(item), args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    finally:
      handler.close()
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointFormatError(
        f"Cannot read the Orbax checkpoint {item}: {type(e).__name__}: "
        f"{e}") from e
  return jax.tree.map(np.asarray, restored["params"])


def load_params(path: str, num_heads: int) -> tuple[dict, dict]:
  """(params as numpy, model settings the checkpoint implies) from `path`.

  `num_heads` splits PyTorch's fused attention weights, which do not record
  it. Settings hold `approximate_gelu`, `layer_norm_epsilon`, `classifier`
  and `source`.
  """
  if os.path.isdir(path):
    params, source = _orbax_params(path), "orbax"
  elif path.endswith(".npz"):
    params = npz.params_from_npz(
        npz.read_npz(path), path)
    source = "npz"
  elif path.endswith(_TORCH_SUFFIXES):
    return torch_state_dicts.convert_state_dict(
        state_dict_files.read_state_dict(path), num_heads)
  elif not os.path.exists(path):
    raise FileNotFoundError(f"No checkpoint at {path}.")
  else:
    raise CheckpointFormatError(
        f"Unknown checkpoint type {path}: expected an .npz file, an Orbax "
        f"checkpoint folder, or a state dict ({', '.join(_TORCH_SUFFIXES)}).")
  settings = dict(_JAX_SETTINGS, source=source,
                  classifier="token" if "cls" in params else "gap")
  return params, settings


def resize_pos_embedding(pos_embedding: np.ndarray,
                         new_grid: tuple[int, int], num_prefix_tokens: int,
                         old_grid: Optional[tuple[int, int]] = None,
                         method: str = "bilinear") -> np.ndarray:
  """Interpolates a (1, prefix + h*w, D) position embedding to `new_grid`.

  The class-token row (prefix) is kept as is. `old_grid` defaults to a
  square grid. "bilinear" matches the official code (scipy zoom, order 1,
  corner-aligned); "bicubic" is cubic with half-pixel centres (as PyTorch's
  interpolate with align_corners=False).
  """
  if method not in RESIZE_METHODS:
    raise ValueError(f"Unknown resize method {method!r}; choose one of "
                     f"{RESIZE_METHODS}.")
  prefix = pos_embedding[:, :num_prefix_tokens]
  grid = pos_embedding[0, num_prefix_tokens:]
  if old_grid is None:
    side = math.isqrt(len(grid))
    if side * side != len(grid):
      raise ValueError(
          f"The position embedding has {len(grid)} grid tokens, not a square "
          "number: pass old_grid=(height, width).")
    old_grid = (side, side)
  grid = grid.reshape(*old_grid, -1)
  if tuple(old_grid) == tuple(new_grid):
    return pos_embedding
  if method == "bilinear":
    import scipy.ndimage  # pylint: disable=g-import-not-at-top  # 0.2 s; only here
    zoom = (new_grid[0] / old_grid[0], new_grid[1] / old_grid[1], 1)
    resized = scipy.ndimage.zoom(grid, zoom, order=1)
  else:
    resized = np.asarray(jax.image.resize(
        jnp.asarray(grid, jnp.float32), (*new_grid, grid.shape[-1]),
        "cubic", antialias=False)).astype(grid.dtype)
  resized = resized.reshape(1, new_grid[0] * new_grid[1], -1)
  return np.concatenate([prefix, resized], axis=1)


def check_settings(settings: dict, model_config) -> None:
  """Raises if the model config computes differently from the checkpoint."""
  mismatched = [f"--config.model.{key}={settings[key]}"
                for key in ("classifier", "approximate_gelu",
                            "layer_norm_epsilon")
                if model_config[key] != settings[key]]
  if mismatched:
    raise ValueError(
        f"The {settings['source']} checkpoint was trained with settings the "
        f"model config does not have; add {' '.join(mismatched)}.")


def adapt_params(loaded: dict, target: dict, grid: tuple[int, int], *,
                 method: str = "bilinear") -> tuple[dict, list[str]]:
  """Fits `loaded` params to the shapes of `target` (a fresh init).

  grid: the target's patch grid (H/P, W/P). Returns (params with the
  target's dtypes, report lines: how many parameters were loaded and what
  was resized, re-initialised or dropped).
  """
  loaded = traverse_util.flatten_dict(loaded, sep="/")
  target = traverse_util.flatten_dict(target, sep="/")
  report, fresh = [], set()
  if ("cls" in loaded) != ("cls" in target):
    have, want = (("token", "gap") if "cls" in loaded else ("gap", "token"))
    raise ValueError(f"The checkpoint uses classifier={have!r} and the "
                     f"model {want!r}; set --config.model.classifier={have}.")
  for optional in ("pre_logits", "head"):
    source_keys = [k for k in loaded if k.startswith(optional + "/")]
    target_keys = [k for k in target if k.startswith(optional + "/")]
    if not source_keys and not target_keys:
      continue
    fits = source_keys and all(
        k in target and loaded[k].shape == target[k].shape
        for k in source_keys) and len(source_keys) == len(target_keys)
    if fits:
      continue
    for k in source_keys:
      del loaded[k]
    if target_keys:
      for k in target_keys:
        loaded[k] = target[k]
        fresh.add(k)
      shape = target[f"{optional}/kernel"].shape
      report.append(f"{optional}: new {shape[0]}x{shape[1]} layer, freshly "
                    "initialised" + (" (zeros)" if optional == "head" else ""))
    else:
      report.append(f"{optional}: dropped (the model has none)")
  posemb_key = "Transformer/posembed_input/pos_embedding"
  # Sin-cos position embeddings are fixed, not parameters: nothing to resize.
  # A learned one on one side only is reported by the key check below.
  if posemb_key in loaded and posemb_key in target:
    old, new = loaded[posemb_key].shape, target[posemb_key].shape
    if old != new and old[2] == new[2]:
      loaded[posemb_key] = resize_pos_embedding(
          loaded[posemb_key], grid, 1 if "cls" in target else 0,
          method=method)
      report.append(f"position embedding: resized {old} -> {new} ({method})")
  for key in sorted(set(loaded) | set(target)):
    if key not in target or key not in loaded:
      where = "the checkpoint" if key in loaded else "the model"
      raise ValueError(f"Parameter {key} exists only in {where}: the "
                       "checkpoint is a different architecture (depth, "
                       "classifier) from config.model.")
    if loaded[key].shape != target[key].shape:
      raise ValueError(
          f"Parameter {key} has shape {loaded[key].shape} in the checkpoint "
          f"and {target[key].shape} in the model: config.model does not "
          "match the checkpoint (width, MLP size, patch size or heads).")
  params = {k: np.asarray(loaded[k]).astype(target[k].dtype) for k in target}
  count = lambda keys: sum(int(np.prod(target[k].shape)) for k in keys)
  report.insert(0, f"{count(set(target) - fresh):,} of {count(target):,} "
                "parameters loaded")
  return traverse_util.unflatten_dict(params, sep="/"), report
