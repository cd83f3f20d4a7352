"""The Vision Transformer (Dosovitskiy et al., 2020) as Flax linen modules.

Parameter names follow the official google-research/vision_transformer
checkpoint tree, so released `.npz` files map onto this model one to one:

  embedding/{kernel,bias}                      patch embedding (Conv)
  cls                                          class token, (1, 1, D)
  Transformer/posembed_input/pos_embedding     (1, N+1, D); absent with
                                               posemb="sincos2d" (fixed)
  Transformer/encoderblock_{i}/LayerNorm_0
  Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/{query,key,value,out}
  Transformer/encoderblock_{i}/LayerNorm_2
  Transformer/encoderblock_{i}/MlpBlock_3/{Dense_0,Dense_1}
  Transformer/encoder_norm
  pre_logits/{kernel,bias}                     only with representation_size
  head/{kernel,bias}
"""

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.kernels import attention, block_runner, cpu_attention, matmuls
from vit_jax.kernels.matmuls import per_token
from vit_jax.model import options
from vit_jax.model.options import ViTInputError

Dtype = Any
CLASSIFIERS = ("token", "gap")
POSITION_EMBEDDINGS = ("learn", "sincos2d")


def _split(key: Optional[jax.Array], num: int) -> list[Optional[jax.Array]]:
  """num keys from `key` for a module's dropout sites; all None (each site
  then draws from the "dropout" stream) without one."""
  return [None] * num if key is None else list(jax.random.split(key, num))


class MlpBlock(nn.Module):
  """Dense -> GELU -> dropout -> Dense -> dropout. (..., D) -> (..., D).

  Without dropout between them (rate 0, or at evaluation) the GELU runs
  inside the second Dense's `matmuls.gelu_dot_general`, which recomputes
  it in the backward pass instead of storing it: the same values, less
  memory.
  """
  mlp_dim: int
  dropout_rate: float = 0.0
  approximate_gelu: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, deterministic: bool,
               dropout_key: Optional[jax.Array] = None) -> jax.Array:
    out_dim = x.shape[-1]
    hidden_key, out_key = _split(dropout_key, 2)
    dense = lambda features, name, dot_general=matmuls.dense_dot_general: (
        nn.Dense(features, dtype=self.dtype, param_dtype=self.param_dtype,
                 kernel_init=nn.initializers.xavier_uniform(),
                 bias_init=nn.initializers.normal(stddev=1e-6),
                 dot_general=dot_general, name=name))
    x = dense(self.mlp_dim, "Dense_0")(x)
    if deterministic or self.dropout_rate == 0.0:
      x = dense(out_dim, "Dense_1", matmuls.gelu_dot_general(
          self.approximate_gelu))(x)
    else:
      x = nn.gelu(x, approximate=self.approximate_gelu)
      x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic,
                                        rng=hidden_key)
      x = dense(out_dim, "Dense_1")(x)
    return nn.Dropout(self.dropout_rate)(x, deterministic=deterministic,
                                         rng=out_key)


class HeadsProjection(nn.Module):
  """The parameters of attention's query, key or value projection, as
  `nn.DenseGeneral((heads, head_dim))` lays them out and initialises them
  (kernel (D, heads, head_dim), Xavier-uniform over its (D, heads *
  head_dim) matrix; bias (heads, head_dim), zeros): returned, not applied,
  as a (D, heads * head_dim) kernel and a flat bias, so that the
  projections can run as one matmul."""
  num_heads: int
  head_dim: int
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, hidden_size: int) -> tuple[jax.Array, jax.Array]:
    width = self.num_heads * self.head_dim
    kernel = self.param(
        "kernel", lambda key, shape, dtype: nn.initializers.xavier_uniform()(
            key, (hidden_size, width), dtype).reshape(shape),
        (hidden_size, self.num_heads, self.head_dim), self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros,
                      (self.num_heads, self.head_dim), self.param_dtype)
    return kernel.reshape(hidden_size, width), bias.reshape(width)


