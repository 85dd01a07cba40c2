"""SANATAN power-normalised causal attention (SPEC §1.1 step 6, §1.2): one function, four forms.

    a_tj = (s_tj / c)^p / (sum_{l<=t} (s_tl / c)^p + eps),  o_t = sum_{j<=t} a_tj v_j,  eps = 1e-6,

with ``s_tj = Phi(q_t).Phi(k_j)`` (features.py; 4ch clips ``s`` at 0, 3ch legacy adds d).

* ``parallel``: the materialised T x T reference; any p and channel variant.
* ``blocked``: the same sum tiled over query and key blocks; no T x T array is ever held, in the
  forward or (through rematerialisation of each query block) the backward pass. Scores lie in
  [0, 1] after division by c, so no running maximum is needed.
* ``chunked`` (p = 1, 6ch): chunked linear attention, intra-chunk causal block + fp32 state.
* ``pallas``: Triton-Pallas kernels with the features computed inside them and a custom VJP. p = 1
  with 6ch: the chunked recurrence, parallel over chunks (kernels/pallas_p1.py; its own chunk, not
  ``chunk_size``; on a TPU the Mosaic kernels of kernels/pallas_p1_tpu.py).
  Every other p and channel variant: the blocked, flash-style kernels
  (kernels/pallas_blocked.py; their own blocks, not ``block_size``), no state; on a TPU their Mosaic
  form (kernels/pallas_blocked_tpu.py).
* ``recurrent`` (p = 1, 6ch): write-then-read ``S_t = S_{t-1} + Phi(k_t) v_t^T``,
  ``z_t = z_{t-1} + Phi(k_t)``, ``o_t = Phi(q_t)^T S_t / (Phi(q_t)^T z_t + c eps)``.
* ``auto`` (or None): ``pallas`` on GPU, XLA ``chunked`` (p = 1, 6ch) or ``blocked`` elsewhere
  (``resolve_implementation``).

Packed documents: segments are maximal runs of equal ``segment_ids`` in a row. A token sees only
its own run, and an incoming state belongs to the first run of each row (pass a zero state, or none,
when a call starts a new document).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common import pallas_utils
from lmcore.ops.common.layout import default_positions
from sanatan_jax import features
from sanatan_jax.ops.sanatan_attention import pallas_triton_blocked as pallas_blocked
from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_blocked as pallas_blocked_tpu
from sanatan_jax.ops.sanatan_attention import pallas_triton_p1 as pallas_p1
from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_p1 as pallas_p1_tpu

EPS = 1e-6
IMPLEMENTATIONS = ("parallel", "blocked", "chunked", "recurrent", "pallas", "auto")
_F32 = jnp.float32


class SanatanState(NamedTuple):
  """The exact p = 1 six-channel state of SPEC §1.2, accumulated in float32.

  Attributes:
    S: [B, H, F, dv], sum of Phi(k_j) v_j^T over the current document.
    z: [B, H, F], sum of Phi(k_j).
    position: [B] int32, the position of the next token.
  """

  S: jax.Array
  z: jax.Array
  position: jax.Array


def has_constant_state(p: int, channels: int) -> bool:
  """Only p = 1 with 6 channels has the exact constant-size recurrence (SPEC §1.2)."""
  return p == 1 and channels == 6


def resolve_implementation(implementation: str | None, p: int, channels: int) -> str:
  """The form "auto" (or None) runs; other names pass through.

  p = 1 with 6 channels: ``pallas_utils.default_implementation()`` ("pallas" on GPU, else
  "chunked"). Every other p and channel variant: "pallas" (the blocked kernel) on GPU, else XLA
  "blocked" (TPUs keep XLA: libtpu has never compiled the Mosaic kernels).
  """
  if implementation not in (None, "auto"):
    return implementation
  if has_constant_state(p, channels):
    return pallas_utils.default_implementation()
  return "pallas" if pallas_utils.backend() == "gpu" else "blocked"


def validate_options(*, p: int, channels: int, three_channel: str, implementation: str) -> None:
  """Raises ValueError for option combinations SPEC §1 does not define or this op cannot run."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"unknown implementation {implementation!r}; valid: {', '.join(IMPLEMENTATIONS)}")
  if not isinstance(p, int) or p < 1:
    raise ValueError(f"p must be a positive integer (SPEC uses 1, 2, 4), got {p!r}")
  features.check_channels(channels, three_channel)
  if implementation in ("chunked", "recurrent") and not has_constant_state(p, channels):
    raise ValueError(
        f"implementation={implementation!r} exists only for p=1 with 6 channels (the exact "
        f"recurrence of SPEC §1.2), got p={p}, channels={channels}; use 'parallel' or 'blocked'")


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
  return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=_F32)


