"""`python -m vit_jax ...`: the command line of vit_jax/cli.py."""

if __name__ == "__main__":
  from vit_jax import cli
  cli.main()
