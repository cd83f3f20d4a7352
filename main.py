"""Trains, evaluates and inspects a ViT: vit_jax's command line from a clone.

  python main.py --config=configs/vit_tiny_fashion_mnist.py
  python main.py --config=configs/vit_tiny_fashion_mnist.py \
      --config.batch_size=64 --config.num_epochs=5 --workdir=/tmp/run
  python main.py --config=configs/vit_tiny_fashion_mnist.py --mode=report

The same as `vit-jax ...` and `python -m vit_jax ...` once installed; every
flag and mode is described in vit_jax/cli.py (`python main.py --help`).
Running the same command again resumes from the latest checkpoint in
workdir.
"""

if __name__ == "__main__":
  # Only here: the input pipeline's workers import this file again, and
  # need none of it.
  from vit_jax import cli
  cli.main()
