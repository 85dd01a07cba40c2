"""Pallas (Triton lowering) kernels for the factors of Phi (MATH §1.1 steps 2-4) and their VJP.

For a raw query or key component u (already divided by sqrt(d)) of head dimension a at document
position t::

    theta = pi u / (1 + |u|),   r = tanh(gamma (cos(theta + omega_a) - sin(theta + omega_a))),
    theta_rot = theta + t lam_a,   lam = 0.01 tanh(lam_raw),

and Phi's channels are (1, cos, sin, r, r cos, r sin) of (theta_rot, r) (``base.factor_channel``).
These kernels are the GPU kernels' one statement of the feature map: the fused-chunk kernels read the
factors (cos theta_rot, sin theta_rot) and r, the flash kernels (6 channels) the channels XLA forms
from them; these kernels make them and take their gradients, each reading and writing every array
once. Compiled with 16-bit operands, sines and cosines come from the GPU's special-function unit after
a reduction by 2 pi (``reduced``), divisions take two ulps and tanh is one approximate exponential and
one such division (``tanh_by_exp2``): errors three orders below a bf16 unit, which the factors are
rounded to. fp32 operands (and the interpreter) take sines and cosines in pairs from one argument
reduction and Taylor polynomials (``_sincos``), IEEE division and jnp's tanh.

``factors``: u -> (cos theta_rot, sin theta_rot) [B, Tp, H, 2, dp] and r [B, Tp, H, dp] in u's dtype
(fp32 inside), zero on padding.

``factor_grads`` (d Phi channel-major, in channel groups) and ``channel_grads`` (its five non-constant
channels as separate arrays): u and d Phi -> du, d omega, d lam_raw, by the product rule and the chain
rule in fp32 (the constant channel has no gradient)::

    d cos = dPhi_1 + r dPhi_4,   d sin = dPhi_2 + r dPhi_5,   d r = dPhi_3 + cos dPhi_4 + sin dPhi_5,
    d theta_rot = cos d sin - sin d cos,
    g = d r · gamma (1 - r^2) (-sin(theta + omega) - cos(theta + omega))   (d omega per token),
    du = (d theta_rot + g) pi / (1 + |u|)^2,
    d omega = sum_tokens g,   d lam_raw = 0.01 (1 - tanh^2 lam_raw) sum_tokens t d theta_rot.

Each program owns ``BLOCK_T`` tokens of one (row, head) and writes its tokens' sums of g and of
t d theta_rot; XLA adds the programs' sums.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lmcore.ops.common import pallas_utils as pu
from sanatan_jax import features
from sanatan_jax.ops.sanatan_attention.base import factor_channel

# Tokens per program (fewer when the padded length has fewer factors of two) and Triton warps: eight
# tokens of 64 head dims on two warps, eight values per thread.
BLOCK_T = 8
NUM_WARPS = 2
_F32 = jnp.float32


class Factors(NamedTuple):
  """The factors of Phi of one operand (q or k) that the fused kernels read: (cos th_rot, sin th_rot)
  [B, Tp, H, 2, dp] and the roots r [B, Tp, H, dp], zero on padding."""

  trig: jax.Array
  root: jax.Array


class Config(NamedTuple):
  """Static parameters: tokens per program, the real length and head dim, whether either is padded,
  the rotation flag; for ``pu.call``, the interpret flag, Triton warps and stages and the precision of
  dots (these kernels have none)."""

  block_t: int
  length: int
  head_dim: int
  padded: bool
  rotate: bool
  interpret: bool
  fast: bool = False  # the GPU's approximate sine, cosine, division and tanh (compiled 16-bit operands)
  num_warps: int = NUM_WARPS
  num_stages: int = 1
  precision: str = "input"


# In-kernel pieces.

# The kernels' arithmetic bounds them (five transcendentals per value), so each sine-cosine pair shares
# one argument reduction (``_sincos``).
# pi / 2 in three parts whose leading ones have few significant bits (8 and 10), so k times them is
# exact for |k| < 2^13; the parts sum to pi / 2 within 2e-15.
_HALF_PI = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)
_SIN_TAYLOR = (-1 / 6, 1 / 120, -1 / 5040, 1 / 362880)  # y^3 .. y^9
_COS_TAYLOR = (-1 / 2, 1 / 24, -1 / 720, 1 / 40320, -1 / 3628800)  # y^2 .. y^10


def _horner(y2, coefficients):
  """sum_i coefficients[i] y2^(i + 1)."""
  acc = coefficients[-1]
  for c in reversed(coefficients[:-1]):
    acc = c + y2 * acc
  return y2 * acc


def _sincos(x):
  """(sin x, cos x) in fp32 with one argument reduction for both: x = k pi/2 + y, |y| <= pi/4, then
  Taylor polynomials in y (truncation below 2e-9 at pi/4) and the quadrant k mod 4. Exact reduction
  for |x| < 12,800 (the rotation t lam reaches 0.01 t: positions up to about 1.28M)."""
  k = jnp.floor(x * (2 / jnp.pi) + 0.5)
  y = x
  for part in _HALF_PI:
    y = y - k * part
  y2 = y * y
  s, c = y + y * _horner(y2, _SIN_TAYLOR), 1.0 + _horner(y2, _COS_TAYLOR)
  quadrant = k.astype(jnp.int32) & 3
  odd = (quadrant & 1) == 1
  sin, cos = jnp.where(odd, c, s), jnp.where(odd, s, c)
  return (jnp.where(quadrant >= 2, -sin, sin),
          jnp.where((quadrant == 1) | (quadrant == 2), -cos, cos))


# 2 pi in two parts (the first with 8 significant bits, so k times it is exact for |k| < 2^16); they
# sum to 2 pi within 2e-15.
_TWO_PI = (6.28125, 1.9353071795864769e-3)


def _asm(instruction: str, *args):
  """One PTX instruction "op $0, $1[, $2];" applied elementwise to fp32 ``args`` (a GPU kernel only)."""
  operands = ", ".join(f"${i}" for i in range(len(args) + 1))
  [out] = plgpu.elementwise_inline_asm(f"{instruction} {operands};", args=list(args),
                                       constraints=",".join(["=f"] + ["f"] * len(args)), pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, _F32)])
  return out


def reduced(x):
  """x - 2 pi k with k = round(x / 2 pi) in fp32: the angle within 1e-3 of [-pi, pi] (k * 2 pi's
  leading part is exact for |x| < 2^16 · pi)."""
  k = jnp.floor(x * (0.5 / jnp.pi) + 0.5)
  for part in _TWO_PI:
    x = x - k * part
  return x


def _fast_sincos(x):
  """(sin x, cos x) by the GPU's special-function unit (``sin.approx`` / ``cos.approx``: about 2^-20.5
  from the exact values near [-pi, pi], below a thousandth of a bf16 unit) after ``reduced``."""
  y = reduced(x)
  return _asm("sin.approx.ftz.f32", y), _asm("cos.approx.ftz.f32", y)


def _trig(x, cfg: Config):
  return _fast_sincos(x) if cfg.fast else _sincos(x)


def tanh_by_exp2(x, exp2=jnp.exp2, quotient=jnp.divide):
  """tanh x = 1 - 2 / (2^(2 x log2 e) + 1): one exponential and one division, exactly -1 and 1 where
  the exponential under- or overflows. Its error is absolute, within 2e-7 of tanh in fp32 with an
  exact exp2: far below a bf16 root's rounding, and 1e-4 relative or less in the VJP's 1 - r^2 where
  that is 1e-2 or more."""
  e1 = exp2(x * (2.0 / math.log(2.0))) + 1.0
  return 1.0 - quotient(jnp.full_like(e1, 2.0), e1)


def _tanh(x, cfg: Config):
  """tanh x; by the GPU's approximate base-2 exponential and two-ulp division (``tanh_by_exp2``) when
  ``cfg.fast``."""
  if not cfg.fast:
    return jnp.tanh(x)
  return tanh_by_exp2(x, lambda y: _asm("ex2.approx.ftz.f32", y), lambda a, b: _quotient(a, b, cfg))


def _quotient(a, b, cfg: Config):
  """a / b, by the GPU's two-ulp division (``div.full``) when ``cfg.fast``."""
  return _asm("div.full.f32", a, b) if cfg.fast else a / b


