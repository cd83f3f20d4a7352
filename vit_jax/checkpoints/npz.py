"""Official `.npz` checkpoints: read both released layouts, write the old one.

Two layouts exist, both flat `np.savez` archives keyed by '/'-joined paths:

* google-research/vision_transformer (ImageNet-21k and AugReg releases), the
  layout of this package's parameter tree: `Transformer/encoderblock_{i}/
  {LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3}`,
  `Transformer/posembed_input/pos_embedding` (class row included), optionally
  under an `opt/target/` prefix (training checkpoints).
* big_vision: `{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1,
  MlpBlock_0}`, a top-level `pos_embedding` without the class row (big_vision
  adds it before prepending the class token, which equals a zero class row
  here), blocks either per layer or stacked on a leading axis
  (`Transformer/encoderblock/...`, from `nn.scan`), under `params/` or
  `params/img/`.

Files are read with `allow_pickle=False`: a checkpoint can never run code.
"""

import os
import re
import tempfile
import zipfile

import numpy as np
from flax import traverse_util

# big_vision block sub-module -> ours.
_BIG_VISION_BLOCK = {
    "LayerNorm_0": "LayerNorm_0",
    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
    "LayerNorm_1": "LayerNorm_2",
    "MlpBlock_0": "MlpBlock_3",
}
_OLD_BLOCK = frozenset(_BIG_VISION_BLOCK.values())


class CheckpointFormatError(ValueError):
  """A checkpoint file that is unreadable or holds a model we cannot load."""


def read_npz(path: str) -> dict[str, np.ndarray]:
  """The arrays of an `.npz` file, keyed by their '/'-joined paths."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No checkpoint file at {path}.")
  try:
    with np.load(path, allow_pickle=False) as archive:
      return {key: archive[key] for key in archive.files}
  except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
    raise CheckpointFormatError(
        f"{path} is not a readable .npz archive ({type(e).__name__}: {e}). "
        "It may be truncated (re-download it) or hold Python objects, "
        "which are never unpickled.") from e


def _strip_prefix(flat: dict[str, np.ndarray], path: str
                  ) -> dict[str, np.ndarray]:
  """Drops the `opt/target/`, `params/` or `params/img/` key prefix."""
  kernels = [k for k in flat if k == "embedding/kernel" or
             k.endswith("/embedding/kernel")]
  if not kernels:
    hint = ("It looks like a hybrid ResNet+ViT, which is not supported."
            if any("conv_root" in k or "block1" in k for k in flat) else
            "It is not a ViT checkpoint of the official or big_vision "
            "layout.")
    raise CheckpointFormatError(
        f"{path} has no patch embedding ('embedding/kernel'). {hint} Keys "
        f"start with: {sorted(flat)[:5]}.")
  prefix = min(kernels, key=len)[:-len("embedding/kernel")]
  return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def _unstack_scanned(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Splits `Transformer/encoderblock/...` (layer axis first) per layer."""
  out = {}
  for key, value in flat.items():
    if key.startswith("Transformer/encoderblock/"):
      rest = key[len("Transformer/encoderblock/"):]
      for layer, array in enumerate(value):
        out[f"Transformer/encoderblock_{layer}/{rest}"] = array
    else:
      out[key] = value
  return out


def _rename_big_vision_blocks(flat):
  out = {}
  for key, value in flat.items():
    match = re.match(r"(Transformer/encoderblock_\d+)/([^/]+)/(.*)", key)
    if match and match.group(2) not in _OLD_BLOCK:
      block, module, rest = match.groups()
      if module not in _BIG_VISION_BLOCK:
        raise CheckpointFormatError(
            f"Unknown encoder block module {module!r} in key {key!r}.")
      key = f"{block}/{_BIG_VISION_BLOCK[module]}/{rest}"
    out[key] = value
  return out


def params_from_npz(flat: dict[str, np.ndarray], path: str = "checkpoint"
                    ) -> dict:
  """Converts a flat official or big_vision archive into our parameter tree.

  Returns nested dicts of numpy arrays. Refuses models this package cannot
  express (MAP pooling, fixed sin-cos position embeddings) with the reason.
  """
  flat = _strip_prefix(flat, path)
  if any(k.startswith("MAPHead") for k in flat):
    raise CheckpointFormatError(
        f"{path} uses multi-head attention pooling ('map'); vit_jax "
        "supports the class token ('token') and global average pooling "
        "('gap'). Pick a checkpoint trained with one of those.")
  flat = _rename_big_vision_blocks(_unstack_scanned(flat))
  if "pos_embedding" in flat:  # big_vision: no class row
    posemb = flat.pop("pos_embedding")
    if posemb.ndim == 2:
      posemb = posemb[None]
    if "cls" in flat:
      posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)
    flat["Transformer/posembed_input/pos_embedding"] = posemb
  if "Transformer/posembed_input/pos_embedding" not in flat:
    raise CheckpointFormatError(
        f"{path} has no learned position embedding (big_vision's fixed "
        "'sincos2d' embedding is not a parameter); vit_jax models learn it. "
        "Use a checkpoint trained with posemb='learn'.")
  return traverse_util.unflatten_dict(
      {tuple(k.split("/")): np.asarray(v) for k, v in flat.items()})


def flatten(params) -> dict[str, np.ndarray]:
  """Our parameter tree as a flat dict keyed by '/'-joined paths (numpy)."""
  return {"/".join(path): np.asarray(value) for path, value in
          traverse_util.flatten_dict(params).items()}


def save_npz(params, path: str) -> None:
  """Writes `params` as an official-layout `.npz`, atomically.

  The archive is written to a temporary file beside `path` and renamed, so
  a crash never leaves a half-written checkpoint under the final name.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  handle, tmp_path = tempfile.mkstemp(dir=directory, suffix=".npz.tmp")
  try:
    with os.fdopen(handle, "wb") as f:
      np.savez(f, **flatten(params))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates files 0600
    os.replace(tmp_path, path)
  except BaseException:
    os.unlink(tmp_path)
    raise
