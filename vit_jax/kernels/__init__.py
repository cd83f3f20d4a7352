"""Speed paths the model composes in.

- The attention core: `attention` (XLA's einsums, cuDNN's fused attention)
  and the C++ CPU kernel `cpu_attention`.
- The Dense layers' matmuls with their backward passes: `matmuls`, the MLP's
  GELU with its Dense in `gelu_matmul`, the single products in
  `xla_products`; on a CPU, oneDNN's products `cpu_gemm`, the GELU kernel
  `cpu_gelu` and the bfloat16 transpose `cpu_transpose`.
- LayerNorm `cpu_layer_norm`, AdamW's update `cpu_adamw`, the encoder's
  blocks as one traced function `block_runner`.
- The C++ kernels' build, once per CPU: `cpu_build`, sources in csrc/.
"""
