"""The attention core's implementations: the einsums, XLA's and cuDNN's
`jax.nn.dot_product_attention`, and which one `attention_implementation`
picks where (the CPU kernel's own tests: test_cpu_attention.py)."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.kernels import attention, cpu_attention
from vit_jax.model import vit

# head_dim 12: 1/sqrt(12) is inexact, so scaling the query first (einsums)
# and the logits after (jax.nn.dot_product_attention) round differently.
_DIMS = dict(num_classes=5, patch_size=4, hidden_size=36, num_layers=2,
             num_heads=3, mlp_dim=48)


def _params_and_images(**overrides):
  """Random params of the model's shapes (not an init's zero head, so every
  parameter matters) and images, drawn in NumPy: nothing to compile."""
  rng = np.random.default_rng(0)
  images = rng.standard_normal((3, 12, 12, 3)).astype(np.float32)
  shapes = jax.eval_shape(vit.VisionTransformer(**_DIMS, **overrides).init,
                          jax.random.key(1), images)
  params = jax.tree.map(
      lambda leaf: 0.3 * rng.standard_normal(leaf.shape).astype(np.float32),
      shapes)
  return params, images


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_xla_dot_product_attention_gives_the_einsums_values(
    classifier, padded, monkeypatch):
  """Logits and gradients agree to float rounding, with the class-token-only
  last block ("token": 10 tokens, 1 query in the last block) and with a
  full one ("gap": 9 tokens); padded: with the tokens padded to even
  counts as for cuDNN, the padding masked out as keys and dropped as
  queries."""
  if padded:
    monkeypatch.setattr(attention, "needs_even_tokens",
                        lambda implementation: implementation == "xla")
    jax.clear_caches()  # blocks traced unpadded by earlier tests trace again
  params, images = _params_and_images(classifier=classifier)

  def logits_and_grads(implementation):  # ((loss, logits), grads)
    model = vit.VisionTransformer(
        **_DIMS, classifier=classifier,
        attention_implementation=implementation)

    def loss(params):
      logits = model.apply(params, images)
      return jnp.sum(jnp.sin(logits)), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, einsum_logits), einsum_grads = logits_and_grads("einsum")
  (_, xla_logits), xla_grads = logits_and_grads("xla")
  assert float(jnp.max(jnp.abs(einsum_logits))) > 0.1  # not trivially equal
  chex.assert_trees_all_close(xla_logits, einsum_logits, atol=1e-5,
                              rtol=1e-5)
  chex.assert_trees_all_close(xla_grads, einsum_grads, atol=1e-5, rtol=1e-4)
  differ = jax.tree.leaves(jax.tree.map(
      lambda a, b: bool(jnp.any(a != b)), xla_grads, einsum_grads))
  assert any(differ), "the two paths should be different computations"


def test_auto_on_cpu_traces_the_einsums_where_the_kernel_cannot_run():
  """head_dim 12 is not a multiple of the CPU kernel's 16 lanes (the kernel
  itself: tests/kernels/test_cpu_attention.py)."""
  params, images = _params_and_images()
  jaxpr = lambda implementation: str(jax.make_jaxpr(
      vit.VisionTransformer(
          **_DIMS, attention_implementation=implementation).apply)(
              params, images))
  assert jaxpr("auto") == jaxpr("einsum")
  assert jaxpr("xla") != jaxpr("einsum")


def test_attention_maps_are_captured_whatever_the_implementation():
  params, images = _params_and_images()
  model = vit.VisionTransformer(**_DIMS, attention_implementation="xla")
  logits, state = model.apply(params, images, mutable=["intermediates"])
  chex.assert_trees_all_close(logits, model.apply(params, images),
                              atol=1e-5, rtol=1e-5)
  weights = state["intermediates"]["Transformer"]["encoderblock_0"][
      "MultiHeadDotProductAttention_1"]["attention_weights"][0]
  chex.assert_shape(weights, (3, 3, 10, 10))  # (B, heads, T, T)
  np.testing.assert_allclose(np.sum(weights, axis=-1), 1.0, rtol=1e-5)


def test_forced_implementations_refuse_what_they_cannot_compute():
  params, images = _params_and_images()
  dropout = vit.VisionTransformer(**_DIMS, attention_dropout_rate=0.1,
                                     attention_implementation="xla")
  dropout.apply(params, images)  # evaluation: no dropout, runs
  with pytest.raises(ValueError, match="attention dropout.*'auto'"):
    dropout.apply(params, images, train=True,
                  rngs={"dropout": jax.random.key(3)})
  with pytest.raises(ValueError, match="needs a CUDA GPU.*'cpu'"):
    vit.VisionTransformer(**_DIMS, attention_implementation="cudnn").apply(
        params, images)
  with pytest.raises(ValueError, match="Unknown attention_implementation"):
    vit.VisionTransformer(**_DIMS, attention_implementation="flash").apply(
        params, images)


@dataclasses.dataclass
class _Device:
  platform: str
  compute_capability: str | None = None


_AMPERE = _Device("gpu", "8.0")


_CPU_KERNEL_PROBLEM = cpu_attention.problem(jnp.float32, 64, _Device("cpu"))
_NEEDS_THE_CPU_KERNEL = pytest.mark.skipif(
    _CPU_KERNEL_PROBLEM is not None,
    reason=f"the CPU kernel cannot run here: {_CPU_KERNEL_PROBLEM}")


@pytest.mark.parametrize("kernel, device, dtype, head_dim, problem", [
    ("cudnn", _AMPERE, jnp.bfloat16, 64, None),
    ("cudnn", _Device("gpu", "9.0"), jnp.float16, 128, None),
    ("cudnn", _AMPERE, jnp.float32, 64, "bfloat16 or float16"),
    ("cudnn", _Device("gpu", "7.5"), jnp.bfloat16, 64,
     "compute capability 8.0"),
    ("cudnn", _AMPERE, jnp.bfloat16, 100, "multiple of 8 up to 128"),
    ("cudnn", _AMPERE, jnp.bfloat16, 136, "multiple of 8 up to 128"),
    ("cudnn", _Device("gpu"), jnp.bfloat16, 64, "CUDA GPU"),  # ROCm
    ("cudnn", _Device("cpu"), jnp.bfloat16, 64, "CUDA GPU"),
    ("cudnn", _Device("tpu"), jnp.bfloat16, 64, "CUDA GPU"),
    pytest.param("cpu_kernel", _Device("cpu"), jnp.float32, 64, None,
                 marks=_NEEDS_THE_CPU_KERNEL),
    pytest.param("cpu_kernel", _Device("cpu"), jnp.float32, 80, None,
                 marks=_NEEDS_THE_CPU_KERNEL),
    ("cpu_kernel", _Device("cpu"), jnp.bfloat16, 64, "computes in float32"),
    ("cpu_kernel", _Device("cpu"), jnp.float32, 12, "multiple of 16"),
    ("cpu_kernel", _Device("gpu"), jnp.float32, 64, "runs on CPUs"),
    ("cpu_kernel", _Device("tpu"), jnp.float32, 64, "runs on CPUs"),
])
def test_auto_takes_a_fused_kernel_exactly_where_it_runs(
    kernel, device, dtype, head_dim, problem):
  choose = lambda requested, **flags: attention.fused_implementation(
      requested, dtype, head_dim, device=device, **flags)
  assert choose("auto") == (None if problem else kernel)
  if problem:
    with pytest.raises(ValueError, match=f"{problem}.*Use 'auto'"):
      choose(kernel)
  else:
    assert choose(kernel) == kernel
    for flags in (dict(capturing=True), dict(dropout=True),
                  dict(locality=True)):
      assert choose("auto", **flags) is None  # the einsums


def test_cudnn_whatever_the_token_counts():
  """Odd counts too (197 tokens; the last block's single class-token
  query): `dot_product_attention` pads them to even for cuDNN."""
  assert attention.fused_implementation(
      "auto", jnp.bfloat16, 64, device=_Device("gpu", "9.0")) == "cudnn"


def _qkv(query_tokens, key_tokens, batch=2, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  shape = lambda tokens: (batch, tokens, 3, 16)  # (B, T, heads, head_dim)
  return (jax.random.normal(keys[0], shape(query_tokens)),
          jax.random.normal(keys[1], shape(key_tokens)),
          jax.random.normal(keys[2], shape(key_tokens)))


@pytest.mark.parametrize("query_tokens, key_tokens",
                         [(197, 197), (1, 197), (3, 8)])
def test_padded_keys_are_masked_out(query_tokens, key_tokens):
  """Padded to even counts with zero tokens and key_tokens given: the
  values and gradients of the unpadded attention (XLA's implementation,
  which takes the same key_value_seq_lengths mask as cuDNN)."""
  qkv = _qkv(query_tokens, key_tokens)
  padded = lambda q, k, v: attention.dot_product_attention(
      *map(attention.pad_to_even, (q, k, v)), "xla",
      key_tokens=key_tokens)[:, :query_tokens]
  plain = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, scale=q.shape[-1] ** -0.5, implementation="xla")
  assert attention.pad_to_even(qkv[1]).shape[1] == key_tokens + key_tokens % 2
  np.testing.assert_allclose(padded(*qkv), plain(*qkv), rtol=1e-5,
                             atol=1e-6)
  loss = lambda attend: lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))
  grads = jax.grad(loss(padded), argnums=(0, 1, 2))(*qkv)
  expected = jax.grad(loss(plain), argnums=(0, 1, 2))(*qkv)
  for grad, reference in zip(grads, expected):
    np.testing.assert_allclose(grad, reference, rtol=1e-4, atol=1e-5)


def test_the_key_mask_splits_over_the_batch_like_the_keys():
  """Sharded over the batch (a device each), masked attention gives the
  unsharded values and keeps the batch split (the mask's lengths are made
  from the keys, so they are split with them)."""
  devices = jax.devices()[:8]
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  qkv = [attention.pad_to_even(x)
         for x in _qkv(197, 197, batch=len(devices), seed=3)]
  attend = jax.jit(lambda q, k, v: attention.dot_product_attention(
      q, k, v, "xla", key_tokens=197))
  sharded = attend(*[jax.device_put(x, split) for x in qkv])
  assert sharded.sharding.is_equivalent_to(split, sharded.ndim)
  np.testing.assert_allclose(sharded, attend(*qkv), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("classifier, calls", [
    # One call per distinct block (the blocks share a trace). 10 tokens:
    # as they are; the last block's single query padded.
    ("token", [(10, 10, False), (2, 10, False)]),
    # 9 tokens: padded to 10, the tenth key masked out.
    ("gap", [(10, 10, True)])])
def test_cudnn_gets_even_token_counts_and_a_key_mask(classifier, calls,
                                                     monkeypatch):
  """What the model hands `jax.nn.dot_product_attention` for cuDNN
  (recorded, then run by XLA's implementation here, where no GPU is): the
  query and key token counts, and whether a key mask comes (its values:
  test_xla_dot_product_attention_gives_the_einsums_values, padded)."""
  assert attention.needs_even_tokens("cudnn")
  recorded = []
  original = jax.nn.dot_product_attention

  def recording(query, key, value, **kwargs):
    recorded.append((query.shape[1], key.shape[1],
                     kwargs.get("key_value_seq_lengths") is not None))
    return original(query, key, value, **{**kwargs, "implementation": "xla"})

  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  monkeypatch.setattr(attention, "needs_even_tokens",
                      lambda implementation: implementation == "xla")
  jax.clear_caches()  # blocks traced by earlier tests trace again
  params, images = _params_and_images(classifier=classifier)
  model = vit.VisionTransformer(**_DIMS, classifier=classifier,
                                attention_implementation="xla")
  assert model.apply(params, images).shape == (3, 5)
  assert recorded == calls


def test_einsums_whenever_probabilities_or_masks_are_needed():
  choose = lambda requested, **flags: attention.fused_implementation(
      requested, jnp.bfloat16, 64, device=_AMPERE, **flags)
  for requested in attention.IMPLEMENTATIONS:  # attention maps: einsums
    assert choose(requested, capturing=True) is None
  assert choose("auto", dropout=True) is None
  assert choose("auto", locality=True) is None
  assert choose("einsum") is None
  assert choose("xla") == "xla"
  for requested in ("xla", "cudnn", "cpu_kernel"):
    with pytest.raises(ValueError, match="locality_attention"):
      choose(requested, locality=True)
    with pytest.raises(ValueError, match="attention dropout"):
      choose(requested, dropout=True)


def _attention_stack_loss(tokens, scales, softmax):
  """sum(sin) of (B, heads, T, head_dim) tokens through len(scales)
  residual attention cores, tokens + softmax(scale Q K^T) V, Q = K = V the
  tokens: each core's probabilities live until the backward pass."""
  for scale in scales:
    logits = scale * jnp.einsum("bhqd,bhkd->bhqk", tokens, tokens)
    tokens = tokens + jnp.einsum("bhqk,bhkd->bhqd", softmax(logits), tokens)
  return jnp.sum(jnp.sin(tokens))


def test_softmax_matches_a_float64_reference_and_keeps_only_its_output():
  """attention.softmax: values and gradients of a float64 NumPy softmax
  (logits of a wide range, a masked diagonal as Locality Self-Attention
  masks it), and in a compiled forward + backward pass through attention
  cores XLA's scratch holds at most one (B, heads, T, T) array per core
  until the backward pass, whose working set is three more (the
  probabilities' gradient, its product with them, the logits' gradient).
  jax.nn.softmax took three more than that up to JAX 0.12.0 (XLA:CPU kept
  exp(logits - max) beside the output: 7.5 MB here against 5.1 MB);
  0.12.1's XLA keeps only the output for it too (4.4 MB)."""
  rng = np.random.default_rng(0)
  logits = 8 * rng.standard_normal((2, 3, 5, 7))
  logits[..., np.arange(5), np.arange(5)] = np.finfo(np.float32).min
  output_grad = rng.standard_normal(logits.shape)
  shifted = np.exp(logits - logits.max(-1, keepdims=True))
  expected = shifted / shifted.sum(-1, keepdims=True)
  expected_grad = expected * (
      output_grad - (output_grad * expected).sum(-1, keepdims=True))

  as32 = lambda array: jnp.asarray(array, jnp.float32)
  np.testing.assert_allclose(attention.softmax(as32(logits)), expected,
                             rtol=1e-5, atol=1e-7)
  probabilities, pullback = jax.vjp(attention.softmax, as32(logits))
  np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(pullback(as32(output_grad))[0], expected_grad,
                             rtol=1e-4, atol=1e-6)

  tokens = 0.5 * jax.random.normal(jax.random.PRNGKey(0), (4, 3, 128, 16))
  scales = jnp.array([0.1, 0.2, 0.15, 0.25])
  gradients = {name: jax.jit(jax.grad(functools.partial(
      _attention_stack_loss, scales=scales, softmax=softmax)))
               for name, softmax in (
                   ("ours", attention.softmax),
                   ("jax.nn", lambda x: jax.nn.softmax(x, axis=-1)))}
  chex.assert_trees_all_close(gradients["ours"](tokens),
                              gradients["jax.nn"](tokens), rtol=1e-4,
                              atol=1e-5)
  scratch = {name: gradient.lower(tokens).compile().memory_analysis()
             .temp_size_in_bytes for name, gradient in gradients.items()}
  probabilities_bytes = 4 * 3 * 128 * 128 * 4
  assert scratch["ours"] <= (len(scales) + 3) * probabilities_bytes, scratch


def test_row_max_is_jnp_max_without_xla_cpus_reduce_window():
  """attention._row_max: jnp.max(x, -1, keepdims=True)'s values, infinities
  and NaN included, and compiled for a row of 197 logits (ViT-Ti/16's
  tokens) without the padded reduce-window XLA:CPU makes of jnp.max there
  (the reason it exists)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, 4, 197)).astype(np.float32)
  x[0, 0, 0, 5] = np.inf
  x[0, 0, 1, :] = -np.inf
  x[0, 1, 2, 7] = np.nan
  x[1, 2, 3, 196] = 50.0  # the last element, beyond the 32-wide windows
  np.testing.assert_array_equal(jax.jit(attention._row_max)(x),  # pylint: disable=protected-access
                                np.max(x, -1, keepdims=True))
  if jax.default_backend() == "cpu":
    hlo = lambda fn: jax.jit(fn).lower(x).compile().as_text()
    # The premise, with vit_jax's XLA flags (host.py: no YNNPACK fusions).
    assert "reduce-window(" in hlo(lambda v: jnp.max(v, -1))
    assert "reduce-window(" not in hlo(attention._row_max)  # pylint: disable=protected-access
