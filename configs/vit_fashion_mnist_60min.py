r"""Fashion-MNIST from scratch in 60 minutes of a 2-core CPU.

  python benchmarks/fashion_mnist.py --config=configs/vit_fashion_mnist_60min.py

The recipe of configs/vit_fashion_mnist_15min.py (ViT-Mini/7: patch 7,
4x4 = 16 tokens, width 128, 6 layers, 4 heads, MLP 512, mean-pooled tokens,
2-D sin-cos position embeddings, shifted patch tokens and locality
self-attention; flip, label smoothing, EMA) for 24 epochs, or as many as
fit 60 minutes where 24 do not (`time_budget_minutes`: the trainer measures
its first steps and plans the schedule to the budget), with a longer
warm-up and a longer EMA horizon.

Measured here as now (2-core CPU, a device per core, in a session whose
GEMM rate was half the usual): the plan after 21 steps was 319 ms per
step, 14.6 s per evaluation and 2.3 s per checkpoint, so 20.88 epochs;
test accuracy 90.5% (EMA 90.6%) in 57.3 wall minutes, data loading and
compilation included; the EMA stood at 90.5-90.6% from epoch 16 on;
per-epoch curve in docs/fashion_mnist_60min.png. Short of the 94% target
(README). On a faster day, before the time budget and with one
multi-threaded device: 90.3% (EMA 90.5%) after 24 epochs in 37.8 minutes,
the EMA peaking at 90.7% at epoch 18. Without
shifted patches and locality attention: 90.1% (EMA 90.0%) in 44.6 minutes
(a slower session). The model overfits by the end (training accuracy 98%),
but regularising it did not raise the test accuracy: stochastic depth 0.1
and random erasing 0.25 gave 90.5% (EMA 90.5%) in 38.2 minutes, and a
random 2-pixel shift (`--config.crop_padding=2`, without the two add-ons)
89.5% (EMA 89.3%).
The ablations above ran with one multi-threaded CPU device for 24 epochs;
the config makes the CPU a device per core (`cpu_devices=-1`, as the
15-minute one, where it made the train step 1.2-1.5x faster).
"""

from vit_jax import configs


def get_config():
  config = configs.base_config("ViT-Mini/7")
  config.dataset = "fashion_mnist"
  config.model.classifier = "gap"
  config.model.posemb = "sincos2d"
  config.model.shifted_patches = True  # Lee et al. 2021's SPT and LSA
  config.model.locality_attention = True
  config.num_epochs = 24  # at most; fewer if 60 minutes do not fit them
  config.time_budget_minutes = 60  # plans the steps that fit (budget.py)
  config.batch_size = 128
  config.learning_rate = 2e-3
  config.warmup_epochs = 0.5
  config.weight_decay = 0.05
  config.label_smoothing = 0.1
  config.ema_decay = 0.999
  config.crop_padding = 0
  config.random_flip = True  # garments are left-right symmetric
  config.eval_batch_size = 1000
  config.cpu_devices = -1  # a device per core: small matmuls (README)
  config.log_every_steps = 100
  config.checkpoint_every_steps = 2000
  return config