def _valid(shape, cfg: Config):
  """[BT, dp] bool: the program's real tokens and head dims."""
  start = pl.program_id(1) * cfg.block_t
  token = start + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  dim = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return (token < cfg.length) & (dim < cfg.head_dim)


class _Angles(NamedTuple):
  """Per-token values shared by both kernels, fp32 [BT, dp]."""

  u: jax.Array
  cos_phase: jax.Array  # cos(theta + omega)
  sin_phase: jax.Array
  r: jax.Array
  cos_rot: jax.Array  # cos(theta_rot)
  sin_rot: jax.Array
  t: jax.Array  # document positions [BT, 1]


def _angles(u_ref, pos_ref, omega_ref, lam_ref, cfg: Config) -> _Angles:
  u = u_ref[...].astype(_F32)
  theta = _quotient(jnp.pi * u, 1.0 + jnp.abs(u), cfg)  # features.angles
  phase = theta + omega_ref[...].astype(_F32)[None, :]
  sin_phase, cos_phase = _trig(phase, cfg)
  r = _tanh(features.GAMMA * (cos_phase - sin_phase), cfg)
  t = pos_ref[...].astype(_F32)[:, None]
  theta_rot = theta
  if cfg.rotate:
    lam = features.LAMBDA_SCALE * jnp.tanh(lam_ref[...].astype(_F32))
    theta_rot = theta + t * lam[None, :]
  sin_rot, cos_rot = _trig(theta_rot, cfg)
  return _Angles(u, cos_phase, sin_phase, r, cos_rot, sin_rot, t)


