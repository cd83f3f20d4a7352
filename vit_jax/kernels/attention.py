"""Which kernel computes softmax(Q K^T / sqrt(d)) V: the model's own einsums,
vit_jax's C++ kernel for XLA:CPU (`vit_jax.kernels.cpu_attention`) or
`jax.nn.dot_product_attention` (XLA's, or cuDNN's fused flash attention).

`MultiHeadSelfAttention` asks `fused_implementation` each time it is traced. The
choice changes neither the parameters nor (beyond float rounding) the values.

  "auto"    cuDNN's flash attention where it runs (a CUDA GPU of compute
            capability 8.0 or later, bfloat16/float16 compute, head_dim a
            multiple of 8 up to 128; odd token counts padded by one, see
            `dot_product_attention`): no (B, heads, T, T) probabilities in
            memory. On a CPU in float32 with head_dim a
            multiple of 16, the C++ kernel where it builds. Elsewhere the
            einsums: on XLA:CPU `jax.nn.dot_product_attention` was no
            faster (docs/performance.md, *Attention kernel*), and in JAX
            0.10 its own default is XLA's path.
  "einsum"  always the einsums.
  "cpu_kernel" the C++ kernel; an error where it cannot run.
  "xla"     `jax.nn.dot_product_attention(implementation="xla")`.
  "cudnn"   `jax.nn.dot_product_attention(implementation="cudnn")`; an
            error where cuDNN cannot run it.

The einsums' softmax is `softmax`, below: it keeps only its output for
the backward pass. Attention maps (the `intermediates` collection) need
the probabilities, so capturing them always takes the einsums. Dropout on
the probabilities and Locality Self-Attention's diagonal mask exist only
there too: "auto" then takes the einsums, the other kernels raise.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from vit_jax.kernels import cpu_attention

IMPLEMENTATIONS = ("auto", "einsum", "cpu_kernel", "xla", "cudnn")
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_problem(dtype: Any, head_dim: int, device: Any = None
                  ) -> Optional[str]:
  """Why cuDNN's flash attention cannot run this attention on `device`
  (default: JAX's first device), or None if it can."""
  device = jax.devices()[0] if device is None else device
  capability = getattr(device, "compute_capability", None)  # CUDA only
  if device.platform != "gpu" or capability is None:
    return f"it needs a CUDA GPU, and this device is {device.platform!r}"
  if tuple(int(part) for part in str(capability).split(".")) < (8, 0):
    return (f"it needs a GPU of compute capability 8.0 or later, and this "
            f"one has {capability}")
  if jnp.dtype(dtype) not in _CUDNN_DTYPES:
    return (f"it computes in bfloat16 or float16, and the model computes in "
            f"{jnp.dtype(dtype).name} (config.model.dtype)")
  if head_dim % 8 or head_dim > 128:
    return (f"it needs head_dim (hidden_size / num_heads) a multiple of 8 up "
            f"to 128, and it is {head_dim}")
  return None


def fused_implementation(requested: str, dtype: Any, head_dim: int, *,
                         capturing: bool = False, dropout: bool = False,
                         locality: bool = False, device: Any = None
                         ) -> Optional[str]:
  """The `implementation` to pass to `jax.nn.dot_product_attention`,
  "cpu_kernel" for `cpu_attention.self_attention` (and `query_attention`),
  or None for the einsums.

  requested: one of IMPLEMENTATIONS; dtype: the compute dtype; head_dim:
  hidden_size / num_heads; capturing: attention maps are being captured;
  dropout: dropout on the probabilities is active (training, rate > 0);
  locality: Locality Self-Attention.
  """
  if requested not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown attention_implementation {requested!r}; "
                     f"choose one of {IMPLEMENTATIONS}.")
  if requested == "einsum" or capturing:
    return None
  unsupported = ("attention dropout" if dropout else
                 "locality_attention" if locality else None)
  if requested == "auto":
    if unsupported:
      return None
    if not cudnn_problem(dtype, head_dim, device):
      return "cudnn"
    if not cpu_attention.problem(dtype, head_dim, device):
      return "cpu_kernel"
    return None
  if unsupported:
    raise ValueError(
        f"attention_implementation={requested!r} does not support "
        f"{unsupported}; use 'auto' or 'einsum' (the model's own einsums).")
  problem = {"cudnn": cudnn_problem,
             "cpu_kernel": cpu_attention.problem,
             "xla": lambda *_: None}[requested](dtype, head_dim, device)
  if problem:
    raise ValueError(
        f"attention_implementation={requested!r} cannot run here: "
        f"{problem}. Use 'auto', which takes cuDNN or the CPU kernel where "
        "they can run and the einsums elsewhere.")
  return requested


