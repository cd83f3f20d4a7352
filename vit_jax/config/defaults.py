"""The trainer's defaults: `base_config`, which every file in configs/
starts from, with a comment on every option.

Every config is locked: an override of a key that does not exist
(`--config.batch_sise=64`) fails with the list of valid keys instead of being
silently ignored.
"""

import ml_collections
from ml_collections import config_dict

from vit_jax.model import variants
from vit_jax.runtime import sharding


def base_config(model: str = "ViT-Ti/4") -> ml_collections.ConfigDict:
  """Defaults for every option of the trainer, with model `model`."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Data. `dataset` is cifar10, cifar100, mnist, fashion_mnist, synthetic
  # (these five held in memory), a folder of images (root/train/<class>/*,
  # root/test/<class>/* or val/), or any TFDS image-classification name
  # (imagenette, oxford_iiit_pet, food101, imagenet2012, ...); see
  # vit_jax/data/file_sources.py.
  config.dataset = "cifar10"
  # Where to look: "auto" tries raw files (raw_data_dir, then known system
  # paths), then TFDS; "raw" and "tfds" use only that source.
  config.data_source = "auto"
  config.raw_data_dir = config_dict.placeholder(str)  # IDX / CIFAR binary files
  config.data_dir = config_dict.placeholder(str)  # TFDS data_dir
  config.manual_dir = config_dict.placeholder(str)  # TFDS manual_dir
  config.tfds_download = True  # let TFDS download and prepare when missing
  # Use only the first N examples (folders, TFDS: a fixed random N).
  config.max_train_examples = config_dict.placeholder(int)
  config.max_eval_examples = config_dict.placeholder(int)
  # Folders and TFDS datasets: decoded at image_size (224 if unset) with
  # `channels` (None: 3); "auto" holds them in memory when that takes at
  # most in_memory_max_mib, else streams them ("memory", "stream" force it).
  config.data_pipeline = "auto"
  config.in_memory_max_mib = 2048
  config.channels = config_dict.placeholder(int)
  # Worker processes decoding a streamed dataset; None: half the cores.
  config.data_workers = config_dict.placeholder(int)
  # A folder without test/ or val/: this fraction of each class held out
  # (the same files for the same seed).
  config.holdout_fraction = 0.1
  # Unreadable images: an error naming the file (False), or skipped,
  # counted and reported each epoch (True).
  config.skip_bad_images = False
  # Evaluation of folder/TFDS data: the central crop_fraction of the
  # shorter side, resized to image_size. None: 0.875 with
  # random_resized_crop (the ImageNet recipes' 224/256), else 1.0.
  config.eval_crop_fraction = config_dict.placeholder(float)
  # Synthetic data (dataset="synthetic"): class-dependent patterns + noise.
  config.synthetic = ml_collections.ConfigDict(dict(
      num_train=512, num_eval=128, image_size=32, channels=3, num_classes=10))

  # Augmentation, applied on device inside the train step.
  config.crop_padding = 4  # random crop after zero padding; 0 disables
  # Or an Inception-style random resized crop (box of min_crop_area..1 of
  # the image, aspect 3/4..4/3) resized to image_size: the official
  # fine-tuning augmentation. Use with crop_padding=0.
  config.random_resized_crop = False
  config.min_crop_area = 0.05
  config.random_flip = config_dict.placeholder(bool)  # None: dataset default
  # Evaluation (and the report, predict, attention tools) classify by the
  # mean logits of each image and its mirror image: 2x the eval forward.
  config.eval_flip_average = False
  # After crop and flip: "randaugment" (randaugment_num_ops operations at
  # randaugment_magnitude, 0-10) or "trivialaugment" (one operation, random
  # magnitude), on device; see vit_jax/data/randaugment.py. "none" disables.
  config.auto_augment = "none"
  config.randaugment_num_ops = 2
  config.randaugment_magnitude = 9.0
  # Probability of erasing a random box of each image (after
  # normalisation, with noise); 0 disables.
  config.random_erasing = 0.0
  # Mixup / CutMix Beta(alpha, alpha) weights; 0 disables one. Both > 0:
  # each batch uses one of them, 50/50. Targets are mixed the same way.
  config.mixup_alpha = 0.0
  config.cutmix_alpha = 0.0
  # Resize (bilinear, on device) to image_size x image_size after the crop,
  # e.g. 384 to fine-tune at the paper's resolution; None keeps the size.
  config.image_size = config_dict.placeholder(int)
  # Pixel scaling: "dataset" (per-channel mean/std of the training split),
  # "inception" ([-1, 1]: official and big_vision checkpoints) or
  # "imagenet" (ImageNet mean/std: torchvision, timm and most HF models).
  config.normalization = "dataset"

  # Start from a pretrained checkpoint (.npz, Orbax folder or PyTorch state
  # dict); see vit_jax/checkpoints/pretrained.py. Ignored when resuming
  # from workdir.
  config.init_from = config_dict.placeholder(str)
  config.posemb_resize = "bilinear"  # or "bicubic": for a new image size
  config.trainable = "all"  # "head" freezes the rest: a linear probe

  config.model = variants.get_variant(model)

  # Devices: config.mesh gives the size of each mesh axis; -1 takes the
  # remaining devices. `data` splits the batch; `fsdp` also splits every
  # floating array of at least fsdp_min_size elements (params and optimizer
  # state) along its largest divisible dimension. E.g. data=-1 (default:
  # data parallel on every device), or data=4, fsdp=2 on 8 devices.
  # Training results do not depend on the mesh (up to float rounding).
  config.mesh = sharding.default_mesh_config()
  config.fsdp_min_size = 1024
  # On a CPU: split it into this many devices (-1: one per core it may
  # use, within a container's CPU quota), each running its part of the
  # batch, so that independent chains of kernels keep the cores busy. Pays
  # for small models (docs/performance.md); 0 keeps one multi-threaded
  # device. Applied by main.py before JAX starts;
  # an XLA_FLAGS device count of the user's wins.
  config.cpu_devices = 0
  # On a CPU, check before the train and eval steps first run that they fit
  # in the host's memory (vit_jax/runtime/host_memory.py): a step that does
  # not is otherwise killed partway by the system, with nothing logged.
  # False runs it regardless (e.g. where swap makes up the difference).
  config.check_host_memory = True
  # Train steps per dispatch from the host: k > 1 runs k steps as one
  # program looping on the device (steps.train_steps), so the host's work
  # per step (sending a state of hundreds of arrays) is paid once per k
  # steps. Pays where that work sets the pace: small models on a GPU. The
  # steps and their results are the same; logs, evaluations and
  # checkpoints fall between dispatches, so choose a k that divides
  # log_every_steps, checkpoint_every_steps and the steps between
  # evaluations (others run single steps around them, compiled apart).
  config.steps_per_dispatch = 1

  # Optimisation: linear warm-up then cosine decay, global-norm clip, and
  # "adamw", "lamb" or "sgd" (with momentum: the paper's fine-tuning
  # recipe).
  config.optimizer = "adamw"
  # How AdamW updates the parameters: "auto" (a C++ kernel for float32
  # parameters on a CPU, whole on each device; XLA's per-parameter fusions
  # elsewhere), "cpu_kernel" or "xla" (kernels/cpu_adamw.py says why).
  config.optimizer_implementation = "auto"
  config.batch_size = 128  # examples per update, over all devices
  # Split each batch into accum_steps micro-batches whose gradients are
  # averaged: the same update as the whole batch, in 1/accum_steps memory.
  # So batch_size = (examples per device per micro-batch) x accum_steps x
  # devices (data x fsdp), whatever the mesh or the number of hosts.
  config.accum_steps = 1
  config.eval_batch_size = 500
  config.num_epochs = 100
  config.num_train_steps = config_dict.placeholder(int)  # overrides epochs
  # Train as many steps as fit this many wall minutes (at most the epochs or
  # steps above), planned from the speed of the first steps; 0: off.
  # The plan is kept in workdir/time_plan.json for resuming (budget.py).
  config.time_budget_minutes = 0.0
  config.learning_rate = 1e-3
  config.end_learning_rate = 1e-5
  config.schedule = "cosine"  # decay after warm-up: "cosine" or "linear"
  config.warmup_epochs = 5.0
  config.warmup_steps = config_dict.placeholder(int)  # overrides the epochs
  config.weight_decay = 0.05
  config.decay_all_params = False  # also decay biases, LN scales, embeddings
  config.adam_b1 = 0.9
  config.adam_b2 = 0.999
  config.momentum = 0.9  # for optimizer="sgd"
  # Layer-wise learning-rate decay: block i from the top learns at
  # layer_decay ** i times the head's rate (e.g. 0.75 to fine-tune); 1 off.
  config.layer_decay = 1.0
  # Exponential moving average of the params, evaluated next to them
  # (eval metrics ema_loss, ema_accuracy); 0 disables, e.g. 0.999.
  config.ema_decay = 0.0
  config.grad_clip_norm = 1.0  # 0 disables clipping
  # A NaN/Inf loss or gradient stops training (nothing poisoned is saved);
  # True skips that step's update instead and logs it.
  config.skip_nonfinite_steps = False
  config.label_smoothing = 0.1
  # Sharpness-aware minimisation: each update takes the gradient at the
  # params moved sam_rho along the normalised gradient (two passes a step);
  # 0 disables, e.g. 0.05.
  config.sam_rho = 0.0
  # Unmasked tuning (Li et al. 2023, FLIP), for a model trained with
  # model.patch_dropout_rate > 0: the run's last unmasked_tuning_epochs
  # train on every patch, as the model is tested, at a learning rate
  # decaying from unmasked_tuning_learning_rate to 0 (cosine). 0 disables.
  config.unmasked_tuning_epochs = 0.0
  config.unmasked_tuning_learning_rate = 1e-4

  # Bookkeeping.
  config.log_every_steps = 50
  # And after the last step; an interval's evaluation less than half an
  # interval before it is skipped (budget.evaluates_after).
  config.eval_every_epochs = 1
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 3  # the latest N (resume uses the last one)
  # Also keep the params of the best eval accuracy in workdir/best/
  # (params.npz, official layout, usable as init_from; metrics.json).
  config.keep_best = False
  config.lock()
  return config
