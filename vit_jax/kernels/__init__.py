"""Speed paths the model composes in: the attention core's kernels
(`attention`, the C++ `cpu_attention` with its source in csrc/) and the
Dense layers' matmuls with their backward passes (`matmuls`)."""
