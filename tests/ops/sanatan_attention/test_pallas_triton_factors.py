"""The factor kernels of the fused SANATAN p = 1 path equal XLA: the factors (cos th_rot, sin th_rot, r)
of ``base.rotated_angles_and_roots`` padded with zeros, and their VJP equal autodiff's through the
product rule of the six channels, for padded tokens and head dims, every channel grouping of d Phi,
document positions and the no-rotation ablation (and ``channel_grads``, the VJP of d Phi given as
separate channels, as ``factor_grads``); both kernels lower to Triton for an H200.

Interpret mode on CPU, fp32. Tolerance: relative L2 1e-5 (the same fp32 formulas, differently
fused, the kernels' sine and cosine by their own argument reduction and polynomials; observed below
1e-6); at positions near 32K, 1e-4: a rotated angle near 330 radians is itself rounded by 2^-24 · 330 ≈
2e-5 in fp32, in either form (observed 1.2e-5 with the kernels' sine and cosine and with jnp's).
"""

import jax
import jax.numpy as jnp
import pytest

from lmcore.numerics import relative_l2
from lmcore.ops.common import pallas_utils
from sanatan_jax.ops.sanatan_attention.base import rotated_angles_and_roots
import numpy as np

from sanatan_jax.ops.sanatan_attention.pallas_triton_factors import (channel_grads, factor_grads,
                                                                     factors, reduced, tanh_by_exp2)

TOL = 1e-5
CHANNELS = 6


LONG_TOL = 1e-4


def _close(got, want, what, tol=TOL):
  error = relative_l2(got, want)
  assert error <= tol, f"{what}: relative L2 error {error:.2e} > {tol}"


def _xla_factors(u, omega, lam_raw, positions, rotate, Tp, dp):
  """(trig [B, Tp, H, 2, dp], r [B, Tp, H, dp]) by XLA, zero-padded."""
  theta_rot, r = rotated_angles_and_roots(u, omega, lam_raw, positions, rotate=rotate)
  trig = jnp.stack([jnp.cos(theta_rot), jnp.sin(theta_rot)], axis=-2)
  pad = pallas_utils.pad_axis
  return pad(pad(trig, 1, Tp), 4, dp), pad(pad(r, 1, Tp), 3, dp)


def _product_rule(dphi, trig, r):
  """d Phi [..., 6, dp] -> the cotangents of (trig, r) for channels (1, cos, sin, r, r cos, r sin)."""
  d = [dphi[..., c, :] for c in range(CHANNELS)]
  cos, sin = trig[..., 0, :], trig[..., 1, :]
  return jnp.stack([d[1] + r * d[4], d[2] + r * d[5]], axis=-2), d[3] + cos * d[4] + sin * d[5]


def _inputs(B, T, H, d, first=0, seed=0):
  """Documents restart every 17 tokens, from position ``first``; rotation rates up to 0.01."""
  ks = jax.random.split(jax.random.key(seed), 4)
  u = 2.0 * jax.random.normal(ks[0], (B, T, H, d))
  omega = jax.random.uniform(ks[1], (H, d), minval=-3.0, maxval=3.0)
  lam_raw = 2.0 * jax.random.normal(ks[2], (H, d))
  positions = jnp.broadcast_to(first + jnp.arange(T) % 17, (B, T))
  return u, omega, lam_raw, positions, ks[3]


