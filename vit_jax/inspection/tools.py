"""The inspection tools behind `main.py --mode=...`, as plain functions.

  trained = load_trained(config, workdir)       # model, params, preprocessing
  print(summary(config))                          # shapes, parameters, FLOPs
  attention_figure(trained, images, "attention.png")
  curves(workdir, "curves.png")
  report = evaluation_report(config, trained, out_dir)
  for result in predict_files(trained, ["shirt.png"]): print(result)

A training run writes `workdir/model_info.json` (class names, input shape,
normalisation), so these need the checkpoint and that file, not the dataset
(except the evaluation report, which reads the test split).
"""

import dataclasses
import json
import os
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vit_jax import config as config_lib
from vit_jax.checkpoints import pretrained
from vit_jax.data import augment, datasets
from vit_jax.inspection import figure7 as figure7_lib
from vit_jax.inspection import introspect, plots, reports
from vit_jax.kernels import xla_products
from vit_jax.model import inference, variants
from vit_jax.runtime import sharding
from vit_jax.training import metric_writer

MODEL_INFO = metric_writer.MODEL_INFO


@dataclasses.dataclass
class TrainedModel:
  """A model with its trained params and the preprocessing it expects."""
  model: nn.Module
  params: dict
  class_names: list[str]
  image_shape: tuple[int, int, int]  # model input (H, W, C)
  mean: np.ndarray
  std: np.ndarray
  flip_average: bool = False  # mean logits of each image and its mirror

  def __post_init__(self):
    def logits(params, images):
      inputs = augment.normalize(images, self.mean, self.std)
      logits_fn = lambda x: self.model.apply({"params": params}, x)
      return (augment.mirror_averaged(logits_fn, inputs) if self.flip_average
              else logits_fn(inputs))
    # Compiled once per input shape, with the options of the trainer's steps.
    self._logits = jax.jit(logits, compiler_options=(
        xla_products.xla_compiler_options(self.model.matmul_dtype)))
    self._prepared = (None, None)  # (params, their inference_params)

  def logits(self, images: jax.Array) -> jax.Array:
    """uint8 images at the model's input size -> logits (B, K), from the
    params prepared for inference once (`inference.inference_params`: the
    same logits)."""
    source, prepared = self._prepared
    if source is not self.params:
      prepared = inference.inference_params(self.params,
                                            self.model.matmul_dtype)
      self._prepared = (self.params, prepared)
    return self._logits(prepared, images)

  @property
  def num_prefix_tokens(self) -> int:
    return 1 if self.model.classifier == "token" else 0

  @property
  def grid(self) -> tuple[int, int]:
    return (self.image_shape[0] // self.model.patch_size,
            self.image_shape[1] // self.model.patch_size)


def load_trained(config: ml_collections.ConfigDict, workdir: str
                 ) -> TrainedModel:
  """The latest checkpoint in `workdir` with the model `config` describes."""
  info_path = os.path.join(workdir, MODEL_INFO)
  if os.path.exists(info_path):
    with open(info_path) as f:
      info = json.load(f)
  else:  # a run from before model_info.json: derive it from the dataset
    dataset = datasets.load(config)
    mean, std = augment.pixel_stats(config.normalization, dataset)
    info = dict(class_names=dataset.class_names,
                image_shape=config_lib.image_shape_of(config),
                mean=mean.tolist(), std=std.tolist())
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise FileNotFoundError(
        f"No checkpoints in {workdir}: train first with python main.py "
        f"--config=... --workdir={workdir}.")
  params, _ = pretrained.load_params(workdir, config.model.num_heads)
  model = variants.build_model(config.model, len(info["class_names"]))
  return TrainedModel(model=model, params=params,
                      class_names=list(info["class_names"]),
                      image_shape=tuple(info["image_shape"]),
                      mean=np.asarray(info["mean"], np.float32),
                      std=np.asarray(info["std"], np.float32),
                      flip_average=config.eval_flip_average)


def summary(config: ml_collections.ConfigDict, num_classes: int = 10) -> str:
  """Shape trace, parameter table and FLOPs of `config.model`, from its
  shapes alone: nothing is initialised or compiled."""
  image_shape = config_lib.image_shape_of(config)
  model = variants.build_model(config.model, num_classes)
  images = jnp.zeros((1, *image_shape), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), images)["params"]
  forward = introspect.flops_per_image(model, params, image_shape)
  train = introspect.flops_per_image(model, params, image_shape, train=True)
  return "\n\n".join([
      f"{config.model.name} on {image_shape} images, {num_classes} classes",
      introspect.format_table(introspect.shape_trace(model, params, images),
                              ("stage", "output shape")),
      introspect.format_table(introspect.parameter_summary(params),
                              ("module", "parameters")),
      f"FLOPs per image (XLA cost analysis): forward {_flops(forward)}, "
      f"forward + backward {_flops(train)}"])


