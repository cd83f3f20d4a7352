"""Convert ViT checkpoints between vit_jax, official .npz and PyTorch files.

  # A trained vit_jax run -> official .npz, or a timm state dict:
  python -m vit_jax.checkpoints.convert --input=runs/vit_tiny_cifar --output=model.npz
  python -m vit_jax.checkpoints.convert --input=runs/vit_tiny_cifar \
      --output=model.safetensors --layout=timm
  # torchvision / timm / Hugging Face -> official .npz (heads are not stored
  # in a PyTorch state dict: give them):
  python -m vit_jax.checkpoints.convert --input=vit_b_16.pth --num_heads=12 \
      --output=vit_b_16.npz
  # A randomly initialised model in the official layout (smoke tests):
  python -m vit_jax.checkpoints.convert --random_init=ViT-B/16 --num_classes=21843 \
      --representation_size=768 --output=/tmp/ViT-B_16-random.npz

Output type follows the suffix: .npz (official layout, readable by the
official loader and timm), .safetensors or .pth (`--layout` timm or
torchvision).
"""

from absl import app, flags, logging
import jax
import numpy as np

from vit_jax.checkpoints import (npz, pretrained, state_dict_files,
                                 torch_state_dicts)
from vit_jax.model import variants
from vit_jax.runtime import prng

_INPUT = flags.DEFINE_string("input", None, "Checkpoint to convert.")
_OUTPUT = flags.DEFINE_string("output", None, "File to write.")
_LAYOUT = flags.DEFINE_enum("layout", "timm", ["timm", "torchvision"],
                            "State-dict naming for .safetensors/.pth output.")
_NUM_HEADS = flags.DEFINE_integer(
    "num_heads", None, "Attention heads (needed for PyTorch inputs).")
_RANDOM_INIT = flags.DEFINE_string(
    "random_init", None, "Instead of --input: a randomly initialised "
    "variant, e.g. ViT-B/16.")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 1000,
                                    "Head size for --random_init.")
_REPRESENTATION_SIZE = flags.DEFINE_integer(
    "representation_size", None, "Pre-logits width for --random_init.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224,
                                   "Image side for --random_init.")


def _random_params(name: str) -> dict:
  model_config = variants.get_variant(name).unlock()
  model_config.representation_size = _REPRESENTATION_SIZE.value
  model = variants.build_model(model_config, _NUM_CLASSES.value)
  images = np.zeros((1, _IMAGE_SIZE.value, _IMAGE_SIZE.value, 3), np.float32)
  params = jax.jit(model.init)(prng.flat_draws(jax.random.PRNGKey(0)),
                               images)["params"]
  return jax.device_get(params)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if (_INPUT.value is None) == (_RANDOM_INIT.value is None):
    raise app.UsageError("Give exactly one of --input and --random_init.")
  logging.set_verbosity(logging.WARNING)
  try:
    if _RANDOM_INIT.value:
      params, source = _random_params(_RANDOM_INIT.value), "random init"
    else:
      params, settings = pretrained.load_params(_INPUT.value,
                                                _NUM_HEADS.value or 0)
      source = settings["source"]
      if not settings["approximate_gelu"]:
        print(f"Note: the {source} model uses exact GELU and LayerNorm "
              f"epsilon {settings['layer_norm_epsilon']}; build vit_jax "
              "models for it with approximate_gelu=False and that epsilon.")
    output = _OUTPUT.value
    if output.endswith(".npz"):
      npz.save_npz(params, output)
      layout = "official .npz"
    else:
      state_dict_files.save_state_dict(
          torch_state_dicts.export_state_dict(params, _LAYOUT.value), output)
      layout = f"{_LAYOUT.value} state dict"
  except (ValueError, FileNotFoundError, ImportError) as e:
    raise SystemExit(f"{type(e).__name__}: {e}") from e
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  print(f"Wrote {output}: {count:,} parameters from {source}, as {layout}.")


if __name__ == "__main__":
  flags.mark_flags_as_required(["output"])
  app.run(main)
