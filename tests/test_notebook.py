"""notebooks/vit_from_scratch.ipynb runs from a clean state, and is the
notebook its builder writes."""

import json
import os
import sys
import time

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "notebooks"))
import build_notebook  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_committed_notebook_has_the_builders_cells():
  nbformat = pytest.importorskip("nbformat")
  committed = nbformat.read(build_notebook.NOTEBOOK, as_version=4)
  built = build_notebook.build()
  assert [(c.cell_type, c.source) for c in committed.cells] == [
      (c.cell_type, c.source) for c in built.cells], (
          "notebooks/vit_from_scratch.ipynb is out of date: run python "
          "notebooks/build_notebook.py")
  code = [c for c in committed.cells if c.cell_type == "code"]
  assert all(c.get("outputs") for c in code[2:]), "committed without outputs"


def _summary(notebook) -> dict:
  for cell in reversed(notebook.cells):
    for output in cell.get("outputs", []):
      for line in output.get("text", "").splitlines():
        if line.startswith("NOTEBOOK_SUMMARY "):
          return json.loads(line.split(" ", 1)[1])
  raise AssertionError("the notebook printed no NOTEBOOK_SUMMARY line")


@pytest.mark.slow
def test_notebook_runs_from_a_clean_state(tmp_path, fashion_mnist_dir,
                                          monkeypatch):
  del fashion_mnist_dir  # the notebook reads the Debian files
  pytest.importorskip("nbclient")
  monkeypatch.setenv("PYTHONPATH", ROOT)  # the kernel imports this checkout
  notebook = build_notebook.build()  # the cells, no outputs
  # A fixed number of steps in place of the notebook's three-minute budget:
  # a budget trains as many steps as the host fits, and CI's host beside the
  # suite's other worker fitted too few for the check below (2026-11-29:
  # 44% after two minutes). 150 steps (0.32 epochs) with the schedule ending
  # there: 67.8%, and neighbouring position embeddings 0.29 alike against
  # 0.0003 for distant ones (2026-12-02, 94 s for the cell on 2 quiet cores,
  # the whole notebook 147 s; 250 steps gave 72.6% in 124 s of 190).
  (training,) = [cell for cell in notebook.cells
                 if "config.time_budget_minutes = 3.0" in cell.source]
  training.source = training.source.replace(
      "config.time_budget_minutes = 3.0",
      "config.time_budget_minutes = 0.0\nconfig.num_train_steps = 150")
  start = time.perf_counter()
  build_notebook.execute(notebook, timeout=600, cwd=str(tmp_path))
  seconds = time.perf_counter() - start
  summary = _summary(notebook)
  print(f"notebook ran in {seconds:.0f} s: {summary}")
  # A broken pipeline or model stays near 10%.
  assert summary["test_accuracy"] > 0.5
  # Position embeddings start random; training makes neighbours alike.
  assert summary["neighbour_similarity"] > summary["distant_similarity"] + 0.1
  if "timm_max_abs_logit_diff" in summary:
    assert summary["timm_max_abs_logit_diff"] < 1e-4
