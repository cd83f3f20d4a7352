"""The README's library example runs as written and means what it says."""

import os
import re

import chex

from helpers import ROOT  # pylint: disable=wrong-import-order


def test_readme_library_example_runs():
  with open(os.path.join(ROOT, "README.md")) as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  namespace = {}
  exec(blocks[0], namespace)  # pylint: disable=exec-used
  chex.assert_shape(namespace["logits"], (1, 1000))
  attention = namespace["state"]["intermediates"]["Transformer"][
      "encoderblock_0"]["MultiHeadDotProductAttention_1"]["attention_weights"]
  chex.assert_shape(attention[0], (1, 12, 197, 197))
