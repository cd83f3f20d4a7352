"""vit_jax: the Vision Transformer (Dosovitskiy et al., 2020) in JAX/Flax.

  from vit_jax import VisionTransformer, get_variant, build_model
  model = build_model(get_variant("ViT-B/16"), num_classes=1000)

The trainer: `train_and_evaluate(config, workdir)`, or the pieces
`create_train_state`, `train_step`, `eval_step` for a loop of your own.
Pretrained checkpoints: `load_params(path, num_heads)` reads official .npz,
Orbax and PyTorch files, `adapt_params` fits them to a model
(vit_jax.pretrained); `python -m vit_jax.convert` writes them back out.
"""

from vit_jax.configs import base_config
from vit_jax.datasets import Dataset, DatasetUnavailableError, load as load_dataset
from vit_jax.models import (Encoder, Encoder1DBlock, MlpBlock,
                            MultiHeadSelfAttention, ViTInputError,
                            VisionTransformer)
from vit_jax.pretrained import adapt_params, load_params, resize_pos_embedding
from vit_jax.train import (TrainState, create_train_state, eval_step,
                           train_and_evaluate, train_step)
from vit_jax.variants import VARIANTS, build_model, get_variant

__version__ = "0.1.0"
