"""Look inside a ViT: attention weights, rollout, shape trace, parameters.

All functions take the real model and its params; nothing here is a second
model definition. The model sows what these read into its `intermediates`
collection, which costs nothing unless `mutable=["intermediates"]` asks.

  weights = attention_weights(model, params, images)   # per layer (B,H,T,T)
  maps = attention_rollout(weights, num_prefix_tokens=1)  # (B, T-1)
  print(format_table(shape_trace(model, params, images)))
  print(format_table(parameter_summary(params)))
"""

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


# One compiled program per model and input shape (Flax modules hash by their
# fields): run op by op, a first call compiled each operation on its own,
# 2.7 s against 0.7 s for the Fashion-MNIST model.
@functools.partial(jax.jit, static_argnames=("model", "capture"))
def _intermediates(model: nn.Module, params, images, capture: bool = False):
  _, state = model.apply({"params": params}, images, train=False,
                         mutable=["intermediates"],
                         capture_intermediates=capture)
  return state["intermediates"]


def attention_weights(model: nn.Module, params, images: jax.Array
                      ) -> list[jax.Array]:
  """Attention probabilities of every layer, each (B, heads, T, T).

  T = patches (+1 with a class token; token 0 is the class token).
  """
  encoder = _intermediates(model, params, images)["Transformer"]
  return [encoder[f"encoderblock_{layer}"]["MultiHeadDotProductAttention_1"]
          ["attention_weights"][0] for layer in range(model.num_layers)]


def block_outputs(model: nn.Module, params, images: jax.Array
                  ) -> list[jax.Array]:
  """Token representations after every block, each (B, T, D)."""
  return list(_intermediates(model, params, images)["Transformer"]
              ["block_outputs"])


def rollout_matrix(weights: Sequence[jax.Array], head_fusion: str = "mean"
                   ) -> jax.Array:
  """Attention rollout (Abnar & Zuidema, 2020) over all layers: (B, T, T).

  Each layer's attention, fused over heads ("mean", "max" or "min"), gets the
  residual path added (0.5 A + 0.5 I, rows renormalised); the layers are
  multiplied from the first to the last. Row t says how much each input
  token flows into token t at the output.
  """
  fuse = {"mean": jnp.mean, "max": jnp.max, "min": jnp.min}[head_fusion]
  rollout = None
  for layer_weights in weights:
    attention = fuse(layer_weights.astype(jnp.float32), axis=1)  # (B, T, T)
    identity = jnp.eye(attention.shape[-1], dtype=attention.dtype)
    attention = 0.5 * attention + 0.5 * identity
    attention = attention / attention.sum(axis=-1, keepdims=True)
    rollout = attention if rollout is None else attention @ rollout
  return rollout


def attention_rollout(weights: Sequence[jax.Array], num_prefix_tokens: int,
                      head_fusion: str = "mean") -> jax.Array:
  """Rollout relevance of each patch: (B, patches).

  The class token's row of `rollout_matrix` over the patch tokens, or with
  no class token (num_prefix_tokens=0) the mean row.
  """
  rollout = rollout_matrix(weights, head_fusion)
  if num_prefix_tokens:
    return rollout[:, 0, num_prefix_tokens:]
  return rollout.mean(axis=1)


def class_token_attention(weights: Sequence[jax.Array], layer: int,
                          head: int) -> jax.Array:
  """Raw attention of the class token to the patches: (B, patches)."""
  return weights[layer][:, head, 0, 1:]


def to_image_map(patch_values: jax.Array, grid: tuple[int, int],
                 image_size: tuple[int, int]) -> np.ndarray:
  """(B, h*w) patch scores -> (B, H, W) bilinear map scaled to [0, 1]."""
  values = jnp.asarray(patch_values, jnp.float32).reshape(-1, *grid)
  values = jax.image.resize(values, (values.shape[0], *image_size),
                            "bilinear")
  low = values.min(axis=(1, 2), keepdims=True)
  high = values.max(axis=(1, 2), keepdims=True)
  return np.asarray((values - low) / jnp.maximum(high - low, 1e-12))


