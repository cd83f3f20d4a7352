"""Evaluation report: predictions over a test set, confusion matrix, per-class
precision and recall, and the most confident mistakes (numpy, no plotting).
"""

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import numpy as np


@dataclasses.dataclass
class Predictions:
  """Model outputs over a test set, one row per example, in dataset order."""
  labels: np.ndarray         # (N,) int
  probabilities: np.ndarray  # (N, K) float32, softmax of the logits
  # (N,) int: each row's index in the test split (rows skipped as
  # unreadable leave gaps); None: row i is example i.
  indices: Optional[np.ndarray] = None

  def example_indices(self, rows) -> np.ndarray:
    """The test-split indices of `rows`."""
    rows = np.asarray(rows, np.int64)
    return rows if self.indices is None else self.indices[rows]

  @property
  def predicted(self) -> np.ndarray:
    return self.probabilities.argmax(axis=1)

  @property
  def accuracy(self) -> float:
    return float(np.mean(self.predicted == self.labels))


def predict_dataset(logits_fn: Callable, dataset, batch_size: int, mesh
                    ) -> Predictions:
  """Runs `logits_fn(uint8 batch) -> logits` over every test example of
  `dataset` (its `eval_batches`) once."""
  probabilities, labels, indices = [], [], []
  offset = 0
  for batch_images, batch_labels, mask in dataset.eval_batches(batch_size,
                                                               mesh):
    logits = logits_fn(batch_images)
    probs = np.asarray(jax.device_get(jax.nn.softmax(logits, axis=-1)))
    keep = np.asarray(jax.device_get(mask)) > 0
    probabilities.append(probs[keep])
    labels.append(np.asarray(jax.device_get(batch_labels))[keep])
    indices.append(offset + np.flatnonzero(keep))
    offset += len(keep)
  return Predictions(labels=np.concatenate(labels),
                     probabilities=np.concatenate(probabilities),
                     indices=np.concatenate(indices))


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray,
                     num_classes: int) -> np.ndarray:
  """(K, K) counts: row = true class, column = predicted class."""
  matrix = np.zeros((num_classes, num_classes), np.int64)
  np.add.at(matrix, (labels, predicted), 1)
  return matrix


def per_class_metrics(matrix: np.ndarray) -> list[dict[str, float]]:
  """Precision, recall and support per class from a confusion matrix."""
  true_positives = np.diag(matrix).astype(np.float64)
  predicted = matrix.sum(axis=0)
  support = matrix.sum(axis=1)
  return [dict(precision=tp / p if p else 0.0, recall=tp / s if s else 0.0,
               support=int(s))
          for tp, p, s in zip(true_positives, predicted, support)]


def confident_mistakes(predictions: Predictions, count: int) -> np.ndarray:
  """Indices of the `count` wrong predictions with the highest confidence."""
  wrong = np.flatnonzero(predictions.predicted != predictions.labels)
  confidence = predictions.probabilities[wrong].max(axis=1)
  return wrong[np.argsort(-confidence, kind="stable")[:count]]


def format_report(predictions: Predictions, class_names: Sequence[str]
                  ) -> str:
  """Accuracy, a per-class table and the confusion matrix, as text."""
  matrix = confusion_matrix(predictions.labels, predictions.predicted,
                            len(class_names))
  width = max(len(name) for name in class_names)
  lines = [f"Test accuracy {predictions.accuracy:.4f} over "
           f"{len(predictions.labels)} images.", "",
           f"{'class':{width}s}  precision  recall  support"]
  for name, metrics in zip(class_names, per_class_metrics(matrix)):
    lines.append(f"{name:{width}s}  {metrics['precision']:9.4f}  "
                 f"{metrics['recall']:6.4f}  {metrics['support']:7d}")
  lines += ["", "Confusion matrix (rows: true class, columns: predicted):"]
  cell = max(5, len(str(matrix.max())) + 1)
  lines.append(" " * width + "".join(f"{i:>{cell}d}"
                                     for i in range(len(class_names))))
  for i, (name, row) in enumerate(zip(class_names, matrix)):
    lines.append(f"{name:{width}s}" + "".join(f"{v:>{cell}d}" for v in row)
                 + f"   ({i})")
  return "\n".join(lines)
