"""Parameters prepared for inference: the encoder's Dense kernels stored in
the dtype its products read them in.

With `matmul_dtype=bfloat16` the encoder's Dense products (attention's
query, key, value and output projections, the MLP's two layers) round
their float32 kernels to bfloat16 at every call, 6 conversions a block.
Rounded once beforehand, the model gives the same logits bit for bit,
from half the kernels' memory, and converts less: XLA drops the output
projection's and the MLP's bfloat16 -> float32 -> bfloat16 round trips
(and attention joins its q, k and v kernels as bfloat16 bits,
`self_attention._concatenate_columns`). A batch-1 forward pass on a 2-core
AMD EPYC (Zen 4), medians of 200 calls alternating in one process:
ViT-Ti/16 @32 px 6.03 -> 4.95 ms, @224 px 13.36 -> 12.37 ms
(docs/performance.md, *The Zen 4 a twenty-second time*); the bitwise
concatenation then took a Zen 5's from 3.54 to 3.21 ms and 7.43 to 7.16
ms (*The Zen 5 a seventh time*).

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
  """`params` with the kernels of `is_product_kernel` in `matmul_dtype` (a
  model's `matmul_dtype`: None, or float32, returns them unchanged),
  everything else as it is. The model's logits from these are its logits
  from `params`, bit for bit."""
  if matmul_dtype is None or jnp.dtype(matmul_dtype) == jnp.float32:
    return params
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({
      path: value.astype(matmul_dtype) if is_product_kernel(path) else value
      for path, value in flat.items()})
