"""The model: shapes, parameter counts and names, values, and input errors."""

import contextlib
import functools
import io

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ad_checkpoint

from vit_jax.inspection import introspect
from vit_jax.model import blocks, encoder, self_attention, variants, vit


def _tiny(**overrides):
  fields = dict(num_classes=5, patch_size=4, hidden_size=32, num_layers=2,
                num_heads=4, mlp_dim=64)
  fields.update(overrides)
  return vit.VisionTransformer(**fields)


def _init(model, shape, seed=0):
  # jit: one compilation instead of dispatching each op of init eagerly.
  return jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros(shape))


# ------------------------------------------------------------------ shapes
def _logits_and_variables(model, images, run: bool):
  """`model` initialised on one image of `images`' shape, then applied to
  them: computed (jitted, logits checked finite) if `run`, else only traced
  (`jax.eval_shape`: the same shapes and dtypes, no compile of seconds)."""
  if not run:
    return jax.eval_shape(lambda: model.init_with_output(
        jax.random.PRNGKey(0), images))
  variables = _init(model, (1,) + images.shape[1:])
  logits = jax.jit(model.apply)(variables, images)
  chex.assert_tree_all_finite(logits)
  return logits, variables


@pytest.mark.parametrize("classifier,image_shape,run", [
    ("token", (16, 24, 3), True), ("gap", (28, 28, 1), True),
    ("token", (32, 32, 3), False), ("token", (28, 28, 1), False),
    ("gap", (32, 32, 3), False), ("gap", (16, 24, 3), False)])
def test_output_shape_and_dtype(classifier, image_shape, run):
  """Logits and position embeddings for any image shape; two cases run,
  the others are traced."""
  model = _tiny(classifier=classifier)
  images = jax.random.normal(jax.random.PRNGKey(1), (3,) + image_shape)
  logits, variables = _logits_and_variables(model, images, run)
  chex.assert_shape(logits, (3, 5))
  chex.assert_type(logits, jnp.float32)
  num_patches = (image_shape[0] // 4) * (image_shape[1] // 4)
  pos = variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  chex.assert_shape(pos, (1, num_patches + (classifier == "token"), 32))
  assert ("cls" in variables["params"]) == (classifier == "token")


@pytest.mark.parametrize("name,image_size,run", [("ViT-Ti/16", 224, True),
                                                 ("ViT-S/32", 96, False),
                                                 ("ViT-Ti/4", 32, False),
                                                 ("ViT-Mini/4", 28, False),
                                                 ("ViT-Mini/7", 28, True),
                                                 ("ViT-Micro/4", 28, False)])
def test_named_variants_run(name, image_size, run):
  """Every variant builds and maps images to logits; two of them (a 224 px
  RGB and a 28 px grey one) run, the others are traced."""
  model = variants.build_model(variants.get_variant(name), num_classes=7)
  channels = 1 if image_size == 28 else 3
  shape = (2, image_size, image_size, channels)
  logits, _ = _logits_and_variables(model, jnp.ones(shape), run)
  chex.assert_shape(logits, (2, 7))
  chex.assert_type(logits, jnp.float32)


def test_bfloat16_compute_keeps_float32_params():
  model = _tiny(dtype=jnp.bfloat16)
  variables = _init(model, (1, 16, 16, 3))
  chex.assert_trees_all_equal_dtypes(
      variables, jax.tree.map(lambda x: x.astype(jnp.float32), variables))
  _, state = model.apply(variables, jnp.ones((2, 16, 16, 3)),
                         mutable=["intermediates"])
  tokens = state["intermediates"]["patch_tokens"][0]
  chex.assert_type(tokens, jnp.bfloat16)
  logits = model.apply(variables, jnp.ones((2, 16, 16, 3)))
  chex.assert_type(logits, jnp.float32)


# ------------------------------------------------------ parameter counts
OFFICIAL_PARAM_COUNTS = {  # 1000 classes, 224x224, no pre-logits layer
    "ViT-Ti/16": 5_717_416,
    "ViT-S/16": 22_050_664,
    "ViT-B/16": 86_567_656,
    "ViT-L/16": 304_326_632,
}


@pytest.mark.parametrize("name,count", sorted(OFFICIAL_PARAM_COUNTS.items()))
def test_param_count_matches_official(name, count):
  model = variants.build_model(variants.get_variant(name), num_classes=1000)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3))))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == count