def sanatan_features(q_BxTxHxd: jax.Array, k_BxTxHxd: jax.Array, omega_Hxd: jax.Array,
                     lam_raw_Hxd: jax.Array, positions_BxT: jax.Array, *, channels: int = 6,
                     rotate: bool = True) -> tuple[jax.Array, jax.Array]:
  """Phi(q), Phi(k) as float32 [B, T, H, F] (SPEC §1.1 steps 2-5).

  Roots come from the pre-rotation angles; ``rotate=False`` is the "no lambda" ablation.
  """
  omega_Hxd = omega_Hxd.astype(_F32)

  def phi(u_BxTxHxd):
    theta = features.angles(u_BxTxHxd.astype(_F32))
    r = features.soft_roots(theta, omega_Hxd) if channels != 3 else None
    theta_rot = features.rotate(theta, positions_BxT, lam_raw_Hxd.astype(_F32)) if rotate else theta
    return features.feature_map(theta_rot, r, channels)

  return phi(q_BxTxHxd), phi(k_BxTxHxd)


def segment_runs(segment_ids_BxT: jax.Array | None, batch_size: int, length: int) -> jax.Array:
  """Run index int32 [B, T]: 0 for the first run of equal segment ids in a row, then 1, 2, ..."""
  if segment_ids_BxT is None:
    return jnp.zeros((batch_size, length), jnp.int32)
  change_BxT = segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]
  runs_BxT = jnp.cumsum(change_BxT.astype(jnp.int32), axis=1)
  return jnp.pad(runs_BxT, ((0, 0), (1, 0)))


def _power_weights(s: jax.Array, mask: jax.Array, *, p: int, channels: int, three_channel: str,
                   d: int) -> jax.Array:
  """(s / c)^p where ``mask`` holds, else 0 (float32)."""
  u = features.unit_scores(s, channels=channels, three_channel=three_channel, d=d)
  return jnp.where(mask, u**p, 0.0)


def _parallel(phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, run_BxT, weights):
  """Numerator [B, T, H, V] and denominator [B, T, H] of a_tj from the full T x T score matrix."""
  T = phi_q_BxTxHxF.shape[1]
  s_BxHxTxT = _einsum("bthf,bshf->bhts", phi_q_BxTxHxF, phi_k_BxTxHxF)
  causal_TxT = jnp.tril(jnp.ones((T, T), bool))
  mask_BxTxT = causal_TxT[None] & (run_BxT[:, :, None] == run_BxT[:, None, :])
  w_BxHxTxT = weights(s_BxHxTxT, mask_BxTxT[:, None])
  num_BxTxHxV = _einsum("bhts,bshv->bthv", w_BxHxTxT.astype(v_BxTxHxV.dtype), v_BxTxHxV)
  return num_BxTxHxV, jnp.sum(w_BxHxTxT, axis=-1).transpose(0, 2, 1)


