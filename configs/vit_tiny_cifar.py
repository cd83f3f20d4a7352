r"""ViT-Ti-sized model trained from scratch on 32x32 CIFAR-10.

  python main.py --config=configs/vit_tiny_cifar.py

Model "ViT-Ti/4": patch 4 (64 patches + class token), hidden 192, 12 layers,
3 heads, MLP 768, 5.36 M parameters.

Recipe, after published small-data ViT training (the DeiT-style AdamW
recipe used for CIFAR by Hassani et al., 2021, "Escaping the Big Data
Paradigm with Compact Transformers", and Lee et al., 2021, "Vision
Transformer for Small-Size Datasets"): AdamW lr 1e-3 at batch 128, weight
decay 0.05, 5 warm-up epochs then cosine decay over 200 epochs, label
smoothing 0.1, random crop (pad 4) + horizontal flip, global-norm clip 1.0.

Expected accuracy on a GPU: the published from-scratch figures for ViTs of
this size are 91.4% (ViT-Lite-7/4, 200 epochs, with AutoAugment) and 93.6%
(Lee et al., 100 epochs, with AutoAugment, CutMix/Mixup, random erasing and
stochastic depth). This config uses only crop + flip, so expect several
points less, roughly 85-90%; that range is an estimate, not a measurement
(no GPU run has been made).

On the 2-core CPU of this project's machines one epoch takes about 24
minutes (390 steps at 34.9 images/s; train-step compile 8.4 s; measured with
`python benchmarks/train_throughput.py`), so train it on a GPU/TPU.
"""

from vit_jax import configs


def get_config():
  # The shared defaults in vit_jax/configs.py are this recipe; only the data
  # and the length are set here.
  config = configs.base_config("ViT-Ti/4")
  config.dataset = "cifar10"
  config.num_epochs = 200
  config.random_flip = True
  return config
