"""Causal Taylor linear attention of BASED (SPEC §2.1, based_zoology §1–§2).

Three XLA implementations of one function, parallel, chunked, recurrent, and Pallas kernels (no
decay ablation): ``implementation="pallas"``, the chunked kernels, ``based_jax.ops.taylor_attention.pallas_triton``
(Triton) off TPU, ``based_jax.ops.taylor_attention.pallas_mosaic_tpu`` (Mosaic) where ``pallas_utils.backend()``
is "tpu"; ``"pallas_blocked"``, the quadratic form block by block
(``based_jax.ops.taylor_attention.pallas_triton_blocked``, Triton; interpreted off GPU).
Per head, with ``A_tj = phi(q_t)·phi(k_j) = 1 + s + s²/2`` and ``s = q_t·k_j / sqrt(d')``::

    y_t = dt_t · sum_{j<=t} gamma^(t-j) A_tj v_j / (sum_{j<=t} A_tj + eps)

Without the decay ablation ``gamma = 1`` and ``dt = 1`` (the released models). With it
(based_zoology §2.6) ``gamma_h`` is a fixed per-head rate, ``dt`` an input-dependent scalar per
position and head that multiplies the query row, and the denominator stays undecayed. The recurrent
state is ``S = sum_j gamma^(T-1-j) phi(k_j) v_j^T`` [F, dv] and ``z = sum_j phi(k_j)`` [F], both
fp32; a state passed in is the prefix of the same sequence (write-then-read: token t sees itself).

``eps`` defaults to 1e-12, the released code's value; FLA's kernels use 1e-6. Both are far below
the smallest possible denominator (1/2, since every A_tj >= 1/2), so the choice only matters for
bit-level comparisons with one code base or the other.

Packed sequences (``segment_ids`` [B, T]): a new document starts wherever the id changes; tokens see
only keys of their own run of ids, and an incoming state continues the first run (a document that
starts exactly at a call boundary gets a fresh state instead). ``parallel``, ``recurrent`` and
both kernels support it; ``chunked`` raises.

``implementation="auto"`` picks the fastest form that takes the arguments
(``resolve_implementation``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from based_jax.ops.taylor_attention import pallas_triton as pallas_taylor

from based_jax.ops.taylor_attention import pallas_triton_blocked as pallas_taylor_blocked

from based_jax.ops.taylor_attention import pallas_mosaic_tpu as pallas_taylor_tpu
from based_jax.taylor import Feature, feature_width, taylor_features, taylor_kernel
from lmcore.ops.common import pallas_utils

IMPLEMENTATIONS: tuple[str, ...] = ("parallel", "chunked", "recurrent")  # the XLA forms
KERNELS: tuple[str, ...] = ("pallas", "pallas_blocked")  # GPU kernels (no decay ablation)
VALID_IMPLEMENTATIONS: tuple[str, ...] = IMPLEMENTATIONS + KERNELS + ("auto",)


class TaylorState(NamedTuple):
  """Recurrent state of Taylor linear attention (fp32)."""

  S: jax.Array  # [B, H, F, dv]: sum_j gamma^(age) phi(k_j) v_j^T
  z: jax.Array  # [B, H, F]: sum_j phi(k_j), undecayed


def zero_state(batch_size: int, n_heads: int, key_dim: int, value_dim: int,
               feature: Feature = "compact") -> TaylorState:
  """The start-of-sequence state."""
  f = feature_width(key_dim, feature)
  return TaylorState(S=jnp.zeros((batch_size, n_heads, f, value_dim), jnp.float32),
                     z=jnp.zeros((batch_size, n_heads, f), jnp.float32))


def default_decay_rates(n_heads: int) -> jax.Array:
  """The decay ablation's rates ``gamma_h = 1 - 2^(-3-h)``, h = 0..H-1 (SPEC §2.1), fp32 [H]."""
  return 1.0 - 2.0 ** (-3.0 - jnp.arange(n_heads, dtype=jnp.float32))