class MultiHeadSelfAttention(nn.Module):
  """Multi-head dot-product self-attention. (B, T, D) -> (B, T, D).

  With num_query_tokens=n only the first n tokens query (attending to all
  T): (B, T, D) -> (B, n, D).

  Same parameter layout as `flax.linen.MultiHeadDotProductAttention` (and the
  official checkpoints): query/key/value kernels (D, heads, D/heads), out
  kernel (heads, D/heads, D). Softmax runs in float32 whatever `dtype` is, so
  bfloat16 compute stays stable. The attention probabilities
  (B, heads, T, T) are sown into the `intermediates` collection as
  `attention_weights` when that collection is mutable, and cost nothing
  otherwise. `implementation` picks the kernel of the attention core (see
  `vit_jax.kernels.attention`: "auto" is cuDNN's flash attention on a
  recent CUDA GPU in bfloat16/float16, the einsums below elsewhere).

  With `locality=True` it is the Locality Self-Attention of Lee et al. 2021
  ("Vision Transformer for Small-Size Datasets"): the logits are divided by
  a learned temperature (parameter `temperature`, initialised to
  sqrt(head_dim), so training starts where plain attention does) and each
  token may not attend to itself, which sharpens attention towards other
  tokens on small data.
  """
  num_heads: int
  attention_dropout_rate: float = 0.0
  locality: bool = False
  implementation: str = "auto"
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, deterministic: bool,
               num_query_tokens: Optional[int] = None,
               dropout_key: Optional[jax.Array] = None) -> jax.Array:
    hidden_size = x.shape[-1]
    if hidden_size % self.num_heads:
      raise ViTInputError(
          f"hidden_size {hidden_size} is not divisible by num_heads "
          f"{self.num_heads}; choose num_heads that divides it.")
    head_dim = hidden_size // self.num_heads
    projections = {name: HeadsProjection(self.num_heads, head_dim,
                                         self.param_dtype, name=name)(
                                             hidden_size)
                   for name in ("query", "key", "value")}

    fused = attention.fused_implementation(
        self.implementation, self.dtype, head_dim,
        capturing=self.is_mutable_collection("intermediates"),
        dropout=bool(self.attention_dropout_rate) and not deterministic,
        locality=self.locality,
        sequence_lengths=(num_query_tokens or x.shape[1], x.shape[1]))

    def project(inputs, names):
      """(B, T, D) -> a (B, heads, T, head_dim) per name for the einsums,
      (B, T, heads, head_dim) for the fused kernels, from one matmul:
      (B*T, D) @ (D, 3*D) runs faster on XLA:CPU than three of (D, D).

      Heads first for the einsums: XLA:CPU then runs both products as
      plain batched matmuls. From the token-major layout it computed the
      weighted sum as V^T P^T, at half the rate of Q K^T (ViT-Ti/16 @224
      inference 5.6% slower; docs/performance.md, *Heads first*). One
      transpose for all names, not a split and one per name: 1.8-3.7%
      faster vit_tiny_cifar training steps."""
      kernel = jnp.concatenate([projections[n][0] for n in names], axis=1)
      bias = jnp.concatenate([projections[n][1] for n in names])
      inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias,
                                                     dtype=self.dtype)
      outputs = per_token(lambda tokens: matmuls.dense_dot_general(
          tokens, kernel, (((1,), (0,)), ((), ()))) + bias, inputs)
      outputs = outputs.reshape(*outputs.shape[:2], len(names),
                                self.num_heads, head_dim)
      token_major = fused in ("xla", "cudnn")
      order = (2, 0, 1, 3, 4) if token_major else (2, 0, 3, 1, 4)
      return list(jnp.transpose(outputs, order))

    if num_query_tokens is None:
      query, key, value = project(x, ("query", "key", "value"))
    else:  # only the first num_query_tokens tokens query
      (query,) = project(x[:, :num_query_tokens], ("query",))
      key, value = project(x, ("key", "value"))
    output = nn.DenseGeneral(
        hidden_size, axis=(-2, -1), dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=nn.initializers.xavier_uniform(),
        dot_general=matmuls.dense_dot_general, name="out")

    if fused == "cpu_kernel":
      attended = cpu_attention.attention_core(
          query / jnp.sqrt(head_dim).astype(self.dtype), key, value)
      return per_token(output, jnp.swapaxes(attended, 1, 2))
    if fused is not None:
      return per_token(output, jax.nn.dot_product_attention(
          query, key, value, scale=head_dim ** -0.5, implementation=fused))

    temperature = (self.param("temperature",
                              nn.initializers.constant(head_dim ** 0.5), (),
                              self.param_dtype)
                   if self.locality else jnp.sqrt(head_dim))
    query = query / temperature.astype(self.dtype)
    logits = jnp.einsum("bhqd,bhkd->bhqk", query, key).astype(jnp.float32)
    if self.locality:  # a token does not attend to itself
      logits = jnp.where(jnp.eye(*logits.shape[-2:], dtype=bool),
                         jnp.finfo(jnp.float32).min, logits)
    weights = attention.softmax(logits)
    self.sow("intermediates", "attention_weights", weights)
    weights = nn.Dropout(self.attention_dropout_rate)(
        weights, deterministic=deterministic, rng=dropout_key
    ).astype(self.dtype)
    attended = jnp.einsum("bhqk,bhkd->bhqd", weights, value)
    return per_token(output, jnp.swapaxes(attended, 1, 2))


