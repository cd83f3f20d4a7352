"""The numbers augmentations make from one uniform draw (draws.py) follow
their distributions."""

import jax
import numpy as np
import scipy.stats

from vit_jax.data import draws


def _uniforms(count: int) -> np.ndarray:
  return draws.uniforms(jax.random.PRNGKey(3), (count,))


def test_uniforms_are_on_the_open_unit_interval():
  u = np.asarray(_uniforms(100_000))
  assert u.dtype == np.float32 and np.all((u > 0) & (u < 1))
  assert scipy.stats.kstest(u, "uniform").statistic < 0.0062  # p ~ 0.001


def test_standard_normal_matches_the_normal_distribution():
  x = np.asarray(draws.standard_normal(_uniforms(100_000)))
  assert np.all(np.isfinite(x))
  assert scipy.stats.kstest(x, "norm").statistic < 0.0062
  # The extremes stay finite, at the float32 grid's ends.
  ends = np.asarray(draws.standard_normal(np.array(
      [np.finfo(np.float32).tiny, 1 - 2**-24], np.float32)))
  assert np.all(np.isfinite(ends)) and ends[0] < -5 and ends[1] > 5


def test_integers_and_signs_are_uniform():
  u = _uniforms(140_000)
  counts = np.bincount(np.asarray(draws.integers(u, 14)), minlength=14)
  assert counts.shape == (14,)  # nothing at 14 or above
  assert scipy.stats.chisquare(counts).pvalue > 0.001
  assert np.asarray(draws.integers(np.float32([0.0, 1 - 2**-24]), 14)
                    ).tolist() == [0, 13]
  signs = np.asarray(draws.signs(u))
  assert set(np.unique(signs)) == {-1.0, 1.0}
  assert abs(signs.mean()) < 0.01