def segment_boundaries(segment_ids_BxT: jax.Array) -> jax.Array:
  """True where a document starts inside the call (id differs from the previous token's). [B, T]."""
  return jnp.concatenate([jnp.zeros_like(segment_ids_BxT[:, :1], dtype=bool),
                          segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)


def segment_runs(segment_ids_BxT: jax.Array) -> jax.Array:
  """Run index of every token: 0 for the first run of equal ids, +1 at each change of id. [B, T]."""
  return jnp.cumsum(segment_boundaries(segment_ids_BxT), axis=1, dtype=jnp.int32)


# "auto" on a GPU: the blocked (quadratic) kernels below this length, the chunked ones from it. H200
# fwd+bwd (B T = 16,384, 16 heads, d' = 16, dv = 64): 1.59 against 4.43 ms at T = 2048, 2.97
# against 4.31 at 4096, 4.80 against 4.74 at 8192, 33.5 against 10.7 at 32768.
BLOCKED_BELOW = 8192


def resolve_implementation(implementation: str, *, length: int, decay: bool = False,
                           segments: bool = False) -> str:
  """The form "auto" runs for these arguments; other names pass through.

  ``length``: T; ``decay``: the decay ablation is on (``decay`` or ``dt`` given); ``segments``:
  ``segment_ids`` given. On a GPU without the decay ablation (which the kernels lack) the Pallas
  kernels: "pallas_blocked" for T < ``BLOCKED_BELOW``, else "pallas" (H200 fwd+bwd 2.05× / 3.71×
  / 5.97× XLA chunked at T = 2048 / 8192 / 32768; the blocked ones 5.9× at 2048). Otherwise XLA
  (TPUs too: libtpu has never compiled the Mosaic kernels): "chunked", or with ``segments``, which
  chunked does not take, "parallel", the fastest XLA form that does (0.86× chunked at T = 2048 on
  the H200, at the cost of B H T² fp32 scores); "recurrent" is a T-step serial scan, the decode
  path.
  """
  if implementation != "auto":
    return implementation
  if pallas_utils.backend() == "gpu" and not decay:
    return "pallas_blocked" if length < BLOCKED_BELOW else "pallas"
  return "parallel" if segments else "chunked"


def taylor_linear_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "parallel",
    state: TaylorState | None = None, eps: float = 1e-12, feature: Feature = "compact",
    chunk_size: int = 64, decay: jax.Array | None = None, dt: jax.Array | None = None,
    segment_ids: jax.Array | None = None, kernel_precision: str = "input"
    ) -> tuple[jax.Array, TaylorState]:
  """Causal normalised Taylor linear attention (module docstring).

  Args:
    q, k: raw per-head projections [B, T, H, d'] (the feature map is applied here).
    v: values [B, T, H, dv].
    implementation: ``parallel`` (materialised T x T scores), ``chunked`` (``lax.scan`` over
      chunks of ``chunk_size``), ``recurrent`` (``lax.scan`` over tokens), ``pallas`` (the
      kernels: chunk-parallel Triton on GPU, interpreted on CPU; sequential-chunk Mosaic on TPU;
      no ``decay``/``dt``) or ``pallas_blocked`` (the quadratic form's Triton kernels, faster below
      a few thousand tokens; no ``decay``/``dt``); same function. ``auto``: see
      ``resolve_implementation``.
    state: the state after a prefix of this sequence, or None for the start of a sequence.
    eps: added to the denominator.
    feature: ``compact`` (F = 153 at d' = 16) or ``full`` (F = 273): same function, different
      state width.
    chunk_size: tokens per chunk of the chunked form.
    decay: per-head rates gamma [H] (e.g. ``default_decay_rates(H)``), or None for no decay.
    dt: per-position, per-head query scale [B, T, H], or None for 1.
    segment_ids: packed-document ids [B, T] (parallel, recurrent and pallas only).
    kernel_precision: the Pallas GPU kernels' dot operands, "input" (the inputs' dtype), "tf32"
      or "float32" (fp32 throughout, fp32 o; ``pallas_utils.PRECISIONS``). Other implementations
      ignore it.

  Returns:
    ``(o, new_state)``: o [B, T, H, dv] in v's dtype (fp32 from the kernels at kernel_precision
    "tf32"/"float32"); the fp32 state after the last token.
  """
  batch, length, heads, key_dim = q.shape
  implementation = resolve_implementation(implementation, length=length,
                                          decay=decay is not None or dt is not None,
                                          segments=segment_ids is not None)
  _check_args(q, k, v, implementation, decay, dt, segment_ids)
  pallas_utils.check_precision(kernel_precision, "taylor_linear_attention")
  if implementation == "pallas":
    options = pallas_utils.kernel_options(kernel_precision, "taylor_linear_attention")
    kernels = (pallas_taylor_tpu.taylor_linear_attention_tpu if pallas_utils.backend() == "tpu"
               else pallas_taylor.taylor_linear_attention_pallas)
    return kernels(q, k, v, state=state, eps=eps, feature=feature, chunk_size=chunk_size,
                   segment_ids=segment_ids, **options)
  runs_BxT = (jnp.zeros((batch, length), jnp.int32) if segment_ids is None
              else segment_runs(segment_ids))
  if implementation == "pallas_blocked":
    return _blocked_kernels(q, k, v, state, runs_BxT, eps=eps, feature=feature,
                            precision=kernel_precision)
  if state is None:
    state = zero_state(batch, heads, key_dim, v.shape[-1], feature)
  state = TaylorState(*(x.astype(jnp.float32) for x in state))
  log_gamma_H = (jnp.zeros((heads,), jnp.float32) if decay is None
                 else jnp.log(decay.astype(jnp.float32)))
  dt_BxTxH = jnp.ones((batch, length, heads), jnp.float32) if dt is None else dt.astype(jnp.float32)
  if implementation == "parallel":
    return _parallel(q, k, v, state, log_gamma_H, dt_BxTxH, runs_BxT, eps=eps, feature=feature)
  if implementation == "chunked":
    return _chunked(q, k, v, state, log_gamma_H, dt_BxTxH, eps=eps, feature=feature,
                    chunk_size=chunk_size)
  return _recurrent(q, k, v, state, log_gamma_H, dt_BxTxH, runs_BxT, eps=eps, feature=feature)