def test_param_names_follow_official_layout():
  config = variants.get_variant("ViT-B/16")
  config.unlock()
  config.representation_size = 768
  model = variants.build_model(config, num_classes=1000)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3))))
  flat = {"/".join(k): v.shape for k, v in
          flax.traverse_util.flatten_dict(shapes["params"]).items()}
  expected = {
      "embedding/kernel": (16, 16, 3, 768),
      "cls": (1, 1, 768),
      "Transformer/posembed_input/pos_embedding": (1, 197, 768),
      "Transformer/encoderblock_0/LayerNorm_0/scale": (768,),
      "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel":
          (768, 12, 64),
      "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/out/kernel":
          (12, 64, 768),
      "Transformer/encoderblock_11/LayerNorm_2/bias": (768,),
      "Transformer/encoderblock_11/MlpBlock_3/Dense_0/kernel": (768, 3072),
      "Transformer/encoderblock_11/MlpBlock_3/Dense_1/kernel": (3072, 768),
      "Transformer/encoder_norm/scale": (768,),
      "pre_logits/kernel": (768, 768),
      "head/kernel": (768, 1000),
  }
  for name, shape in expected.items():
    assert flat[name] == shape, name
  assert not any("encoderblock_12" in name for name in flat)


def test_initialisation_follows_paper():
  model = _tiny(num_layers=1, hidden_size=64, num_heads=4, mlp_dim=128)
  params = _init(model, (1, 64, 64, 3))["params"]
  chex.assert_trees_all_equal(params["cls"], jnp.zeros((1, 1, 64)))
  chex.assert_trees_all_equal(params["head"]["kernel"], jnp.zeros((64, 5)))
  pos = params["Transformer"]["posembed_input"]["pos_embedding"]
  assert 0.015 < float(jnp.std(pos)) < 0.025  # normal(0.02), 257*64 draws


def test_blocks_initialised_at_once_draw_like_the_submodule_loop():
  """The encoder's blocks come from one loop over layers at init
  (`_init_blocks_at_once`); init while capturing intermediates runs the
  submodules themselves. Same tree and initialisers, independent layers."""
  model = _tiny(num_layers=3, hidden_size=64, num_heads=4, mlp_dim=256)
  images = jnp.zeros((1, 32, 32, 3))
  at_once = _init(model, images.shape)["params"]["Transformer"]
  looped = jax.jit(functools.partial(
      model.init, mutable=["params", "intermediates"]))(
          jax.random.PRNGKey(0), images)["params"]["Transformer"]
  chex.assert_trees_all_equal_shapes_and_dtypes(at_once, looped)
  pairs = jax.tree_util.tree_leaves_with_path(
      jax.tree.map(lambda a, b: (np.asarray(a), np.asarray(b)), at_once,
                   looped), is_leaf=lambda x: isinstance(x, tuple))
  for path, (leaf, reference) in pairs:
    if "encoderblock" in jax.tree_util.keystr(path):
      name = jax.tree_util.keystr(path)
      if reference.std() == 0:  # zeros and ones: equal
        np.testing.assert_array_equal(leaf, reference, err_msg=name)
      else:  # random: the same spread (4 standard errors), other draws
        tolerance = 4 / np.sqrt(2 * leaf.size)
        assert abs(leaf.std() / reference.std() - 1) < tolerance, name
        assert not np.allclose(leaf, reference), name
      if "kernel" in name:  # xavier_uniform: |w| <= sqrt(3) std
        assert np.abs(leaf).max() <= np.sqrt(3) * reference.std() * 1.05
  kernels = [np.asarray(at_once[f"encoderblock_{layer}"]["MlpBlock_3"][
      "Dense_0"]["kernel"]).ravel() for layer in range(3)]
  assert abs(np.corrcoef(kernels)[np.triu_indices(3, 1)]).max() < 0.05


# --------------------------------------------- values vs. a numpy reference
def _layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _numpy_shift(images, dy, dx):
  """images moved down by dy and right by dx pixels, zeros shifted in."""
  out = np.zeros_like(images)
  height, width = images.shape[1:3]
  out[:, max(dy, 0):height + min(dy, 0), max(dx, 0):width + min(dx, 0)] = \
      images[:, max(-dy, 0):height - max(dy, 0),
             max(-dx, 0):width - max(dx, 0)]
  return out


