"""What every backend of SANATAN attention shares (MATH §1.1-1.2): the problem a backend is chosen
for, the state, the options, their checks, the feature map on [B, T, H, d] arrays, the power weights
and the one kernel-side statement of Phi's channels from their factors (``factor_channel``).

    a_tj = (s_tj / c)^p / (sum_{l<=t} (s_tl / c)^p + eps),  o_t = sum_{j<=t} a_tj v_j,  eps = 1e-6,

with ``s_tj = Phi(q_t).Phi(k_j)`` (sanatan_jax.features; 4ch clips ``s`` at 0, 3ch legacy adds d).
Packed documents: a token sees only tokens of its own document (``segments.document_index``), and an
incoming state belongs to the first document of each row.

The backend contract: ``backend(q, k, v, omega, lam_raw, *, positions, segment_ids, state, tiles,
options) -> (o [B, T, H, dv], SanatanState or None)``, with ``tiles`` the backend's tiling
(``lmcore.ops.common.backend``) and ``options`` the ``Options`` it reads.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common import pallas_utils
from lmcore.ops.common.layout import default_positions
from lmcore.ops.common.segments import document_index
from sanatan_jax import features

OP = "sanatan_attention"
EPS = 1e-6
F32 = jnp.float32


def has_constant_state(p: int, channels: int) -> bool:
  """Only p = 1 with 6 channels has the exact constant-size recurrence (MATH §1.2)."""
  return p == 1 and channels == 6


@dataclasses.dataclass(frozen=True)
class Problem:
  """What decides the backend, its tiling and its FLOP count: the platform, the power p and channel
  variant, the head widths d and dv, the length T (None: not known) and the dtype the kernels' dots
  take ("float32" for fp32 inputs or kernel_precision "tf32"/"float32")."""

  platform: str
  p: int = 1
  channels: int = 6
  head_dim: int = 0
  value_dim: int = 0
  length: int | None = None
  dtype: str = "bfloat16"

  @property
  def constant_state(self) -> bool:
    return has_constant_state(self.p, self.channels)

  @property
  def feature_dim(self) -> int:
    """F = channels · d, the width of Phi."""
    return self.channels * self.head_dim

  def describe(self) -> str:
    return (f"p={self.p} with {self.channels} channels, heads of {self.head_dim} x {self.value_dim} on "
            f"{self.platform}")


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


# The kernels' arguments by name and each one's leading dimensions, for their shard_map
# (``lmcore.ops.common.shard_map.run_sharded``); outputs: o "BTH" and, for p = 1, ``STATE_LAYOUT``.
KERNEL_LAYOUTS = dict(q="BTH", k="BTH", v="BTH", omega="H", lam_raw="H", positions="B", segment_ids="B",
                      state="BH")
STATE_LAYOUT = SanatanState(S="BH", z="BH", position="B")


class Options(NamedTuple):
  """The options a backend may read besides its tiling (``sanatan_attention``'s arguments).

  p, channels, three_channel: the kernel (MATH §1.1 steps 5-6).
  rotate: False drops the temporal rotation (the "no lambda" ablation).
  precision: the Triton kernels' dot operands (``pallas_utils.PRECISIONS``); the others ignore it.
  remat: ``chunked``'s backward recomputes its forward; ``pallas_fused``'s recomputes the factors.
  """

  p: int = 1
  channels: int = 6
  three_channel: str = "clean"
  rotate: bool = True
  precision: str = "input"
  remat: bool = True


def validate_options(*, p: int, channels: int, three_channel: str) -> None:
  """Raises ValueError for a power or channel variant MATH §1 does not define."""
  if not isinstance(p, int) or p < 1:
    raise ValueError(f"p must be a positive integer (MATH uses 1, 2, 4), got {p!r}")
  features.check_channels(channels, three_channel)


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
  """o = N / (D + eps) of the power forms (``parallel``) in v's dtype, the incoming
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


# Phi's channels from their factors, the one statement of them the kernels use.

def factor_channel(c, cos: jax.Array, sin: jax.Array, r: jax.Array, one=1.0) -> jax.Array:
  """Channel c of the six-channel Phi of one head dimension (feature_map's order 1, cos, sin, r, r cos,
  r sin) from its factors cos th_rot, sin th_rot and r: U_c · W_c with U = (one, cos, sin)[c mod 3] and
  W = (1, r)[c div 3]. ``c`` is an int, or an int array (traced, or one per lane) that broadcasts
  against the factors; ``one`` is the constant channel's value (1, or 0 on padding). With ``cos is
  sin`` (one array holding whichever of them U_c needs) that array is U_c for c mod 3 != 0."""
  if isinstance(c, int):
    u = (one, cos, sin)[c % 3]
    return u if c < 3 else u * r
  trig = cos if cos is sin else jnp.where(c % 3 == 1, cos, sin)
  return jnp.where(c % 3 == 0, one, trig) * jnp.where(c < 3, 1.0, r)


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
