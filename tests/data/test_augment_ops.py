"""RandAugment / TrivialAugment operations, Mixup, CutMix, random erasing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from PIL import Image, ImageEnhance, ImageOps

from vit_jax.data import augment, draws, mixing, randaugment

OPS = randaugment.OPS


def _images(batch=4, size=20, channels=3, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (batch, size, size, channels)).astype(np.uint8)


_apply_ops = jax.jit(randaugment.apply_ops)  # one compile per image shape


def _apply(images, op, magnitude, sign=1.0):
  batch = len(images)
  return np.asarray(_apply_ops(
      jnp.asarray(images, jnp.float32), jnp.full((batch,), OPS.index(op)),
      jnp.full((batch,), magnitude), jnp.full((batch,), sign)))


@pytest.mark.parametrize("op", OPS)
def test_each_op_keeps_shape_and_pixel_range(op):
  images = _images()
  for magnitude, sign in ((0.3, 1.0), (1.0, -1.0)):
    out = _apply(images, op, magnitude, sign)
    assert out.shape == images.shape and out.dtype == np.float32
    assert out.min() >= 0.0 and out.max() <= 255.0


@pytest.mark.parametrize("op", [op for op in OPS if op not in
                                ("auto_contrast", "equalize")])
def test_magnitude_zero_is_the_identity(op):
  images = _images()
  np.testing.assert_allclose(_apply(images, op, 0.0), images, atol=1e-3)


@pytest.mark.parametrize("op, pil", [
    ("brightness", lambda im, f: ImageEnhance.Brightness(im).enhance(f)),
    ("color", lambda im, f: ImageEnhance.Color(im).enhance(f)),
    ("contrast", lambda im, f: ImageEnhance.Contrast(im).enhance(f)),
    ("sharpness", lambda im, f: ImageEnhance.Sharpness(im).enhance(f)),
])
def test_enhancements_match_pil(op, pil):
  images = _images(batch=2, size=24)
  for magnitude, sign in ((0.5, 1.0), (0.8, -1.0)):
    factor = 1.0 + 0.9 * magnitude * sign
    ours = _apply(images, op, magnitude, sign)
    reference = np.stack([np.asarray(pil(Image.fromarray(image), factor))
                          for image in images])
    # PIL rounds to uint8 at each stage (and Contrast uses an integer
    # mean), so allow a couple of levels.
    assert np.abs(ours - reference.astype(np.float32)).max() <= 2.5, op


def test_point_operations_match_pil():
  images = _images(batch=2, size=16)
  solarized = _apply(images, "solarize", 0.5)  # threshold 128
  posterized = _apply(images, "posterize", 1.0)  # 4 bits
  stretched = _apply(np.clip(images // 2 + 40, 0, 255).astype(np.uint8),
                     "auto_contrast", 0.0)
  for i, image in enumerate(images):
    pil = Image.fromarray(image)
    np.testing.assert_array_equal(solarized[i],
                                  np.asarray(ImageOps.solarize(pil, 128)))
    np.testing.assert_array_equal(posterized[i],
                                  np.asarray(ImageOps.posterize(pil, 4)))
    low = Image.fromarray(np.clip(image // 2 + 40, 0, 255).astype(np.uint8))
    assert np.abs(stretched[i] - np.asarray(ImageOps.autocontrast(low))
                  ).max() <= 1.0


def test_equalize_spreads_a_narrow_histogram():
  rng = np.random.default_rng(1)
  narrow = rng.integers(100, 110, (2, 16, 16, 1)).astype(np.uint8)
  out = _apply(narrow, "equalize", 0.0)
  assert out.max() == 255.0 and out.min() < 40
  # Monotone: a brighter input pixel never becomes darker.
  order = np.argsort(narrow[0].ravel(), kind="stable")
  assert np.all(np.diff(out[0].ravel()[order]) >= 0)


def test_geometric_ops_move_pixels_as_specified():
  image = np.zeros((1, 20, 20, 1), np.uint8)
  image[0, 5:15, 8:12] = 200
  # translate_x at full magnitude: 0.3 x 20 = 6 columns, zeros shifted in.
  shifted = _apply(image, "translate_x", 1.0)
  expected = np.zeros_like(image)
  expected[0, 5:15, 14:18] = 200
  np.testing.assert_allclose(shifted, expected, atol=1e-3)
  # Rotation keeps the centre and the total mass (roughly), moves corners.
  square = np.full((1, 21, 21, 1), 255, np.uint8)
  rotated = _apply(square, "rotate", 1.0)  # 30 degrees
  assert rotated[0, 10, 10, 0] == pytest.approx(255.0)
  assert rotated[0, 0, 0, 0] == 0.0
  sheared = _apply(image, "shear_x", 1.0)
  assert not np.allclose(sheared, image)
  assert sheared.sum() == pytest.approx(image.sum(), rel=0.05)


def test_rand_and_trivial_augment_vary_per_image_and_jit():
  same = np.repeat(_images(batch=1, size=16), 16, axis=0).astype(np.float32)
  key = jax.random.PRNGKey(0)
  for augmented in (jax.jit(randaugment.rand_augment)(same, key),
                    jax.jit(randaugment.trivial_augment)(same, key)):
    augmented = np.asarray(augmented)
    assert augmented.shape == same.shape
    distinct = {augmented[i].tobytes() for i in range(16)}
    assert len(distinct) > 8  # different ops/magnitudes per image


@pytest.mark.parametrize("num_ops", [0, 1, 3])
def test_rand_augment_applies_num_ops_draws_in_turn(num_ops):
  """rand_augment (a scan over its operations) is apply_ops applied
  num_ops times in turn, each with its own row of the one draw: the same
  values as that loop, bit for bit."""
  images = jax.random.uniform(jax.random.PRNGKey(0), (6, 12, 12, 3)) * 255
  key = jax.random.PRNGKey(1)
  got = jax.jit(randaugment.rand_augment, static_argnums=2)(
      images, key, num_ops)

  def looped(images):
    for choice, jitter, sign in draws.uniforms(key, (num_ops, 3, 6)):
      magnitudes = jnp.clip(0.9 + 0.05 * draws.standard_normal(jitter),
                            0.0, 1.0)
      images = randaugment.apply_ops(
          images, draws.integers(choice, len(randaugment.OPS)), magnitudes,
          draws.signs(sign))
    return images

  np.testing.assert_array_equal(got, jax.jit(looped)(images))
  assert (num_ops == 0) == bool(jnp.all(got == images))


def test_train_preprocess_with_everything_and_eval_is_unaffected():
  images = jnp.asarray(_images(batch=8, size=16, channels=1))
  mean, std = np.array([100.0]), np.array([50.0])
  out = augment.train_preprocess(
      images, jax.random.PRNGKey(0), mean=mean, std=std, crop_padding=2,
      flip=True, auto_augment="randaugment", erase_probability=0.5)
  assert out.shape == (8, 16, 16, 1) and out.dtype == jnp.float32
  evaluated = augment.eval_preprocess(images, mean=mean, std=std)
  np.testing.assert_allclose(evaluated, (np.asarray(images) - 100.0) / 50.0,
                             rtol=1e-6)


def test_mixup_mixes_images_and_targets_by_lam():
  images = jnp.arange(4.0).reshape(4, 1, 1, 1) * jnp.ones((4, 2, 2, 1))
  targets = jax.nn.one_hot(jnp.arange(4), 4)
  mixed, mixed_targets = mixing.mixup(images, targets, jnp.float32(0.3))
  np.testing.assert_allclose(mixed[:, 0, 0, 0],
                             0.3 * np.arange(4) + 0.7 * np.arange(4)[::-1])
  np.testing.assert_allclose(mixed_targets[0], [0.3, 0, 0, 0.7], atol=1e-7)
  np.testing.assert_allclose(mixed_targets.sum(-1), 1.0, rtol=1e-6)


def test_cutmix_targets_match_the_pasted_area():
  batch = 6
  images = jnp.arange(float(batch)).reshape(batch, 1, 1, 1) * jnp.ones(
      (batch, 16, 16, 1))
  targets = jax.nn.one_hot(jnp.arange(batch), batch)
  for seed in range(5):
    key = jax.random.PRNGKey(seed)
    mixed, mixed_targets = mixing.cutmix(images, targets, jnp.float32(0.6),
                                         key)
    for i in range(batch):
      partner = batch - 1 - i
      if partner == i:
        continue
      pasted = float(np.mean(np.asarray(mixed[i]) == partner))
      assert mixed_targets[i, partner] == pytest.approx(pasted, abs=1e-6)
      assert mixed_targets[i, i] == pytest.approx(1 - pasted, abs=1e-6)


def test_mix_batch_lam_statistics_and_disabled_is_identity():
  images = jnp.ones((4, 8, 8, 1))
  targets = jax.nn.one_hot(jnp.arange(4), 4)
  same = mixing.mix_batch(images, targets, jax.random.PRNGKey(0),
                          mixup_alpha=0.0, cutmix_alpha=0.0)
  assert same[0] is images and same[1] is targets
  # Mixup with alpha 1: lam ~ Uniform(0, 1); the first row's own weight.
  weights = jax.vmap(lambda key: mixing.mix_batch(
      images, targets, key, mixup_alpha=1.0, cutmix_alpha=0.0)[1][0, 0])(
          jax.random.split(jax.random.PRNGKey(1), 2000))
  assert float(jnp.mean(weights)) == pytest.approx(0.5, abs=0.03)
  assert float(jnp.std(weights)) == pytest.approx(np.sqrt(1 / 12), abs=0.02)
  both = jax.vmap(lambda key: mixing.mix_batch(
      targets[:, None, None, :], targets, key, mixup_alpha=1.0,
      cutmix_alpha=1.0)[1])(jax.random.split(jax.random.PRNGKey(2), 500))
  np.testing.assert_allclose(both.sum(-1), 1.0, rtol=1e-5)


def test_beta_draws_follow_beta_distributions():
  alphas = (0.2, 0.8, 1.0, 5.0)
  draws = np.asarray(jax.vmap(lambda key: mixing.beta_draws(key, alphas))(
      jax.random.split(jax.random.PRNGKey(0), 20_000)))
  assert draws.shape == (20_000, 4)
  assert np.all((draws >= 0) & (draws <= 1))
  for column, alpha in enumerate(alphas):
    # Mean 1/2, variance 1 / (4 (2 alpha + 1)).
    assert draws[:, column].mean() == pytest.approx(0.5, abs=0.01)
    assert draws[:, column].var() == pytest.approx(
        1 / (4 * (2 * alpha + 1)), rel=0.03)
    if alpha >= 0.5:
      # Kolmogorov-Smirnov against Beta(alpha, alpha): at 20,000 draws a
      # correct sampler's largest CDF gap is ~0.01 (p = 0.001 at 0.0138).
      # (Below 0.5, float32 rounds ~2% of draws to exactly 1, a gap that
      # jax.random.beta has too.)
      assert scipy.stats.kstest(draws[:, column],
                                scipy.stats.beta(alpha, alpha).cdf
                                ).statistic < 0.0138, alpha
  # Independent across alphas, e.g. Mixup's lam and CutMix's.
  assert abs(np.corrcoef(draws[:, 1], draws[:, 2])[0, 1]) < 0.03


def test_log_gamma_draws_follow_gamma_distributions():
  alphas = jnp.array([0.1, 0.5, 1.0, 2.5, 10.0])
  draws = np.asarray(jax.vmap(lambda key: mixing.log_gamma_draws(
      key, alphas))(jax.random.split(jax.random.PRNGKey(1), 20_000)),
                     np.float64)
  assert draws.shape == (20_000, 5) and np.all(np.isfinite(draws))
  for column, alpha in enumerate(np.asarray(alphas, np.float64)):
    # Kolmogorov-Smirnov of the logs against log Gamma(alpha)'s CDF (the
    # critical gap as in the Beta test), and the mean against alpha.
    statistic = scipy.stats.kstest(
        draws[:, column],
        lambda y, a=alpha: scipy.stats.gamma(a).cdf(np.exp(y))).statistic
    assert statistic < 0.0138, alpha
    assert np.exp(draws[:, column]).mean() == pytest.approx(
        alpha, rel=0.05), alpha


def test_beta_draws_have_no_rejection_loop():
  # The point of the loop-free sampler: jax.random.beta's rejection loops
  # are many kernels to compile in every train step with Mixup/CutMix. The
  # one loop left is the random bits' (threefry, rolled on a CPU).
  key = jax.random.PRNGKey(0)
  loops = lambda program: program.as_text().count("stablehlo.while")
  ours = loops(jax.jit(mixing.beta_draws, static_argnums=1).lower(
      key, (0.8, 1.0)))
  bits = loops(jax.jit(lambda key: jax.random.uniform(key)).lower(key))
  assert ours <= bits <= 1
  assert loops(jax.jit(lambda key: jax.random.beta(key, 0.8, 0.8)).lower(
      key)) > bits  # what the test would catch


def test_random_erasing_rate_area_and_noise():
  images = jnp.full((2000, 16, 16, 1), 7.0)
  erased = np.asarray(mixing.random_erasing(images, jax.random.PRNGKey(0),
                                            0.5))
  changed = erased != 7.0
  per_image = changed.mean(axis=(1, 2, 3))
  assert np.mean(per_image > 0) == pytest.approx(0.5, abs=0.04)
  hit = per_image[per_image > 0]
  assert hit.max() <= 1 / 3 + 0.05
  assert np.median(hit) > 0.05
  noise = erased[changed]
  assert abs(noise.mean()) < 0.05 and noise.std() == pytest.approx(1, abs=0.05)
  untouched = mixing.random_erasing(images, jax.random.PRNGKey(0), 0.0)
  assert untouched is images
