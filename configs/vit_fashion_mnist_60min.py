r"""Fashion-MNIST from scratch in 60 minutes of a 2-core CPU.

  python benchmarks/fashion_mnist.py --config=configs/vit_fashion_mnist_60min.py

The recipe of configs/vit_fashion_mnist_15min.py (ViT-Micro/4: patch 4,
7x7 = 49 tokens, width 64, 6 layers, 4 heads, MLP 128, mean-pooled tokens,
2-D sin-cos position embeddings, shifted patch tokens and locality
self-attention; flip, label smoothing, EMA; test images classified together
with their mirror images) for 24 epochs, or as many as fit 60 minutes where
24 do not (`time_budget_minutes`: the trainer measures its first steps and
plans the schedule to the budget), with a longer warm-up and a longer EMA
horizon.

Measured here as now (2-core CPU, a device per core, in a session whose
GEMM rate was half the best seen on this machine): the plan after 21 steps was 285 ms per
step, 30.6 s per evaluation and 2.2 s per checkpoint, so 20.71 epochs;
test accuracy 91.5% (EMA 91.5%), data loading and compilation included,
after 68.3 wall minutes, late because test runs of mine shared the two
cores for about 21 of them and the steps ran 8% slower than planned (the
trainer now revises its plan after each evaluation); 91.4% (EMA 91.5%) at
epoch 18, after 56.7 minutes. Then, alone on the machine, in a session
slower still: planned 347 ms per step and 34.0 s per evaluation, 17.09
epochs; revised after six of the evaluations (16.00 to 18.00 epochs) as the
step measured 313 to 362 ms; 91.1% (EMA 91.2%) in 58.2 minutes at 17.46
epochs, per-epoch curve in docs/fashion_mnist_60min.png. Short of the 94%
target (README). The same run without the flip average, in the same session: the
24 epochs fitted (plan 248 ms per step); 90.6% (EMA 90.8%) in 56.9 minutes,
the EMA peaking at 91.1% at epoch 19, then slipping as the model overfits
(training accuracy 97.5%); the flip average lifts its final params from
90.63% to 91.64%.

With ViT-Mini/7 (patch 7, width 128, MLP 512, 1.2 M parameters), the model of
this config until now, in an equally slow session: 90.5% (EMA 90.6%) in
57.3 minutes (20.88 planned epochs), the EMA flat at 90.5-90.6% from epoch
16 on. Regularising that model did not raise its test accuracy: stochastic
depth 0.1 and random erasing 0.25 gave 90.5% (EMA 90.5%), a random 2-pixel
shift 89.5% (EMA 89.3%), sharpness-aware minimisation 90.4% (EMA 90.35%).
"""

from vit_jax import configs


def get_config():
  config = configs.base_config("ViT-Micro/4")
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
  config.eval_flip_average = True  # and so classified from both sides
  config.eval_batch_size = 1000
  config.cpu_devices = -1  # a device per core: small matmuls (README)
  config.log_every_steps = 100
  config.checkpoint_every_steps = 2000
  return config