def _numpy_vit(params, images, patch, num_heads, representation,
               shifted_patches=False, locality_attention=False):
  """The paper's forward pass written independently in float64 numpy, with
  Lee et al.'s Shifted Patch Tokenization and Locality Self-Attention."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  if shifted_patches:  # down-right, down-left, up-right, up-left
    half = patch // 2
    images = np.concatenate([images] + [
        _numpy_shift(images, dy, dx)
        for dy, dx in ((half, half), (half, -half), (-half, half),
                       (-half, -half))], axis=-1)
  batch, height, width, channels = images.shape
  grid_h, grid_w = height // patch, width // patch
  patches = images.reshape(batch, grid_h, patch, grid_w, patch, channels)
  patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(
      batch, grid_h * grid_w, -1)
  if shifted_patches:
    norm = jax.tree.map(lambda a: a.reshape(-1), p["embedding_norm"])
    patches = _layer_norm(patches, norm)
  kernel = p["embedding"]["kernel"].reshape(-1, p["embedding"]["bias"].size)
  x = patches @ kernel + p["embedding"]["bias"]
  cls = np.broadcast_to(p["cls"], (batch, 1, x.shape[-1]))
  x = np.concatenate([cls, x], 1)
  x = x + p["Transformer"]["posembed_input"]["pos_embedding"]
  layer = 0
  while f"encoderblock_{layer}" in p["Transformer"]:
    block = p["Transformer"][f"encoderblock_{layer}"]
    attn = block["MultiHeadDotProductAttention_1"]
    y = _layer_norm(x, block["LayerNorm_0"])
    q, k, v = (np.einsum("btd,dhe->bthe", y, attn[n]["kernel"]) +
               attn[n]["bias"] for n in ("query", "key", "value"))
    head_dim = q.shape[-1]
    temperature = (attn["temperature"] if locality_attention else
                   np.sqrt(head_dim))
    logits = np.einsum("bqhe,bkhe->bhqk", q, k) / temperature
    if locality_attention:
      logits[..., np.eye(logits.shape[-1], dtype=bool)] = -np.inf
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhe->bqhe", weights, v)
    x = x + np.einsum("bqhe,hed->bqd", out, attn["out"]["kernel"]) + \
        attn["out"]["bias"]
    mlp = block["MlpBlock_3"]
    y = _layer_norm(x, block["LayerNorm_2"])
    y = _gelu_tanh(y @ mlp["Dense_0"]["kernel"] + mlp["Dense_0"]["bias"])
    x = x + y @ mlp["Dense_1"]["kernel"] + mlp["Dense_1"]["bias"]
    layer += 1
  x = _layer_norm(x, p["Transformer"]["encoder_norm"])[:, 0]
  if representation:
    x = np.tanh(x @ p["pre_logits"]["kernel"] + p["pre_logits"]["bias"])
  return x @ p["head"]["kernel"] + p["head"]["bias"]


def test_forward_matches_numpy_reference():
  model = _tiny(representation_size=16, num_layers=3)
  variables = _init(model, (1, 16, 16, 3))
  # Random (non-zero) head so the logits depend on everything before them.
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  variables = flax.core.unfreeze(variables)
  variables["params"]["head"]["kernel"] = jax.random.normal(keys[0], (16, 5))
  variables["params"]["cls"] = jax.random.normal(keys[1], (1, 1, 32))
  images = np.asarray(jax.random.normal(jax.random.PRNGKey(4),
                                        (2, 16, 16, 3)))
  logits = model.apply(variables, images)
  expected = _numpy_vit(variables["params"], images.astype(np.float64),
                        patch=4, num_heads=4, representation=True)
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)


def test_shifted_patches_and_locality_attention_match_numpy_reference():
  model = _tiny(shifted_patches=True, locality_attention=True)
  variables = flax.core.unfreeze(_init(model, (1, 16, 16, 3)))
  params = variables["params"]
  assert params["embedding"]["kernel"].shape == (4, 4, 15, 32)
  assert params["embedding_norm"]["scale"].shape == (4, 4, 15)
  attention = params["Transformer"]["encoderblock_0"][
      "MultiHeadDotProductAttention_1"]
  assert float(attention["temperature"]) == pytest.approx(np.sqrt(8))
  # Random values everywhere the initialisation is constant, so a wrong
  # shift direction, channel order, normalised axis or temperature shows.
  keys = iter(jax.random.split(jax.random.PRNGKey(5), 8))
  params["head"]["kernel"] = jax.random.normal(next(keys), (32, 5))
  for name in ("scale", "bias"):
    params["embedding_norm"][name] = jax.random.uniform(
        next(keys), (4, 4, 15), minval=0.5, maxval=1.5)
  for layer in range(2):
    params["Transformer"][f"encoderblock_{layer}"][
        "MultiHeadDotProductAttention_1"]["temperature"] = jnp.asarray(
            0.5 + layer)
  images = np.asarray(jax.random.normal(next(keys), (2, 16, 16, 3)))
  expected = _numpy_vit(params, images.astype(np.float64), patch=4,
                        num_heads=4, representation=False,
                        shifted_patches=True, locality_attention=True)
  np.testing.assert_allclose(model.apply(variables, images), expected,
                             rtol=1e-4, atol=1e-5)
  # No token attends to itself; attention still sums to one.
  _, state = model.apply(variables, images, mutable=["intermediates"])
  weights = state["intermediates"]["Transformer"]["encoderblock_1"][
      "MultiHeadDotProductAttention_1"]["attention_weights"][0]
  assert np.all(np.diagonal(weights, axis1=-2, axis2=-1) == 0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)


def test_shifted_patches_see_their_neighbours_edges():
  model = _tiny(shifted_patches=True, classifier="gap", posemb="sincos2d")
  variables = _init(model, (1, 16, 16, 3))
  tokens = lambda images: model.apply(
      variables, images, mutable=["intermediates"])[1]["intermediates"][
          "patch_tokens"][0][0]
  images = jnp.zeros((1, 16, 16, 3))
  base = tokens(images)
  # Pixel (5, 5) lies in patch (1, 1); shifted by half a patch (2 pixels)
  # it lands in patches (0, 0), (0, 1), (1, 0) as well. Patch (2, 2) at
  # pixel distance > 2 is untouched.
  changed = np.abs(tokens(images.at[0, 5, 5].set(1.0)) - base).max(-1)
  changed = changed.reshape(4, 4) > 1e-6
  assert changed[:2, :2].all() and changed.sum() == 4
  # A token of 1 patch only: attention to itself is all there is.
  lonely = _tiny(locality_attention=True, patch_size=16, classifier="gap")
  out = lonely.apply(_init(lonely, (1, 16, 16, 3)), jnp.ones((1, 16, 16, 3)))
  assert np.isfinite(out).all()


def test_dropout_off_is_deterministic_and_on_is_random():
  model = _tiny(dropout_rate=0.3, attention_dropout_rate=0.3)
  variables = flax.core.unfreeze(_init(model, (1, 16, 16, 3)))
  variables["params"]["head"]["kernel"] = jnp.ones((32, 5))
  images = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 16, 3))
  a = model.apply(variables, images, train=False)
  b = model.apply(variables, images, train=False)
  chex.assert_trees_all_equal(a, b)
  c = model.apply(variables, images, train=True,
                  rngs={"dropout": jax.random.PRNGKey(1)})
  d = model.apply(variables, images, train=True,
                  rngs={"dropout": jax.random.PRNGKey(2)})
  assert not np.allclose(c, d)
  assert not np.allclose(a, c)


# ------------------------------------------------- scan_blocks / remat_blocks
def _mlp_stack_loss(params, x, mlp, reference: bool):
  """sum(sin) of x through len(params) residual MLP blocks: `mlp` (which
  recomputes its GELU), or with `reference` the same arithmetic written
  out, Dense -> nn.gelu -> Dense, for autodiff to keep what it keeps."""
  for block in params:
    if reference:
      hidden = nn.gelu(x @ block["Dense_0"]["kernel"] + block["Dense_0"]["bias"],
                       approximate=mlp.approximate_gelu)
      y = hidden @ block["Dense_1"]["kernel"] + block["Dense_1"]["bias"]
    else:
      y = mlp.apply({"params": block}, x, deterministic=True)
    x = x + y
  return jnp.sum(jnp.sin(x))


@pytest.mark.parametrize("approximate_gelu", [True, False])
def test_mlp_recomputes_its_gelu_for_the_backward_pass(approximate_gelu):
  """MlpBlock's gradients are those of Dense -> GELU -> Dense, but its
  backward pass keeps only the first Dense's output: per block one
  (tokens, mlp_dim) residual instead of autodiff's several, and XLA's
  compiled scratch memory shrinks accordingly (the recomputation is not
  merged back into the forward pass)."""
  # XLA's dots: with oneDNN's products (custom calls) JAX 0.12's XLA lays
  # out the scratch otherwise (4.7 MB less, where JAX 0.10 saves the whole
  # 8.4), though the residuals are the same.
  mlp = blocks.MlpBlock(mlp_dim=256, approximate_gelu=approximate_gelu,
                        matmul_implementation="xla")
  x = jax.random.normal(jax.random.PRNGKey(1), (2048, 64))
  params = [jax.jit(mlp.init, static_argnames="deterministic")(
      jax.random.PRNGKey(seed), x, deterministic=True)["params"]
            for seed in range(4)]
  losses = {reference: functools.partial(
      _mlp_stack_loss, mlp=mlp, reference=reference)
            for reference in (False, True)}
  grads = {reference: jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
           for reference, loss in losses.items()}
  # Float rounding only: XLA fuses the two backward passes differently.
  chex.assert_trees_all_close(grads[False], grads[True], rtol=1e-4,
                              atol=1e-4)

  def wide_residuals(loss):
    printed = io.StringIO()  # print_saved_residuals: one line per residual
    with contextlib.redirect_stdout(printed):
      ad_checkpoint.print_saved_residuals(loss, params, x)
    return printed.getvalue().count("f32[2048,256] ")
  assert wide_residuals(losses[False]) == len(params)
  assert wide_residuals(losses[True]) >= 2 * len(params)

  scratch = {reference: jax.jit(jax.grad(loss)).lower(params, x).compile()
             .memory_analysis().temp_size_in_bytes
             for reference, loss in losses.items()}
  wide_bytes = 2048 * 256 * 4
  assert scratch[False] <= scratch[True] - len(params) * wide_bytes, scratch


def test_mlp_parameters_are_those_of_nn_dense():
  """Without dropout MlpBlock takes its parameters from `DenseParameters`
  (for `gelu_matmul.mlp`), with dropout from nn.Dense: the same names,
  shapes and initial values from the same key."""
  x = jnp.ones((4, 64))
  fused = blocks.MlpBlock(mlp_dim=256).init(jax.random.PRNGKey(0), x,
                                            deterministic=True)
  dense = blocks.MlpBlock(mlp_dim=256, dropout_rate=0.1).init(
      {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x,
      deterministic=False)
  assert jax.tree.map(jnp.shape, fused) == {"params": {
      "Dense_0": {"kernel": (64, 256), "bias": (256,)},
      "Dense_1": {"kernel": (256, 64), "bias": (64,)}}}
  chex.assert_trees_all_equal(fused, dense)


def test_remat_blocks_alone_recomputes_in_the_backward_pass():
  """remat_blocks without scan: the same gradients, and XLA's compiled
  scratch keeps no block's activations from the forward pass (with
  jax.checkpoint it kept all of them: XLA:CPU merged the recomputation
  back into the forward pass)."""
  images = jax.random.normal(jax.random.PRNGKey(1), (32, 32, 32, 3))
  labels = jnp.arange(32) % 5
  models_by_mode = {remat: _tiny(num_layers=4, remat_blocks=remat)
                    for remat in (False, True)}
  params = _init(models_by_mode[False], (1, 32, 32, 3))["params"]
  params = jax.tree.map(  # a non-zero head, so gradients reach every block
      lambda p: p + 0.05 * jax.random.normal(jax.random.PRNGKey(3), p.shape),
      params)

  def loss(model, params):
    logits = model.apply({"params": params}, images, train=True,
                         rngs={"dropout": jax.random.PRNGKey(0)})
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
        logits, labels[:, None], axis=-1)[:, 0])

  compiled = {remat: jax.jit(jax.grad(functools.partial(loss, model)))
              .lower(params).compile()
              for remat, model in models_by_mode.items()}
  chex.assert_trees_all_close(compiled[True](params), compiled[False](params),
                              rtol=1e-5, atol=1e-6)
  scratch = {remat: program.memory_analysis().temp_size_in_bytes
             for remat, program in compiled.items()}
  # Without remat every block keeps its attention probabilities (B, heads,
  # T, T) for the backward pass; with it, only the block being recomputed.
  probabilities_bytes = 32 * 4 * 65 * 65 * 4
  assert scratch[True] < scratch[False] - 3 * probabilities_bytes, scratch


BLOCK_MODES = [dict(scan_blocks=True), dict(remat_blocks=True),
               dict(scan_blocks=True, remat_blocks=True)]


@pytest.mark.slow  # 35-40 s here: keeps the default run near 10 minutes
def test_scan_and_remat_keep_params_outputs_and_gradients():
  plain = _tiny(num_layers=3)
  variables = _init(plain, (1, 8, 8, 3))
  params = jax.tree.map(  # a non-zero head, so gradients reach every block
      lambda p: p + 0.05 * jax.random.normal(jax.random.PRNGKey(3), p.shape),
      variables["params"])
  images = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 3))
  # One jitted (logits, gradient) per mode: each compiles once. The
  # reference runs the blocks as Flax submodules (what capturing
  # intermediates does), not through block_function as every mode does.
  outputs_and_grads = lambda logits_of: jax.jit(jax.value_and_grad(
      lambda p: jnp.sum(jnp.sin(logits_of(p)))))(params)
  expected = outputs_and_grads(lambda p: plain.apply(
      {"params": p}, images, mutable="intermediates")[0])
  for mode in [{}, *BLOCK_MODES]:
    other = _tiny(num_layers=3, **mode)
    # The parameter tree is the official one in every mode.
    chex.assert_trees_all_equal_shapes_and_dtypes(variables, jax.eval_shape(
        other.init, jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3))))
    chex.assert_trees_all_close(outputs_and_grads(
        lambda p: other.apply({"params": p}, images)), expected, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(
        lambda p: other.apply({"params": p}, images))(params))
    assert ("scan[" in jaxpr) == mode.get("scan_blocks", False), mode
    assert ("remat" in jaxpr or "checkpoint" in jaxpr) == mode.get(
        "remat_blocks", False), mode


@pytest.mark.parametrize("mode", [{}, dict(remat_blocks=True)])
@pytest.mark.parametrize("drop_path_rate", [0.0, 0.2])
def test_blocks_share_one_trace(mode, drop_path_rate):
  """The encoder's blocks are one jitted function of (params, x, rate, key):
  every block but the class-token-only last one reuses the first block's
  trace (its jaxpr object), in inference and in a dropout training step."""
  model = _tiny(num_layers=5, drop_path_rate=drop_path_rate,
                dropout_rate=0.1, **mode)
  variables = _init(model, (1, 8, 8, 3))
  images = jnp.zeros((2, 8, 8, 3))

  def block_jaxprs(train):
    jaxpr = jax.make_jaxpr(lambda v: model.apply(
        v, images, train=train,
        rngs={"dropout": jax.random.PRNGKey(0)}))(variables)
    return [id(eqn.params["jaxpr"]) for eqn in jaxpr.jaxpr.eqns
            if "apply_block" in str(eqn.params.get("name", ""))]

  for train in (False, True):
    traces = block_jaxprs(train)
    assert len(traces) == 5, traces  # one call per block
    assert len(set(traces[:4])) == 1 and traces[4] != traces[0], train


# Locality attention (its own mask and temperature for the one query) with
# the plain loop and with each of the other modes once, not in every pair.
@pytest.mark.parametrize("mode,locality", [
    ({}, False), ({}, True), (BLOCK_MODES[0], True), (BLOCK_MODES[1], False),
    (BLOCK_MODES[2], True)])
def test_encoder_computes_only_the_output_tokens_in_its_last_block(
    mode, locality):
  """num_output_tokens=1 (what the class-token model uses) gives the first
  token of the full encoder's output, and the same gradients, while the
  last block's queries, attention output and MLP run for that token only."""
  make_encoder = lambda block_mode=mode, **kw: encoder.Encoder(
      num_layers=3, num_heads=4, mlp_dim=64, num_prefix_tokens=1,
      locality_attention=locality, **block_mode, **kw)
  tokens = jax.random.normal(jax.random.PRNGKey(0), (2, 17, 32))

  @jax.jit  # one compilation, not one per eager random draw
  def perturbed_params():
    # The parameters do not depend on the mode: every mode's case reuses
    # this one init program (from the compilation cache).
    params = make_encoder({}).init(jax.random.PRNGKey(1), tokens,
                                   deterministic=True)["params"]
    return jax.tree.map(  # no zero or constant leaf: every path counts
        lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(2),
                                              p.shape), params)

  params = perturbed_params()

  def value_and_grads(model):
    def loss(p, x):
      first = model.apply({"params": p}, x, deterministic=True)[:, :1]
      return jnp.sum(jnp.sin(first)), first
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  def first_token_and_grads(model):
    (_, first), grads = value_and_grads(model)(params, tokens)
    # FLOPs of the same program in XLA's own operations: XLA counts none
    # inside the CPU kernels' custom calls.
    counted = value_and_grads(introspect.xla_operations_only(model))
    return first, grads, counted.lower(params, tokens).cost_analysis()["flops"]

  full_out, full_grads, full_flops = first_token_and_grads(make_encoder())
  out, grads, flops = first_token_and_grads(
      make_encoder(num_output_tokens=1))
  assert out.shape == (2, 1, 32)
  chex.assert_trees_all_close((out, grads), (full_out, full_grads),
                              atol=1e-5)
  # One of three blocks is mostly skipped: 15-30% fewer FLOPs in all. (XLA
  # counts a scan's body once, so only unscanned runs compare.)
  if not mode.get("scan_blocks"):
    assert 0.70 < flops / full_flops < 0.85, flops / full_flops


