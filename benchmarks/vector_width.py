r"""XLA:CPU's generated kernels at 256- and 512-bit vectors, side by side.

  taskset -c 0 python benchmarks/vector_width.py
  taskset -c 0 python benchmarks/vector_width.py --rows=6304 --repeats=50

Compiles three of the train step's elementwise and reduction fusions at
ViT-Ti's widths (GELU with its bias; GELU's gradient with the bias's; a
LayerNorm's forward and backward) twice, with
`xla_cpu_prefer_vector_width` 256 (XLA:CPU's default) and 512, and times
the two alternately in one process. Run it on one core (`taskset -c 0`):
in the train step each device runs its kernels on one.
`runtime.host.default_xla_flags` sets 512 on Intel CPUs with AVX-512,
where this and the train step measured faster (docs/performance.md, *XLA's
kernels at 512-bit vectors*). Prints each median and
  summary: gelu=… gelu_gradient=… layernorm=… cpu="…"
the 512-bit time over the 256-bit one (below 1: 512 bits faster).
"""

import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import race_report  # this folder's: the CPU's model and ISA flags
from vit_jax.runtime import cpu_info

_ROWS = flags.DEFINE_integer("rows", 3152, "Tokens (rows) of each matrix: "
                             "ViT-Ti/16 @224's 16 images x 197 per device.")
_REPEATS = flags.DEFINE_integer("repeats", 30, "Timed runs of each width.")
WIDTHS = (256, 512)


def gelu(x, bias):
  return jax.nn.gelu(x + bias)


def gelu_gradient(x, bias, output_grad):
  _, pullback = jax.vjp(lambda x: gelu(x, bias), x)
  (grad,) = pullback(output_grad)
  return grad, grad.sum(0)  # and the bias's


def layer_norm(x, scale, offset):
  mean = x.mean(-1, keepdims=True)
  variance = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(variance + 1e-6) * scale + offset


def layer_norm_forward_backward(x, scale, offset, output_grad):
  _, pullback = jax.vjp(layer_norm, x, scale, offset)
  return pullback(output_grad)


def time_widths(fn, args, repeats: int) -> dict[int, float]:
  """Median seconds of fn(*args) compiled at each of WIDTHS, run
  alternately."""
  compiled = {width: jax.jit(fn).lower(*args).compile(
      compiler_options={"xla_cpu_prefer_vector_width": width})
              for width in WIDTHS}
  times = {width: [] for width in WIDTHS}
  for _ in range(repeats):
    for width, program in compiled.items():
      jax.block_until_ready(program(*args))  # its memory touched again
      start = time.perf_counter()
      jax.block_until_ready(program(*args))
      times[width].append(time.perf_counter() - start)
  return {width: statistics.median(t) for width, t in times.items()}


def main(argv):
  del argv
  rows, rng = _ROWS.value, np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  cases = {  # ViT-Ti: MLP width 768, model width 192
      "gelu": (gelu, (normal(rows, 768), normal(768))),
      "gelu_gradient": (gelu_gradient, (normal(rows, 768), normal(768),
                                        normal(rows, 768))),
      "layernorm": (layer_norm_forward_backward, (
          normal(rows, 192), normal(192), normal(192), normal(rows, 192))),
  }
  model, isa = race_report.cpu_description()
  print(f"Command: python benchmarks/vector_width.py {' '.join(sys.argv[1:])}")
  print(f"CPU: {model} ({cpu_info.cpu_features()[0] or 'vendor unknown'}), "
        f"{cpu_info.cpu_cores()} core(s) for this process; {' '.join(isa)}")
  print(race_report.code_line())
  ratios = {}
  for name, (fn, args) in cases.items():
    medians = time_widths(fn, args, _REPEATS.value)
    ratios[name] = medians[512] / medians[256]
    print(f"{name}: 256-bit {medians[256] * 1e3:.2f} ms, 512-bit "
          f"{medians[512] * 1e3:.2f} ms, ratio {ratios[name]:.3f}")
  print("summary: " + " ".join(f"{name}={ratio:.3f}"
                               for name, ratio in ratios.items())
        + f' cpu="{model}"')


if __name__ == "__main__":
  app.run(main)