def _check_args(q, k, v, implementation, decay, dt, segment_ids) -> None:
  if implementation not in VALID_IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; "
                     f"valid: {', '.join(VALID_IMPLEMENTATIONS)}")
  if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
    raise ValueError(f"q, k must be [B, T, H, d'] and v [B, T, H, dv]; "
                     f"got {q.shape}, {k.shape}, {v.shape}")
  if decay is not None and decay.shape != q.shape[2:3]:
    raise ValueError(f"decay must be per-head rates of shape {q.shape[2:3]}, got {decay.shape}")
  if dt is not None and dt.shape != q.shape[:3]:
    raise ValueError(f"dt must have shape [B, T, H] = {q.shape[:3]}, got {dt.shape}")
  if implementation in KERNELS and (decay is not None or dt is not None):
    raise NotImplementedError("the decay ablation (decay, dt) is supported by implementation="
                              f"'parallel', 'chunked' or 'recurrent', not {implementation!r}")
  if segment_ids is not None and implementation == "chunked":
    raise NotImplementedError("segment_ids are supported by implementation='parallel', 'recurrent' "
                              "or 'pallas', not 'chunked'")


def _mm(spec: str, *operands: jax.Array) -> jax.Array:
  """einsum accumulated in fp32 at full precision."""
  return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def _scores(q_BxTxHxK: jax.Array, k_BxSxHxK: jax.Array) -> jax.Array:
  """A_ts = 1 + s + s²/2 straight from q·k (no feature map), fp32 [B, H, T, S]."""
  s_BxHxTxS = _mm("bthk,bshk->bhts", q_BxTxHxK, k_BxSxHxK) / math.sqrt(q_BxTxHxK.shape[-1])
  return taylor_kernel(s_BxHxTxS)


def _parallel(q, k, v, state, log_gamma_H, dt_BxTxH, runs_BxT, *, eps, feature):
  """Materialised scores, masked by causality and by runs of segment ids."""
  length = q.shape[1]
  t_T = jnp.arange(length)
  lag_TxT = t_T[:, None] - t_T[None, :]
  visible_Bx1xTxT = ((lag_TxT >= 0)[None] & (runs_BxT[:, :, None] == runs_BxT[:, None, :]))[:, None]
  A_BxHxTxT = jnp.where(visible_Bx1xTxT, _scores(q, k), 0.0)
  decay_HxTxT = jnp.exp(log_gamma_H[:, None, None] * jnp.maximum(lag_TxT, 0))
  num_BxTxHxV = _mm("bhts,bshv->bthv", A_BxHxTxT * decay_HxTxT, v)
  den_BxTxH = A_BxHxTxT.sum(-1).transpose(0, 2, 1)

  # The incoming state is the prefix of the first run; it has decayed by gamma^(t+1) at token t.
  first_BxTx1, (read_S_BxTxHxV, read_z_BxTxH) = _state_reads(q, state, runs_BxT, feature)
  prefix_BxTxH = first_BxTx1 * jnp.exp((t_T[:, None] + 1) * log_gamma_H)
  num_BxTxHxV += prefix_BxTxH[..., None] * read_S_BxTxHxV
  den_BxTxH += first_BxTx1 * read_z_BxTxH
  o_BxTxHxV = dt_BxTxH[..., None] * num_BxTxHxV / (den_BxTxH[..., None] + eps)
  return o_BxTxHxV.astype(v.dtype), _parallel_final_state(k, v, state, log_gamma_H, runs_BxT,
                                                          feature=feature)


