"""SANATAN feature maps and score constants, one function per formula of MATH §1.1.

Per head and per dimension ``a`` a query/key component ``u`` becomes an angle ``theta``, a soft root
label ``r`` (from the angle *before* rotation) and a rotated angle ``theta_rot``; the feature vector
concatenates the per-dimension blocks ``Phi_a`` over ``a = 1..d`` (width ``F = channels * d``).
Callers evaluate these in float32: the rotation ``t * lam`` reaches tens of radians at t = 2048,
which bfloat16 cannot resolve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GAMMA = 10.0
LAMBDA_SCALE = 0.01
SCALE_EPS = 1e-6
CHANNELS = (6, 4, 3)
THREE_CHANNEL = ("clean", "legacy")


def angles(u: jax.Array) -> jax.Array:
  """theta = pi * u / (1 + |u|) (MATH §1.1 step 2): a C^1 squashing of R onto (-pi, pi)."""
  return jnp.pi * u / (1.0 + jnp.abs(u))


def soft_roots(theta: jax.Array, omega: jax.Array, gamma: float = GAMMA) -> jax.Array:
  """r = tanh(gamma * (cos(theta + omega) - sin(theta + omega))) (MATH §1.1 step 3).

  ``theta`` are the PRE-rotation angles [..., H, d]; ``omega`` [H, d] broadcasts over the leading
  axes. At omega = pi/4 this is ``-tanh(gamma * sqrt(2) * sin(theta))``.
  """
  phase = theta + omega.reshape((1,) * (theta.ndim - omega.ndim) + omega.shape)
  return jnp.tanh(gamma * (jnp.cos(phase) - jnp.sin(phase)))


def rotate(theta_BxTxHxd: jax.Array, positions_BxT: jax.Array, lam_raw_Hxd: jax.Array) -> jax.Array:
  """theta_rot = theta + t * lam with lam = 0.01 * tanh(lam_raw) (MATH §1.1 step 4).

  ``t`` is the 0-based position of each token in its document, int [B, T].
  """
  lam_Hxd = LAMBDA_SCALE * jnp.tanh(lam_raw_Hxd)
  t_BxTx1x1 = positions_BxT[:, :, None, None].astype(theta_BxTxHxd.dtype)
  return theta_BxTxHxd + t_BxTx1x1 * lam_Hxd[None, None]


def feature_map(theta_rot: jax.Array, r: jax.Array | None, channels: int) -> jax.Array:
  """Phi = concat_a Phi_a over the last axis (MATH §1.1 step 5); [..., d] -> [..., channels*d].

  6 channels: ``Phi_a = [1, cos th, sin th, r, r cos th, r sin th]``, so
  ``Phi(q).Phi(k) = sum_a (1 + rq rk)(1 + cos(th_q - th_k))`` in [0, 4d].
  4 channels: ``Phi_a = [1, r, r cos th, r sin th]``, per-dim score ``1 + rq rk (1 + cos)``.
  3 channels: ``Phi_a = [1, cos th, sin th]`` (``r`` unused, may be None), score ``d + sum cos``.
  """
  cos, sin = jnp.cos(theta_rot), jnp.sin(theta_rot)
  one = jnp.ones_like(theta_rot)
  if channels == 6:
    parts = (one, cos, sin, r, r * cos, r * sin)
  elif channels == 4:
    parts = (one, r, r * cos, r * sin)
  elif channels == 3:
    parts = (one, cos, sin)
  else:
    raise ValueError(f"channels must be one of {CHANNELS}, got {channels!r}")
  phi_xdxC = jnp.stack(parts, axis=-1)
  return phi_xdxC.reshape(*phi_xdxC.shape[:-2], -1)


def score_scale(channels: int, three_channel: str, d: int) -> float:
  """The divisor c of MATH §1.1 step 6: the maximum (shifted) score plus 1e-6.

  6ch: 4d; 4ch: 3d (our choice: its maximum score); 3ch legacy: 3d (score s3 + d, the original
  code); 3ch clean: 2d (score s3, the fair ablation).
  """
  check_channels(channels, three_channel)
  if channels == 6:
    max_score = 4 * d
  elif channels == 4 or three_channel == "legacy":
    max_score = 3 * d
  else:
    max_score = 2 * d
  return max_score + SCALE_EPS


def score_shift(channels: int, three_channel: str, d: int) -> float:
  """The constant added to the raw score before division: d for 3ch legacy, else 0 (MATH §1.1)."""
  check_channels(channels, three_channel)
  return float(d) if channels == 3 and three_channel == "legacy" else 0.0


def unit_scores(s: jax.Array, *, channels: int, three_channel: str, d: int) -> jax.Array:
  """Raw scores -> (s + shift) / c in [0, 1], the base of the power; 4ch first clips s at 0.

  The 4-channel clip of the total score (MATH §1.1 step 5) makes that variant parallel-only.
  """
  if channels == 4:
    s = jnp.maximum(s, 0.0)
  return (s + score_shift(channels, three_channel, d)) / score_scale(channels, three_channel, d)


def check_channels(channels: int, three_channel: str) -> None:
  """Raises ValueError for a channel count or three-channel variant MATH §1.1 does not define."""
  if channels not in CHANNELS:
    raise ValueError(f"channels must be one of {CHANNELS}, got {channels!r}")
  if three_channel not in THREE_CHANNEL:
    raise ValueError(f"three_channel must be one of {THREE_CHANNEL}, got {three_channel!r}")