def _factors_kernel(u_ref, pos_ref, omega_ref, lam_ref, trig_ref, root_ref, *, cfg: Config):
  a = _angles(u_ref, pos_ref, omega_ref, lam_ref, cfg)
  cos, sin, r = a.cos_rot, a.sin_rot, a.r
  if cfg.padded:
    valid = _valid(r.shape, cfg)
    cos, sin, r = (jnp.where(valid, x, 0.0) for x in (cos, sin, r))
  trig_ref[:, 0, :] = cos.astype(trig_ref.dtype)
  trig_ref[:, 1, :] = sin.astype(trig_ref.dtype)
  root_ref[...] = r.astype(root_ref.dtype)


def _grads_kernel(u_ref, pos_ref, omega_ref, lam_ref, d1_ref, d2_ref, d3_ref, d4_ref, d5_ref,
                  du_ref, d_omega_ref, d_lam_ref, *, cfg: Config):
  a = _angles(u_ref, pos_ref, omega_ref, lam_ref, cfg)
  dphi = tuple(x[...].astype(_F32) for x in (d1_ref, d2_ref, d3_ref, d4_ref, d5_ref))
  cos, sin = a.cos_rot, a.sin_rot
  # The product rule: the VJP of the channels 1..5 as ``factor_channel`` forms them.
  channels = lambda cos, sin, r: tuple(factor_channel(c, cos, sin, r) for c in range(1, 6))
  _, channels_vjp = jax.vjp(channels, cos, sin, a.r)
  d_cos, d_sin, d_r = channels_vjp(dphi)
  d_theta_rot = cos * d_sin - sin * d_cos
  g = d_r * features.GAMMA * (1.0 - a.r * a.r) * (-a.sin_phase - a.cos_phase)
  du = _quotient((d_theta_rot + g) * jnp.pi, jnp.square(1.0 + jnp.abs(a.u)), cfg)
  du_ref[...] = du.astype(du_ref.dtype)
  t_d_theta_rot = a.t * d_theta_rot
  if cfg.padded:
    valid = _valid(g.shape, cfg)
    g, t_d_theta_rot = jnp.where(valid, g, 0.0), jnp.where(valid, t_d_theta_rot, 0.0)
  d_omega_ref[...] = jnp.sum(g, axis=0)
  d_lam_ref[...] = jnp.sum(t_d_theta_rot, axis=0)


# Host side.

def _config(u, length: int, head_dim: int, rotate: bool, interpret: bool) -> Config:
  """For padded u [B, Tp, H, dp] of real length and head dim; the GPU's approximate sine, cosine,
  division and tanh for 16-bit operands when compiled."""
  _, Tp, _, dp = u.shape
  fast = not interpret and jnp.dtype(u.dtype).itemsize == 2
  return Config(block_t=math.gcd(BLOCK_T, Tp), length=length, head_dim=head_dim,
                padded=(Tp, dp) != (length, head_dim), rotate=rotate, interpret=interpret, fast=fast)


def _grid(u, cfg: Config):
  """(H, token blocks, B): the heads of one token block run side by side (adjacent memory)."""
  B, Tp, H, _ = u.shape
  return H, Tp // cfg.block_t, B


def _in_specs(dp: int, cfg: Config) -> list:
  BT, spec = cfg.block_t, pl.BlockSpec
  return [spec((None, BT, None, dp), lambda h, t, b: (b, t, h, 0)),
          spec((None, BT), lambda h, t, b: (b, t)),
          spec((None, dp), lambda h, t, b: (h, 0)),
          spec((None, dp), lambda h, t, b: (h, 0))]


def _padded(u, omega, lam_raw, pos, padded_length: int, dp: int):
  """u [B, Tp, H, dp], positions [B, Tp] int32, omega and lam_raw [H, dp]."""
  u = pu.pad_axis(pu.pad_axis(u, 1, padded_length), 3, dp)
  pos = pu.pad_axis(pos.astype(jnp.int32), 1, padded_length)
  return u, pu.pad_axis(omega, 1, dp), pu.pad_axis(lam_raw, 1, dp), pos


