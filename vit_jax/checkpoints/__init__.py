"""Checkpoints: the trainer's Orbax checkpoints (`orbax_checkpoints`),
official .npz files (`npz`), PyTorch state dicts (`torch_state_dicts`,
`state_dict_files`), loading and adapting pretrained params (`pretrained`)
and the converter (`python -m vit_jax.checkpoints.convert`)."""
