"""Looking inside: attention, rollout, shape trace, parameters, FLOPs,
curves and TensorBoard, evaluation report, predict."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from helpers import small_config, small_vit
from vit_jax.data import augment
from vit_jax.inspection import introspect, reports, tools
from vit_jax.kernels import xla_products
from vit_jax.model import variants
from vit_jax.training import loop, metric_writer


def _init(model, image_size=16, seed=0):
  images = jax.random.normal(jax.random.PRNGKey(seed + 1),
                             (3, image_size, image_size, 3))
  return model.init(jax.random.PRNGKey(seed), images)["params"], images


# ------------------------------------------------------------- attention
def test_attention_weights_are_distributions_of_the_right_shape():
  model = small_vit()
  params, images = _init(model)
  weights = introspect.attention_weights(model, params, images)
  assert len(weights) == 2
  for layer_weights in weights:
    chex.assert_shape(layer_weights, (3, 4, 17, 17))
    np.testing.assert_allclose(layer_weights.sum(-1), 1.0, rtol=1e-5)
    assert float(layer_weights.min()) >= 0.0


def _layer_norm(x, p, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def test_attention_weights_equal_recomputation_from_q_and_k():
  model = small_vit()
  params, images = _init(model)
  weights = introspect.attention_weights(model, params, images)
  _, state = model.apply({"params": params}, images, mutable=["intermediates"])
  encoder = state["intermediates"]["Transformer"]
  inputs = [encoder["embedded"][0]] + list(encoder["block_outputs"][:-1])
  for layer, x in enumerate(inputs):
    block = params["Transformer"][f"encoderblock_{layer}"]
    attention = block["MultiHeadDotProductAttention_1"]
    y = _layer_norm(np.asarray(x, np.float64), block["LayerNorm_0"])
    q = np.einsum("btd,dhk->bthk", y, attention["query"]["kernel"]) + \
        attention["query"]["bias"]
    k = np.einsum("btd,dhk->bthk", y, attention["key"]["kernel"]) + \
        attention["key"]["bias"]
    logits = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights[layer], expected, atol=1e-5)


def test_block_outputs_per_layer():
  model = small_vit(num_layers=3)
  params, images = _init(model)
  outputs = introspect.block_outputs(model, params, images)
  assert len(outputs) == 3
  chex.assert_shape(outputs, [(3, 17, 32)] * 3)


def test_rollout_of_identity_attention_is_identity():
  identity = jnp.broadcast_to(jnp.eye(5), (2, 3, 5, 5))
  rollout = introspect.rollout_matrix([identity] * 4)
  np.testing.assert_allclose(rollout, jnp.broadcast_to(jnp.eye(5), (2, 5, 5)),
                             atol=1e-6)
  # The class token then attends only to itself: no patch is relevant.
  np.testing.assert_allclose(
      introspect.attention_rollout([identity] * 4, 1), 0.0, atol=1e-6)


def test_rollout_of_uniform_attention_follows_the_formula():
  """A = U (all 1/T): each layer is 0.5 U + 0.5 I, so L layers give
  0.5^L I + (1 - 0.5^L) U; every patch is equally relevant."""
  tokens, layers = 6, 3
  uniform = jnp.full((1, 2, tokens, tokens), 1.0 / tokens)
  rollout = introspect.rollout_matrix([uniform] * layers)
  expected = 0.5**layers * np.eye(tokens) + (1 - 0.5**layers) / tokens
  np.testing.assert_allclose(rollout[0], expected, atol=1e-6)
  relevance = introspect.attention_rollout([uniform] * layers, 1)
  np.testing.assert_allclose(relevance, relevance[0, 0], atol=1e-7)


def test_image_maps_for_any_patch_and_image_size():
  model = small_vit(patch_size=8)
  images = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 24, 3))
  params = model.init(jax.random.PRNGKey(0), images)["params"]
  weights = introspect.attention_weights(model, params, images)
  relevance = introspect.attention_rollout(weights, 1)
  chex.assert_shape(relevance, (2, 15))
  maps = introspect.to_image_map(relevance, (5, 3), (40, 24))
  chex.assert_shape(maps, (2, 40, 24))
  assert maps.min() == 0.0 and np.isclose(maps.max(), 1.0)


# ---------------------------------------------------- shapes, parameters
def _b16():
  model = variants.build_model(variants.get_variant("ViT-B/16"), 1000)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, 224, 224, 3)))["params"]
  return model, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def test_shape_trace_of_vit_b16_at_224():
  model, params = _b16()
  rows = introspect.shape_trace(model, params, jnp.zeros((1, 224, 224, 3)))
  expected = ([("input image", (1, 224, 224, 3)),
               ("patch embedding (conv 16x16, stride 16)", (1, 14, 14, 768)),
               ("flatten to patch tokens", (1, 196, 768)),
               ("+ class token", (1, 197, 768)),
               ("+ position embedding", (1, 197, 768))] +
              [(f"encoder block {i}", (1, 197, 768)) for i in range(12)] +
              [("final LayerNorm (class token only)", (1, 1, 768)),
               ("class token", (1, 768)),
               ("head (logits)", (1, 1000))])
  assert rows == expected


def test_shape_trace_with_gap_and_pre_logits():
  model = small_vit(classifier="gap", representation_size=8)
  params, images = _init(model)
  rows = dict(introspect.shape_trace(model, params, images))
  assert "+ class token" not in rows
  assert rows["mean over tokens"] == (3, 32)
  assert rows["pre-logits (dense + tanh)"] == (3, 8)


def test_shape_trace_and_summary_with_shifted_patches():
  model = small_vit(shifted_patches=True, locality_attention=True)
  params, images = _init(model)
  rows = introspect.shape_trace(model, params, images)
  assert rows[1:3] == [("shifted patch tokens (image + 4 shifts, 4x4 "
                        "patches, LayerNorm, linear)", (3, 16, 32)),
                       ("+ class token", (3, 17, 32))]
  summary = dict(introspect.parameter_summary(params))
  assert list(summary)[:2] == ["embedding_norm", "embedding"]
  assert summary["embedding_norm"] == 2 * 4 * 4 * 15
  assert summary["embedding"] == 4 * 4 * 15 * 32 + 32


def test_parameter_summary_of_vit_b16():
  _, params = _b16()
  rows = introspect.parameter_summary(params)
  assert rows[-1] == ("total", 86_567_656)
  assert sum(count for _, count in rows[:-1]) == 86_567_656
  width, mlp = 768, 3072
  block = 4 * (width * width + width) + 4 * width + 2 * width * mlp + mlp + \
      width
  table = dict(rows)
  assert table["Transformer/encoderblock_11"] == block == 7_087_872
  assert table["embedding"] == 16 * 16 * 3 * width + width
  names = [name for name, _ in rows]
  assert names[:3] == ["embedding", "cls", "Transformer/posembed_input"]
  assert names.index("Transformer/encoderblock_2") < names.index(
      "Transformer/encoderblock_10")
  text = introspect.format_table(rows, ("module", "parameters"))
  assert "86,567,656" in text


def test_flops_match_an_analytic_count():
  """XLA's count for ViT-B/16 forward vs 2 x multiply-adds of the matmuls.

  The last block computes only the class token's query, attention output
  and MLP; keys and values come from every token."""
  model, params = _b16()
  tokens, width, mlp = 197, 768, 3072
  block = lambda queries: (
      (2 * tokens + 2 * queries) * width * width +  # k, v; q, out
      2 * queries * tokens * width +  # q k^T and attention x v
      2 * queries * width * mlp)  # MLP
  macs = (196 * 16 * 16 * 3 * width +  # patch embedding
          11 * block(tokens) + block(1) +
          width * 1000)  # head
  flops = introspect.flops_per_image(model, params, (224, 224, 3))
  assert abs(flops / (2 * macs) - 1) < 0.03, flops / (2 * macs)


# --------------------------------------- a small trained run for the tools
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  config = small_config(num_train_steps=8, checkpoint_every_steps=4)
  metrics = loop.train_and_evaluate(config, workdir)
  return config, workdir, metrics


def test_model_info_and_tensorboard_events(trained_run):
  _, workdir, _ = trained_run
  with open(os.path.join(workdir, tools.MODEL_INFO)) as f:
    info = json.load(f)
  assert info["image_shape"] == [16, 16, 3] and len(info["class_names"]) == 10
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  events = event_accumulator.EventAccumulator(workdir)
  events.Reload()
  records = metric_writer.read_metrics(workdir)
  train_losses = [(r["step"], r["loss"]) for r in records
                  if r["split"] == "train"]
  scalars = events.Scalars("train/loss")
  assert [(e.step, round(e.value, 5)) for e in scalars] == [
      (step, round(loss, 5)) for step, loss in train_losses]
  assert "eval/accuracy" in events.Tags()["scalars"]


def test_curves_png(trained_run, tmp_path):
  _, workdir, _ = trained_run
  path = tools.curves(workdir, str(tmp_path / "curves.png"))
  with Image.open(path) as image:
    assert image.size[0] > 2 * image.size[1]  # four panels side by side


def test_evaluation_report_counts_and_accuracy(trained_run, tmp_path):
  config, workdir, metrics = trained_run
  trained = tools.load_trained(config, workdir)
  text = tools.evaluation_report(config, trained, str(tmp_path))
  assert f"Test accuracy {metrics['accuracy']:.4f} over 40 images" in text
  for name in ("report.txt", "confusion_matrix.png",
               "confident_mistakes.png"):
    assert os.path.getsize(tmp_path / name) > 0


def test_confusion_matrix_and_per_class_metrics():
  labels = np.array([0, 0, 1, 1, 1, 2])
  probabilities = np.eye(3)[[0, 1, 1, 1, 0, 2]] * 0.8 + 0.2 / 3
  probabilities[4] = [0.9, 0.05, 0.05]
  predictions = reports.Predictions(labels, probabilities)
  matrix = reports.confusion_matrix(labels, predictions.predicted, 3)
  np.testing.assert_array_equal(matrix, [[1, 1, 0], [1, 2, 0], [0, 0, 1]])
  assert matrix.sum() == len(labels)
  metrics = reports.per_class_metrics(matrix)
  assert metrics[1] == dict(precision=2 / 3, recall=2 / 3, support=3)
  # Index 4 (0.9 sure, wrong) comes before index 1 (0.8 sure, wrong).
  np.testing.assert_array_equal(reports.confident_mistakes(predictions, 5),
                                [4, 1])
  text = reports.format_report(predictions, ["a", "b", "c"])
  assert "Test accuracy 0.6667 over 6 images." in text


def test_predict_png_matches_the_model_on_the_array(trained_run, tmp_path):
  config, workdir, _ = trained_run
  trained = tools.load_trained(config, workdir)
  rng = np.random.default_rng(0)
  arrays = rng.integers(0, 256, (4, 16, 16, 3)).astype(np.uint8)
  paths = []
  for i, array in enumerate(arrays):
    paths.append(str(tmp_path / f"image{i}.png"))
    Image.fromarray(array).save(paths[-1])
  results = tools.predict_files(trained, paths, top_k=3,
                                attention_dir=str(tmp_path / "attention"))
  expected = np.asarray(trained.logits(arrays)).argmax(axis=1)
  for result, label in zip(results, expected):
    assert result["top"][0][0] == trained.class_names[label]
    probs = [p for _, p in result["top"]]
    assert len(probs) == 3 and probs == sorted(probs, reverse=True)
  assert os.path.exists(tmp_path / "attention" / "image0_attention.png")


def test_eval_flip_average_makes_the_tools_average_image_and_mirror(
    trained_run):
  config, workdir, _ = trained_run
  trained = tools.load_trained(config, workdir)
  flipped_config = config.copy_and_resolve_references()
  flipped_config.eval_flip_average = True
  averaging = tools.load_trained(flipped_config, workdir)
  images = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3)).astype(
      np.uint8)
  plain = np.asarray(trained.logits(images))
  mirrored = np.asarray(trained.logits(images[:, :, ::-1]))
  np.testing.assert_allclose(averaging.logits(images), (plain + mirrored) / 2,
                             rtol=1e-5, atol=1e-6)
  assert np.abs(plain - mirrored).max() > 1e-3  # the mirror really differs


def test_predict_resizes_any_image_and_rejects_bad_files(trained_run,
                                                         tmp_path):
  config, workdir, _ = trained_run
  trained = tools.load_trained(config, workdir)
  big = tmp_path / "big.jpg"
  Image.fromarray(np.full((90, 60, 3), 128, np.uint8)).save(big)
  array = tools.read_image_file(str(big), trained.image_shape)
  assert array.shape == (16, 16, 3) and abs(int(array.mean()) - 128) <= 1
  broken = tmp_path / "broken.png"
  broken.write_bytes(b"not an image")
  with pytest.raises(ValueError, match="broken.png"):
    tools.predict_files(trained, [str(broken)])
  with pytest.raises(FileNotFoundError, match="missing.png"):
    tools.predict_files(trained, [str(tmp_path / "missing.png")])


def test_attention_figure_png(trained_run, tmp_path):
  config, workdir, _ = trained_run
  trained = tools.load_trained(config, workdir)
  images, titles = tools.attention_inputs(config, trained, [], 3)
  assert images.shape == (3, 16, 16, 3) and "true:" in titles[0]
  path = tools.attention_figure(trained, images, str(tmp_path / "a.png"),
                                titles)
  with Image.open(path) as image:
    # One column for the image, rollout, and one per head (2).
    assert image.size[0] > image.size[1]


def test_a_bfloat16_model_predicts_from_kernels_rounded_once():
  """TrainedModel.logits of a model with bfloat16 products runs on its
  params prepared once (`model.inference`): the logits of model.apply on
  the float32 params, the prepared copy reused, and made again when the
  params are replaced."""
  model = small_vit(matmul_dtype=jnp.bfloat16, num_classes=3)
  images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3)).astype(
      np.uint8)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))[
      "params"]
  params = jax.tree.map(  # a head that is not zero: logits that vary
      lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(1), x.shape),
      params)
  mean, std = np.full(3, 127.0, np.float32), np.full(3, 64.0, np.float32)
  trained = tools.TrainedModel(model, params, ["a", "b", "c"], (16, 16, 3),
                               mean, std)

  # Compiled as TrainedModel compiles (YNNPACK's bfloat16 dots on a CPU).
  expected = jax.jit(lambda p: model.apply(
      {"params": p}, augment.normalize(images, mean, std)),
                     compiler_options=xla_products.xla_compiler_options(
                         model.matmul_dtype))

  np.testing.assert_array_equal(trained.logits(images), expected(params))
  prepared = trained._prepared[1]
  kernel = prepared["Transformer"]["encoderblock_0"]["MlpBlock_3"][
      "Dense_0"]["kernel"]
  assert kernel.dtype == jnp.bfloat16
  trained.logits(images)
  assert trained._prepared[1] is prepared  # not rounded again
  trained.params = jax.tree.map(lambda x: -x, params)
  np.testing.assert_array_equal(trained.logits(images),
                                expected(trained.params))