def _flops(count: float) -> str:
  return (f"{count / 1e9:.2f} GFLOP" if count >= 1e9 else
          f"{count / 1e6:.1f} MFLOP")


def attention_maps(trained: TrainedModel, images: np.ndarray,
                   heads: Sequence[int] = (), layer: int = -1
                   ) -> tuple[list[np.ndarray], list[str]]:
  """Rollout and per-head class-token attention maps at image resolution.

  Returns ([maps (B, H, W) in [0, 1]], [titles]).
  """
  inputs = augment.normalize(jnp.asarray(images), trained.mean, trained.std)
  weights = introspect.attention_weights(trained.model, trained.params,
                                         inputs)
  size = trained.image_shape[:2]
  maps = [introspect.to_image_map(introspect.attention_rollout(
      weights, trained.num_prefix_tokens), trained.grid, size)]
  titles = ["rollout"]
  layer = layer % len(weights)
  if trained.num_prefix_tokens:
    for head in heads:
      maps.append(introspect.to_image_map(
          introspect.class_token_attention(weights, layer, head),
          trained.grid, size))
      titles.append(f"layer {layer} head {head}")
  return maps, titles


def _test_images(config: ml_collections.ConfigDict, trained: TrainedModel,
                 count: int) -> tuple[np.ndarray, np.ndarray]:
  """(uint8 images at the model's input size, labels) of the first `count`
  test examples."""
  dataset = datasets.load(config)
  images, labels = dataset.test_examples(
      np.arange(min(count, dataset.num_test)))
  if images.shape[1:] != tuple(trained.image_shape):
    images = np.asarray(jnp.round(augment.resize(
        jnp.asarray(images), trained.image_shape[0])).astype(jnp.uint8))
  return images, labels


def attention_inputs(config: ml_collections.ConfigDict,
                     trained: TrainedModel, paths: Sequence[str],
                     num_images: int) -> tuple[np.ndarray, list[str]]:
  """Images for an attention figure: the files in `paths`, else the first
  `num_images` test images; with captions (true and predicted class)."""
  if paths:
    images = np.stack([read_image_file(p, trained.image_shape)
                       for p in paths])
    captions = [os.path.basename(p) for p in paths]
  else:
    images, labels = _test_images(config, trained, num_images)
    captions = [f"true: {trained.class_names[label]}" for label in labels]
  predicted = np.asarray(trained.logits(images)).argmax(axis=1)
  return images, [f"{caption}\npredicted: {trained.class_names[p]}"
                  for caption, p in zip(captions, predicted)]


def attention_figure(trained: TrainedModel, images: np.ndarray, path: str,
                     titles: Optional[Sequence[str]] = None,
                     heads: Optional[Sequence[int]] = None,
                     layer: int = -1) -> str:
  """PNG grid: each image, its rollout map, and class-token attention of
  `heads` (default: all heads) in `layer` (default: the last)."""
  if heads is None:
    heads = range(trained.model.num_heads)
  maps, map_titles = attention_maps(trained, images, heads, layer)
  return plots.attention_grid(images, maps, map_titles, path, titles)


def figure7(config: ml_collections.ConfigDict, trained: TrainedModel,
            out_dir: str, num_images: int = 64) -> tuple[str, str]:
  """The paper's Figure 7 for `trained`: position-embedding similarity and
  the mean attention distance per head and layer over the first
  `num_images` test images. Returns the two PNG paths in out_dir."""
  embeddings = figure7_lib.patch_position_embeddings(
      trained.params, trained.model, trained.grid)
  similarity = plots.position_similarity(
      figure7_lib.position_embedding_similarity(embeddings, trained.grid),
      os.path.join(out_dir, "position_embedding_similarity.png"))
  images, _ = _test_images(config, trained, num_images)
  inputs = augment.normalize(jnp.asarray(images), trained.mean, trained.std)
  weights = introspect.attention_weights(trained.model, trained.params,
                                         inputs)
  distances = figure7_lib.mean_attention_distance(
      weights, trained.grid, trained.model.patch_size,
      trained.num_prefix_tokens)
  distance = plots.attention_distance(
      distances, os.path.join(out_dir, "mean_attention_distance.png"),
      trained.image_shape[0])
  return similarity, distance


