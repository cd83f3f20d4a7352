"""The encoder block (pre-LN attention and MLP, Eq. 2-3 of Dosovitskiy et
al., 2020) and its MLP."""

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_layer_norm, gelu_matmul, matmuls
from vit_jax.kernels.matmuls import per_token
from vit_jax.model import options
from vit_jax.model.self_attention import MultiHeadSelfAttention

Dtype = Any


def _split(key: Optional[jax.Array], num: int) -> list[Optional[jax.Array]]:
  """num keys from `key` for a module's dropout sites; all None (each site
  then draws from the "dropout" stream) without one."""
  return [None] * num if key is None else list(jax.random.split(key, num))


# The MLP's Dense layers' initialisers (the official implementation's).
_KERNEL_INIT = nn.initializers.xavier_uniform()
_BIAS_INIT = nn.initializers.normal(stddev=1e-6)


class DenseParameters(nn.Module):
  """The parameters an MLP layer's nn.Dense makes (the official
  checkpoints' names and shapes, the MLP's initialisers) without its
  product, for a function that takes several layers' at once
  (`gelu_matmul.mlp`): in_features -> (kernel (in_features, features),
  bias (features,))."""
  features: int
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, in_features: int) -> tuple[jax.Array, jax.Array]:
    kernel = self.param("kernel", _KERNEL_INIT, (in_features, self.features),
                        self.param_dtype)
    bias = self.param("bias", _BIAS_INIT, (self.features,), self.param_dtype)
    return kernel, bias


class MlpBlock(nn.Module):
  """Dense -> GELU -> dropout -> Dense -> dropout. (..., D) -> (..., D).

  Without dropout between them (rate 0, or at evaluation) the two Dense
  layers and the GELU run as one function, `gelu_matmul.mlp`, which
  recomputes the GELU in the backward pass instead of storing the
  activations (the same values, less memory) and, in the CPU's GELU
  kernel, adds the first layer's bias and sums its gradient in its own
  passes. The parameters are nn.Dense's either way (`Dense_0`, `Dense_1`).
  """
  mlp_dim: int
  dropout_rate: float = 0.0
  approximate_gelu: bool = True
  matmul_dtype: Optional[Dtype] = None
  matmul_implementation: str = "auto"
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, deterministic: bool,
               dropout_key: Optional[jax.Array] = None) -> jax.Array:
    out_dim = x.shape[-1]
    hidden_key, out_key = _split(dropout_key, 2)
    products = matmuls.resolve_implementation(
        self.matmul_implementation, self.dtype, self.matmul_dtype)
    if deterministic or self.dropout_rate == 0.0:
      kernel0, bias0 = DenseParameters(self.mlp_dim, self.param_dtype,
                                       name="Dense_0")(out_dim)
      kernel1, bias1 = DenseParameters(out_dim, self.param_dtype,
                                       name="Dense_1")(self.mlp_dim)
      x, kernel0, bias0, kernel1, bias1 = nn.dtypes.promote_dtype(
          x, kernel0, bias0, kernel1, bias1, dtype=self.dtype)
      x = gelu_matmul.mlp(x, kernel0, bias0, kernel1, self.approximate_gelu,
                          self.matmul_dtype, products) + bias1
    else:
      dense_dot_general = functools.partial(
          matmuls.dense_dot_general, operand_dtype=self.matmul_dtype,
          implementation=products)
      dense = lambda features, name: nn.Dense(
          features, dtype=self.dtype, param_dtype=self.param_dtype,
          kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT,
          dot_general=dense_dot_general, name=name)
      x = dense(self.mlp_dim, "Dense_0")(x)
      x = nn.gelu(x, approximate=self.approximate_gelu)
      x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic,
                                        rng=hidden_key)
      x = dense(out_dim, "Dense_1")(x)
    return nn.Dropout(self.dropout_rate)(x, deterministic=deterministic,
                                         rng=out_key)


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
  layer_norm_implementation: str = "auto"
  matmul_dtype: Optional[Dtype] = None
  matmul_implementation: str = "auto"
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  def _layer_norm(self, name: str) -> nn.Module:
    if cpu_layer_norm.resolve_implementation(
        self.layer_norm_implementation, self.dtype) == "cpu_kernel":
      return cpu_layer_norm.LayerNorm(epsilon=self.layer_norm_epsilon,
                                      param_dtype=self.param_dtype, name=name)
    return nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                        param_dtype=self.param_dtype, name=name)

  @nn.compact
  def __call__(self, x: jax.Array, *, deterministic: bool,
               num_query_tokens: Optional[int] = None,
               drop_path_uniforms: Optional[jax.Array] = None,
               dropout_key: Optional[jax.Array] = None) -> jax.Array:
    uniforms = ((None, None) if drop_path_uniforms is None
                else tuple(drop_path_uniforms))
    attention_key, residual_key, mlp_key = _split(dropout_key, 3)
    products = matmuls.resolve_implementation(
        self.matmul_implementation, self.dtype, self.matmul_dtype)
    grouped = products == "onednn"  # each device's rows a group
    y = per_token(self._layer_norm("LayerNorm_0"), x, grouped)
    y = MultiHeadSelfAttention(
        num_heads=self.num_heads,
        attention_dropout_rate=self.attention_dropout_rate,
        locality=self.locality_attention,
        implementation=self.attention_implementation,
        matmul_dtype=self.matmul_dtype, matmul_implementation=products,
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

    y = per_token(self._layer_norm("LayerNorm_2"), x, grouped)
    y = per_token(functools.partial(MlpBlock(
        mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate,
        approximate_gelu=self.approximate_gelu,
        matmul_dtype=self.matmul_dtype, matmul_implementation=products,
        dtype=self.dtype, param_dtype=self.param_dtype, name="MlpBlock_3"),
        deterministic=deterministic, dropout_key=mlp_key), y, grouped)
    return x + options.drop_path(self, y, self.drop_path_rate, deterministic,
                                 uniforms[1])