def test_scan_and_remat_apply_per_layer_drop_path():
  # Two blocks, drop_path_rate=1: block 0 has rate 0 (always kept) and block
  # 1 rate 1 (always dropped), so training mode is deterministic and equal
  # in every mode only if each block gets its own rate.
  plain = _tiny(drop_path_rate=1.0)
  variables = flax.core.unfreeze(_init(plain, (1, 8, 8, 3)))
  variables["params"]["head"]["kernel"] = jnp.ones((32, 5))  # not zero
  images = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 3))
  trainer = lambda model: jax.jit(lambda seed: model.apply(
      variables, images, train=True,
      rngs={"dropout": jax.random.PRNGKey(seed)}))
  expected = trainer(plain)(0)
  assert not np.allclose(expected, plain.apply(variables, images))
  for mode in BLOCK_MODES:
    train = trainer(_tiny(drop_path_rate=1.0, **mode))
    chex.assert_trees_all_close(train(0), expected, atol=1e-5)
    chex.assert_trees_all_close(train(1), expected, atol=1e-5)
    # Dropout in the scanned / remat'd blocks draws per key.
    train = trainer(_tiny(dropout_rate=0.3, **mode))
    a, b = train(1), train(2)
    chex.assert_tree_all_finite((a, b))
    assert not np.allclose(a, b), mode