def shape_trace(model: nn.Module, params, images: jax.Array
                ) -> list[tuple[str, tuple[int, ...]]]:
  """(stage, output shape) for every stage of the forward pass.

  Read from the real modules' outputs (Flax capture_intermediates plus the
  model's own sown stages): input, patch embedding, flatten, class token,
  position embedding, each block, final norm, pooling, pre-logits, head.
  """
  # Shapes only: traced, not run (running it op by op compiled ~90 XLA
  # programs, ~4 s of `--mode=summary`).
  got = jax.eval_shape(
      lambda p, x: _intermediates(model, p, x, capture=True), params, images)
  encoder = got["Transformer"]
  shape = lambda value: tuple(value[0].shape)
  patch = f"{model.patch_size}x{model.patch_size}"
  rows = [("input image", tuple(images.shape))]
  if model.shifted_patches:  # embeds the patches as tokens, (B, N, D)
    rows.append((f"shifted patch tokens (image + 4 shifts, {patch} patches, "
                 "LayerNorm, linear)", shape(got["patch_tokens"])))
  else:
    rows += [(f"patch embedding (conv {patch}, stride {model.patch_size})",
              shape(got["embedding"]["__call__"])),
             ("flatten to patch tokens", shape(got["patch_tokens"]))]
  if "with_class_token" in got:
    rows.append(("+ class token", shape(got["with_class_token"])))
  rows.append(("+ position embedding", shape(encoder["embedded"])))
  for layer in range(model.num_layers):
    rows.append((f"encoder block {layer}",
                 shape(encoder[f"encoderblock_{layer}"]["__call__"])))
  # With a class token only it goes on (the paper's y = LN(z_L^0)).
  rows.append(("final LayerNorm" + " (class token only)" *
               (model.classifier == "token"),
               shape(encoder["encoder_norm"]["__call__"])))
  rows.append(("class token" if model.classifier == "token" else
               "mean over tokens", shape(got["pooled"])))
  if "pre_logits" in got:
    rows.append(("pre-logits (dense + tanh)",
                 shape(got["features"])))
  rows.append(("head (logits)", shape(got["head"]["__call__"])))
  return rows


def _forward_order(module: str):
  """Sort key: modules in the order the forward pass uses them."""
  order = ["embedding_norm", "embedding", "cls", "Transformer/posembed_input",
           "Transformer/encoderblock_", "Transformer/encoder_norm",
           "pre_logits", "head"]
  for rank, prefix in enumerate(order):
    if module.startswith(prefix):
      suffix = module[len(prefix):].split("/")[0]
      return (rank, int(suffix) if suffix.isdigit() else 0, module)
  return (len(order), 0, module)


def parameter_summary(params, depth: int = 2) -> list[tuple[str, int]]:
  """(module path, parameter count) per module in forward order, then total.

  Modules are grouped `depth` levels deep (2: `Transformer/encoderblock_0`).
  """
  totals = {}
  for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [entry.key for entry in path]
    module = "/".join(names[:max(1, min(depth, len(names) - 1))])
    totals[module] = totals.get(module, 0) + int(np.prod(value.shape))
  rows = sorted(totals.items(), key=lambda item: _forward_order(item[0]))
  return rows + [("total", sum(totals.values()))]


def xla_operations_only(model: nn.Module) -> nn.Module:
  """`model` with its attention core as einsums and its Dense products as
  XLA's dots, for XLA's cost analysis, which counts no FLOPs inside custom
  calls such as the CPU attention kernel's (`kernels.cpu_attention`),
  oneDNN's products (`kernels.cpu_gemm`) or the LayerNorm kernel's. The same parameters and
  values."""
  changes = {field: value for field, value in (
      ("attention_implementation", "einsum"), ("matmul_implementation", "xla"),
      ("layer_norm_implementation", "xla"))
             if getattr(model, field, value) != value}
  return model.clone(**changes) if changes else model


def flops_per_image(model: nn.Module, params, image_shape, train: bool = False
                    ) -> float:
  """FLOPs of one forward (or forward + backward) pass, from XLA's cost
  analysis of the program at batch 1 (with `xla_operations_only`), as lowered:
  nothing is compiled, and params may be shapes (`jax.ShapeDtypeStruct`s).
  (The compiled program's count differs by 0.06% for ViT-B/16 and 0.4% for
  the 0.8 M-parameter Fashion-MNIST model: XLA's fusions change a few
  elementwise operations.)"""
  model = xla_operations_only(model)
  images = jnp.zeros((1, *image_shape), jnp.float32)

  def forward(params, images):
    return model.apply({"params": params}, images, train=False).sum()

  fn = jax.grad(forward) if train else forward
  analysis = jax.jit(fn).lower(params, images).cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX: one dict per device
    analysis = analysis[0]
  return float(analysis["flops"])


def format_table(rows: Sequence[tuple], headers: Sequence[str]) -> str:
  """Plain-text table, numbers right-aligned with thousands separators."""
  cells = [[f"{c:,}" if isinstance(c, int) else str(c) for c in row]
           for row in rows]
  widths = [max(len(h), *(len(r[i]) for r in cells))
            for i, h in enumerate(headers)]
  line = lambda values: "  ".join(
      v.rjust(w) if i else v.ljust(w)
      for i, (v, w) in enumerate(zip(values, widths)))
  return "\n".join([line(headers), line(["-" * w for w in widths])] +
                   [line(row) for row in cells])
