"""PyTorch state-dict files: read (.safetensors, .pth, .pt, .bin), write.

Safetensors files are parsed here (any dtype, bfloat16 included, via
ml_dtypes) and written with the `safetensors` package: no torch needed.
`.pth`/`.bin` files need torch and are read with `weights_only=True`, so
nothing but tensors is ever unpickled.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np

from vit_jax.checkpoints.npz import CheckpointFormatError

# safetensors dtype names -> numpy (bfloat16 via ml_dtypes, a JAX dependency).
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Parses a .safetensors file: an 8-byte header size, a JSON header of
  {name: {dtype, shape, data_offsets}}, then the raw little-endian data."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_size])
    body = memoryview(data)[8 + header_size:]
    tensors = {}
    for name, info in header.items():
      if name == "__metadata__":
        continue
      begin, end = info["data_offsets"]
      array = np.frombuffer(body[begin:end],
                            dtype=_SAFETENSORS_DTYPES[info["dtype"]])
      tensors[name] = array.reshape(info["shape"]).astype(np.float32)
    return tensors
  except (struct.error, ValueError, KeyError, TypeError) as e:
    raise CheckpointFormatError(
        f"{path} is not a readable safetensors file ({type(e).__name__}: "
        f"{e}); it may be truncated.") from e


def read_state_dict(path: str) -> dict[str, np.ndarray]:
  """Tensors of a `.safetensors`, `.pth`, `.pt` or `.bin` file as float32."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No checkpoint file at {path}.")
  if path.endswith(".safetensors"):
    return _read_safetensors(path)
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        f"Reading {path} needs PyTorch: pip install -e '.[torch]' (or save "
        "the state dict as .safetensors, which needs no torch).") from e
  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointFormatError(
        f"{path} cannot be read as a PyTorch state dict with "
        f"weights_only=True ({type(e).__name__}: {e}). Only plain tensors "
        "are loaded; files holding other Python objects are refused.") from e
  for wrapper in ("state_dict", "model", "module"):
    if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
      state = state[wrapper]
  return {k.removeprefix("module."): v.detach().float().numpy()
          for k, v in state.items() if hasattr(v, "detach")}


def save_state_dict(state: dict[str, np.ndarray], path: str) -> None:
  """Writes a state dict as `.safetensors` (no torch needed) or `.pth`."""
  tmp_path = path + ".tmp"
  if path.endswith(".safetensors"):
    try:
      from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("Writing .safetensors needs the safetensors package: "
                        "pip install -e '.[torch]' (or safetensors).") from e
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()},
              tmp_path)
  else:
    import torch  # pylint: disable=g-import-not-at-top
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v))
                for k, v in state.items()}, tmp_path)
  os.replace(tmp_path, path)