@pytest.mark.parametrize("classifier,posemb,shifted_patches", [
    ("token", "learn", False), ("gap", "sincos2d", True)])
def test_patch_dropout_trains_on_a_random_subset_of_the_embedded_patches(
    classifier, posemb, shifted_patches):
  """Training keeps round(0.75 * 16) = 12 of each image's 16 embedded patch
  tokens: its own subset, in grid order, each patch equally likely; the
  class token always. The patches are dropped before they are embedded,
  so each kept token must equal its token in the full sequence. Evaluation
  sees every token."""
  settings = dict(classifier=classifier, posemb=posemb,
                  shifted_patches=shifted_patches)
  model = _tiny(patch_dropout_rate=0.25, **settings)
  variables = flax.core.unfreeze(_init(model, (1, 16, 16, 3)))
  variables["params"]["head"]["kernel"] = jnp.ones((32, 5))  # not zero
  images = jax.random.normal(jax.random.PRNGKey(1), (256, 16, 16, 3))
  embedded = lambda **kw: np.asarray(jax.jit(functools.partial(
      model.apply, mutable="intermediates", **kw))(variables, images)[1][
          "intermediates"]["Transformer"]["embedded"][0])
  everything = embedded()  # (256, prefix + 16, 32), position embedding added
  kept = embedded(train=True, rngs={"dropout": jax.random.PRNGKey(2)})
  prefix = int(classifier == "token")
  assert everything.shape == (256, prefix + 16, 32)
  assert kept.shape == (256, prefix + 12, 32)
  np.testing.assert_array_equal(kept[:, :prefix], everything[:, :prefix])
  # Which of its image's patch tokens each kept token is.
  distances = np.sum((kept[:, prefix:, None] - everything[:, None, prefix:])
                     ** 2, axis=-1)  # (256, 12, 16)
  np.testing.assert_allclose(distances.min(-1), 0.0, atol=1e-10)
  index = distances.argmin(-1)
  assert np.all(np.diff(index, axis=1) > 0)  # distinct, in grid order
  assert len({tuple(row) for row in index}) > 200  # each image its own
  frequency = np.bincount(index.ravel(), minlength=16) / 256
  np.testing.assert_allclose(frequency, 0.75, atol=0.1)
  # Evaluation: every token, the output of the same model without dropout.
  chex.assert_trees_all_close(
      jax.jit(model.apply)(variables, images[:8]),
      jax.jit(_tiny(**settings).apply)(variables, images[:8]), atol=1e-6)
  logits = jax.jit(lambda key: model.apply(
      variables, images[:8], train=True, rngs={"dropout": key}))
  assert not np.allclose(logits(jax.random.PRNGKey(3)),
                         logits(jax.random.PRNGKey(4)))


