"""PNG figures: attention maps, training curves, confusion matrix, mistakes.

matplotlib is an optional extra (`pip install -e ".[tools]"`), imported on
first use with the headless Agg backend, so servers without a display work.
Every function takes numpy data and a path, and returns the path.
"""

from typing import Optional, Sequence

import numpy as np


def _pyplot():
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "Plots need matplotlib: pip install -e '.[tools]'.") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _show_image(axis, image: np.ndarray) -> None:
  """uint8 (H, W, C) with C = 1 or 3, no ticks."""
  if image.shape[-1] == 1:
    axis.imshow(image[..., 0], cmap="gray", vmin=0, vmax=255)
  else:
    axis.imshow(image)
  axis.set_xticks([])
  axis.set_yticks([])


def attention_grid(images: np.ndarray, maps: Sequence[np.ndarray],
                   map_titles: Sequence[str], path: str,
                   image_titles: Optional[Sequence[str]] = None,
                   alpha: float = 0.55) -> str:
  """Rows of images; each row: the image, then each map overlaid on it.

  images: uint8 (B, H, W, C); maps: one (B, H, W) array in [0, 1] per column.
  """
  plt = _pyplot()
  rows, columns = len(images), 1 + len(maps)
  figure, axes = plt.subplots(rows, columns, squeeze=False,
                              figsize=(1.6 * columns, 1.6 * rows))
  for row, image in enumerate(images):
    _show_image(axes[row, 0], image)
    if image_titles:
      axes[row, 0].set_title(image_titles[row], fontsize=7)
    for column, (attention, title) in enumerate(zip(maps, map_titles), 1):
      _show_image(axes[row, column], image)
      axes[row, column].imshow(attention[row], cmap="inferno", alpha=alpha,
                               vmin=0, vmax=1)
      if row == 0:
        axes[row, column].set_title(title, fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def training_curves(records: Sequence[dict], path: str) -> str:
  """Loss, accuracy, learning rate and throughput against epoch.

  records: the lines of metrics.jsonl (train and eval splits). The train
  loss includes label smoothing; the eval loss does not.
  """
  plt = _pyplot()
  train = [r for r in records if r["split"] == "train"]
  evals = [r for r in records if r["split"] == "eval"]
  panels = [("loss", "loss"), ("accuracy", "accuracy"),
            ("learning_rate", "learning rate"),
            ("images_per_second", "images / s (train)")]
  figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
  xlabel = "epoch"
  if train and train[-1]["epoch"]:
    xlabel += f" ({train[-1]['step'] / train[-1]['epoch']:.0f} steps each)"
  for axis, (key, title) in zip(axes, panels):
    for split, rows, style in (("train", train, "-"), ("eval", evals, "o-")):
      rows = [r for r in rows if key in r]
      if rows:
        axis.plot([r["epoch"] for r in rows], [r[key] for r in rows], style,
                  label=split, markersize=3)
    axis.set_title(title)
    axis.set_xlabel(xlabel)
    axis.grid(alpha=0.3)
    if key in ("loss", "accuracy"):
      axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def confusion_matrix(matrix: np.ndarray, class_names: Sequence[str],
                     path: str) -> str:
  """Heat map of counts (rows true, columns predicted), counts written in."""
  plt = _pyplot()
  size = 1.0 + 0.55 * len(class_names)
  figure, axis = plt.subplots(figsize=(size + 1.5, size))
  image = axis.imshow(matrix, cmap="Blues")
  figure.colorbar(image, ax=axis, fraction=0.046)
  ticks = range(len(class_names))
  axis.set_xticks(ticks, class_names, rotation=60, ha="right", fontsize=8)
  axis.set_yticks(ticks, class_names, fontsize=8)
  axis.set_xlabel("predicted")
  axis.set_ylabel("true")
  threshold = matrix.max() / 2
  for (row, column), count in np.ndenumerate(matrix):
    axis.text(column, row, str(count), ha="center", va="center", fontsize=6,
              color="white" if count > threshold else "black")
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def image_grid(images: np.ndarray, titles: Sequence[str], path: str,
               columns: int = 8) -> str:
  """A grid of uint8 images with a caption each."""
  plt = _pyplot()
  rows = max(1, -(-len(images) // columns))
  figure, axes = plt.subplots(rows, columns, squeeze=False,
                              figsize=(1.5 * columns, 1.7 * rows))
  for axis in axes.flat:
    axis.axis("off")
  for axis, image, title in zip(axes.flat, images, titles):
    _show_image(axis, image)
    axis.axis("on")
    axis.set_title(title, fontsize=6)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def accuracy_vs_time(curve: Sequence[dict], path: str, title: str) -> str:
  """Test accuracy of eval records ({"minutes", "accuracy"[,
  "ema_accuracy"]}) against wall minutes, as a PNG at `path`."""
  plt = _pyplot()
  figure, axis = plt.subplots(figsize=(6, 4))
  minutes = [r["minutes"] for r in curve]
  axis.plot(minutes, [100 * r["accuracy"] for r in curve], "o-",
            label="params")
  if curve and "ema_accuracy" in curve[0]:
    axis.plot(minutes, [100 * r["ema_accuracy"] for r in curve], "s-",
              label="EMA of params")
  axis.set_xlabel("wall time, minutes (data loading and compilation "
                  "included)")
  axis.set_ylabel("test accuracy (%)")
  axis.set_title(title)
  axis.grid(alpha=0.3)
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)
  return path


def position_similarity(similarity: np.ndarray, path: str) -> str:
  """The paper's Figure 7 (centre): for each patch (i, j) of an (h, w)
  grid, a small map of its position embedding's cosine similarity to every
  patch, laid out on the grid. similarity: (h, w, h, w)."""
  plt = _pyplot()
  rows, columns = similarity.shape[:2]
  figure, axes = plt.subplots(rows, columns, squeeze=False,
                              figsize=(0.45 * columns + 1.2, 0.45 * rows + 0.6))
  for (row, column), axis in np.ndenumerate(axes):
    image = axis.imshow(similarity[row, column], cmap="viridis", vmin=-1,
                        vmax=1)
    axis.set_xticks([])
    axis.set_yticks([])
  for row in range(rows):
    axes[row, 0].set_ylabel(str(row + 1), fontsize=6, rotation=0, ha="right")
  for column in range(columns):
    axes[-1, column].set_xlabel(str(column + 1), fontsize=6)
  figure.supxlabel("input patch column", fontsize=8)
  figure.supylabel("input patch row", fontsize=8)
  figure.suptitle("Position embedding similarity", fontsize=9)
  figure.colorbar(image, ax=axes, fraction=0.02, pad=0.02,
                  label="cosine similarity")
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def attention_distance(distances: np.ndarray, path: str,
                       image_size: int) -> str:
  """The paper's Figure 7 (right): each head's mean attention distance
  (pixels) against its layer. distances: (layers, heads)."""
  plt = _pyplot()
  layers, heads = distances.shape
  figure, axis = plt.subplots(figsize=(4.2, 3.2))
  for head in range(heads):
    axis.scatter(np.arange(1, layers + 1), distances[:, head], s=12,
                 label=f"head {head + 1}")
  axis.set_xlabel("network depth (layer)")
  axis.set_ylabel("mean attention distance (pixels)")
  axis.set_ylim(0, image_size)
  axis.set_xticks(range(1, layers + 1))
  if heads <= 16:
    axis.legend(fontsize=6, ncol=2)
  axis.set_title(f"{image_size} px images", fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path
