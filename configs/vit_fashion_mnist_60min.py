r"""Fashion-MNIST from scratch in 60 minutes of a 2-core CPU.

  python benchmarks/fashion_mnist.py --config=configs/vit_fashion_mnist_60min.py

The recipe of configs/vit_fashion_mnist_15min.py (patch 4, 7x7 = 49
tokens, width 64, 4 heads, mean-pooled tokens, 2-D sin-cos position
embeddings, shifted patch tokens and locality self-attention; flip, label
smoothing, EMA; test images classified together with their mirror images;
patch dropout: each training image keeps a random quarter of its 49
patches, Liu et al. 2023, dropped before they are embedded) on ViT-Micro/4
at its full 6 layers and with the paper's MLP ratio of 4 (MLP 256, 0.31 M
parameters), a longer warm-up and a longer EMA horizon. Patch dropout makes
a train step 5-8x cheaper here (attention's cost falls with the square of
the tokens), so 110-160 epochs fit where 17-21 did, and it regularises the
model, which overfitted without it. The trainer plans the epochs to the
budget (`time_budget_minutes`; at most 300), evaluating every 20 epochs
(params and EMA with the flip average, in batches of 100: 13-26 s).

Measured here (2-core CPU, a device per core), alone on the machine, in a
session where a bare train step of the MLP-128 model took 46 ms: planned
54.5 ms per step, 25.9 s per evaluation, 125.05 epochs; revised at epoch 20
(60.7 ms per step) to 112.93; test accuracy 93.99% (EMA; the params
94.01%) in 58.1 wall minutes, data loading and compilation included;
per-epoch curve in docs/fashion_mnist_60min.png. The EMA read 90.5, 92.0,
93.1, 93.7 and 93.9% at epochs 20, 40, 60, 80 and 100 (11.1, 21.2, 31.0,
41.0 and 51.3 minutes); training accuracy (on a quarter of the patches)
ended at 94.3%. The MLP ratio of 2 (MLP 128), this config before, steps
1.3-1.5x faster and gets more epochs, but learns less from each: 158.29
epochs, 93.7% (EMA 93.7%) in 59.1 minutes in a faster session (40-44 ms per
step), and 101.37 epochs, 93.3% (EMA 93.3%) in a slower one (63-65 ms per
step, an evaluation every 10 epochs). Keeping half of the patches (patch
dropout 0.5, MLP 128, 123-128 ms per step, an evaluation every 5 epochs) in
that session: 50.49 epochs, 92.8% (EMA 92.8%). With 4 layers and MLP 128,
in this session: 193.99 epochs (34-35 ms per step), 93.6% (EMA 93.6%) in
57.9 minutes. The target is 94.0% (README); this run's summary line reads
0.9399, a hundredth of a point short.

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

from vit_jax import configs


def get_config():
  config = configs.base_config("ViT-Micro/4")
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
