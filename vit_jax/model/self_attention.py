"""Multi-head self-attention, the paper's attention sub-layer (Eq. 2 of
Dosovitskiy et al., 2020), with the official checkpoints' parameter layout.

The projections run as one matmul (as three for cuDNN's attention, of
tokens padded to an even count); the attention core runs as the einsums
here or as a fused kernel from `vit_jax.kernels` (`implementation`).
"""

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.kernels import attention, cpu_attention, matmuls
from vit_jax.kernels.matmuls import per_token
from vit_jax.model.options import ViTInputError

Dtype = Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_projections(stacked: jax.Array, order: tuple[int, ...]
                      ) -> list[jax.Array]:
  """(B, T, P, heads, head_dim) -> P arrays, each the stacked array's slice
  at P, laid out by `order` (a permutation of the 5 axes starting with 2).

  The same values as list(jnp.transpose(stacked, order)). The gradient is
  written its own way: JAX's transpose of the slices is P zero-paddings
  summed, which XLA:CPU ran as one fusion of pads and adds at 1.8 ms for
  ViT-Ti/16's (16, 3, 197, 64) x 3 on a core; each cotangent transposed
  back and then stacked took 0.5-0.7 ms (docs/performance.md).
  """
  return list(jnp.transpose(stacked, order))


def _split_forward(stacked, order):
  return split_projections(stacked, order), None


def _split_backward(order, _, cotangents):
  # A slice's own axes (B, T, heads, head_dim) as `order` lays them out.
  part_order = [axis if axis < 2 else axis - 1 for axis in order[1:]]
  inverse = [part_order.index(axis) for axis in range(4)]
  return (jnp.stack([jnp.transpose(cotangent, inverse)
                     for cotangent in cotangents], axis=2),)


split_projections.defvjp(_split_forward, _split_backward)


