"""The encoder's blocks as one pure function of their parameters.

`run_blocks` applies a stack of identical blocks (`Encoder1DBlock`s, each
free-standing, parent=None) to tokens x (B, T, D), each with its own
parameters, drop-path rate, dropout key and drop-path draws. Every block
goes through `block_function`: one jitted function whose trace serves every
block of a shape, optionally rematerialized and/or run as one
`jax.lax.scan` body. The values are those of applying the blocks in turn;
only tracing, compile time and memory change.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.kernels import helper_threads, matmuls


def apply_block(block: nn.Module, params: Any, x: jax.Array,
                rate: Optional[jax.Array], key: Optional[jax.Array],
                deterministic: bool, num_query_tokens: Optional[int],
                drop_path_uniforms: Optional[jax.Array] = None) -> jax.Array:
  """block (free-standing, parent=None) applied to x (B, T, D) with params;
  rate, if given, replaces its drop-path rate; key feeds its dropout
  (`dropout_key`); drop_path_uniforms (2, B) decide its drop path."""
  if rate is not None:
    block = block.clone(drop_path_rate=rate)
  return block.apply({"params": params}, x, deterministic=deterministic,
                     num_query_tokens=num_query_tokens,
                     drop_path_uniforms=drop_path_uniforms, dropout_key=key)


_STATIC_ARGS = (0, 5, 6)  # the block, deterministic, num_query_tokens


def _zero_cotangent(value: jax.Array):
  if jnp.issubdtype(value.dtype, jnp.inexact):
    return jnp.zeros_like(value)
  return np.zeros(value.shape, jax.dtypes.float0)  # integer or key inputs


# `apply_block`, keeping only its inputs for the backward pass, which
# recomputes the block once the output gradient exists.
_apply_block_rematerialized = jax.custom_vjp(
    apply_block, nondiff_argnums=_STATIC_ARGS)


@helper_threads.on_xla_threads
def _rematerialized_forward(block, params, x, rate, key, deterministic,
                            num_query_tokens, drop_path_uniforms=None):
  return (apply_block(block, params, x, rate, key, deterministic,
                      num_query_tokens, drop_path_uniforms),
          (params, x, rate, key, drop_path_uniforms))


@helper_threads.on_xla_threads
def _rematerialized_backward(block, deterministic, num_query_tokens,
                             inputs, output_grad):
  params, x, rate, key, drop_path_uniforms = inputs
  x = matmuls.tie_to_gradient(x, output_grad)
  _, vjp = jax.vjp(lambda params, x: apply_block(
      block, params, x, rate, key, deterministic, num_query_tokens,
      drop_path_uniforms), params, x)
  params_grad, x_grad = vjp(output_grad)
  # No gradients for the drop-path rate, the dropout key or the draws.
  zeros = lambda tree: jax.tree.map(_zero_cotangent, tree)
  return (params_grad, x_grad, zeros(rate), zeros(key),
          zeros(drop_path_uniforms))


_apply_block_rematerialized.defvjp(_rematerialized_forward,
                                   _rematerialized_backward)


@functools.cache
def block_function(remat: bool, scanned: bool) -> Callable[..., jax.Array]:
  """`apply_block`, rematerialized if asked, and jitted unless it is a
  scan body.

  Remat inside a scan is `jax.checkpoint` (each iteration's recomputation
  is tied to it); outside, `_apply_block_rematerialized`, whose backward
  pass ties the recomputation to the output gradient
  (`matmuls.tie_to_gradient`): `jax.checkpoint` there saved no memory
  under XLA:CPU.

  Why jit: the blocks of a ViT share their shapes, so jit's trace cache
  traces (and lowers) one block and reuses it for the others, and for the
  gradient's blocks: the vit_tiny_cifar train step traces and lowers in
  ~1.5 s instead of 2-2.7 s. XLA inlines the calls, so the compiled step is
  the same. Made once per process, so eager calls reuse it too.
  """
  function = apply_block
  if remat and scanned:
    function = jax.checkpoint(function, prevent_cse=False,
                              static_argnums=_STATIC_ARGS)
  elif remat:
    function = _apply_block_rematerialized
  if scanned:  # traced once anyway, as the scan's body
    return function
  return jax.jit(function, static_argnums=_STATIC_ARGS)


def run_blocks(template: nn.Module, block_params: Sequence[Any],
               x: jax.Array, *, rates: Sequence[Optional[jax.Array]],
               keys: Sequence[Optional[jax.Array]],
               uniforms: Sequence[Optional[jax.Array]], deterministic: bool,
               num_output_tokens: Optional[int], remat: bool, scan: bool
               ) -> jax.Array:
  """The blocks applied in turn to x (B, T, D): block i with
  block_params[i], rates[i], keys[i] and uniforms[i]; the last one
  computes only the first num_output_tokens tokens if that is set (their
  queries, attention output and MLP). With `scan`, all but the last run
  as one `jax.lax.scan` over their stacked parameters."""
  apply = block_function(remat, scan)
  last = len(block_params) - 1
  if scan:
    stack = lambda *leaves: jnp.stack(leaves)
    xs = (jax.tree.map(stack, *block_params[:last]),
          *(None if per_layer[0] is None else jnp.stack(per_layer[:last])
            for per_layer in (rates, keys, uniforms)))

    def body(x, layer_inputs):
      params, rate, key, layer_uniforms = layer_inputs
      return apply(template, params, x, rate, key, deterministic, None,
                   layer_uniforms), None

    x, _ = jax.lax.scan(body, x, xs)
  else:
    for layer in range(last):
      x = apply(template, block_params[layer], x, rates[layer], keys[layer],
                deterministic, None, uniforms[layer])
  return apply(template, block_params[last], x, rates[last], keys[last],
               deterministic, num_output_tokens, uniforms[last])