@pytest.mark.parametrize("shape,padded,rotate,groups,first", [
    ((2, 40, 3, 5), (48, 8), True, 1, 0),  # a partial block and padded head dims, d Phi in one array
    ((1, 32, 2, 8), (32, 8), False, 2, 0),  # no rotation: d lam_raw is zero; two channels per part
    ((2, 64, 2, 16), (64, 16), True, 3, 0),  # nothing padded, three channels per part
    ((1, 16, 2, 8), (16, 8), True, 1, 32752),  # positions near 32K: rotations of up to ~330 radians
])
def test_factors_and_their_vjp_equal_xla(shape, padded, rotate, groups, first):
  B, T, H, d = shape
  Tp, dp = padded
  u, omega, lam_raw, positions, key = _inputs(*shape, first=first)
  got = factors(u, omega, lam_raw, positions, rotate=rotate, padded_length=Tp, dp=dp, interpret=True)
  want, vjp = jax.vjp(lambda *a: _xla_factors(*a, positions, rotate, Tp, dp), u, omega, lam_raw)
  tol = TOL if first == 0 else LONG_TOL
  _close(got.trig, want[0], "trig", tol)
  _close(got.root, want[1], "roots", tol)

  dphi = jax.random.normal(key, (B, Tp, H, CHANNELS, dp))
  expected = vjp(_product_rule(dphi, *want))
  parts_g = dphi.reshape(B, Tp, H, CHANNELS // groups, groups, dp)
  parts = [parts_g[..., i, :] for i in range(groups)]  # channel c = g · groups + i
  du, d_omega, d_lam = factor_grads(u, omega, lam_raw, positions, parts, rotate=rotate, interpret=True)
  assert du.shape == u.shape and d_omega.shape == d_lam.shape == (H, d)
  for name, a, b in zip(("du", "d_omega", "d_lam_raw"), (du, d_omega, d_lam), expected):
    if not rotate and name == "d_lam_raw":
      assert not jnp.any(a) and not jnp.any(b)
      continue
    _close(a, b, name, tol)


def test_channel_grads_equal_factor_grads_of_the_same_channels():
  """``channel_grads`` (the five non-constant channels of d Phi as separate arrays, the flash
  kernels' layout) gives ``factor_grads``' results for the same cotangent, padded tokens and dims."""
  B, T, H, d, Tp, dp = 1, 20, 2, 6, 24, 8
  u, omega, lam_raw, positions, key = _inputs(B, T, H, d)
  dphi = jax.random.normal(key, (B, Tp, H, CHANNELS, dp))
  common = dict(rotate=True, interpret=True)
  want = factor_grads(u, omega, lam_raw, positions, [dphi], **common)
  channels = tuple(dphi[..., c, :] for c in range(1, CHANNELS))
  got = channel_grads(u, omega, lam_raw, positions, channels, **common)
  for name, a, b in zip(("du", "d_omega", "d_lam_raw"), got, want):
    _close(a, b, name)


def test_factor_grads_without_the_constant_channel_equal_those_with_it():
  """d Phi given from channel 1 on (``first_channel=1``, the dq and dk walks' layout when they skip
  the constant channel) gives the same gradients as the whole six channels."""
  B, T, H, d, Tp, dp = 1, 20, 2, 6, 24, 8
  u, omega, lam_raw, positions, key = _inputs(B, T, H, d)
  dphi = jax.random.normal(key, (B, Tp, H, CHANNELS, dp))
  common = dict(rotate=True, interpret=True)
  want = factor_grads(u, omega, lam_raw, positions, [dphi], **common)
  got = factor_grads(u, omega, lam_raw, positions, [dphi[..., 1:, :]], first_channel=1, **common)
  for name, a, b in zip(("du", "d_omega", "d_lam_raw"), got, want):
    _close(a, b, name)


def test_the_fast_paths_angle_reduction_keeps_sine_and_cosine():
  """``reduced`` (before the GPU's approximate sine and cosine, accurate near [-pi, pi]) lands within
  1e-3 of [-pi, pi] (k is rounded in fp32) and keeps sin and cos within 2e-6 of float64's, up to
  |x| = 1e4 (rotations reach 0.01 t)."""
  x = np.linspace(-1e4, 1e4, 200_001, dtype=np.float32)
  y = np.asarray(reduced(jnp.asarray(x)), np.float64)
  assert np.all(np.abs(y) <= np.pi + 1e-3)
  for fn in (np.sin, np.cos):
    assert np.max(np.abs(fn(y) - fn(x.astype(np.float64)))) <= 2e-6


def test_tanh_by_exp2_matches_tanh_and_saturates():
  """The fast path's tanh (one exponential, one division) stays within 3e-7 of float64's tanh over
  [-60, 60] in fp32, is exactly -1 and 1 where the exponential under- or overflows, and keeps 1 - r^2
  within 1e-4 relative wherever 1 - r^2 >= 1e-2."""
  x = np.linspace(-60, 60, 400_001, dtype=np.float32)
  r = np.asarray(tanh_by_exp2(jnp.asarray(x)), np.float64)
  want = np.tanh(x.astype(np.float64))
  assert np.max(np.abs(r - want)) <= 3e-7
  assert r[0] == -1.0 and r[-1] == 1.0
  slope = (1 - want * want) >= 1e-2
  assert np.max(np.abs((1 - r * r)[slope] / (1 - want * want)[slope] - 1)) <= 1e-4


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_factor_kernels_lower_to_triton_for_an_h200():
  """Both kernels pass the Pallas Triton lowering for bf16 inputs with a partial block and padded
  head dims, with the GPU's approximate sine, cosine and division; fp32 inputs keep the exact ones."""
  B, T, H, d, Tp, dp = 1, 200, 2, 24, 256, 32
  u = jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16)
  param = jax.ShapeDtypeStruct((H, d), jnp.float32)
  pos = jax.ShapeDtypeStruct((B, T), jnp.int32)
  dphi = jax.ShapeDtypeStruct((B, Tp, H, CHANNELS, dp), jnp.bfloat16)

  def both(u, omega, lam_raw, positions, dphi):
    f = factors(u, omega, lam_raw, positions, rotate=True, padded_length=Tp, dp=dp, interpret=False)
    g = factor_grads(u, omega, lam_raw, positions, [dphi], rotate=True, interpret=False)
    return f, g

  text = pallas_utils.lower_for_gpu(both, u, param, param, pos, dphi).as_text()
  assert text.count("xla.gpu.triton") == 2
  assert "sin.approx" in text and "div.full" in text and "ex2.approx" in text
  u32, dphi32 = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (u, dphi))
  text = pallas_utils.lower_for_gpu(both, u32, param, param, pos, dphi32).as_text()
  assert "sin.approx" not in text and "div.full" not in text and "ex2.approx" not in text