def needs_even_tokens(implementation: Optional[str]) -> bool:
  """Whether `implementation` must get even token counts (see
  `dot_product_attention`): cuDNN's. The model then pads the tokens it
  projects by one where a count is odd."""
  return implementation == "cudnn"


def pad_to_even(tokens: jax.Array) -> jax.Array:
  """tokens (B, T, ...) with a zero token appended where T is odd."""
  padding = [(0, 0)] * tokens.ndim
  padding[1] = (0, tokens.shape[1] % 2)
  return jnp.pad(tokens, padding)


def dot_product_attention(query: jax.Array, key: jax.Array,
                          value: jax.Array, implementation: str,
                          key_tokens: Optional[int] = None) -> jax.Array:
  """softmax(Q K^T / sqrt(head_dim)) V by `jax.nn.dot_product_attention`.

  query: (B, Tq, heads, head_dim); key, value: (B, Tk, heads, head_dim);
  returns (B, Tq, heads, head_dim). implementation: "xla" or "cudnn".
  key_tokens: only the first key_tokens keys count, the rest are padding
  (masked out by cuDNN's padding mask, `key_value_seq_lengths`, which
  needs no bias); None: all of them.

  Why padding: JAX 0.11's cuDNN path raises "Unsupported sequence length
  Q 197, KV 197" when it differentiates odd token counts (its check takes
  the placeholder of an absent bias for a bias), and every class-token ViT
  at 224 px has 197 tokens (the last block's class-token queries: 1). So
  where `needs_even_tokens`, the model pads the tokens it projects to
  even counts (`pad_to_even`) and drops the padded queries after the
  output projection.
  """
  lengths = None
  if key_tokens is not None and key_tokens != key.shape[1]:
    # From key itself, so that it is split over the batch like key is.
    lengths = jnp.full_like(key[:, 0, 0, 0], key_tokens, jnp.int32)
  return jax.nn.dot_product_attention(
      query, key, value, scale=query.shape[-1] ** -0.5,
      key_value_seq_lengths=lengths, implementation=implementation)


def _row_max(x: jax.Array) -> jax.Array:
  """max over the last axis, keepdims: the values of jnp.max(x, -1,
  keepdims=True).

  Why not jnp.max: XLA:CPU rewrites a reduction over more than 32 elements
  into a padded reduce-window of 32-wide windows and a second reduce (for
  the precision of long sums), and that reduce-window ran 4x slower than a
  plain loop: 0.83 against 0.21 ms for the row maxima of a (16, 3, 197,
  197) array on one core. It leaves reductions with several outputs alone,
  so this computes the maximum twice in one reduction and keeps both.
  """
  axis = x.ndim - 1
  init = jnp.array(-jnp.inf, x.dtype)
  first, second = jax.lax.reduce(
      (x, x), (init, init),
      lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])),
      (axis,))
  # Both outputs used, or XLA drops one and the rewrite applies again.
  return jnp.expand_dims(jnp.maximum(first, second), axis)


@jax.custom_vjp
def softmax(logits: jax.Array) -> jax.Array:
  """softmax over the last axis; its gradient keeps only the output.

  The same values as `jax.nn.softmax` up to float rounding. Under
  differentiation the probabilities are computed as exp(shifted -
  log(sum(exp(shifted)))), shifted = logits - max(logits), and the backward
  pass reads only them: d logits = p * (g - sum(g * p)), g the gradient of
  p. Why: for jax.nn.softmax XLA:CPU materialises exp(logits - max), keeps
  it for the backward pass and recomputes p from it there, while p itself
  is kept for the gradient of the weighted sum of values: two (B, heads,
  T, T) arrays per block. With the exponential inside p's own kernel (exp
  is too costly for XLA to duplicate into the backward pass) only p is
  kept: a ViT-Ti/16 @224 train step's scratch per device (batch 16) went
  from 511 to 432 MiB, at the same speed. Without differentiation it is
  jax.nn.softmax's arithmetic (one exp per logit).
  """
  unnormalized = jnp.exp(logits - _row_max(logits))
  return unnormalized / jnp.sum(unnormalized, axis=-1, keepdims=True)


def _softmax_forward(logits):
  # log(sum) after the shift: it is at most log(T), so rounding it costs
  # p as little as jax.nn.softmax's division (logsumexp itself would carry
  # the rounding of |max logit| into every exponent).
  shifted = logits - _row_max(logits)
  log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
  probabilities = jnp.exp(shifted - log_sum)
  return probabilities, probabilities


def _softmax_backward(probabilities, output_grad):
  return (probabilities * (output_grad - jnp.sum(
      output_grad * probabilities, axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_forward, _softmax_backward)
