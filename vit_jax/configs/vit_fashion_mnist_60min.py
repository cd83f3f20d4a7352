r"""Fashion-MNIST from scratch in 60 minutes of a 2-core CPU.

  python benchmarks/fashion_mnist.py --config=configs/vit_fashion_mnist_60min.py

The recipe of configs/vit_fashion_mnist_15min.py (patch 4, 7x7 = 49
tokens, width 64, 4 heads, mean-pooled tokens, 2-D sin-cos position
embeddings, shifted patch tokens and locality self-attention; flip, label
smoothing, EMA; test images classified together with their mirror images;
patch dropout: each training image keeps a random quarter of its 49
patches, Liu et al. 2023, dropped before they are embedded) on ViT-Micro/4
at its full 6 layers and with the paper's MLP ratio of 4 (MLP 256, 0.31 M
parameters), a longer warm-up and a longer EMA horizon, and one epoch of
unmasked tuning at the end (Li et al. 2023): the last 468 steps train on
all 49 patches, as the model is tested, at a learning rate decaying from
1e-4 to 0, which closes the gap patch dropout leaves between training and
test (about 1.8 minutes: 213 ms a step). Patch dropout makes a train step
5-8x cheaper here (attention's cost falls with the square of the tokens),
so 110-160 epochs fit where 17-21 did, and it regularises the model, which
overfitted without it. The trainer plans the epochs to the budget
(`time_budget_minutes`; at most 300) with the tuning's measured cost set
aside, evaluating every 20 epochs (params and EMA with the flip average, in
batches of 100: 13-26 s).

Measured here (2-core CPU, a device per core), alone on the machine:
planned 51.0 ms per step, 15.3 s per evaluation, 133.88 epochs; revised at
epochs 60, 80, 100 and 120 as the steps sped up (49.4 to 45.6 ms) to
143.44; test accuracy 94.04% (EMA 94.02%, the summary line's 0.9402) in
58.0 wall minutes, data loading and compilation included; per-epoch curve
in docs/fashion_mnist_60min.png. The EMA read 90.6, 91.9, 93.0, 93.3, 93.6
and 93.9% at epochs 20, 40, 60, 80, 100 and 120 (9.2 to 47.8 minutes).
The same config without the tuning, run just before it: 140.50 epochs,
93.84% (EMA 93.89%) in 58.6 minutes, and 94.01% (EMA 93.99%) at 112.93
epochs in a slower session. The MLP ratio of 2 (MLP 128) steps 1.3-1.5x
faster and gets more epochs, but learns less from each: 158.29 epochs,
93.7% (EMA 93.7%); with 4 layers and MLP 128, 193.99 epochs, 93.6% (EMA
93.6%). Keeping half of the patches (patch dropout 0.5, MLP 128): 50.49
epochs, 92.8% (EMA 92.8%).

Before patch dropout (17-21 epochs in the budget): 91.5% (EMA 91.5%) in
68.3 minutes with the cores shared for a third of the run, and 91.1% (EMA
91.2%) in 58.2 minutes alone in a slower session; 24 epochs without the
flip average overfitted (training accuracy 97.5%, the EMA peaking at 91.1%
at epoch 19). With ViT-Mini/7 (patch 7, width 128, MLP 512, 1.2 M
parameters), the model of this config before ViT-Micro/4: 90.5% (EMA
90.6%); stochastic depth 0.1 with random erasing 0.25, a random 2-pixel
shift, or sharpness-aware minimisation did not raise it (90.5%, 89.5%,
90.4%).
"""

from vit_jax import config as config_lib


def get_config():
  config = config_lib.base_config("ViT-Micro/4")
  config.dataset = "fashion_mnist"
  config.model.classifier = "gap"
  config.model.posemb = "sincos2d"
  config.model.mlp_dim = 256  # the paper's MLP ratio of 4; 128 learned less
  config.model.shifted_patches = True  # Lee et al. 2021's SPT and LSA
  config.model.locality_attention = True
  config.model.patch_dropout_rate = 0.75  # trains on 12 of the 49 tokens
  config.unmasked_tuning_epochs = 1.0  # then on all 49: +0.1-0.2 points
  config.num_epochs = 300  # at most; the time budget decides
  config.time_budget_minutes = 60  # plans the steps that fit (budget.py)
  config.batch_size = 128
  config.learning_rate = 2e-3
  config.warmup_epochs = 0.5
  config.weight_decay = 0.05
  config.label_smoothing = 0.1
  config.ema_decay = 0.999
  config.crop_padding = 0
  config.random_flip = True  # garments are left-right symmetric
  config.eval_flip_average = True  # and so classified from both sides
  config.eval_batch_size = 100  # 1.5x the images/s of 1000 here (cache)
  config.eval_every_epochs = 20
  config.cpu_devices = -1  # a device per core: small matmuls (README)
  config.log_every_steps = 100
  config.checkpoint_every_steps = 2000
  return config
