"""The Transformer encoder: position embedding, `num_layers` encoder blocks,
final LayerNorm (the `Transformer` scope of the official checkpoints)."""

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.kernels import block_runner, xla_products
from vit_jax.model.blocks import Encoder1DBlock

Dtype = Any


class Encoder(nn.Module):
  """Position embeddings, dropout, `num_layers` blocks, final LayerNorm.

  The learned position embedding is added here (official layout); with
  learned_posemb=False the caller has added fixed ones. Under patch dropout
  x holds the first num_prefix_tokens (the class token) and then only the
  kept patches' tokens, patch_indices (B, K) in the grid: the position
  embedding is gathered to match. Block i drops its residual branches with
  rate drop_path_rate * i / (num_layers - 1).

  The blocks run as one pure function of their parameters
  (`block_function`), jitted so that one trace serves every block of a
  shape. scan_blocks / remat_blocks change how they run, never the parameter
  tree (`encoderblock_{i}` as in the official checkpoints): the blocks'
  parameters are stacked on the fly and the blocks run as one
  `jax.lax.scan` body, and/or each block is wrapped in `jax.checkpoint`
  (activations recomputed in the backward pass). Initialisation makes every
  block's parameters in one loop over the layers (`_init_blocks_at_once`).
  Capturing the `intermediates` collection runs the blocks as submodules
  instead (the same values; initialised so, they draw other ones).

  With num_output_tokens=n only the first n tokens leave the encoder,
  (B, n, D): the last block computes queries, attention output and MLP for
  those n only (keys and values still from every token), which gives the
  same values as slicing the full output. When `intermediates` is being
  captured the last block runs in full, so every layer's attention map and
  block output is whole, and the output is sliced after it.
  """
  num_layers: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  drop_path_rate: float = 0.0
  num_prefix_tokens: int = 0
  learned_posemb: bool = True
  locality_attention: bool = False
  attention_implementation: str = "auto"
  approximate_gelu: bool = True
  layer_norm_epsilon: float = 1e-6
  layer_norm_implementation: str = "auto"
  scan_blocks: bool = False
  remat_blocks: bool = False
  num_output_tokens: Optional[int] = None
  matmul_dtype: Optional[Dtype] = None
  matmul_implementation: str = "auto"
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, deterministic: bool,
               patch_indices: Optional[jax.Array] = None) -> jax.Array:
    if self.learned_posemb:
      x = self._add_learned_posemb(x, patch_indices)
    self.sow("intermediates", "embedded", x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    capturing = self.is_mutable_collection("intermediates")
    if self.is_initializing() and not capturing:
      self._init_blocks_at_once(x)
    rates, keys, uniforms = self._block_randomness(x, deterministic)
    if capturing:
      x = self._run_blocks_capturing(x, deterministic, rates, keys, uniforms)
    else:
      x = block_runner.run_blocks(
          self._block(0.0, parent=None),  # parent=None: free-standing
          [self.variables["params"][f"encoderblock_{layer}"]
           for layer in range(self.num_layers)], x, rates=rates, keys=keys,
          uniforms=uniforms, deterministic=deterministic,
          num_output_tokens=self.num_output_tokens, remat=self.remat_blocks,
          scan=self.scan_blocks)
    if self.num_output_tokens is not None:
      x = x[:, :self.num_output_tokens]
    return nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                        param_dtype=self.param_dtype, name="encoder_norm")(x)

  def _init_blocks_at_once(self, x: jax.Array) -> None:
    """Creates every block's parameters (`encoderblock_{i}`) by mapping one
    template block's initialisation over the layers' keys; x (B, N, D)
    gives the shapes.

    Why: initialised block by block, XLA compiles each block's random
    initialisers anew (~0.7 s a block on 2 cores); mapped, once, as the
    loop's body.
    `lax.map`, not vmap: a vmap holds every layer's random bits at once
    (ViT-L/16 on 8 FSDP devices: 403 MiB scratch a device, against 151).
    Same initialisers as the submodule loop, other keys.
    """
    template = self._block(0.0, parent=None)
    keys = jax.random.split(self.make_rng("params"), self.num_layers)
    stacked = jax.lax.map(lambda key: template.init(
        {"params": key}, x[:1], deterministic=True)["params"], keys)
    for layer in range(self.num_layers):
      self.param(f"encoderblock_{layer}",
                 lambda _, i=layer: jax.tree.map(lambda a: a[i], stacked))

  def _drop_path_rate_of(self, layer: int) -> float:
    return self.drop_path_rate * layer / max(self.num_layers - 1, 1)

  def _block(self, drop_path_rate: float | jax.Array,
             **module_kwargs) -> Encoder1DBlock:
    return Encoder1DBlock(
        num_heads=self.num_heads, mlp_dim=self.mlp_dim,
        dropout_rate=self.dropout_rate,
        attention_dropout_rate=self.attention_dropout_rate,
        drop_path_rate=drop_path_rate,
        locality_attention=self.locality_attention,
        attention_implementation=self.attention_implementation,
        approximate_gelu=self.approximate_gelu,
        layer_norm_epsilon=self.layer_norm_epsilon,
        layer_norm_implementation=self.layer_norm_implementation,
        matmul_dtype=self.matmul_dtype,
        matmul_implementation=self.matmul_implementation, dtype=self.dtype,
        param_dtype=self.param_dtype, **module_kwargs)

  def _block_randomness(self, x: jax.Array, deterministic: bool):
    """Per layer: (drop-path rates, dropout keys, drop-path draws (2, B)),
    each None where unused; the same whichever way the blocks run.

    Dropout keys are split off this module's "dropout" stream, and drop
    path is one (layers, 2, B) uniform draw: fewer RNG loops for XLA to
    compile than a draw per residual branch.
    """
    num = self.num_layers
    dropout = not deterministic and (self.dropout_rate or
                                     self.attention_dropout_rate)
    keys = (list(jax.random.split(self.make_rng("dropout"), num))
            if dropout else [None] * num)
    uniforms = (list(jax.random.uniform(self.make_rng("dropout"),
                                        (num, 2, x.shape[0])))
                if self.drop_path_rate and not deterministic else [None] * num)
    # Per-layer drop-path rates are arguments (so all blocks share a trace)
    # only when drop path is on; otherwise the template's static 0.0 lets
    # drop_path skip itself.
    rates = ([jnp.float32(self._drop_path_rate_of(layer))
              for layer in range(num)]
             if self.drop_path_rate else [None] * num)
    # Why the barrier: XLA would fold each layer's rate (a constant) into
    # that layer's kernels, so no two layers would share a kernel. With it
    # and the one draw, drop path added 52 distinct XLA:CPU kernels to a
    # vit_tiny_cifar train step instead of 119, and ~3 s less compile.
    rates, uniforms = jax.lax.optimization_barrier((rates, uniforms))
    return rates, keys, uniforms

  def _run_blocks_capturing(self, x: jax.Array, deterministic: bool, rates,
                            keys, uniforms) -> jax.Array:
    """The blocks as submodules (`encoderblock_{i}`), so that the
    `intermediates` collection captures what they sow: the values, random
    draws and gradients of `block_runner.run_blocks`
    (tests/model/test_vit.py). In evaluation the last block runs in full, so
    that every layer's attention maps and block outputs are whole (the
    caller slices the output tokens: the same values); in training it
    computes only the output tokens, as training does, so that its dropout
    masks are the same draws."""
    last = self.num_layers - 1
    for layer in range(self.num_layers):
      rate = 0.0 if rates[layer] is None else rates[layer]
      x = self._block(rate, name=f"encoderblock_{layer}")(
          x, deterministic=deterministic, drop_path_uniforms=uniforms[layer],
          dropout_key=keys[layer],
          num_query_tokens=(self.num_output_tokens
                            if layer == last and not deterministic else None))
      self.sow("intermediates", "block_outputs", x)
    return x

  def _add_learned_posemb(self, x: jax.Array,
                          patch_indices: Optional[jax.Array]) -> jax.Array:
    num_tokens, hidden_size = x.shape[1:]
    if patch_indices is not None:
      # Made (at initialisation, from every patch) before any are dropped.
      num_tokens = self.variables["params"]["posembed_input"][
          "pos_embedding"].shape[1]
    pos_embedding = PositionEmbedding(
        param_dtype=self.param_dtype, name="posembed_input")(
            num_tokens, hidden_size)  # (1, prefix + N, D)
    if patch_indices is not None:  # the kept patches' rows, after the prefix
      prefix = self.num_prefix_tokens
      kept = jnp.take(pos_embedding[0, prefix:], patch_indices, axis=0)
      prefix_rows = jnp.broadcast_to(pos_embedding[:, :prefix],
                                     (x.shape[0], prefix, hidden_size))
      pos_embedding = jnp.concatenate([prefix_rows, kept], axis=1)
      return x + pos_embedding.astype(x.dtype)
    # x + pos_embedding, the gradient's sum over the batch as a product.
    return xla_products.add_to_every_example(x, pos_embedding.astype(x.dtype))


class PositionEmbedding(nn.Module):
  """Learned 1-D position embedding, (1, num_tokens, D), normal(0.02) init."""
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, num_tokens: int, hidden_size: int) -> jax.Array:
    return self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                      (1, num_tokens, hidden_size), self.param_dtype)