def _to_blocks(x_BxTx: jax.Array, size: int, pad_mode: str = "constant") -> jax.Array:
  """[B, T, ...] -> [N, B, size, ...], padding T up to N * size."""
  B, T = x_BxTx.shape[:2]
  n = -(-T // size)
  pad = [(0, 0), (0, n * size - T)] + [(0, 0)] * (x_BxTx.ndim - 2)
  x = jnp.pad(x_BxTx, pad, mode=pad_mode)
  return x.reshape(B, n, size, *x.shape[2:]).swapaxes(0, 1)


def _from_blocks(x_NxBxCx: jax.Array, length: int) -> jax.Array:
  """[N, B, C, ...] -> [B, length, ...]."""
  N, B, C = x_NxBxCx.shape[:3]
  return x_NxBxCx.swapaxes(0, 1).reshape(B, N * C, *x_NxBxCx.shape[3:])[:, :length]


def _blocked(phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, run_BxT, weights, block_size):
  """``_parallel`` tiled: memory O(T * block) (padded keys sit after every real query)."""
  T = phi_q_BxTxHxF.shape[1]
  C = min(block_size, T)
  q_NxBxCxHxF, k_NxBxCxHxF = _to_blocks(phi_q_BxTxHxF, C), _to_blocks(phi_k_BxTxHxF, C)
  v_NxBxCxHxV, run_NxBxC = _to_blocks(v_BxTxHxV, C), _to_blocks(run_BxT, C)
  n = q_NxBxCxHxF.shape[0]
  offsets_C = jnp.arange(C)

  def key_step(i, q_BxCxHxF, run_q_BxC, carry, xs):
    j, k_BxCxHxF, v_BxCxHxV, run_k_BxC = xs

    def accumulate(carry):
      num_BxCxHxV, den_BxHxC = carry
      s_BxHxCxC = _einsum("bqhf,bkhf->bhqk", q_BxCxHxF, k_BxCxHxF)
      causal_CxC = (i * C + offsets_C)[:, None] >= (j * C + offsets_C)[None, :]
      mask_BxCxC = causal_CxC[None] & (run_q_BxC[:, :, None] == run_k_BxC[:, None, :])
      w_BxHxCxC = weights(s_BxHxCxC, mask_BxCxC[:, None])
      num_BxCxHxV += _einsum("bhqk,bkhv->bqhv", w_BxHxCxC.astype(v_BxCxHxV.dtype), v_BxCxHxV)
      return num_BxCxHxV, den_BxHxC + jnp.sum(w_BxHxCxC, axis=-1)

    # Key blocks after the query block are fully masked: skip their work.
    return jax.lax.cond(j <= i, accumulate, lambda c: c, carry), None

  # Remat per query block: the backward pass recomputes one block row at a time, so its residuals
  # are O(T * block) instead of the T x T scores.
  @jax.checkpoint
  def query_block(i, q_BxCxHxF, run_q_BxC, k_blocks, v_blocks, run_blocks):
    B, _, H, _ = q_BxCxHxF.shape
    init = (jnp.zeros((B, C, H, v_BxTxHxV.shape[-1]), _F32), jnp.zeros((B, H, C), _F32))
    step = functools.partial(key_step, i, q_BxCxHxF, run_q_BxC)
    (num, den), _ = jax.lax.scan(step, init, (jnp.arange(n), k_blocks, v_blocks, run_blocks))
    return num, den.transpose(0, 2, 1)

  num_N, den_N = jax.lax.map(
      lambda xs: query_block(*xs, k_NxBxCxHxF, v_NxBxCxHxV, run_NxBxC),
      (jnp.arange(n), q_NxBxCxHxF, run_NxBxC))
  return _from_blocks(num_N, T), _from_blocks(den_N, T)


def _zero_state(batch_size: int, heads: int, width: int, dv: int) -> tuple[jax.Array, jax.Array]:
  return (jnp.zeros((batch_size, heads, width, dv), _F32),
          jnp.zeros((batch_size, heads, width), _F32))


def _chunked(phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, run_BxT, S_BxHxFxV, z_BxHxF, c, chunk_size):
  """Chunked p = 1 form: o [B, T, H, V] fp32 and the final (S, z) (SPEC §1.2)."""
  T = phi_q_BxTxHxF.shape[1]
  C = min(chunk_size, T)
  # Edge-padding the run ids keeps padded (zero-feature) tokens in the last run, so they neither
  # reset the state nor add to it.
  xs = (_to_blocks(phi_q_BxTxHxF, C), _to_blocks(phi_k_BxTxHxF, C), _to_blocks(v_BxTxHxV, C),
        _to_blocks(run_BxT, C, pad_mode="edge"))
  causal_CxC = jnp.tril(jnp.ones((C, C), bool))

  def step(carry, xs):
    S_BxHxFxV, z_BxHxF, run_prev_B = carry
    q_BxCxHxF, k_BxCxHxF, v_BxCxHxV, run_BxC = xs
    same_run_BxCxC = run_BxC[:, :, None] == run_BxC[:, None, :]
    s_BxHxCxC = _einsum("bqhf,bkhf->bhqk", q_BxCxHxF, k_BxCxHxF)
    s_BxHxCxC = jnp.where(causal_CxC[None, None] & same_run_BxCxC[:, None], s_BxHxCxC, 0.0)
    reads_state_BxCx1 = (run_BxC == run_prev_B[:, None])[:, :, None]
    state_num_BxCxHxV = _einsum("bqhf,bhfv->bqhv", q_BxCxHxF, S_BxHxFxV)
    num_BxCxHxV = (_einsum("bhqk,bkhv->bqhv", s_BxHxCxC.astype(v_BxCxHxV.dtype), v_BxCxHxV)
                   + reads_state_BxCx1[..., None] * state_num_BxCxHxV)
    den_BxCxH = (jnp.sum(s_BxHxCxC, axis=-1).transpose(0, 2, 1)
                 + reads_state_BxCx1 * _einsum("bqhf,bhf->bqh", q_BxCxHxF, z_BxHxF))
    o_BxCxHxV = num_BxCxHxV / (den_BxCxH[..., None] + c * EPS)
    run_last_B = run_BxC[:, -1]
    keep_B = run_last_B == run_prev_B
    k_last_BxCxHxF = jnp.where((run_BxC == run_last_B[:, None])[:, :, None, None], k_BxCxHxF, 0)
    S_BxHxFxV = (jnp.where(keep_B[:, None, None, None], S_BxHxFxV, 0.0)
                 + _einsum("bkhf,bkhv->bhfv", k_last_BxCxHxF, v_BxCxHxV))
    z_BxHxF = (jnp.where(keep_B[:, None, None], z_BxHxF, 0.0)
               + jnp.sum(k_last_BxCxHxF.astype(_F32), axis=1))
    return (S_BxHxFxV, z_BxHxF, run_last_B), o_BxCxHxV

  init = (S_BxHxFxV, z_BxHxF, jnp.zeros(run_BxT.shape[:1], jnp.int32))
  (S_BxHxFxV, z_BxHxF, _), o_NxBxCxHxV = jax.lax.scan(step, init, xs)
  return _from_blocks(o_NxBxCxHxV, T), S_BxHxFxV, z_BxHxF


def _recurrent(phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, run_BxT, S_BxHxFxV, z_BxHxF, c):
  """Token-by-token write-then-read recurrence: o [B, T, H, V] fp32 and the final (S, z)."""

  def step(carry, xs):
    S_BxHxFxV, z_BxHxF, run_prev_B = carry
    q_BxHxF, k_BxHxF, v_BxHxV, run_B = xs
    keep_B = run_B == run_prev_B
    S_BxHxFxV = (jnp.where(keep_B[:, None, None, None], S_BxHxFxV, 0.0)
                 + _einsum("bhf,bhv->bhfv", k_BxHxF, v_BxHxV))
    z_BxHxF = jnp.where(keep_B[:, None, None], z_BxHxF, 0.0) + k_BxHxF.astype(_F32)
    num_BxHxV = _einsum("bhf,bhfv->bhv", q_BxHxF, S_BxHxFxV)
    den_BxH = _einsum("bhf,bhf->bh", q_BxHxF, z_BxHxF)
    return (S_BxHxFxV, z_BxHxF, run_B), num_BxHxV / (den_BxH[..., None] + c * EPS)

  xs = tuple(x.swapaxes(0, 1) for x in (phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, run_BxT))
  init = (S_BxHxFxV, z_BxHxF, jnp.zeros(run_BxT.shape[:1], jnp.int32))
  (S_BxHxFxV, z_BxHxF, _), o_TxBxHxV = jax.lax.scan(step, init, xs)
  return o_TxBxHxV.swapaxes(0, 1), S_BxHxFxV, z_BxHxF


def _final_state(phi_k_BxTxHxF, v_BxTxHxV, run_BxT, positions_BxT, state):
  """The state after the last token, directly from its definition (used by parallel and blocked)."""
  run_last_Bx1 = run_BxT[:, -1:]
  in_last_BxTx1x1 = (run_BxT == run_last_Bx1)[:, :, None, None]
  k_last_BxTxHxF = jnp.where(in_last_BxTx1x1, phi_k_BxTxHxF, 0)
  S_BxHxFxV = _einsum("bthf,bthv->bhfv", k_last_BxTxHxF, v_BxTxHxV)
  z_BxHxF = jnp.sum(k_last_BxTxHxF.astype(_F32), axis=1)
  if state is not None:
    keep_B = run_last_Bx1[:, 0] == 0
    S_BxHxFxV += jnp.where(keep_B[:, None, None, None], state.S, 0.0)
    z_BxHxF += jnp.where(keep_B[:, None, None], state.z, 0.0)
  return SanatanState(S_BxHxFxV, z_BxHxF, positions_BxT[:, -1].astype(jnp.int32) + 1)


def _read_state(phi_q_BxTxHxF, run_BxT, state):
  """Phi(q)^T S and Phi(q)^T z of the incoming state, for tokens of the row's first run."""
  first_BxTx1 = (run_BxT == 0)[:, :, None]
  num_BxTxHxV = first_BxTx1[..., None] * _einsum("bthf,bhfv->bthv", phi_q_BxTxHxF, state.S)
  return num_BxTxHxV, first_BxTx1 * _einsum("bthf,bhf->bth", phi_q_BxTxHxF, state.z)


def _check_state(state, p, channels, shape):
  if state is None:
    return
  if not has_constant_state(p, channels):
    raise ValueError(
        f"a SanatanState exists only for p=1 with 6 channels (SPEC §1.2), got p={p}, "
        f"channels={channels}; p>=2 and the 4/3-channel ablations have no constant-size state — "
        "run them on the whole sequence with state=None")
  if state.S.shape != shape:
    raise ValueError(f"state.S has shape {state.S.shape}, expected [B, H, F, dv] = {shape}")


def sanatan_attention(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                      lam_raw: jax.Array, *, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, p: int = 1, channels: int = 6,
                      three_channel: str = "clean", implementation: str | None = "parallel",
                      state: SanatanState | None = None, chunk_size: int = 64,
                      block_size: int = 128, rotate: bool = True,
                      kernel_precision: str = "input"
                      ) -> tuple[jax.Array, SanatanState | None]:
  """SANATAN attention of SPEC §1.1 (steps 2-6) for every head.

  Args:
    q, k: [B, T, H, d], already divided by sqrt(d). v: [B, T, H, dv].
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1 offset by ``state.position``.
    segment_ids: optional [B, T] packed-document ids (see the module docstring).
    p, channels, three_channel: the kernel (SPEC §1.1 steps 5-6).
    implementation: "parallel" | "blocked" | "chunked" | "recurrent" | "pallas" (same function);
      "auto" or None picks the measured fastest for the backend (``resolve_implementation``).
    state: a SanatanState to continue from (p = 1, 6ch only).
    chunk_size, block_size: tile lengths of "chunked" and "blocked".
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    kernel_precision: the Pallas GPU kernels' dot operands, "input" (the inputs' dtype), "tf32"
      or "float32" (fp32 throughout, fp32 o; ``pallas_utils.PRECISIONS``). Other implementations
      ignore it.

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 from the kernels at kernel_precision "tf32"/"float32"),
    and the state after the last token for p = 1 with 6 channels
    (every implementation), else None.
  """
  B, T, H, d = q.shape
  width, dv = channels * d, v.shape[-1]
  implementation = resolve_implementation(implementation, p, channels)
  # The state check goes first: for a p >= 2 decode call it is the error that explains.
  _check_state(state, p, channels, (B, H, width, dv))
  validate_options(p=p, channels=channels, three_channel=three_channel,
                   implementation=implementation)
  pallas_utils.check_precision(kernel_precision, "sanatan_attention")
  if implementation == "pallas":
    options = pallas_utils.kernel_options(kernel_precision, "sanatan_attention")
    on_tpu = pallas_utils.backend() == "tpu"
    if has_constant_state(p, channels):
      kernels = pallas_p1_tpu.sanatan_p1_tpu if on_tpu else pallas_p1.sanatan_p1_pallas
      return kernels(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids,
                     state=state, rotate=rotate, **options)
    blocked = (pallas_blocked_tpu.sanatan_blocked_tpu if on_tpu
               else pallas_blocked.sanatan_blocked_pallas)
    return blocked(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids, p=p,
                   channels=channels, three_channel=three_channel, rotate=rotate,
                   **options), None
  if positions is None:
    positions = default_positions(B, T, None if state is None else state.position)
  run_BxT = segment_runs(segment_ids, B, T)
  phi_q, phi_k = sanatan_features(q, k, omega, lam_raw, positions, channels=channels, rotate=rotate)
  phi_q, phi_k = phi_q.astype(q.dtype), phi_k.astype(k.dtype)
  c = features.score_scale(channels, three_channel, d)

  if implementation in ("chunked", "recurrent"):
    S, z = _zero_state(B, H, width, dv) if state is None else (state.S, state.z)
    if implementation == "chunked":
      o, S, z = _chunked(phi_q, phi_k, v, run_BxT, S, z, c, chunk_size)
    else:
      o, S, z = _recurrent(phi_q, phi_k, v, run_BxT, S, z, c)
    return o.astype(v.dtype), SanatanState(S, z, positions[:, -1].astype(jnp.int32) + 1)

  weights = functools.partial(_power_weights, p=p, channels=channels, three_channel=three_channel,
                              d=d)
  if implementation == "parallel":
    num, den = _parallel(phi_q, phi_k, v, run_BxT, weights)
  else:
    num, den = _blocked(phi_q, phi_k, v, run_BxT, weights, block_size)
  if state is not None:
    # The state holds raw-score sums; the parallel form works in units of s / c.
    state_num, state_den = _read_state(phi_q, run_BxT, state)
    num, den = num + state_num / c, den + state_den / c
  o = num / (den[..., None] + EPS)
  new_state = None
  if has_constant_state(p, channels):
    new_state = _final_state(phi_k, v, run_BxT, positions, state)
  return o.astype(v.dtype), new_state
