"""Mixup, CutMix and random erasing: batch-level regularisers, on device.

Mixup (Zhang et al., 2018) blends each image with another of the batch and
their one-hot targets by the same weight lam ~ Beta(alpha, alpha). CutMix
(Yun et al., 2019) pastes a box of another image instead, and mixes the
targets by the pasted area. As in timm, one lam per batch, the partner of
image i is image B-1-i (the batch is already shuffled), and when both are
enabled each batch uses one of them with probability 1/2. Random erasing
(Zhong et al., 2020) replaces a random box of each chosen image by noise.
"""

import jax
import jax.numpy as jnp


def _box_masks(key: jax.Array, batch: int, height: int, width: int,
               area: jax.Array, aspect: jax.Array) -> jax.Array:
  """(batch, H, W, 1) masks, 1 inside a box of `area` (fraction of the
  image, per image) and aspect ratio `aspect` centred at a uniform random
  point and clipped to the image."""
  y_key, x_key = jax.random.split(key)
  box_height = jnp.sqrt(area / aspect) * height
  box_width = jnp.sqrt(area * aspect) * width
  centre_y = jax.random.uniform(y_key, (batch,)) * height
  centre_x = jax.random.uniform(x_key, (batch,)) * width
  rows = jnp.arange(height)[None, :, None] + 0.5
  cols = jnp.arange(width)[None, None, :] + 0.5
  inside = ((jnp.abs(rows - centre_y[:, None, None]) < box_height[:, None,
                                                                  None] / 2) &
            (jnp.abs(cols - centre_x[:, None, None]) < box_width[:, None,
                                                                 None] / 2))
  return inside[..., None].astype(jnp.float32)


def mixup(images: jax.Array, targets: jax.Array, lam: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
  """lam x (image, target) + (1 - lam) x the reversed batch's."""
  return (lam * images + (1 - lam) * images[::-1],
          lam * targets + (1 - lam) * targets[::-1])


def cutmix(images: jax.Array, targets: jax.Array, lam: jax.Array,
           key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Pastes a box of (1 - lam) of the area from the reversed batch; the
  targets mix by the area actually pasted (the box is clipped at edges)."""
  batch, height, width, _ = images.shape
  mask = _box_masks(key, 1, height, width, jnp.reshape(1 - lam, (1,)),
                    jnp.ones((1,)))
  pasted = jnp.mean(mask)
  return (mask * images[::-1] + (1 - mask) * images,
          (1 - pasted) * targets + pasted * targets[::-1])


def beta_draws(key: jax.Array, alphas: tuple[float, ...]) -> jax.Array:
  """One Beta(alpha, alpha) draw per alpha, shape (len(alphas),).

  Why not `jax.random.beta` per alpha: each makes two gamma draws, each a
  rejection-sampling loop that XLA:CPU compiles separately (Mixup + CutMix
  added ~4 s to a vit_tiny_cifar train step's compile). Here all the gammas
  are one vectorised draw; Beta(a, a) = G1 / (G1 + G2) for independent
  G1, G2 ~ Gamma(a), taken in log space, as jax.random.beta does, so
  small alphas do not underflow.
  """
  log_gammas = jax.random.loggamma(
      key, jnp.repeat(jnp.asarray(alphas, jnp.float32), 2)).reshape(-1, 2)
  return jax.nn.sigmoid(log_gammas[:, 0] - log_gammas[:, 1])


def mix_batch(images: jax.Array, targets: jax.Array, key: jax.Array, *,
              mixup_alpha: float, cutmix_alpha: float
              ) -> tuple[jax.Array, jax.Array]:
  """Mixup and/or CutMix of float images (B, H, W, C) and soft targets
  (B, K); alpha 0 disables one. Both enabled: one per batch, chosen 50/50.
  """
  if not mixup_alpha and not cutmix_alpha:
    return images, targets
  choice_key, lam_key, box_key = jax.random.split(key, 3)
  mixup_lam, cutmix_lam = beta_draws(
      lam_key, (mixup_alpha or 1.0, cutmix_alpha or 1.0))
  if mixup_alpha:
    mixed = mixup(images, targets, mixup_lam)
  if cutmix_alpha:
    cut = cutmix(images, targets, cutmix_lam, box_key)
  if not cutmix_alpha:
    return mixed
  if not mixup_alpha:
    return cut
  use_cutmix = jax.random.bernoulli(choice_key, 0.5)
  return jax.tree.map(lambda a, b: jnp.where(use_cutmix, a, b), cut, mixed)


def random_erasing(images: jax.Array, key: jax.Array, probability: float,
                   min_area: float = 0.02, max_area: float = 1 / 3,
                   aspect: tuple[float, float] = (0.3, 3.3)) -> jax.Array:
  """With `probability` per image, replaces a box of min_area..max_area of
  it (log-uniform aspect ratio) by standard normal noise. For normalised
  images (B, H, W, C), where noise has the data's scale."""
  if probability <= 0:
    return images
  batch, height, width, _ = images.shape
  apply_key, area_key, aspect_key, box_key, noise_key = jax.random.split(
      key, 5)
  area = jax.random.uniform(area_key, (batch,), minval=min_area,
                            maxval=max_area)
  ratio = jnp.exp(jax.random.uniform(aspect_key, (batch,),
                                     minval=jnp.log(aspect[0]),
                                     maxval=jnp.log(aspect[1])))
  mask = _box_masks(box_key, batch, height, width, area, ratio)
  mask = mask * jax.random.bernoulli(apply_key, probability,
                                     (batch, 1, 1, 1))
  noise = jax.random.normal(noise_key, images.shape, images.dtype)
  return jnp.where(mask > 0, noise, images)
