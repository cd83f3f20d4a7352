"""Parameters prepared for inference: the encoder's Dense kernels stored in
the dtype its products read them in.

With `matmul_dtype=bfloat16` the encoder's Dense products (attention's
query, key, value and output projections, the MLP's two layers) round
their float32 kernels to bfloat16 at every call: 72 conversions a ViT-Ti
forward pass, 9-15% of a batch-1 inference on a 2-core AMD EPYC (Zen 4;
docs/performance.md, *The Zen 4 a twenty-second time*). Rounded once
beforehand, the model converts nothing (XLA drops a bfloat16 -> float32 ->
bfloat16 round trip) and gives the same logits bit for bit, from half the
kernels' memory.

For inference only: training keeps float32 kernels, which AdamW's small
updates need.
"""

from typing import Any, Optional

import jax.numpy as jnp
from flax import traverse_util

# (module name prefix, Dense layer names) of the encoder's products that
# read `matmul_dtype` operands (model/blocks.py, model/self_attention.py).
_PRODUCT_LAYERS = (("MlpBlock", ("Dense_0", "Dense_1")),
                   ("MultiHeadDotProductAttention",
                    ("query", "key", "value", "out")))


def is_product_kernel(path: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` (names from the root) is a kernel of
  one of the encoder's Dense products."""
  if len(path) < 3 or path[-1] != "kernel":
    return False
  return any(path[-3].startswith(module) and path[-2] in layers
             for module, layers in _PRODUCT_LAYERS)


def inference_params(params: Any, matmul_dtype: Optional[Any]) -> Any:
  """`params` with the encoder's Dense kernels in `matmul_dtype` (a model's
  `matmul_dtype`: None, or float32, returns them unchanged), everything
  else as it is. The model's logits from these are its logits from
  `params`, bit for bit."""
  if matmul_dtype is None or jnp.dtype(matmul_dtype) == jnp.float32:
    return params
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({
      path: value.astype(matmul_dtype) if is_product_kernel(path) else value
      for path, value in flat.items()})
