"""What every form of SANATAN attention shares (MATH §1.1-1.2): the state, the options, their
checks, the feature map on [B, T, H, d] arrays, the power weights and, for the kernels, the feature
channels of one block of tokens.

    a_tj = (s_tj / c)^p / (sum_{l<=t} (s_tl / c)^p + eps),  o_t = sum_{j<=t} a_tj v_j,  eps = 1e-6,

with ``s_tj = Phi(q_t).Phi(k_j)`` (sanatan_jax.features; 4ch clips ``s`` at 0, 3ch legacy adds d).
Packed documents: a token sees only tokens of its own document (``segments.document_index``), and an
incoming state belongs to the first document of each row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common import pallas_utils
from lmcore.ops.common.layout import default_positions
from lmcore.ops.common.segments import document_index
from sanatan_jax import features

EPS = 1e-6
F32 = jnp.float32
# The forms that exist only where the exact constant-size recurrence does (p = 1, 6 channels).
RECURRENT_ONLY = ("chunked", "chunked_scan", "recurrent", "pallas_fused")
# The channels of one head dimension, in feature_map's order: (1, cos th, sin th, r, r cos th,
# r sin th). Each variant's channels other than the constant 1 (which the blocked kernels add to
# the scores as d).
NON_CONSTANT_CHANNELS = {6: (1, 2, 3, 4, 5), 4: (3, 4, 5), 3: (1, 2)}


class SanatanState(NamedTuple):
  """The exact p = 1 six-channel state of MATH §1.2, accumulated in float32.

  Attributes:
    S: [B, H, F, dv], sum of Phi(k_j) v_j^T over the current document.
    z: [B, H, F], sum of Phi(k_j).
    position: [B] int32, the position of the next token.
  """

  S: jax.Array
  z: jax.Array
  position: jax.Array


class Options(NamedTuple):
  """The static options every form receives (``sanatan_attention``'s arguments of the same names);
  a form reads the ones it needs."""

  p: int = 1
  channels: int = 6
  three_channel: str = "clean"
  rotate: bool = True
  chunk_size: int = 64
  block_size: int = 128
  kernel_precision: str = "input"
  chunked_remat: bool = True
  fused_tiles: str = ""
  flash_features: str = "auto"


def has_constant_state(p: int, channels: int) -> bool:
  """Only p = 1 with 6 channels has the exact constant-size recurrence (MATH §1.2)."""
  return p == 1 and channels == 6


def validate_options(*, p: int, channels: int, three_channel: str, implementation: str) -> None:
  """Raises ValueError for option combinations MATH §1 does not define or ``implementation`` (a
  valid name, or "auto") cannot run."""
  if not isinstance(p, int) or p < 1:
    raise ValueError(f"p must be a positive integer (MATH uses 1, 2, 4), got {p!r}")
  features.check_channels(channels, three_channel)
  if implementation in RECURRENT_ONLY and not has_constant_state(p, channels):
    raise ValueError(
        f"implementation={implementation!r} exists only for p=1 with 6 channels (the exact "
        f"recurrence of MATH §1.2), got p={p}, channels={channels}; use 'parallel' or 'blocked'")


def check_state(state: SanatanState | None, p: int, channels: int, shape: tuple) -> None:
  """Raises ValueError for a state where none exists (p >= 2, 4/3 channels) or of the wrong shape
  (``shape`` = [B, H, F, dv])."""
  if state is None:
    return
  if not has_constant_state(p, channels):
    raise ValueError(
        f"a SanatanState exists only for p=1 with 6 channels (MATH §1.2), got p={p}, "
        f"channels={channels}; p>=2 and the 4/3-channel ablations have no constant-size state — "
        "run them on the whole sequence with state=None")
  if state.S.shape != shape:
    raise ValueError(f"state.S has shape {state.S.shape}, expected [B, H, F, dv] = {shape}")


def check_blocked_options(p, channels, three_channel, block_q, block_k, op: str) -> None:
  """Raises ValueError naming ``op`` for a bad power, channel variant or block size of the blocked
  kernels."""
  if not isinstance(p, int) or p < 1:
    raise ValueError(f"{op}: p must be a positive integer, got {p!r}")
  features.check_channels(channels, three_channel)
  for name, size in (("block_q", block_q), ("block_k", block_k)):
    if size < 1 or size & (size - 1):
      raise ValueError(f"{op}: {name} must be a power of two, got {size}")


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
  """``jnp.einsum`` at the highest precision, accumulating (and returning) float32."""
  return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=F32)


def after_cotangent(inputs: tuple, cotangent) -> tuple:
  """``inputs`` behind an optimisation barrier shared with ``cotangent``, for a custom VJP's backward
  that recomputes features from them: XLA can then neither merge the recomputation with the forward's
  identical one (common subexpressions, which would keep every layer's features alive from the
  forward to the backward) nor schedule it before the cotangent exists."""
  *inputs, _ = jax.lax.optimization_barrier((*inputs, cotangent))
  return tuple(inputs)


def sanatan_features(q_BxTxHxd: jax.Array, k_BxTxHxd: jax.Array, omega_Hxd: jax.Array,
                     lam_raw_Hxd: jax.Array, positions_BxT: jax.Array, *, channels: int = 6,
                     rotate: bool = True) -> tuple[jax.Array, jax.Array]:
  """Phi(q), Phi(k) as float32 [B, T, H, F] (MATH §1.1 steps 2-5).

  Roots come from the pre-rotation angles; ``rotate=False`` is the "no lambda" ablation.
  """
  def phi(u_BxTxHxd):
    theta_rot, r = rotated_angles_and_roots(u_BxTxHxd, omega_Hxd, lam_raw_Hxd, positions_BxT,
                                            rotate=rotate, roots=channels != 3)
    return features.feature_map(theta_rot, r, channels)

  return phi(q_BxTxHxd), phi(k_BxTxHxd)


def rotated_angles_and_roots(u_BxTxHxd: jax.Array, omega_Hxd: jax.Array, lam_raw_Hxd: jax.Array,
                             positions_BxT: jax.Array, *, rotate: bool = True,
                             roots: bool = True) -> tuple[jax.Array, jax.Array | None]:
  """theta_rot and the soft roots r (None unless ``roots``) of raw q or k, float32 [B, T, H, d]
  (MATH §1.1 steps 2-4; r from the angles before rotation)."""
  theta = features.angles(u_BxTxHxd.astype(F32))
  r = features.soft_roots(theta, omega_Hxd.astype(F32)) if roots else None
  theta_rot = features.rotate(theta, positions_BxT, lam_raw_Hxd.astype(F32)) if rotate else theta
  return theta_rot, r


def power_weights(s: jax.Array, mask: jax.Array, *, p: int, channels: int, three_channel: str,
                  d: int) -> jax.Array:
  """w = ((s + shift) / c)^p where ``mask`` holds, else 0, float32 (``features.unit_scores``; 4ch
  clips s at 0)."""
  u = features.unit_scores(s, channels=channels, three_channel=three_channel, d=d)
  return jnp.where(mask, u**p, 0.0)


class Prepared(NamedTuple):
  """What the XLA forms compute first: features in the inputs' dtype [B, T, H, F], the document
  index [B, T], the positions [B, T] and the score scale c."""

  phi_q: jax.Array
  phi_k: jax.Array
  doc: jax.Array
  positions: jax.Array
  c: float


def prepare(q, k, omega, lam_raw, positions, segment_ids, state, options: Options) -> Prepared:
  """Positions (default 0..T-1 offset by ``state.position``), document index and features."""
  B, T, _, d = q.shape
  if positions is None:
    positions = default_positions(B, T, None if state is None else state.position)
  phi_q, phi_k = sanatan_features(q, k, omega, lam_raw, positions, channels=options.channels,
                                  rotate=options.rotate)
  c = features.score_scale(options.channels, options.three_channel, d)
  return Prepared(phi_q.astype(q.dtype), phi_k.astype(k.dtype),
                  document_index(segment_ids, B, T), positions, c)


def start_state(state: SanatanState | None, B: int, H: int, F: int,
                dv: int) -> tuple[jax.Array, jax.Array]:
  """(S, z) of ``state``, or zeros [B, H, F, dv], [B, H, F] (fp32)."""
  if state is not None:
    return state.S, state.z
  return jnp.zeros((B, H, F, dv), F32), jnp.zeros((B, H, F), F32)


def next_position(positions_BxT: jax.Array) -> jax.Array:
  """The position after the last token, int32 [B]."""
  return positions_BxT[:, -1].astype(jnp.int32) + 1


def read_state(phi_q_BxTxHxF, doc_BxT, state: SanatanState) -> tuple[jax.Array, jax.Array]:
  """Phi(q)^T S and Phi(q)^T z of the incoming state, for tokens of the row's first document."""
  first_BxTx1 = (doc_BxT == 0)[:, :, None]
  num_BxTxHxV = first_BxTx1[..., None] * einsum("bthf,bhfv->bthv", phi_q_BxTxHxF, state.S)
  return num_BxTxHxV, first_BxTx1 * einsum("bthf,bhf->bth", phi_q_BxTxHxF, state.z)


def final_state(phi_k_BxTxHxF, v_BxTxHxV, doc_BxT, positions_BxT,
                state: SanatanState | None) -> SanatanState:
  """The state after the last token, directly from its definition (the power forms at p = 1)."""
  doc_last_Bx1 = doc_BxT[:, -1:]
  in_last_BxTx1x1 = (doc_BxT == doc_last_Bx1)[:, :, None, None]
  k_last_BxTxHxF = jnp.where(in_last_BxTx1x1, phi_k_BxTxHxF, 0)
  S_BxHxFxV = einsum("bthf,bthv->bhfv", k_last_BxTxHxF, v_BxTxHxV)
  z_BxHxF = jnp.sum(k_last_BxTxHxF.astype(F32), axis=1)
  if state is not None:
    keep_B = doc_last_Bx1[:, 0] == 0
    S_BxHxFxV += jnp.where(keep_B[:, None, None, None], state.S, 0.0)
    z_BxHxF += jnp.where(keep_B[:, None, None], state.z, 0.0)
  return SanatanState(S_BxHxFxV, z_BxHxF, next_position(positions_BxT))


def power_output(num_BxTxHxV, den_BxTxH, v_BxTxHxV, prepared: Prepared,
                 state: SanatanState | None,
                 options: Options) -> tuple[jax.Array, SanatanState | None]:
  """o = N / (D + eps) of the power forms (``parallel``, ``blocked``) in v's dtype, the incoming
  state's terms added, and the state after the last token at p = 1 with 6 channels (else None)."""
  x = prepared
  if state is not None:
    # The state holds raw-score sums; the power forms work in units of s / c.
    state_num, state_den = read_state(x.phi_q, x.doc, state)
    num_BxTxHxV, den_BxTxH = num_BxTxHxV + state_num / x.c, den_BxTxH + state_den / x.c
  o = num_BxTxHxV / (den_BxTxH[..., None] + EPS)
  new_state = None
  if has_constant_state(options.p, options.channels):
    new_state = final_state(x.phi_k, v_BxTxHxV, x.doc, x.positions, state)
  return o.astype(v_BxTxHxV.dtype), new_state


# The feature map inside the kernels, on one block of tokens.

def feature_channels(u, omega, lam_raw, pos, valid) -> tuple:
  """The six channels of Phi for a block of raw q or k [n, dp] (fp32), zero where not ``valid``.

  Roots come from the pre-rotation angles (MATH §1.1 step 3); the channel order is feature_map's.
  """
  theta = features.angles(u)
  r = features.soft_roots(theta, omega)
  # features.rotate on a [n, d] block, written out: its [B, T, H, d] broadcasting would put 4-D
  # arrays (and 4-D reductions in the VJP) into the kernel, which the Triton lowering handles badly.
  rot = theta + pos[:, None].astype(F32) * (features.LAMBDA_SCALE * jnp.tanh(lam_raw))
  cos, sin = jnp.cos(rot), jnp.sin(rot)
  channels = (jnp.ones_like(rot), cos, sin, r, r * cos, r * sin)
  return tuple(jnp.where(valid, x, 0.0) for x in channels)


def block_feature_fn(pos, start, shape, cfg):
  """(u [n, dp], omega [1, dp], lam_raw [1, dp]) -> the variant's non-constant channels (fp32) of
  the block of tokens ``start : start + n``, zero on time and head-dim padding. ``pos`` [n] are
  the block's positions; ``cfg`` is a blocked kernel's config (``length``, ``head_dim``,
  ``channels``)."""
  token = start + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  dim = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  valid = (token < cfg.length) & (dim < cfg.head_dim)

  def fn(u, omega, lam_raw):
    phi = feature_channels(u, omega, lam_raw, pos, valid)
    return tuple(phi[c] for c in NON_CONSTANT_CHANNELS[cfg.channels])

  return fn


def channel_major_state(state: SanatanState | None, B: int, H: int, d: int, dp: int, V: int, Vp: int):
  """SanatanState's S [B, H, 6d, V], z [B, H, 6d] (feature index 6a + c) -> the Triton kernels' padded
  channel-major S [B, H, 6, dp, Vp], z [B, H, 6, dp] in fp32; zeros for no state."""
  channels = 6
  if state is None:
    return (jnp.zeros((B, H, channels, dp, Vp), jnp.float32), jnp.zeros((B, H, channels, dp), jnp.float32))
  S = state.S.astype(jnp.float32).reshape(B, H, d, channels, V).swapaxes(2, 3)
  z = state.z.astype(jnp.float32).reshape(B, H, d, channels).swapaxes(2, 3)
  return (pallas_utils.pad_axis(pallas_utils.pad_axis(S, 3, dp), 4, Vp), pallas_utils.pad_axis(z, 3, dp))


def interleaved_state(S: jax.Array, z: jax.Array, d: int, V: int) -> tuple[jax.Array, jax.Array]:
  """The inverse of ``channel_major_state``: drops the padding and interleaves the channels."""
  B, H, channels = S.shape[:3]
  S = S[:, :, :, :d, :V].swapaxes(2, 3).reshape(B, H, channels * d, V)
  return S, z[:, :, :, :d].swapaxes(2, 3).reshape(B, H, channels * d)
