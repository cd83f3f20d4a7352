"""Named ViT variants: Table 1 of the paper plus small-image models.

`get_variant("ViT-B/16")` returns the model hyper-parameters as a locked
ml_collections.ConfigDict that `build_model` turns into a VisionTransformer.
"""

import dataclasses

import jax.numpy as jnp
import ml_collections

from vit_jax.model import vit

# Table 1 of the paper (Ti and S from DeiT / "How to train your ViT").
_SIZES = {
    # name: (hidden_size, num_layers, num_heads, mlp_dim)
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
    "H": (1280, 32, 16, 5120),
}

# The size/patch pairs with officially released checkpoints.
_RELEASED = ("Ti/16", "S/16", "S/32", "B/8", "B/16", "B/32", "L/16", "L/32",
             "H/14")

# Models for 28x28 and 32x32 images, used by the configs in configs/.
_SMALL_IMAGE = {
    # ViT-Ti widths on 4x4 patches: 64 tokens (+ class token) at 32x32.
    "ViT-Ti/4": dict(patch_size=4, hidden_size=192, num_layers=12,
                     num_heads=3, mlp_dim=768),
    # A light model for 28x28 grayscale images that trains on 2 CPU cores.
    "ViT-Mini/4": dict(patch_size=4, hidden_size=128, num_layers=6,
                       num_heads=4, mlp_dim=256),
    # 7x7 patches (16 tokens at 28x28), MLP ratio 4: the fastest learner per
    # CPU minute on Fashion-MNIST here at 1-2 epochs.
    "ViT-Mini/7": dict(patch_size=7, hidden_size=128, num_layers=6,
                       num_heads=4, mlp_dim=512),
    # 4x4 patches (49 tokens at 28x28) at half the width and MLP ratio 2:
    # a step as cheap as ViT-Mini/7's, and ahead of it from about 4 epochs
    # on Fashion-MNIST (configs/vit_fashion_mnist_*min.py).
    "ViT-Micro/4": dict(patch_size=4, hidden_size=64, num_layers=6,
                        num_heads=4, mlp_dim=128),
}


def _table() -> dict[str, dict]:
  table = {}
  for size_patch in _RELEASED:
    size, patch = size_patch.split("/")
    hidden_size, num_layers, num_heads, mlp_dim = _SIZES[size]
    table[f"ViT-{size_patch}"] = dict(
        patch_size=int(patch), hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, mlp_dim=mlp_dim)
  table.update(_SMALL_IMAGE)
  return table


VARIANTS = _table()


def option_defaults() -> dict:
  """Every option of `VisionTransformer` beyond the variant's dims, with
  its default, read off the module's fields: the one place the defaults
  are written. The compute dtype as its name ("float32"); an optional int
  (representation_size) as an ml_collections placeholder, so that a
  config can set it."""
  dims = {"num_classes", "parent", "name", "param_dtype",
          *next(iter(VARIANTS.values()))}
  defaults = {}
  for field in dataclasses.fields(vit.VisionTransformer):
    if field.name in dims or field.default is dataclasses.MISSING:
      continue
    value = field.default
    if field.name == "dtype":
      value = jnp.dtype(value).name
    elif field.name == "matmul_dtype":  # None or a dtype's name
      value = ml_collections.config_dict.placeholder(str)
    elif value is None:
      value = ml_collections.config_dict.placeholder(int)
    defaults[field.name] = value
  return defaults


def get_variant(name: str) -> ml_collections.ConfigDict:
  """Model hyper-parameters of a named variant, e.g. "ViT-B/16".

  The result also carries the defaults of every other model option
  (dropout, classifier, representation_size, ...) so it can be overridden
  key by key and passed to `build_model`.
  """
  if name not in VARIANTS:
    raise ValueError(f"Unknown ViT variant {name!r}. Known variants: "
                     f"{', '.join(VARIANTS)}.")
  config = ml_collections.ConfigDict(dict(
      name=name, **option_defaults(), **VARIANTS[name]))
  config.lock()
  return config


def build_model(model_config: ml_collections.ConfigDict, num_classes: int
                ) -> vit.VisionTransformer:
  """A VisionTransformer from a `get_variant`-style config."""
  if model_config.dtype not in ("float32", "bfloat16", "float16"):
    raise ValueError(
        f"config.model.dtype={model_config.dtype!r} is not supported; choose "
        "float32, bfloat16 or float16.")
  fields = dict(model_config)
  fields.pop("name")
  fields["dtype"] = jnp.dtype(fields["dtype"])
  if fields["matmul_dtype"] is not None:
    fields["matmul_dtype"] = jnp.dtype(fields["matmul_dtype"])
  return vit.VisionTransformer(num_classes=num_classes, **fields)
