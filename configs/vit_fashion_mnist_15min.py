r"""Fashion-MNIST from scratch in 15 minutes of a 2-core CPU.

  python benchmarks/fashion_mnist.py --config=configs/vit_fashion_mnist_15min.py

A plain ViT (patch embedding + transformer encoder, no convolutional trunk):
patch 4 (7x7 = 49 tokens), width 96, 6 layers, 3 heads, MLP 384; mean-pooled
tokens instead of a class token and fixed 2-D sin-cos position embeddings,
both cheap and kinder to small data. At this length the budget buys few
epochs, so the recipe regularises lightly (flip, label smoothing) and reads
out an exponential moving average of the params.

Measured here (2-core CPU, quiet, 1 device, ~170-225 images/s): with
num_epochs=3 the test accuracy after epochs 1/2/3 was 79.4/83.5/86.2%
(EMA params: 81.4/84.9/86.3%) at 6.0/12.1/18.7 wall minutes, data loading
and compilation included. 3 epochs overrun 15 minutes, so this config runs
2 (its cosine schedule then ends at epoch 2; expect about 85-86%). That
falls short of the 92% target of the recipe issue; see the README.
"""

from vit_jax import configs


def get_config():
  config = configs.base_config("ViT-Mini/4")
  config.dataset = "fashion_mnist"
  config.model.hidden_size = 96
  config.model.num_layers = 6
  config.model.num_heads = 3
  config.model.mlp_dim = 384
  config.model.classifier = "gap"
  config.model.posemb = "sincos2d"
  config.num_epochs = 2  # 3 epochs took 18.7 min here (see docstring)
  config.batch_size = 128
  config.learning_rate = 2e-3
  config.warmup_epochs = 0.25
  config.weight_decay = 0.05
  config.label_smoothing = 0.1
  config.ema_decay = 0.998
  config.crop_padding = 0
  config.random_flip = True  # garments are left-right symmetric
  config.eval_batch_size = 1000
  config.log_every_steps = 100
  config.checkpoint_every_steps = 1000
  return config
