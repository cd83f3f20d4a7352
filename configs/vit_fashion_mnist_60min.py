r"""Fashion-MNIST from scratch in 60 minutes of a 2-core CPU.

  python benchmarks/fashion_mnist.py --config=configs/vit_fashion_mnist_60min.py

The model of configs/vit_fashion_mnist_15min.py (plain ViT: patch 7, 4x4 =
16 tokens, width 128, 6 layers, 4 heads, MLP 512, mean-pooled tokens, 2-D
sin-cos position embeddings) for the 24 epochs an hour buys at ~450
images/s, with a random 2-pixel shift (crop after zero padding) added to the
flip, because over 24 epochs the model starts to see each image often
enough to memorise it, and an EMA of the params with a longer horizon.

Measured here: see the README's "Training recipes for small data".
"""

from vit_jax import configs


def get_config():
  config = configs.base_config("ViT-Mini/7")
  config.dataset = "fashion_mnist"
  config.model.classifier = "gap"
  config.model.posemb = "sincos2d"
  config.num_epochs = 24
  config.batch_size = 128
  config.learning_rate = 2e-3
  config.warmup_epochs = 0.5
  config.weight_decay = 0.05
  config.label_smoothing = 0.1
  config.ema_decay = 0.999
  config.crop_padding = 2
  config.random_flip = True  # garments are left-right symmetric
  config.eval_batch_size = 1000
  config.log_every_steps = 100
  config.checkpoint_every_steps = 2000
  return config