class Encoder1DBlock(nn.Module):
  """Pre-LN transformer block. (B, T, D) -> (B, T, D).

  With num_query_tokens=n it returns only the first n tokens, (B, n, D),
  and computes nothing for the others beyond their keys and values.
  drop_path_uniforms (2, B), if given, are the [0, 1) draws that decide
  the drop path of the attention and the MLP branch (see `drop_path`).
  """
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  drop_path_rate: float | jax.Array = 0.0
  locality_attention: bool = False
  attention_implementation: str = "auto"
  approximate_gelu: bool = True
  layer_norm_epsilon: float = 1e-6
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, deterministic: bool,
               num_query_tokens: Optional[int] = None,
               drop_path_uniforms: Optional[jax.Array] = None,
               dropout_key: Optional[jax.Array] = None) -> jax.Array:
    uniforms = ((None, None) if drop_path_uniforms is None
                else tuple(drop_path_uniforms))
    attention_key, residual_key, mlp_key = _split(dropout_key, 3)
    norm = lambda name: nn.LayerNorm(
        epsilon=self.layer_norm_epsilon, dtype=self.dtype,
        param_dtype=self.param_dtype, name=name)
    y = per_token(norm("LayerNorm_0"), x)
    y = MultiHeadSelfAttention(
        num_heads=self.num_heads,
        attention_dropout_rate=self.attention_dropout_rate,
        locality=self.locality_attention,
        implementation=self.attention_implementation,
        dtype=self.dtype, param_dtype=self.param_dtype,
        name="MultiHeadDotProductAttention_1")(
            y, deterministic=deterministic, num_query_tokens=num_query_tokens,
            dropout_key=attention_key)
    if num_query_tokens is not None:
      x = x[:, :num_query_tokens]
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic,
                                      rng=residual_key)
    x = x + options.drop_path(self, y, self.drop_path_rate, deterministic,
                              uniforms[0])

    y = per_token(norm("LayerNorm_2"), x)
    y = per_token(functools.partial(MlpBlock(
        mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate,
        approximate_gelu=self.approximate_gelu, dtype=self.dtype,
        param_dtype=self.param_dtype, name="MlpBlock_3"),
        deterministic=deterministic, dropout_key=mlp_key), y)
    return x + options.drop_path(self, y, self.drop_path_rate, deterministic,
                                 uniforms[1])


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
  scan_blocks: bool = False
  remat_blocks: bool = False
  num_output_tokens: Optional[int] = None
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
        layer_norm_epsilon=self.layer_norm_epsilon, dtype=self.dtype,
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


class PositionEmbedding(nn.Module):
  """Learned 1-D position embedding, (1, num_tokens, D), normal(0.02) init."""
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, num_tokens: int, hidden_size: int) -> jax.Array:
    return self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                      (1, num_tokens, hidden_size), self.param_dtype)