def test_scan_blocks_still_captures_per_layer_intermediates():
  model = _tiny(num_layers=3, scan_blocks=True, remat_blocks=True)
  variables = _init(model, (1, 8, 8, 3))
  _, captured = model.apply(variables, jnp.ones((2, 8, 8, 3)),
                            mutable="intermediates")
  transformer = captured["intermediates"]["Transformer"]
  assert len(transformer["block_outputs"]) == 3
  attention = transformer["encoderblock_2"]["MultiHeadDotProductAttention_1"]
  chex.assert_shape(attention["attention_weights"][0], (2, 4, 5, 5))


def test_bfloat16_matmuls_keep_the_parameters_and_round_only_the_products():
  """matmul_dtype=bfloat16: the same parameter tree and initial values,
  float32 logits within bfloat16's rounding of the float32 model's."""
  images = jax.random.normal(jax.random.PRNGKey(3), (4, 16, 16, 3))
  variables = _init(_tiny(), images.shape)
  variables16 = _init(_tiny(matmul_dtype=jnp.bfloat16), images.shape)
  chex.assert_trees_all_equal(variables, variables16)
  params = jax.tree.map(  # a head that is not zero, weights not tiny
      lambda p: p + 0.2 * jax.random.normal(jax.random.PRNGKey(4), p.shape),
      variables["params"])
  apply = lambda model: jax.jit(model.apply)({"params": params}, images)
  logits, logits16 = apply(_tiny()), apply(_tiny(matmul_dtype=jnp.bfloat16))
  assert logits16.dtype == jnp.float32
  error = float(jnp.max(jnp.abs(logits16 - logits)) / jnp.max(jnp.abs(logits)))
  assert 1e-4 < error < 3e-2, error


