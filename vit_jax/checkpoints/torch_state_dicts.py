"""PyTorch ViT state dicts (torchvision, timm, Hugging Face) <-> our tree.

Each source names the same tensors differently; a `_Layout` says how, and
one pair of functions converts through a source-neutral "canonical" dict of
PyTorch-shaped arrays:

  patch.weight (D, C, P, P)   cls (1, 1, D)   posemb (1, N+1, D)
  {i}.ln1 / {i}.q / {i}.k / {i}.v / {i}.out / {i}.ln2 / {i}.fc1 / {i}.fc2
  norm   pre_logits (optional)   head (optional)

Linear weights are (out, in) in PyTorch and (in, out) here; conv kernels OIHW
vs HWIO; attention projections are (D, heads, D/heads) here. The models
differ from the official JAX ViT in two numerics a state dict does not
record: they use the exact (erf) GELU, and Hugging Face's LayerNorm epsilon
is 1e-12; `convert_state_dict` returns these as model settings.

Reading and writing the files is vit_jax/checkpoints/state_dict_files.py.
"""

import dataclasses
import re
from typing import Optional

import numpy as np
from flax import traverse_util

from vit_jax.checkpoints.npz import CheckpointFormatError


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where one source keeps each canonical tensor."""
  name: str
  tensors: dict[str, str]        # canonical -> source key (no .weight)
  modules: dict[str, str]        # canonical module -> source module
  block: str                     # block prefix, with {i}
  block_modules: dict[str, str]  # canonical module -> source module in block
  fused_qkv: Optional[tuple[str, str]] = None  # (weight, bias) keys in block
  layer_norm_epsilon: float = 1e-6


TIMM = _Layout(
    name="timm",
    tensors={"cls": "cls_token", "posemb": "pos_embed"},
    modules={"patch": "patch_embed.proj", "norm": "norm", "head": "head"},
    block="blocks.{i}.",
    block_modules={"ln1": "norm1", "out": "attn.proj", "ln2": "norm2",
                   "fc1": "mlp.fc1", "fc2": "mlp.fc2"},
    fused_qkv=("attn.qkv.weight", "attn.qkv.bias"))

TORCHVISION = _Layout(
    name="torchvision",
    tensors={"cls": "class_token", "posemb": "encoder.pos_embedding"},
    modules={"patch": "conv_proj", "norm": "encoder.ln",
             "pre_logits": "heads.pre_logits", "head": "heads.head"},
    block="encoder.layers.encoder_layer_{i}.",
    block_modules={"ln1": "ln_1", "out": "self_attention.out_proj",
                   "ln2": "ln_2", "fc1": "mlp.0", "fc2": "mlp.3"},
    fused_qkv=("self_attention.in_proj_weight",
               "self_attention.in_proj_bias"))

# Hugging Face ViTForImageClassification / ViTModel, transformers >= 5 names.
HUGGING_FACE = _Layout(
    name="hugging_face",
    tensors={"cls": "vit.embeddings.cls_token",
             "posemb": "vit.embeddings.position_embeddings"},
    modules={"patch": "vit.embeddings.patch_embeddings.projection",
             "norm": "vit.layernorm", "pre_logits": "vit.pooler.dense",
             "head": "classifier"},
    block="vit.layers.{i}.",
    block_modules={"ln1": "layernorm_before", "q": "attention.q_proj",
                   "k": "attention.k_proj", "v": "attention.v_proj",
                   "out": "attention.o_proj", "ln2": "layernorm_after",
                   "fc1": "mlp.fc1", "fc2": "mlp.fc2"},
    layer_norm_epsilon=1e-12)

# The same, as named by transformers 4 (the files published on the Hub).
HUGGING_FACE_V4 = dataclasses.replace(
    HUGGING_FACE, name="hugging_face_v4", block="vit.encoder.layer.{i}.",
    block_modules={"ln1": "layernorm_before",
                   "q": "attention.attention.query",
                   "k": "attention.attention.key",
                   "v": "attention.attention.value",
                   "out": "attention.output.dense", "ln2": "layernorm_after",
                   "fc1": "intermediate.dense", "fc2": "output.dense"})

LAYOUTS = {layout.name: layout for layout in
           (TIMM, TORCHVISION, HUGGING_FACE, HUGGING_FACE_V4)}


def detect_layout(state: dict[str, np.ndarray]) -> _Layout:
  """Which library wrote `state`, from its key names."""
  state = _with_hf_prefix(state)
  for layout in LAYOUTS.values():
    if (layout.modules["patch"] + ".weight" in state and
        layout.block.format(i=0) + layout.block_modules["ln1"] + ".weight"
        in state):
      return layout
  raise CheckpointFormatError(
      "Not a torchvision, timm or Hugging Face ViT state dict (no known "
      f"patch-embedding key). First keys: {sorted(state)[:5]}.")


def _with_hf_prefix(state):
  """Hugging Face ViTModel files have no `vit.` prefix; add it."""
  if "embeddings.patch_embeddings.projection.weight" in state:
    return {("" if k.startswith("classifier") else "vit.") + k: v
            for k, v in state.items()}
  return state


def _num_layers(state, layout) -> int:
  pattern = re.compile(re.escape(layout.block).replace(r"\{i\}", r"(\d+)"))
  layers = {int(m.group(1)) for k in state if (m := pattern.match(k))}
  return max(layers) + 1 if layers else 0


def _to_canonical(state, layout) -> dict[str, np.ndarray]:
  """Source keys -> canonical keys; every source key must be used."""
  state = dict(state)
  canonical = {}

  def take(key, name):
    canonical[name] = state.pop(key)

  for name, key in layout.tensors.items():
    if key in state:
      take(key, name)
  for name, module in layout.modules.items():
    for suffix in ("weight", "bias"):
      if f"{module}.{suffix}" in state:
        take(f"{module}.{suffix}", f"{name}.{suffix}")
  for i in range(_num_layers(state, layout)):
    prefix = layout.block.format(i=i)
    if layout.fused_qkv:
      weight, bias = (state.pop(prefix + key) for key in layout.fused_qkv)
      for name, w, b in zip("qkv", np.split(weight, 3), np.split(bias, 3)):
        canonical[f"{i}.{name}.weight"], canonical[f"{i}.{name}.bias"] = w, b
    for name, module in layout.block_modules.items():
      for suffix in ("weight", "bias"):
        take(f"{prefix}{module}.{suffix}", f"{i}.{name}.{suffix}")
  if state:
    raise CheckpointFormatError(
        f"The {layout.name} state dict has tensors vit_jax has no place for, "
        f"e.g. {sorted(state)[:4]}: the model uses a feature the paper's "
        "ViT lacks (register tokens, layer scale, an extra norm, another "
        "pooling). Such models cannot be loaded.")
  return canonical


def _from_canonical(canonical, layout) -> dict[str, np.ndarray]:
  """Canonical keys -> source keys (the inverse of `_to_canonical`)."""
  canonical = dict(canonical)
  state = {}
  for name, key in layout.tensors.items():
    if name in canonical:
      state[key] = canonical.pop(name)
  for name, module in layout.modules.items():
    for suffix in ("weight", "bias"):
      if f"{name}.{suffix}" in canonical:
        state[f"{module}.{suffix}"] = canonical.pop(f"{name}.{suffix}")
  layer = 0
  while f"{layer}.ln1.weight" in canonical:
    prefix = layout.block.format(i=layer)
    if layout.fused_qkv:
      for key, suffix in zip(layout.fused_qkv, ("weight", "bias")):
        state[prefix + key] = np.concatenate(
            [canonical.pop(f"{layer}.{n}.{suffix}") for n in "qkv"])
    for name, module in layout.block_modules.items():
      for suffix in ("weight", "bias"):
        state[f"{prefix}{module}.{suffix}"] = canonical.pop(
            f"{layer}.{name}.{suffix}")
    layer += 1
  if canonical:
    raise CheckpointFormatError(
        f"{layout.name} has no place for {sorted(canonical)[:4]}; export "
        "this model as an official .npz instead.")
  return state


def _canonical_to_params(canonical, num_heads: int) -> dict:
  c = canonical
  width = c["patch.weight"].shape[0]
  if not num_heads or num_heads < 1:
    raise CheckpointFormatError(
        "A PyTorch state dict does not record the number of attention "
        "heads; give it (config.model.num_heads, or --num_heads).")
  if width % num_heads:
    raise CheckpointFormatError(
        f"num_heads={num_heads} does not divide the checkpoint's width "
        f"{width}; set config.model.num_heads to the source model's value.")
  head_dim = width // num_heads
  dense = lambda name: {"kernel": c[f"{name}.weight"].T,
                        "bias": c[f"{name}.bias"]}
  norm = lambda name: {"scale": c[f"{name}.weight"], "bias": c[f"{name}.bias"]}
  tree = {
      "embedding": {"kernel": c["patch.weight"].transpose(2, 3, 1, 0),
                    "bias": c["patch.bias"]},
      "Transformer": {"posembed_input": {"pos_embedding": c["posemb"]},
                      "encoder_norm": norm("norm")},
  }
  if "cls" in c:
    tree["cls"] = c["cls"]
  for extra in ("pre_logits", "head"):
    if f"{extra}.weight" in c:
      tree[extra] = dense(extra)
  layer = 0
  while f"{layer}.ln1.weight" in c:
    attention = {
        name: {"kernel": c[f"{layer}.{name[0]}.weight"].T.reshape(
                   width, num_heads, head_dim),
               "bias": c[f"{layer}.{name[0]}.bias"].reshape(num_heads,
                                                            head_dim)}
        for name in ("query", "key", "value")}
    attention["out"] = {
        "kernel": c[f"{layer}.out.weight"].T.reshape(num_heads, head_dim,
                                                     width),
        "bias": c[f"{layer}.out.bias"]}
    tree["Transformer"][f"encoderblock_{layer}"] = {
        "LayerNorm_0": norm(f"{layer}.ln1"),
        "MultiHeadDotProductAttention_1": attention,
        "LayerNorm_2": norm(f"{layer}.ln2"),
        "MlpBlock_3": {"Dense_0": dense(f"{layer}.fc1"),
                       "Dense_1": dense(f"{layer}.fc2")},
    }
    layer += 1
  return tree


def _params_to_canonical(params) -> dict[str, np.ndarray]:
  p = traverse_util.flatten_dict(params, sep="/")
  p = {k: np.asarray(v) for k, v in p.items()}
  # Options the torchvision/timm/HF ViTs have no weights for.
  unsupported = []
  if "Transformer/posembed_input/pos_embedding" not in p:
    unsupported.append("posemb='sincos2d'")
  if "embedding_norm/scale" in p:
    unsupported.append("shifted_patches")
  if any(key.endswith("/temperature") for key in p):
    unsupported.append("locality_attention")
  if unsupported:
    raise CheckpointFormatError(
        f"These params use {', '.join(unsupported)}, which the PyTorch ViT "
        "layouts cannot hold; export a model trained without them.")
  canonical = {"patch.weight": p["embedding/kernel"].transpose(3, 2, 0, 1),
               "patch.bias": p["embedding/bias"],
               "posemb": p["Transformer/posembed_input/pos_embedding"],
               "norm.weight": p["Transformer/encoder_norm/scale"],
               "norm.bias": p["Transformer/encoder_norm/bias"]}
  if "cls" in p:
    canonical["cls"] = p["cls"]
  for extra in ("pre_logits", "head"):
    if f"{extra}/kernel" in p:
      canonical[f"{extra}.weight"] = p[f"{extra}/kernel"].T
      canonical[f"{extra}.bias"] = p[f"{extra}/bias"]
  layer = 0
  while f"Transformer/encoderblock_{layer}/LayerNorm_0/scale" in p:
    block = f"Transformer/encoderblock_{layer}/"
    attention = block + "MultiHeadDotProductAttention_1/"
    for name in ("query", "key", "value"):
      kernel = p[f"{attention}{name}/kernel"]
      canonical[f"{layer}.{name[0]}.weight"] = kernel.reshape(
          kernel.shape[0], -1).T
      canonical[f"{layer}.{name[0]}.bias"] = p[f"{attention}{name}/bias"
                                               ].reshape(-1)
    out = p[attention + "out/kernel"]
    canonical[f"{layer}.out.weight"] = out.reshape(-1, out.shape[-1]).T
    canonical[f"{layer}.out.bias"] = p[attention + "out/bias"]
    for name, module in (("ln1", "LayerNorm_0"), ("ln2", "LayerNorm_2")):
      canonical[f"{layer}.{name}.weight"] = p[f"{block}{module}/scale"]
      canonical[f"{layer}.{name}.bias"] = p[f"{block}{module}/bias"]
    for name, module in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
      canonical[f"{layer}.{name}.weight"] = p[
          f"{block}MlpBlock_3/{module}/kernel"].T
      canonical[f"{layer}.{name}.bias"] = p[f"{block}MlpBlock_3/{module}/bias"]
    layer += 1
  return canonical


def convert_state_dict(state: dict[str, np.ndarray], num_heads: int
                       ) -> tuple[dict, dict]:
  """A torchvision/timm/Hugging Face state dict -> (params, model settings).

  The settings are the model options the source implies and a state dict
  does not store: `approximate_gelu=False` (exact GELU),
  `layer_norm_epsilon`, `classifier` ("token" with a class token, else
  "gap"), plus `source`, the detected library.
  """
  # torchvision < 0.13 named the MLP layers linear_1 / linear_2.
  state = {re.sub(r"\.mlp\.linear_([12])\.",
                  lambda m: ".mlp.0." if m.group(1) == "1" else ".mlp.3.", k): v
           for k, v in _with_hf_prefix(state).items()}
  layout = detect_layout(state)
  params = _canonical_to_params(_to_canonical(state, layout), num_heads)
  settings = dict(approximate_gelu=False,
                  layer_norm_epsilon=layout.layer_norm_epsilon,
                  classifier="token" if "cls" in params else "gap",
                  source=layout.name)
  return params, settings


def export_state_dict(params, layout: str = "timm") -> dict[str, np.ndarray]:
  """Our params as a state dict of `layout` ("timm", "torchvision", ...).

  Load it with `model.load_state_dict({k: torch.from_numpy(v) ...})` into a
  model built with the same dims; for timm a "gap" model is
  `class_token=False, global_pool="avg", fc_norm=False`.
  """
  return _from_canonical(_params_to_canonical(params), LAYOUTS[layout])