def _concatenate_columns(kernels: list[jax.Array]) -> jax.Array:
  """The (D, n_i) kernels side by side, (D, sum n_i), in their own dtype,
  for XLA's products (oneDNN's read them apart).

  Bfloat16 kernels (`model.inference`) are joined as their bits: XLA:CPU
  runs a bfloat16 concatenation in float32, five thunks a block (each
  kernel converted up, the concatenation, the result converted down)
  where this takes one (a batch-1 `vit_tiny_cifar` forward pass 8-9%
  faster on a Zen 5, docs/performance.md)."""
  if len(kernels) == 1:
    return kernels[0]
  if any(kernel.dtype != jnp.bfloat16 for kernel in kernels):
    return jnp.concatenate(kernels, axis=1)
  return _joined_bits(tuple(kernel.shape[1] for kernel in kernels), *kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _joined_bits(widths: tuple[int, ...], *kernels: jax.Array) -> jax.Array:
  """Bfloat16 (D, widths[i]) kernels concatenated as 16-bit integers. Its
  own gradient, the cotangent's columns split: JAX's would be zero, as
  through any integer."""
  del widths  # the backward pass's
  bits = [jax.lax.bitcast_convert_type(kernel, jnp.uint16)
          for kernel in kernels]
  return jax.lax.bitcast_convert_type(jnp.concatenate(bits, axis=1),
                                      jnp.bfloat16)


def _joined_bits_forward(widths, *kernels):
  return _joined_bits(widths, *kernels), None


def _joined_bits_backward(widths, _, joined_grad):
  starts = [sum(widths[:i]) for i in range(1, len(widths))]
  return tuple(jnp.split(joined_grad, starts, axis=1))


_joined_bits.defvjp(_joined_bits_forward, _joined_bits_backward)


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
  matmul_dtype: Optional[Dtype] = None
  matmul_implementation: str = "auto"
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
        locality=self.locality)

    query_tokens = num_query_tokens or x.shape[1]
    products = matmuls.resolve_implementation(
        self.matmul_implementation, self.dtype, self.matmul_dtype)
    grouped = products == "onednn"  # rows in groups: matmuls.per_token
    output = nn.DenseGeneral(
        hidden_size, axis=(-2, -1), dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=nn.initializers.xavier_uniform(),
        dot_general=functools.partial(
            matmuls.dense_dot_general, operand_dtype=self.matmul_dtype,
            implementation=products),
        name="out")
    if fused == "cpu_kernel":
      attended = self._cpu_kernel_core(x, projections, num_query_tokens,
                                       products)
      return per_token(output, attended, grouped)
    query, key, value = self._queries_keys_values(
        x, projections, num_query_tokens, fused, products)
    if fused is not None:
      attended = attention.dot_product_attention(
          query, key, value, fused, key_tokens=(
              x.shape[1] if attention.needs_even_tokens(fused) else None))
      # Padded queries dropped after the output projection: the slice then
      # fuses into the residual addition that follows.
      return per_token(output, attended, grouped)[:, :query_tokens]
    attended = self._attend(query, key, value, deterministic, dropout_key)
    return per_token(output, jnp.swapaxes(attended, 1, 2), grouped)

  def _queries_keys_values(self, x: jax.Array, projections: dict,
                           num_query_tokens: Optional[int],
                           fused: Optional[str], products: str
                           ) -> list[jax.Array]:
    """q, k and v, their bias added, laid out by `_split`; q only for the
    first num_query_tokens tokens where it is given."""
    if attention.needs_even_tokens(fused):
      return self._padded_queries_keys_values(x, projections,
                                              num_query_tokens, fused,
                                              products)
    if num_query_tokens is None:
      return self._split(self._project(
          x, [projections[n] for n in ("query", "key", "value")], products),
                         fused)
    (query,) = self._split(self._project(
        x[:, :num_query_tokens], [projections["query"]], products), fused)
    key, value = self._split(self._project(
        x, [projections["key"], projections["value"]], products), fused)
    return [query, key, value]

  def _padded_queries_keys_values(self, x: jax.Array, projections: dict,
                                  num_query_tokens: Optional[int],
                                  fused: str, products: str
                                  ) -> list[jax.Array]:
    """q, k and v for cuDNN, each (B, T', heads, head_dim) with T' the
    token count made even (`attention.pad_to_even`), each from its own
    product of the padded tokens.

    Why three products, not the one of `_project`: padding the fused
    product's output left a slice fusion a block that cut k and v apart,
    ~6% of ViT-L/16's forward pass on an H200. Three products of the
    tokens padded once run 1.074x faster there (ViT-B/16 1.032x) and
    train level (docs/gpu.md, 2026-12-04)."""
    keys_from = attention.pad_to_even(x)
    queries_from = (keys_from if num_query_tokens is None else
                    attention.pad_to_even(x[:, :num_query_tokens]))
    return [self._split(self._project(tokens, [projections[name]], products),
                        fused)[0]
            for name, tokens in (("query", queries_from), ("key", keys_from),
                                 ("value", keys_from))]

  def _cpu_kernel_core(self, x: jax.Array, projections: dict,
                       num_query_tokens: Optional[int], products: str
                       ) -> jax.Array:
    """The attention core by vit_jax's C++ kernel, which reads the
    projections in the layout their matmul writes and adds their bias
    itself (`cpu_attention`): (B, Tq, heads, head_dim)."""
    bias = jnp.stack([projections[name][1].astype(self.dtype)
                      for name in ("query", "key", "value")]).reshape(
                          3, self.num_heads, -1)
    scale = 1 / bias.shape[-1] ** 0.5
    if num_query_tokens is None:
      stacked = self._project(
          x, [projections[n] for n in ("query", "key", "value")], products,
          add_bias=False)
      return cpu_attention.self_attention(stacked, bias, scale,
                                          self.matmul_dtype)
    queries = self._project(x[:, :num_query_tokens], [projections["query"]],
                            products, add_bias=False)
    keys_values = self._project(
        x, [projections["key"], projections["value"]], products,
        add_bias=False)
    return cpu_attention.query_attention(queries[:, :, 0], keys_values, bias,
                                         scale, self.matmul_dtype)

  def _project(self, inputs: jax.Array,
               projections: list[tuple[jax.Array, jax.Array]],
               products: str, add_bias: bool = True) -> jax.Array:
    """(B, T, D) -> (B, T, P, heads, head_dim): the P projections from one
    matmul, (B*T, D) @ (D, P*D), which runs faster on XLA:CPU than P of
    (D, D); their bias added unless add_bias is False. oneDNN's products
    read the P kernels where they lie (`matmuls.side_by_side_matmul`),
    XLA's a concatenation of them."""
    kernels = [kernel for kernel, _ in projections]
    bias = jnp.concatenate([bias for _, bias in projections])
    if products == "onednn":
      inputs, bias, *kernels = nn.dtypes.promote_dtype(
          inputs, bias, *kernels, dtype=self.dtype)
      product = lambda tokens: matmuls.side_by_side_matmul(
          tokens, kernels, self.matmul_dtype)
    else:
      inputs, kernel, bias = nn.dtypes.promote_dtype(
          inputs, _concatenate_columns(kernels), bias, dtype=self.dtype)
      product = lambda tokens: matmuls.dense_dot_general(
          tokens, kernel, (((tokens.ndim - 1,), (0,)), ((), ())),
          operand_dtype=self.matmul_dtype, implementation=products)
    outputs = per_token(lambda tokens: product(tokens) + (
        bias if add_bias else 0), inputs, products == "onednn")
    return outputs.reshape(*outputs.shape[:2], len(projections),
                           self.num_heads, -1)

  def _split(self, stacked: jax.Array, fused: Optional[str]
             ) -> list[jax.Array]:
    """(B, T, P, heads, head_dim) -> per projection, (B, heads, T,
    head_dim) for the einsums or (B, T, heads, head_dim) for
    `jax.nn.dot_product_attention`.

    Heads first for the einsums: XLA:CPU then runs both products as plain
    batched matmuls. From the token-major layout it computed the weighted
    sum as V^T P^T, at half the rate of Q K^T (ViT-Ti/16 @224 inference
    5.6% slower; docs/performance.md, *Heads first*). One transpose for all
    projections, not a split and one per projection: 1.8-3.7% faster
    vit_tiny_cifar training steps."""
    token_major = fused in ("xla", "cudnn")
    order = (2, 0, 1, 3, 4) if token_major else (2, 0, 3, 1, 4)
    return split_projections(stacked, order)

  def _attend(self, query: jax.Array, key: jax.Array, value: jax.Array,
              deterministic: bool, dropout_key: Optional[jax.Array]
              ) -> jax.Array:
    """The attention core as the paper writes it, per head:
    softmax(q k^T / sqrt(head_dim)) v. (B, heads, T, head_dim) in and out;
    the query may have fewer tokens than the key and value."""
    head_dim = query.shape[-1]
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
    return jnp.einsum("bhqk,bhkd->bhqd", weights, value)
