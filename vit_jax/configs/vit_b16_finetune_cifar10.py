r"""Fine-tune ImageNet-21k ViT-B/16 on CIFAR-10 at 384 px: the paper's recipe.

  python main.py --config=configs/vit_b16_finetune_cifar10.py \
      --config.init_from=/path/to/imagenet21k/ViT-B_16.npz

The setup of the official google-research/vision_transformer fine-tuning
(Dosovitskiy et al., 2020, Appendix B.1.1): the ImageNet-21k checkpoint
(`imagenet21k/ViT-B_16.npz` of the official release; torchvision, timm and
Hugging Face files load too), its pre-logits layer dropped and a new
zero-initialised 10-class head; CIFAR-10 training images cropped
Inception-style (random box of 5-100% of the area) and resized to 384x384,
test images resized (the 224-px position embedding interpolated bilinearly
to the 24x24 grid), random flips, pixels scaled to [-1, 1]; SGD with momentum 0.9, batch 512, learning rate
0.03, 500 warm-up steps then cosine decay over 10,000 steps, gradient clipped
to global norm 1, no weight decay, no dropout, no label smoothing.

Expected result: about 99.0% test accuracy, the official repository's figure
for this setup (ViT-B/16, 10k steps, 384 px; the paper's Table 5 gives
98.95-99.00%). That is a GPU/TPU run: on 2 cores of a Zen 5 EPYC, ViT-B/16
at 384 px trains at 1.5 images/s with a device per core
(--config.cpu_devices=-1; `python benchmarks/throughput.py
--models=ViT-B/16@384`, 2.5x timm's; 0.7 images/s and 1.35x on a Zen 4),
so one 512-image step takes ~6 minutes there,
and XLA's scratch is ~0.4 GiB per image of a micro-batch: 64 images need
~26 GiB, which the check before the first step reports where the host has
less (raise accum_steps). What runs here, to show it works (34 s and 3 GB
peak RSS on that Zen 5, 61 s and 4.1 GB on the Zen 4):

  python -m vit_jax.checkpoints.convert --random_init=ViT-B/16 --num_classes=21843 \
      --representation_size=768 --output=/tmp/ViT-B_16-random.npz
  python main.py --config=configs/vit_b16_finetune_cifar10.py \
      --config.init_from=/tmp/ViT-B_16-random.npz --config.dataset=synthetic \
      --config.batch_size=8 --config.accum_steps=4 --config.num_train_steps=3 \
      --config.eval_batch_size=8 --config.synthetic.num_eval=8

accum_steps splits each 512-image batch into micro-batches (64 images each
by default) with the same update; raise it if a device runs out of memory.
On GPU/TPU add --config.model.dtype=bfloat16; on a CPU with bfloat16 dot
instructions --config.model.matmul_dtype=bfloat16 (2.6 images/s on that Zen
5, 1.56x PyTorch's autocast; 1.2 images/s and 1.46x on a Zen 4).
"""

from vit_jax import config as config_lib


def get_config():
  config = config_lib.base_config("ViT-B/16")
  config.dataset = "cifar10"
  config.init_from = "ViT-B_16.npz"  # pass the real path on the command line
  config.posemb_resize = "bilinear"
  config.image_size = 384
  config.normalization = "inception"
  config.crop_padding = 0
  config.random_resized_crop = True  # Inception crop, area 5-100%
  config.min_crop_area = 0.05
  config.random_flip = True

  config.optimizer = "sgd"
  config.momentum = 0.9
  config.batch_size = 512
  config.accum_steps = 8
  config.num_train_steps = 10_000
  config.learning_rate = 0.03
  config.end_learning_rate = 0.0
  config.warmup_steps = 500
  config.weight_decay = 0.0
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.0

  config.eval_batch_size = 512
  config.eval_every_epochs = 10
  config.log_every_steps = 50
  config.checkpoint_every_steps = 500
  return config
