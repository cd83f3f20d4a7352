"""The shipped configs: `--config=NAME` (vit-jax, python -m vit_jax) or
`--config=configs/NAME.py` (main.py in a clone, where configs/ links
here). Each file's docstring gives its command and what it reached."""
