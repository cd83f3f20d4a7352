"""Slow: the shipped Fashion-MNIST config learns on the real data.

  python -m pytest -m slow
"""

import pytest

from vit_jax import configs, train


@pytest.mark.slow
def test_fashion_mnist_learns_in_a_few_hundred_steps(tmp_path,
                                                     fashion_mnist_dir):
  config = configs.base_config("ViT-Mini/4")
  config.dataset = "fashion_mnist"
  config.raw_data_dir = fashion_mnist_dir
  config.num_train_steps = 400
  config.batch_size = 128
  config.eval_batch_size = 1000
  config.warmup_epochs = 0.1
  config.crop_padding = 0
  config.log_every_steps = 100
  config.checkpoint_every_steps = 400
  metrics = train.train_and_evaluate(config, str(tmp_path))
  assert metrics["num_examples"] == 10_000
  assert metrics["accuracy"] > 0.75, metrics  # chance is 0.10
