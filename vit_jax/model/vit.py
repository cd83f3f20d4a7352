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

The modules, top down, one file each: `VisionTransformer` (here: patch
embedding, class token, head), `encoder.Encoder` (position embedding, the
blocks, final LayerNorm), `blocks.Encoder1DBlock` and `blocks.MlpBlock`,
`self_attention.MultiHeadSelfAttention`. The options beyond the paper
(patch dropout, shifted patches, 2-D sin-cos position embeddings, drop
path) are in `options`, the speed paths in `vit_jax.kernels`.
"""

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.model import options
from vit_jax.model.encoder import Encoder
from vit_jax.model.options import ViTInputError

Dtype = Any
CLASSIFIERS = ("token", "gap")
POSITION_EMBEDDINGS = ("learn", "sincos2d")


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
      its checkpoints (in float32 on a CPU, a C++ kernel computes it:
      `kernels.cpu_gelu`); False gives the exact erf GELU of PyTorch
      models.
    layer_norm_epsilon: LayerNorm epsilon; 1e-6 as in the official code,
      torchvision and timm; Hugging Face ViT checkpoints use 1e-12.
    layer_norm_implementation: the encoder blocks' LayerNorms, one of
      `cpu_layer_norm.IMPLEMENTATIONS`: "auto" (default) runs float32
      LayerNorms on a CPU as a C++ kernel where the kernels build
      (`kernels.cpu_layer_norm`; the ViT-Ti/16 @224 train step 9% faster
      on an Intel Xeon), Flax's `nn.LayerNorm` elsewhere; "cpu_kernel" or
      "xla" force one. Same parameters and values, up to float rounding.
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
    matmul_dtype: None (the default: the matmuls compute in `dtype`) or
      bfloat16: the encoder's Dense products (attention's projections, the
      MLP) and, with the CPU attention kernel, the attention core's
      products read their operands rounded to bfloat16 and accumulate in
      float32, forward and backward, while everything else (softmax,
      LayerNorm, GELU) computes in `dtype`. For float32 training on CPUs
      with bfloat16 dot instructions (AVX512_BF16, AMX), jitted with
      `kernels.xla_products.xla_compiler_options(matmul_dtype)`: 1.1-1.2x faster
      train steps on an AVX512_BF16 CPU, 1.7x on an AMX one
      (docs/performance.md, *bfloat16 products on a CPU*); slower on CPUs
      without them.
    matmul_implementation: the encoder's Dense products, one of
      `matmuls.IMPLEMENTATIONS`: "auto" (default) runs float32 products on
      a CPU through oneDNN's sgemm where it loads (`kernels.cpu_gemm`; the
      ViT-Ti/16 @224 train step 7% faster than with XLA's own dots on an
      Intel Xeon) and bfloat16 operands through oneDNN's bfloat16 gemm on
      CPUs with AVX512_BF16 and no AMX (ViT-B/16 @224 on a Zen 4: 1.15x
      faster training, 1.43x inference than YNNPACK's); XLA's dots
      elsewhere (YNNPACK's on AMX); "onednn" or "xla" force one. Same
      parameters and values, up to float rounding.
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
  layer_norm_implementation: str = "auto"
  scan_blocks: bool = False
  remat_blocks: bool = False
  matmul_dtype: Optional[Dtype] = None
  matmul_implementation: str = "auto"
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
        layer_norm_implementation=self.layer_norm_implementation,
        scan_blocks=self.scan_blocks, remat_blocks=self.remat_blocks,
        # Only the class token is classified: the last block need not
        # compute the others (same logits, ~7% fewer FLOPs at 12 layers).
        num_output_tokens=1 if self.classifier == "token" else None,
        matmul_dtype=self.matmul_dtype,
        matmul_implementation=self.matmul_implementation, dtype=self.dtype,
        param_dtype=self.param_dtype, name="Transformer")(
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
