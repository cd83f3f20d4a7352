#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, on a CUDA host with JAX, Flax, Optax, Orbax,
# PyTorch and timm installed (vit_jax itself runs from this checkout):
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [PART...]
#
# PARTs, in the order given (default: all six):
#   tests          pytest -m gpu (~4 min on an H100; GPU_TESTS="EXPR" runs
#                  the tests pytest -k EXPR selects)
#   fashion_mnist  the Fashion-MNIST recipe against the 94% / 3 min target
#   dispatch       benchmarks/dispatch.py (one step a dispatch against 18)
#   throughput     benchmarks/gpu_throughput.py with a profile (~5 min)
#   flags          benchmarks/gpu_flags.py: XLA options and model paths
#                  for the ViT-L/16 train step, then for its forward pass,
#                  side by side in one process each (~5 min)
#   input          benchmarks/input_throughput.py: the streamed pipeline's
#                  decode rate on the host's cores and the ViT-B/16 step
#                  fed from it against from memory (~3 min)
#
# Logs go to OUT_DIR. FASHION_MNIST_DIR (default Debian's
# /usr/share/datasets/fashion-mnist) holds the raw Fashion-MNIST files;
# WHEELS_DIR, if set, holds wheels of packages the host lacks (installed
# into a temporary folder first, nothing else touched).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
shift
parts=("$@")
[ $# -eq 0 ] && parts=(tests fashion_mnist dispatch throughput flags input)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${WHEELS_DIR:-}" ]; then
  # One at a time: a folder may hold a package's wheels for several Python
  # versions (pip download --python-version 3.12 / 3.13 ...); the ones that
  # do not fit this Python are skipped, the rest installed.
  for wheel in "$WHEELS_DIR"/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target /tmp/vit_jax_site "$wheel" 2>/dev/null ||
      echo "not for this Python, skipped: $(basename "$wheel")"
  done
  export PYTHONPATH="$PYTHONPATH:/tmp/vit_jax_site"
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv
  python3 -c 'import jax, flax, optax, orbax.checkpoint as o, torch, timm
print("jax", jax.__version__, "flax", flax.__version__, "optax",
      optax.__version__, "orbax", o.__version__, "torch", torch.__version__,
      "timm", timm.__version__); print(jax.devices())'
  nproc
} 2>&1 | tee "$out/environment.txt"

for part in "${parts[@]}"; do
  echo "== $part ($(date -u +%T))"
  case "$part" in
    tests)
      python3 -m pytest -m gpu -n 0 -q -rs tests/test_gpu.py \
        ${GPU_TESTS:+-k "$GPU_TESTS"} 2>&1 | tee "$out/pytest_gpu.txt"
      ;;
    fashion_mnist)
      start=$SECONDS
      python3 benchmarks/fashion_mnist.py \
        --config=configs/vit_fashion_mnist_gpu.py \
        --config.raw_data_dir="${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}" \
        --workdir=/tmp/fashion_mnist_gpu --plot="$out/fashion_mnist_gpu.png" \
        2>&1 | tee "$out/fashion_mnist_gpu.txt"
      echo "whole command, Python's start-up included: $((SECONDS - start)) s" \
        | tee -a "$out/fashion_mnist_gpu.txt"
      cp /tmp/fashion_mnist_gpu/metrics.jsonl \
        "$out/fashion_mnist_gpu_metrics.jsonl"
      ;;
    dispatch)
      python3 benchmarks/dispatch.py 2>&1 | tee "$out/dispatch.txt"
      ;;
    throughput)
      python3 benchmarks/gpu_throughput.py --profile=/tmp/vit_jax_profile \
        2>&1 | tee "$out/gpu_throughput.txt"
      for mode in train infer; do
        find /tmp/vit_jax_profile/$mode -name '*perfetto_trace*' \
          -exec cp {} "$out/vit_l16_${mode}_trace.json.gz" \;
        cp /tmp/vit_jax_profile/$mode/optimized_hlo.txt.gz \
          "$out/vit_l16_${mode}_hlo.txt.gz"
      done
      ;;
    flags)
      python3 benchmarks/gpu_flags.py 2>&1 | tee "$out/gpu_flags.txt"
      python3 benchmarks/gpu_flags.py --mode=infer 2>&1 \
        | tee "$out/gpu_flags_infer.txt"
      ;;
    input)
      spare=$(( $(nproc) - 1 ))
      python3 benchmarks/input_throughput.py --model=ViT-B/16 \
        --dtype=bfloat16 --batch_size=256 --num_images=2048 \
        --workers=4,8,$spare --feed_workers=$spare --rss_files=0 \
        --steps=4 --rounds=2 2>&1 | tee "$out/input_throughput.txt"
      ;;
    *) echo "unknown part $part: tests, fashion_mnist, dispatch," \
         "throughput, flags or input"
       exit 2 ;;
  esac
done
