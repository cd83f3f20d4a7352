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

from vit_jax.data import draws


def _box_masks(centre_y: jax.Array, centre_x: jax.Array, height: int,
               width: int, area: jax.Array, aspect: jax.Array) -> jax.Array:
  """(batch, H, W, 1) masks, 1 inside a box of `area` (fraction of the
  image) and aspect ratio `aspect` centred at (centre_y, centre_x)
  (fractions of the height and width), clipped to the image. Every
  argument but the sizes is per image, shape (batch,)."""
  box_height = jnp.sqrt(area / aspect) * height
  box_width = jnp.sqrt(area * aspect) * width
  rows = jnp.arange(height)[None, :, None] + 0.5
  cols = jnp.arange(width)[None, None, :] + 0.5
  inside = ((jnp.abs(rows - height * centre_y[:, None, None])
             < box_height[:, None, None] / 2) &
            (jnp.abs(cols - width * centre_x[:, None, None])
             < box_width[:, None, None] / 2))
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
  _, height, width, _ = images.shape
  centre_y, centre_x = jax.random.uniform(key, (2, 1))
  mask = _box_masks(centre_y, centre_x, height, width,
                    jnp.reshape(1 - lam, (1,)), jnp.ones((1,)))
  pasted = jnp.mean(mask)
  return (mask * images[::-1] + (1 - mask) * images,
          (1 - pasted) * targets + pasted * targets[::-1])


def beta_draws(key: jax.Array, alphas: tuple[float, ...]) -> jax.Array:
  """One Beta(alpha, alpha) draw per alpha, shape (len(alphas),).

  Beta(a, a) = G1 / (G1 + G2) for independent G1, G2 ~ Gamma(a), taken in
  log space, as jax.random.beta does, so that small alphas do not
  underflow; all the gammas are one draw of `log_gamma_draws`, which has
  no loop. (`jax.random.beta` per alpha made four rejection-sampling
  loops, which XLA:CPU compiles separately: Mixup + CutMix added ~4 s to a
  vit_tiny_cifar train step's compile.)
  """
  log_gammas = log_gamma_draws(
      key, jnp.repeat(jnp.asarray(alphas, jnp.float32), 2)).reshape(-1, 2)
  return jax.nn.sigmoid(log_gammas[:, 0] - log_gammas[:, 1])


def log_gamma_draws(key: jax.Array, alphas: jax.Array,
                    proposals: int = 16) -> jax.Array:
  """The logs of one Gamma(alpha, 1) draw per alpha; alphas (n,) -> (n,).

  Marsaglia and Tsang's (2000) rejection method with every alpha's
  `proposals` drawn at once and the first accepted one kept, so that the
  program has no loop of its own. (`jax.random.loggamma` loops until it
  accepts: `beta_draws` on it compiled 48 XLA:CPU kernels in ~1.5 s on a
  2-core CPU, on this 18 kernels.) Each proposal is accepted with
  probability > 0.95, so all 16 are rejected with probability < 1e-20
  (the last is kept then). Alpha < 1 draws Gamma(alpha + 1) x
  U^(1 / alpha).
  """
  alphas = jnp.asarray(alphas, jnp.float32)
  boosted = jnp.where(alphas < 1, alphas + 1, alphas)[:, None]
  d = boosted - 1 / 3
  # One draw for all: the proposals' normals, their acceptance uniforms,
  # and the boosts' uniforms.
  uniforms = draws.uniforms(key, (2 * proposals + 1,) + alphas.shape)
  x = draws.standard_normal(uniforms[:proposals].T)
  log_u = jnp.log(uniforms[proposals:-1].T)
  v = (1 + x / jnp.sqrt(9 * d)) ** 3
  log_v = jnp.log(jnp.maximum(v, jnp.finfo(jnp.float32).tiny))
  accepted = (v > 0) & (log_u < x**2 / 2 + d - d * v + d * log_v)
  # The first accepted proposal; the last if none is.
  first = jnp.where(accepted.any(-1), jnp.argmax(accepted, -1), proposals - 1)
  log_gamma = (jnp.log(d) + log_v)[jnp.arange(alphas.shape[0]), first]
  log_boost = jnp.log(uniforms[-1]) / alphas
  return jnp.where(alphas < 1, log_gamma + log_boost, log_gamma)


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
  draw_key, noise_key = jax.random.split(key)
  chosen, area, log_ratio, centre_y, centre_x = draws.uniforms(
      draw_key, (5, batch))  # one draw (draws.py)
  area = min_area + (max_area - min_area) * area
  low, high = jnp.log(aspect[0]), jnp.log(aspect[1])
  ratio = jnp.exp(low + (high - low) * log_ratio)
  mask = _box_masks(centre_y, centre_x, height, width, area, ratio)
  mask = mask * (chosen < probability)[:, None, None, None]
  noise = jax.random.normal(noise_key, images.shape, images.dtype)
  return jnp.where(mask > 0, noise, images)