# ------------------------------------------------------------------ errors
def test_patch_must_divide_image():
  with pytest.raises(vit.ViTInputError, match="not divisible by patch_size"):
    _init(_tiny(patch_size=5), (1, 32, 32, 3))


def test_rank_must_be_four():
  with pytest.raises(vit.ViTInputError, match="rank 3"):
    _init(_tiny(), (32, 32, 3))


def test_channels_must_match_initialisation():
  model = _tiny()
  variables = _init(model, (1, 16, 16, 3))
  with pytest.raises(vit.ViTInputError, match="1 channels but the model "
                     "was initialised with 3"):
    model.apply(variables, jnp.zeros((1, 16, 16, 1)))


def test_image_size_must_match_position_embedding():
  model = _tiny()
  variables = _init(model, (1, 16, 16, 3))
  with pytest.raises(vit.ViTInputError, match="position embedding"):
    model.apply(variables, jnp.zeros((1, 32, 32, 3)))


def test_unknown_classifier_and_variant():
  with pytest.raises(vit.ViTInputError, match="Unknown classifier 'cls'"):
    _init(_tiny(classifier="cls"), (1, 16, 16, 3))
  with pytest.raises(ValueError, match="Unknown ViT variant 'ViT-X/16'.*"
                     "ViT-B/16"):
    variants.get_variant("ViT-X/16")