def _state_reads(q, state, runs_BxT, feature):
  """Which tokens read an incoming state (the first run's: [B, T, 1] float) and what they read,
  phi(q)·S [B, T, H, dv] and phi(q)·z [B, T, H] (fp32, undecayed)."""
  phi_q_BxTxHxF = taylor_features(q, feature)
  return ((runs_BxT == 0)[..., None].astype(jnp.float32),
          (_mm("bthf,bhfv->bthv", phi_q_BxTxHxF, state.S),
           _mm("bthf,bhf->bth", phi_q_BxTxHxF, state.z)))


def _blocked_kernels(q, k, v, state, runs_BxT, *, eps, feature, precision):
  """``parallel``'s function by the blocked Pallas kernels (pallas_taylor_blocked.py): the kernels'
  sums N, D, plus a prefix state's read for the first run's tokens; o in v's dtype ("input") or
  fp32; the final state by ``_parallel_final_state`` (XLA, dropped by jit when unused)."""
  num_BxTxHxV, den_BxTxH = pallas_taylor_blocked.taylor_sums_blocked(q, k, v, runs_BxT,
                                                                     precision=precision)
  zero_decay_H = jnp.zeros(q.shape[2:3], jnp.float32)
  if state is None:
    state = zero_state(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], feature)
  else:
    state = TaylorState(*(x.astype(jnp.float32) for x in state))
    first_BxTx1, (read_S_BxTxHxV, read_z_BxTxH) = _state_reads(q, state, runs_BxT, feature)
    num_BxTxHxV += first_BxTx1[..., None] * read_S_BxTxHxV
    den_BxTxH += first_BxTx1 * read_z_BxTxH
  o_BxTxHxV = num_BxTxHxV / (den_BxTxH[..., None] + eps)
  out_dtype = pallas_utils.output_dtype(v.dtype, precision)
  return o_BxTxHxV.astype(out_dtype), _parallel_final_state(k, v, state, zero_decay_H, runs_BxT,
                                                            feature=feature)


def _parallel_final_state(k, v, state, log_gamma_H, runs_BxT, *, feature) -> TaylorState:
  """The state after the last token: only the last run's keys, plus the old state if one run."""
  length = k.shape[1]
  in_last_BxT = (runs_BxT == runs_BxT[:, -1:]).astype(jnp.float32)
  age_T = length - 1 - jnp.arange(length)
  weight_BxTxH = in_last_BxT[..., None] * jnp.exp(age_T[:, None] * log_gamma_H)
  phi_k_BxTxHxF = taylor_features(k, feature).astype(jnp.float32)
  keep_B = (runs_BxT[:, -1] == 0).astype(jnp.float32)
  S = (keep_B[:, None, None, None] * jnp.exp(length * log_gamma_H)[:, None, None] * state.S
       + _mm("bthf,bthv->bhfv", phi_k_BxTxHxF * weight_BxTxH[..., None], v))
  z = keep_B[:, None, None] * state.z + _mm("bthf,bt->bhf", phi_k_BxTxHxF, in_last_BxT)
  return TaylorState(S, z)