def curves(workdir: str, path: str) -> str:
  """PNG of the training curves in workdir/metrics.jsonl."""
  return plots.training_curves(metric_writer.read_metrics(workdir), path)


def evaluation_report(config: ml_collections.ConfigDict,
                      trained: TrainedModel, out_dir: str,
                      num_mistakes: int = 24) -> str:
  """Test-set report: text (returned and saved), confusion-matrix and
  confident-mistakes PNGs in out_dir."""
  dataset = datasets.load(config)
  mesh = sharding.make_mesh()
  batch_size = config.eval_batch_size
  predictions = reports.predict_dataset(
      lambda batch: trained.logits(augment.resize(batch, config.image_size)),
      dataset, batch_size, mesh)
  names = trained.class_names
  text = reports.format_report(predictions, names)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "report.txt"), "w") as f:
    f.write(text + "\n")
  matrix = reports.confusion_matrix(predictions.labels,
                                    predictions.predicted, len(names))
  plots.confusion_matrix(matrix, names,
                         os.path.join(out_dir, "confusion_matrix.png"))
  mistakes = reports.confident_mistakes(predictions, num_mistakes)
  plots.image_grid(
      dataset.test_examples(predictions.example_indices(mistakes))[0],
      [f"{names[predictions.predicted[i]]} "
       f"{predictions.probabilities[i].max():.0%}\n(true: "
       f"{names[predictions.labels[i]]})" for i in mistakes],
      os.path.join(out_dir, "confident_mistakes.png"))
  return text


def read_image_file(path: str, image_shape: Sequence[int]) -> np.ndarray:
  """An image file as uint8 (H, W, C) at the model's input size.

  Any size: the shorter side is resized to the model's side (bilinear) and
  the centre cropped, as the square eval images are. Grayscale <-> RGB as
  the model needs.
  """
  try:
    from PIL import Image, UnidentifiedImageError  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Reading image files needs Pillow: pip install -e "
                      "'.[tools]'.") from e
  height, width, channels = image_shape
  try:
    with Image.open(path) as image:
      image = image.convert("L" if channels == 1 else "RGB")
      scale = max(height / image.height, width / image.width)
      resized = image.resize((max(width, round(image.width * scale)),
                              max(height, round(image.height * scale))),
                             Image.BILINEAR)
  except FileNotFoundError as e:
    raise FileNotFoundError(f"No image file at {path}.") from e
  except (UnidentifiedImageError, OSError) as e:
    raise ValueError(f"Cannot read {path} as an image ({e}); give PNG or "
                     "JPEG files.") from e
  top = (resized.height - height) // 2
  left = (resized.width - width) // 2
  array = np.asarray(resized.crop((left, top, left + width, top + height)),
                     np.uint8)
  return array.reshape(height, width, channels)


def predict_files(trained: TrainedModel, paths: Sequence[str],
                  top_k: int = 3, attention_dir: Optional[str] = None
                  ) -> list[dict]:
  """Top-k classes and probabilities for each image file.

  Returns [{"path", "top": [(class name, probability), ...]}]; with
  attention_dir, also saves each image with its attention maps there.
  """
  images = np.stack([read_image_file(p, trained.image_shape) for p in paths])
  probabilities = np.asarray(jax.nn.softmax(trained.logits(images), -1))
  top_k = min(top_k, probabilities.shape[1])
  results = []
  for path, probs in zip(paths, probabilities):
    order = np.argsort(-probs, kind="stable")[:top_k]
    results.append(dict(path=path, top=[(trained.class_names[i],
                                         float(probs[i])) for i in order]))
  if attention_dir:
    os.makedirs(attention_dir, exist_ok=True)
    for path, image, result in zip(paths, images, results):
      name, prob = result["top"][0]
      stem = os.path.splitext(os.path.basename(path))[0]
      attention_figure(trained, image[None], os.path.join(
          attention_dir, f"{stem}_attention.png"), [f"{name} {prob:.0%}"])
  return results
