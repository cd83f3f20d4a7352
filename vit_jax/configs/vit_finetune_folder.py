r"""Fine-tune a pretrained ViT on your own folder of photos.

  python main.py --config=configs/vit_finetune_folder.py \
      --config.dataset=/path/to/photos --config.init_from=/path/to/ViT-B_16.npz

  python main.py --config=configs/vit_finetune_folder.py:linear_probe \
      --config.dataset=/path/to/photos --config.init_from=/path/to/ViT-B_16.npz
  python main.py --config=configs/vit_finetune_folder.py:ViT-S/16,linear_probe ...

The folder is the ImageNet / torchvision ImageFolder layout:
photos/train/<class>/*.jpg and photos/test/<class>/* (or val/); without a
test split, 10% of each class is held out (--config.holdout_fraction). Any
JPEG, PNG, WebP, BMP or GIF works; class names are the folder names and
appear in the report and predict modes. init_from takes an official or
AugReg `.npz` (imagenet21k/ViT-B_16.npz, augreg/...npz), a vit_jax workdir,
or a torchvision / timm / Hugging Face file (.pth, .bin, .safetensors);
name the checkpoint's architecture after the colon (`:ViT-S/16`, default
ViT-B/16; any name of vit_jax.model.variants) and set
config.normalization to how it was trained ("inception" for
official/big_vision, "imagenet" for torchvision/timm).

The recipe is the paper's fine-tuning (Dosovitskiy et al., 2020, App.
B.1.1): SGD with momentum 0.9, no weight decay, gradient clipping at norm
1, a short warm-up then cosine decay to 0, batch 512, Inception crops
(5-100% of the area) and flips for training, centre crops (87.5%) for
evaluation, the position embeddings interpolated to the new resolution.
The default 224 px is cheaper; the paper's 384 px (--config.image_size=384)
adds ~1 point at 3x the cost. `:linear_probe` trains only a new head on
frozen features (learning rate 0.1): a strong baseline in minutes, and a
way to check a checkpoint before fine-tuning it all.

What to expect: with an ImageNet-21k ViT-B/16, the paper's fine-tuned
results on small natural-image datasets (Table 2 / 5: Oxford Flowers
99.4%, Oxford-IIIT Pets 94.4%, CIFAR-100 91.9% at 384 px) are the
reference; a few thousand photos of everyday classes typically reach
90%+ within 500-2,000 steps on a GPU. On this project's 2-core CPU the
fine-tuning run of docs/data.md (a ViT-Ti/16, an official-layout
checkpoint, Fashion-MNIST written out as a folder of PNGs) shows the path
end to end; ViT-B/16 at 224 px trains at roughly 1-2 images/s there, so
real fine-tuning belongs on an accelerator.
"""

from vit_jax import config as config_lib


def get_config(arg: str = "ViT-B/16"):
  """arg: "[VARIANT][,linear_probe]", e.g. "ViT-S/16,linear_probe"."""
  parts = [part for part in arg.split(",") if part]
  mode = "linear_probe" if "linear_probe" in parts else "finetune"
  names = [part for part in parts if part not in ("finetune", "linear_probe")]
  if len(names) > 1:
    raise ValueError(f"configs/vit_finetune_folder.py:{arg}: give one "
                     "variant, e.g. ViT-S/16,linear_probe.")
  config = config_lib.base_config(names[0] if names else "ViT-B/16")
  config.dataset = "/path/to/photos"  # pass the real folder on the command line
  config.init_from = "ViT-B_16.npz"  # and the real checkpoint
  config.posemb_resize = "bilinear"
  config.image_size = 224
  config.normalization = "inception"
  config.data_pipeline = "auto"  # small folders in memory, big ones streamed
  config.crop_padding = 0
  config.random_resized_crop = True  # Inception crop, area 5-100%
  config.min_crop_area = 0.05
  config.random_flip = True
  config.eval_crop_fraction = 0.875

  config.optimizer = "sgd"
  config.momentum = 0.9
  config.batch_size = 512
  config.accum_steps = 8
  config.num_train_steps = 2_000
  config.learning_rate = 0.01
  config.end_learning_rate = 0.0
  config.warmup_steps = 100
  config.weight_decay = 0.0
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.0
  if mode == "linear_probe":
    config.trainable = "head"
    config.learning_rate = 0.1
    config.accum_steps = 1
    config.num_train_steps = 500

  config.eval_batch_size = 256
  config.eval_every_epochs = 5
  config.log_every_steps = 20
  config.checkpoint_every_steps = 200
  config.keep_best = True
  return config