def factors(u: jax.Array, omega: jax.Array, lam_raw: jax.Array, positions: jax.Array, *,
            rotate: bool, padded_length: int, dp: int, interpret: bool) -> Factors:
  """The factors of Phi of raw u [B, T, H, d] (omega, lam_raw [H, d], int positions [B, T]),
  padded to [B, Tp, H, (2,) dp] with zeros, in u's dtype."""
  B, T, H, d = u.shape
  u, omega, lam_raw, pos = _padded(u, omega, lam_raw, positions, padded_length, dp)
  cfg = _config(u, T, d, rotate, interpret)
  BT = cfg.block_t
  out_specs = [pl.BlockSpec((None, BT, None, 2, dp), lambda h, t, b: (b, t, h, 0, 0)),
               pl.BlockSpec((None, BT, None, dp), lambda h, t, b: (b, t, h, 0))]
  out_shape = [jax.ShapeDtypeStruct((B, padded_length, H, 2, dp), u.dtype),
               jax.ShapeDtypeStruct((B, padded_length, H, dp), u.dtype)]
  return Factors(*pu.call(_factors_kernel, cfg, _grid(u, cfg), _in_specs(dp, cfg), out_specs, out_shape,
                        u, pos, omega, lam_raw))


def factor_grads(u: jax.Array, omega: jax.Array, lam_raw: jax.Array, positions: jax.Array,
                 dphi_parts: list[jax.Array], *, rotate: bool, interpret: bool, first_channel: int = 0
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(du [B, T, H, d] in u's dtype, d omega, d lam_raw [H, d] in their dtypes) from the cotangent of
  Phi given as ``dphi_parts``: G arrays [B, Tp, H, groups, dp] holding channels ``first_channel`` to
  5, channel c = first_channel + g·G + i in part i at group g (one array [B, Tp, H, 6, dp] for G = 1
  from channel 0; ``first_channel`` 1 leaves out the constant channel, which has no gradient)."""
  G = len(dphi_parts)

  def spec(block_t: int, dp: int, c: int) -> pl.BlockSpec:
    group = (c - first_channel) // G
    return pl.BlockSpec((None, block_t, None, None, dp), lambda h, t, b: (b, t, h, group, 0))

  return _grads(u, omega, lam_raw, positions, [dphi_parts[(c - first_channel) % G] for c in range(1, 6)],
                spec, rotate=rotate, interpret=interpret)


def channel_grads(u: jax.Array, omega: jax.Array, lam_raw: jax.Array, positions: jax.Array,
                  dphi_channels: tuple[jax.Array, ...], *, rotate: bool, interpret: bool
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``factor_grads`` with the cotangent of Phi given as its five non-constant channels, each
  [B, Tp, H, dp] (feature_map's order: cos, sin, r, r cos, r sin), as the flash kernels write it."""

  def spec(block_t: int, dp: int, c: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, block_t, None, dp), lambda h, t, b: (b, t, h, 0))

  return _grads(u, omega, lam_raw, positions, list(dphi_channels), spec, rotate=rotate,
                interpret=interpret)


def _grads(u, omega, lam_raw, positions, channels: list[jax.Array], channel_spec, *, rotate: bool,
           interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The VJP kernel over ``channels`` (d Phi's channels 1..5 in order, padded to [B, Tp, H, ...]),
  channel c read through ``channel_spec(block_t, dp, c)``."""
  B, T, H, d = u.shape
  Tp, dp = channels[0].shape[1], channels[0].shape[-1]
  up, omega_p, lam_p, pos = _padded(u, omega, lam_raw, positions, Tp, dp)
  cfg = _config(up, T, d, rotate, interpret)
  BT, spec = cfg.block_t, pl.BlockSpec
  in_specs = _in_specs(dp, cfg) + [channel_spec(BT, dp, c) for c in range(1, 6)]
  grid = _grid(up, cfg)
  sums = spec((None, None, None, dp), lambda h, t, b: (b, t, h, 0))
  out_specs = [spec((None, BT, None, dp), lambda h, t, b: (b, t, h, 0)), sums, sums]
  sums_shape = jax.ShapeDtypeStruct((B, grid[1], H, dp), _F32)
  out_shape = [jax.ShapeDtypeStruct(up.shape, u.dtype), sums_shape, sums_shape]
  du, g_sum, t_sum = pu.call(_grads_kernel, cfg, grid, in_specs, out_specs, out_shape, up, pos, omega_p,
                             lam_p, *channels)
  d_omega = jnp.sum(g_sum, axis=(0, 1))[:, :d]
  if rotate:
    d_lam = (features.LAMBDA_SCALE * (1.0 - jnp.square(jnp.tanh(lam_raw.astype(_F32))))
             * jnp.sum(t_sum, axis=(0, 1))[:, :d])
  else:
    d_lam = jnp.zeros(lam_raw.shape, _F32)
  return du[:, :T, :, :d], d_omega.astype(omega.dtype), d_lam.astype(lam_raw.dtype)