def test_heads_must_divide_hidden_size():
  with pytest.raises(vit.ViTInputError, match="num_heads 5"):
    _init(_tiny(num_heads=5), (1, 16, 16, 3))


def test_attention_matches_flax_multi_head_attention():
  """MultiHeadSelfAttention (its three projections run as one matmul)
  against flax's nn.MultiHeadDotProductAttention with the same Xavier
  init: the same parameter tree and values bit for bit from one key (so
  official checkpoints map onto it), and the same outputs and input
  gradients up to float rounding."""
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 24))
  ours = self_attention.MultiHeadSelfAttention(num_heads=3)
  flax_attention = nn.MultiHeadDotProductAttention(
      num_heads=3, kernel_init=nn.initializers.xavier_uniform())
  params = ours.init(jax.random.PRNGKey(0), x, deterministic=True)
  chex.assert_trees_all_equal(
      params, flax_attention.init(jax.random.PRNGKey(0), x, x))
  params = jax.tree.map(  # non-zero biases, so they matter
      lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(2), p.shape),
      params)
  apply_ours = lambda x: ours.apply(params, x, deterministic=True)
  apply_flax = lambda x: flax_attention.apply(params, x, x)
  np.testing.assert_allclose(apply_ours(x), apply_flax(x), rtol=1e-5,
                             atol=1e-6)
  grads = [jax.grad(lambda x, f=f: jnp.sum(jnp.sin(f(x))))(x)
           for f in (apply_ours, apply_flax)]
  np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [{}, dict(remat_blocks=True)])
def test_capturing_intermediates_trains_the_same_values_and_draws(mode):
  """The encoder runs its blocks one way when capturing intermediates (as
  submodules, whose maps are sown) and another otherwise (the block
  runner); in training, with dropout, attention dropout and drop path,
  both give the same loss and gradients: the same dropout draws."""
  model = _tiny(num_layers=3, dropout_rate=0.1, attention_dropout_rate=0.1,
                drop_path_rate=0.3, attention_implementation="einsum",
                **mode)
  variables = _init(model, (1, 8, 8, 3))
  params = jax.tree.map(  # a non-zero head, so gradients reach every block
      lambda p: p + 0.05 * jax.random.normal(jax.random.PRNGKey(3), p.shape),
      variables["params"])
  images = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 3))

  def loss(params, key, capture):
    kwargs = dict(mutable="intermediates") if capture else {}
    out = model.apply({"params": params}, images, train=True,
                      rngs={"dropout": key}, **kwargs)
    return jnp.sum(jnp.sin(out[0] if capture else out))

  step = jax.jit(jax.value_and_grad(loss), static_argnums=2)
  key = jax.random.PRNGKey(7)
  plain, captured = step(params, key, False), step(params, key, True)
  chex.assert_trees_all_close(captured, plain, atol=1e-5, rtol=1e-5)
  # The draws matter: another key gives another loss.
  assert float(step(params, jax.random.PRNGKey(8), False)[0]) != float(
      plain[0])


@pytest.mark.parametrize("order", [(2, 0, 3, 1, 4), (2, 0, 1, 3, 4)])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_projections_has_the_transposes_values_and_gradient(order,
                                                                  parts):
  """The projections' split (heads first for the einsums and the CPU
  kernel, token-major for cuDNN) gives jnp.transpose's slices, and its own
  gradient equals the one JAX derives from them, bit for bit."""
  rng = np.random.default_rng(parts)
  stacked = jnp.asarray(rng.normal(size=(2, 5, parts, 3, 8)), jnp.float32)
  reference = list(jnp.transpose(stacked, order))
  split = self_attention.split_projections(stacked, order)
  assert len(split) == parts
  for got, want in zip(split, reference):
    np.testing.assert_array_equal(got, want)
  weights = [jnp.asarray(rng.normal(size=part.shape), jnp.float32)
             for part in reference]

  def loss(stacked, split):
    return sum(jnp.sum(jnp.sin(part) * weight)
               for part, weight in zip(split(stacked), weights))

  ours = jax.grad(loss)(stacked, functools.partial(
      self_attention.split_projections, order=order))
  jaxs = jax.grad(loss)(stacked, lambda x: list(jnp.transpose(x, order)))
  assert ours.shape == stacked.shape
  np.testing.assert_array_equal(ours, jaxs)