class VisionTransformer(nn.Module):
  """ViT classifier: images (B, H, W, C) -> logits (B, num_classes), float32.

  Attributes:
    num_classes: size of the classifier output.
    patch_size: side of the square patches; must divide the image height and
      width. The patch embedding is a Conv with kernel = stride = patch_size.
    hidden_size: token width D.
    num_layers: number of encoder blocks.
    num_heads: attention heads per block; must divide hidden_size.
    mlp_dim: hidden width of each block's MLP.
    dropout_rate: dropout after the position embedding, in the MLP and after
      attention.
    attention_dropout_rate: dropout on the attention probabilities.
    classifier: "token" (prepend a learnable class token and classify it) or
      "gap" (no class token; classify the mean of the patch tokens).
    posemb: "learn" (the paper's learned 1-D embedding, one per token
      including the class token) or "sincos2d" (fixed 2-D sine-cosine
      embedding of the patch grid, no parameters, none on the class token;
      helps small data).
    drop_path_rate: stochastic depth: the residual branches of the last
      block are dropped per example with this rate, earlier blocks linearly
      less (0 for the first).
    patch_dropout_rate: PatchDropout (Liu et al. 2023, "PatchDropout:
      Economizing Vision Transformers Using Patch Dropout"): in training,
      each image drops this fraction of its patches (random, its own; the
      class token stays), so the encoder costs less per image, attention
      quadratically less. The patches are dropped before they are
      embedded, which gives the same tokens as dropping embedded tokens
      for less work. Evaluation sees every patch.
    shifted_patches: Shifted Patch Tokenization (Lee et al. 2021, "Vision
      Transformer for Small-Size Datasets"): the image and four copies
      shifted diagonally by half a patch are stacked on the channel axis,
      each patch of that stack is layer-normalised (`embedding_norm`) and
      then embedded, so every token also sees the edges of its neighbours.
      The embedding kernel is (P, P, 5 * C, D).
    locality_attention: Locality Self-Attention (same paper): a learned
      softmax temperature per block and no attention of a token to itself.
    attention_implementation: the attention core's kernel, one of
      `attention.IMPLEMENTATIONS`: "auto" (default) runs cuDNN's fused
      flash attention on a CUDA GPU of compute capability >= 8.0 computing
      in bfloat16/float16 (no (B, heads, T, T) probabilities in memory),
      the model's einsums elsewhere (on XLA:CPU as fast as
      `jax.nn.dot_product_attention`); "einsum", "xla" or "cudnn" force one.
      Capturing attention maps always uses the einsums.
    representation_size: if set, a Dense + tanh "pre-logits" layer of this
      width before the head (the paper's pre-training head).
    approximate_gelu: tanh-approximate GELU, as in the official JAX code and
      its checkpoints; False gives the exact erf GELU of PyTorch models.
    layer_norm_epsilon: LayerNorm epsilon; 1e-6 as in the official code,
      torchvision and timm; Hugging Face ViT checkpoints use 1e-12.
    scan_blocks: run the encoder blocks as one `jax.lax.scan` body, traced
      once whatever the depth (the usual cure for deep models' compile time
      on GPU/TPU; on XLA:CPU compiling was slower, and scan alone needs
      more memory). Same parameters and outputs.
    remat_blocks: recompute each block's activations in the backward pass
      instead of storing them: about 15% less speed for the activation
      memory of one block instead of all (large models; ViT-H/14's train
      step scratch 4.3x less, benchmarks/scan_remat.py). Alone it is a
      custom VJP tied to the output gradient; with scan_blocks,
      `jax.checkpoint` of the scan body.
    dtype: compute dtype (bfloat16 on GPU/TPU); logits are returned float32.
    param_dtype: dtype the parameters are stored in (keep float32).
  """
  num_classes: int
  patch_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  classifier: str = "token"
  posemb: str = "learn"
  drop_path_rate: float = 0.0
  patch_dropout_rate: float = 0.0
  shifted_patches: bool = False
  locality_attention: bool = False
  attention_implementation: str = "auto"
  representation_size: Optional[int] = None
  approximate_gelu: bool = True
  layer_norm_epsilon: float = 1e-6
  scan_blocks: bool = False
  remat_blocks: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, images: jax.Array, *, train: bool = False) -> jax.Array:
    self._check_input(images)
    batch, height, width, _ = images.shape
    grid_h, grid_w = height // self.patch_size, width // self.patch_size
    patch_indices = None  # all patches, in grid order
    # Not at initialisation: the position embedding is made for every patch.
    if train and self.patch_dropout_rate and not self.is_initializing():
      patch_indices = options.kept_patches(
          self.make_rng("dropout"), batch, grid_h * grid_w,
          self.patch_dropout_rate)
    x = images.astype(self.dtype)
    if self.shifted_patches:
      x = options.embed_shifted_patches(
          x, patch_indices, patch_size=self.patch_size,
          hidden_size=self.hidden_size, epsilon=self.layer_norm_epsilon,
          dtype=self.dtype, param_dtype=self.param_dtype)
    else:
      x = self._embed_patches(x, patch_indices)
    hidden = x.shape[-1]  # x: (B, N or K, D)
    self.sow("intermediates", "patch_tokens", x)
    if self.posemb == "sincos2d":
      table = options.sincos_2d_posemb(grid_h, grid_w, hidden)[0]  # (N, D)
      if patch_indices is not None:
        table = jnp.take(table, patch_indices, axis=0)  # (B, K, D)
      x = x + table.astype(x.dtype)

    if self.classifier == "token":
      cls = self.param("cls", nn.initializers.zeros, (1, 1, hidden),
                       self.param_dtype)
      cls = jnp.broadcast_to(cls.astype(x.dtype), (batch, 1, hidden))
      x = jnp.concatenate([cls, x], axis=1)  # (B, N+1, D)
      self.sow("intermediates", "with_class_token", x)

    x = Encoder(
        num_layers=self.num_layers, num_heads=self.num_heads,
        mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate,
        attention_dropout_rate=self.attention_dropout_rate,
        drop_path_rate=self.drop_path_rate,
        num_prefix_tokens=int(self.classifier == "token"),
        learned_posemb=self.posemb == "learn",
        locality_attention=self.locality_attention,
        attention_implementation=self.attention_implementation,
        approximate_gelu=self.approximate_gelu,
        layer_norm_epsilon=self.layer_norm_epsilon,
        scan_blocks=self.scan_blocks, remat_blocks=self.remat_blocks,
        # Only the class token is classified: the last block need not
        # compute the others (same logits, ~7% fewer FLOPs at 12 layers).
        num_output_tokens=1 if self.classifier == "token" else None,
        dtype=self.dtype, param_dtype=self.param_dtype, name="Transformer")(
            x, deterministic=not train, patch_indices=patch_indices)

    x = x[:, 0] if self.classifier == "token" else jnp.mean(x, axis=1)
    self.sow("intermediates", "pooled", x)
    if self.representation_size is not None:
      x = nn.Dense(self.representation_size, dtype=self.dtype,
                   param_dtype=self.param_dtype, name="pre_logits")(x)
      x = jnp.tanh(x)
    # The vector the head reads (after pre-logits, if any). Not named
    # "pre_logits": that is the Dense layer's scope.
    self.sow("intermediates", "features", x)
    logits = nn.Dense(self.num_classes, dtype=self.dtype,
                      param_dtype=self.param_dtype,
                      kernel_init=nn.initializers.zeros, name="head")(x)
    return logits.astype(jnp.float32)

  def _embed_patches(self, images: jax.Array,
                     patch_indices: Optional[jax.Array]) -> jax.Array:
    """The paper's patch embedding, a Conv with kernel = stride = P:
    (B, H, W, C) -> (B, N, D), or (B, K, D) for the patches patch_indices
    (B, K), embedded by the same Conv laid side by side in a strip."""
    embed = nn.Conv(self.hidden_size, (self.patch_size, self.patch_size),
                    strides=(self.patch_size, self.patch_size),
                    padding="VALID", dtype=self.dtype,
                    param_dtype=self.param_dtype, name="embedding")
    if patch_indices is None:
      x = embed(images)  # (B, H/P, W/P, D)
      return x.reshape(x.shape[0], -1, x.shape[-1])
    patches = options.patches(images, self.patch_size,
                              patch_indices)  # (B, K, P, P, C)
    batch, num_kept, patch, _, channels = patches.shape
    strip = patches.transpose(0, 2, 1, 3, 4).reshape(
        batch, patch, num_kept * patch, channels)  # (B, P, K * P, C)
    return embed(strip).reshape(batch, num_kept, self.hidden_size)

  def _check_input(self, images: jax.Array) -> None:
    """Raises ViTInputError, before any computation, for unusable inputs."""
    if self.classifier not in CLASSIFIERS:
      raise ViTInputError(f"Unknown classifier {self.classifier!r}; choose "
                          f"one of {CLASSIFIERS}.")
    if self.posemb not in POSITION_EMBEDDINGS:
      raise ViTInputError(f"Unknown posemb {self.posemb!r}; choose one of "
                          f"{POSITION_EMBEDDINGS}.")
    if images.ndim != 4:
      raise ViTInputError(
          f"Expected images of shape (batch, height, width, channels), got "
          f"shape {images.shape} (rank {images.ndim}). Add a batch axis with "
          "images[None] or a channel axis with images[..., None].")
    _, height, width, channels = images.shape
    if height % self.patch_size or width % self.patch_size:
      raise ViTInputError(
          f"Image size {height}x{width} is not divisible by patch_size "
          f"{self.patch_size}. Resize or crop the images to a multiple of "
          f"{self.patch_size}, or pick a patch_size that divides both sides.")
    posemb = self.variables.get("params", {}).get("Transformer", {}).get(
        "posembed_input")
    if posemb is not None:
      num_tokens = (int(self.classifier == "token") +
                    (height // self.patch_size) * (width // self.patch_size))
      if posemb["pos_embedding"].shape[1] != num_tokens:
        raise ViTInputError(
            f"The input gives {num_tokens} tokens but the position embedding "
            f"holds {posemb['pos_embedding'].shape[1]}: the image size "
            "differs from the one the model was initialised with. Resize "
            "images to that size, or resize the position embedding to the "
            "new grid before fine-tuning.")
    if self.has_variable("params", "embedding"):
      expected = self.variables["params"]["embedding"]["kernel"].shape[2]
      expected //= 5 if self.shifted_patches else 1
      if channels != expected:
        raise ViTInputError(
            f"Images have {channels} channels but the model was initialised "
            f"with {expected}. Convert the images (e.g. grayscale <-> RGB) or "
            "initialise the model with images of this channel count.")