def _chunked(q, k, v, state, log_gamma_H, dt_BxTxH, *, eps, feature, chunk_size):
  """``lax.scan`` over chunks: masked intra-chunk scores plus the carried fp32 state.

  The last chunk is zero-padded after the feature map, so padded keys have phi(k) = 0 and add
  nothing to the state; padded tokens also take no decay step (log gamma 0), so the state after
  the scan is the state after token T-1.
  """
  batch, length, heads, _ = q.shape
  size = min(chunk_size, length)
  n_chunks = -(-length // size)
  valid_NC = jnp.arange(n_chunks * size) < length
  # Cumulative log-decay inside each chunk (inclusive), fp32: b_c = sum_{i<=c} log gamma.
  logdecay_NxCxH = jnp.cumsum(
      (valid_NC[:, None] * log_gamma_H).reshape(n_chunks, size, heads), axis=1)

  def to_chunks(x_BxTx_):
    pad = [(0, 0), (0, n_chunks * size - length)] + [(0, 0)] * (x_BxTx_.ndim - 2)
    x = jnp.pad(x_BxTx_, pad).reshape(batch, n_chunks, size, *x_BxTx_.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  # Feature maps outside the scan: the loop body stays small (and compiles twice as fast).
  phi_q_BxTxHxF = taylor_features(q, feature)
  phi_k_BxTxHxF = taylor_features(k, feature).astype(jnp.float32)
  xs = tuple(map(to_chunks, (q, k, phi_q_BxTxHxF, phi_k_BxTxHxF, v, dt_BxTxH))) + (logdecay_NxCxH,)
  step = lambda carry, x: _chunk_step(carry, *x, eps=eps)
  state, o_NxBxCxHxV = jax.lax.scan(step, state, xs)
  o_BxTxHxV = jnp.moveaxis(o_NxBxCxHxV, 0, 1).reshape(batch, n_chunks * size, heads, -1)
  return o_BxTxHxV[:, :length].astype(v.dtype), state


def _chunk_step(state, q_BxCxHxK, k_BxCxHxK, phi_q_BxCxHxF, phi_k_BxCxHxF, v_BxCxHxV, dt_BxCxH,
                b_CxH, *, eps):
  """One chunk: output from the carried state and the causal in-chunk block, then the new state."""
  size = q_BxCxHxK.shape[1]
  causal_CxC = jnp.tril(jnp.ones((size, size), bool))
  A_BxHxCxC = jnp.where(causal_CxC, _scores(q_BxCxHxK, k_BxCxHxK), 0.0)
  # gamma^(c-d) = exp(b_c - b_d); clamped at 0 so the masked (c < d) entries cannot overflow.
  decay_HxCxC = jnp.exp(jnp.minimum(b_CxH.T[:, :, None] - b_CxH.T[:, None, :], 0.0))
  num_BxCxHxV = (_mm("bhcd,bdhv->bchv", A_BxHxCxC * decay_HxCxC, v_BxCxHxV)
                 + jnp.exp(b_CxH)[..., None] * _mm("bchf,bhfv->bchv", phi_q_BxCxHxF, state.S))
  den_BxCxH = A_BxHxCxC.sum(-1).transpose(0, 2, 1) + _mm("bchf,bhf->bch", phi_q_BxCxHxF, state.z)
  o_BxCxHxV = dt_BxCxH[..., None] * num_BxCxHxV / (den_BxCxH[..., None] + eps)

  age_decay_CxH = jnp.exp(b_CxH[-1] - b_CxH)
  S = (jnp.exp(b_CxH[-1])[:, None, None] * state.S
       + _mm("bchf,bchv->bhfv", phi_k_BxCxHxF * age_decay_CxH[..., None], v_BxCxHxV))
  z = state.z + phi_k_BxCxHxF.sum(1)
  return TaylorState(S, z), o_BxCxHxV


def _recurrent(q, k, v, state, log_gamma_H, dt_BxTxH, runs_BxT, *, eps, feature):
  """``lax.scan`` over tokens: write, then read; the state resets where a new run starts.

  ``S <- gamma S + phi(k) v^T``, ``z <- z + phi(k)``, ``o = dt phi(q)·S / (phi(q)·z + eps)``.
  """
  gamma_H = jnp.exp(log_gamma_H)
  reset_BxT = segment_boundaries(runs_BxT)

  def step(state, x):
    phi_q_BxHxF, phi_k_BxHxF, v_BxHxV, dt_BxH, reset_B = x
    keep_B = 1.0 - reset_B.astype(jnp.float32)
    S = (keep_B[:, None, None, None] * gamma_H[:, None, None] * state.S
         + phi_k_BxHxF[..., None] * v_BxHxV.astype(jnp.float32)[..., None, :])
    z = keep_B[:, None, None] * state.z + phi_k_BxHxF
    num_BxHxV = _mm("bhf,bhfv->bhv", phi_q_BxHxF, S)
    den_BxH = _mm("bhf,bhf->bh", phi_q_BxHxF, z)
    return TaylorState(S, z), dt_BxH[..., None] * num_BxHxV / (den_BxH[..., None] + eps)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = (taylor_features(q, feature), taylor_features(k, feature).astype(jnp.float32), v, dt_BxTxH,
        reset_BxT)
  state, o_TxBxHxV = jax.lax.scan(step, state, jax.tree.map(time_major, xs))
  return time_major(o_TxBxHxV).astype(v.dtype), state
