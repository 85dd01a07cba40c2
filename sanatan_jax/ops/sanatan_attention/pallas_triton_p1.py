"""Pallas (Triton lowering) kernels for SANATAN p = 1, six channels (MATH §1.2), with custom VJP.

Per head, with Phi the six-channel feature map of MATH §1.1 computed *inside* the kernels from the
raw q, k chunk (``base.feature_channels``), the write-then-read recurrence of
``reference.recurrent``::

    S_t = S_{t-1} + Phi(k_t) v_tᵀ,   z_t = z_{t-1} + Phi(k_t),
    o_t = Phi(q_t)ᵀ S_t / (Phi(q_t)ᵀ z_t + c eps)

is computed in chunks of C tokens (intra-chunk causal block + fp32 state), parallel over chunks
(FLA's "chunk" layout): no program walks the chunks. The 6d-wide features never reach HBM: inside
a kernel they are six [C, d] channel arrays ``1, cos th, sin th, r, r cos th, r sin th`` and the
state six [d, BV] tiles. Outside the kernels the state has SanatanState's layout, feature index
``6 a + channel``.

With N chunks, the state at the start of chunk n follows

    S_{n+1} = keep_n S_n + W_n,   z_{n+1} = keep_n z_n + w_n,

where W_n = sum Phi(k) vᵀ and w_n = sum Phi(k) run over chunk n's last run (its writes) and
keep_n says the state's run continues through the chunk (0 at a new packed document). Forward:

1. a kernel over the grid (batch, head, chunk, value tile) writes every chunk's (W_n, w_n) to
   HBM (fp32, channel-major [6, dp, BV] and [6, dp]);
2. ``chunk_scan`` solves the recurrence for the state at every chunk start (``scan="pallas"``: one
   kernel whose programs each carry a tile of the state through the chunks, reading every W_n once
   and writing every S_n once, in q's dtype; ``"xla"``: an associative scan);
3. a kernel over the same grid computes the outputs of every chunk from its start state and the
   intra-chunk block (``_outputs``), features recomputed from the raw q, k.

Backward (``jax.custom_vjp``). The forward stores its inputs, the output o (in v's dtype) and the
fp32 denominator D_t = Phi(q_t)ᵀ z_t per token; no features and no chunk states. With
dN = do / (D + c eps) and dD = -(do · o) / (D + c eps) (computed outside the kernels), the start
states are recomputed by phases 1-2; a kernel writes every chunk's contribution
(R_n, r_n) = (sum Phi(q) dNᵀ, sum Phi(q) dD) over its tokens that read the state; the reverse
recurrence G_n = keep_n G_{n+1} + R_n (G_N = dS_T) gives the gradient of the state after every
chunk (and dS_0 = G_0); two last kernels, again over (batch, head, chunk, value tile), compute
d Phi(q) from the start state (``_dq_kernel``), and d Phi(k) and dv from the gradient after the
chunk (``_dk_dv_kernel``), and chain them through the feature map inside the kernel (``jax.vjp`` of
the same feature functions) into dq, dk, d omega and d lam_raw. (One kernel for both did the same
work 11-16% slower on the H200, fwd+bwd: it holds twice the channel arrays at once.) Sums over
value tiles (dq, dk) and over tiles and chunks (d omega, d lam_raw) are taken outside; the
denominator does not depend on the value tile, so its gradient terms come from value tile 0 only.

The start states S_n enter the output kernel in q's dtype and the gradient kernel in v's (and the
state gradients and dN in v's): the dtypes their dots cast them to anyway, so at bf16 the chunk
states cross HBM at half width for no loss. The normalisers z and their gradients stay fp32.

Packed documents follow api.py: ``runs`` (``segments.document_index``, non-decreasing per row)
number the maximal runs of equal segment ids; a token reads the carried state only in the state's
run and a chunk hands on only its last run's writes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.ops.common import chunk_scan
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.layout import default_positions
from lmcore.ops.common.segments import document_index
from sanatan_jax import features
from sanatan_jax.ops.sanatan_attention.base import (EPS, SanatanState, channel_major_state, feature_channels,
                                                     interleaved_state)

CHANNELS = 6
# Fastest on the H200 at T = 8192 (fwd+bwd 8.07 ms with the chunk scan's first tiles, C = 16 8.58,
# 7.61 at its final tiles; with XLA's scan 9.6, C = 16 11.2, C = 64 13.4; C = 64 overflows shared
# memory in fp32).
DEFAULT_CHUNK = 32
_F32 = jnp.float32


class KernelConfig(NamedTuple):
  """Static kernel parameters: chunk C, value tile BV, real head dim and length, c * eps."""

  chunk: int
  block_v: int
  head_dim: int
  length: int
  c_eps: float
  interpret: bool
  num_warps: int
  num_stages: int
  scan: str
  precision: str


class _Chunk(NamedTuple):
  """One chunk inside a kernel: features (input dtype), values and run ids."""

  phi_q: tuple  # 6 x [C, dp]
  phi_k: tuple  # 6 x [C, dp]
  v: jax.Array  # [C, BV]
  run: jax.Array  # [C] int32


def _valid(n, cfg: KernelConfig, dp: int):
  """[C, dp] bool: a real token (not time padding) and a real head dimension (not dim padding)."""
  C = cfg.chunk
  token = n * C + jax.lax.broadcasted_iota(jnp.int32, (C, dp), 0)
  dim = jax.lax.broadcasted_iota(jnp.int32, (C, dp), 1)
  return (token < cfg.length) & (dim < cfg.head_dim)


def _phi(u_ref, params, n, cfg):
  """Features of chunk n of a raw q or k ref, and (for the backward) their VJP."""
  omega_ref, lam_ref, pos_ref = params
  u = pu.rows(u_ref, n * cfg.chunk, cfg.chunk).astype(_F32)
  pos = pu.rows(pos_ref, n * cfg.chunk, cfg.chunk)
  valid = _valid(n, cfg, u.shape[1])
  fn = lambda u, omega, lam_raw: feature_channels(u, omega, lam_raw, pos, valid)
  phi, vjp = jax.vjp(fn, u, omega_ref[...], lam_ref[...])
  return tuple(x.astype(u_ref.dtype) for x in phi), vjp


def _load(n, refs, params, cfg):
  q_ref, k_ref, v_ref, run_ref = refs
  (phi_q, q_vjp), (phi_k, k_vjp) = _phi(q_ref, params, n, cfg), _phi(k_ref, params, n, cfg)
  chunk = _Chunk(phi_q, phi_k, pu.rows(v_ref, n * cfg.chunk, cfg.chunk),
                 pu.rows(run_ref, n * cfg.chunk, cfg.chunk))
  return chunk, q_vjp, k_vjp


def _causal_same_run(run):
  C = run.shape[0]
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (C, C))
  return (run[:, None] == run[None, :]) & (iota(0) >= iota(1))


def _scores(x: _Chunk):
  """s_ij = Phi(q_i) · Phi(k_j) on visible pairs (j <= i, same run), else 0: fp32 [C, C]."""
  s = sum(pu.dot(a, b, trans_b=True) for a, b in zip(x.phi_q, x.phi_k))
  return jnp.where(_causal_same_run(x.run), s, 0.0)


def _masked(phi, mask):
  return tuple(jnp.where(mask[:, None], a, 0) for a in phi)


def _writes(phi_k, v, run, last_run):
  """What a chunk hands on: sum over its last run's tokens of Phi(k) vᵀ (6 x [dp, BV]) and of
  Phi(k) (6 x [1, dp]), fp32."""
  phi_k = _masked(phi_k, run == last_run)
  return (tuple(pu.dot(a, v, trans_a=True) for a in phi_k),
          tuple(jnp.sum(a.astype(_F32), axis=0, keepdims=True) for a in phi_k))


def _outputs(x: _Chunk, S, z, state_run, c_eps):
  """o [C, BV] (fp32) and the denominator D [C] of one chunk from the state (S, z) at its start:
  N = s v + Phi(q) S and D = rowsum(s) + Phi(q) z (state terms for tokens of the state's run),
  o = N / (D + c eps)."""
  reads = _masked(x.phi_q, x.run == state_run)
  s = _scores(x)
  num = pu.dot(s.astype(x.v.dtype), x.v)
  den = jnp.sum(s, axis=1)
  for a, S_c, z_c in zip(reads, S, z):
    num += pu.dot(a, S_c.astype(a.dtype))
    den += jnp.sum(a.astype(_F32) * z_c, axis=1)
  return num / (den[:, None] + c_eps), den


def _load_state(S_ref, z_ref):
  S = tuple(S_ref[c] for c in range(CHANNELS))
  z = tuple(z_ref[c].reshape(1, -1) for c in range(CHANNELS))
  return S, z


def _store_state(S_ref, z_ref, S, z):
  for c in range(CHANNELS):
    S_ref[c] = S[c]
    z_ref[c] = z[c].reshape(-1)


def _dphi_q(x: _Chunk, dN, dD, S, z, state_run, tile0):
  """d Phi(q) of one chunk [6 x [C, dp] fp32] from the state at its start and the intra scores."""
  dt = x.v.dtype
  A = jnp.where(_causal_same_run(x.run), pu.dot(dN, x.v, trans_b=True) + tile0 * dD[:, None], 0.0)
  reads = (x.run == state_run)[:, None]
  return tuple(
      pu.dot(A.astype(dt), b)
      + jnp.where(reads, pu.dot(dN, S_c.astype(dt), trans_b=True) + tile0 * dD[:, None] * z_c, 0.0)
      for b, S_c, z_c in zip(x.phi_k, S, z))


def _dphi_k_dv(x: _Chunk, dN, dD, dS, dz, last_run, tile0):
  """d Phi(k) [6 x [C, dp]] and dv [C, BV] of one chunk from (dS, dz) after it and later queries."""
  dt = x.v.dtype
  visible = _causal_same_run(x.run)
  A = jnp.where(visible, pu.dot(dN, x.v, trans_b=True) + tile0 * dD[:, None], 0.0)
  writes = (x.run == last_run)[:, None]
  dphi_k = tuple(
      pu.dot(A.astype(dt), a, trans_a=True)
      + jnp.where(writes, pu.dot(x.v, dS_c.astype(dt), trans_b=True) + tile0 * dz_c, 0.0)
      for a, dS_c, dz_c in zip(x.phi_q, dS, dz))
  dv = pu.dot(_scores(x).astype(dt), dN, trans_a=True)
  for b, dS_c in zip(_masked(x.phi_k, x.run == last_run), dS):
    dv += pu.dot(b, dS_c.astype(dt))
  return dphi_k, dv


def _read_grads(phi_q, run, state_run, dN, dD):
  """What a chunk's reads add to the gradient of the state at its start: sum over the tokens of
  the state's run of Phi(q) dNᵀ (6 x [dp, BV]) and of Phi(q) dD (6 x [1, dp]), fp32."""
  reads = _masked(phi_q, run == state_run)
  return (tuple(pu.dot(a, dN, trans_a=True) for a in reads),
          tuple(jnp.sum(a.astype(_F32) * dD[:, None], axis=0, keepdims=True) for a in reads))


def _runs(run_ref, n, C):
  """Chunk n's run ids [C], the run of the state entering it and its last run.

  Runs are non-decreasing, so the state entering chunk n > 0 is in chunk n - 1's last run and
  the initial state in the first token's run.
  """
  run = pu.rows(run_ref, n * C, C)
  previous = pu.rows(run_ref, jnp.maximum(n - 1, 0) * C, C)
  return run, jnp.where(n > 0, jnp.max(previous), jnp.min(previous)), jnp.max(run)


def _writes_kernel(k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, W_ref, w_ref, *, cfg):
  """Phase 1: chunk n's writes (W_n, w_n)."""
  n, C = pl.program_id(2), cfg.chunk
  phi_k, _ = _phi(k_ref, (omega_ref, lam_ref, pos_ref), n, cfg)
  run, _, last_run = _runs(run_ref, n, C)
  W, w = _writes(phi_k, pu.rows(v_ref, n * C, C), run, last_run)
  _store_state(W_ref, w_ref, W, w)


def _output_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, S_ref, z_ref,
                   o_ref, den_ref, *, cfg):
  """Phase 3: chunk n's outputs and denominators from the state (S_n, z_n) at its start."""
  n, C = pl.program_id(2), cfg.chunk
  x, _, _ = _load(n, (q_ref, k_ref, v_ref, run_ref), (omega_ref, lam_ref, pos_ref), cfg)
  _, state_run, _ = _runs(run_ref, n, C)
  o, den = _outputs(x, *_load_state(S_ref, z_ref), state_run, cfg.c_eps)
  pu.store_rows(o_ref, n * C, o.astype(o_ref.dtype))
  pu.store_rows(den_ref, n * C, den)


def _read_grads_kernel(q_ref, pos_ref, run_ref, omega_ref, lam_ref, dN_ref, dD_ref, R_ref, r_ref,
                       *, cfg):
  """Backward phase 1: what chunk n's reads add to the gradient of the state at its start."""
  n, C = pl.program_id(2), cfg.chunk
  phi_q, _ = _phi(q_ref, (omega_ref, lam_ref, pos_ref), n, cfg)
  run, state_run, _ = _runs(run_ref, n, C)
  R, r = _read_grads(phi_q, run, state_run, pu.rows(dN_ref, n * C, C), pu.rows(dD_ref, n * C, C))
  _store_state(R_ref, r_ref, R, r)


def _dq_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, S_ref, z_ref, dN_ref,
               dD_ref, dq_ref, domega_ref, dlam_ref, *, cfg):
  """Backward phase 3, queries: chunk n's dq and its parts of d omega, d lam_raw from the state at
  its start (S_n, z_n)."""
  n, C = pl.program_id(2), cfg.chunk
  tile0 = (pl.program_id(3) == 0).astype(_F32)
  x, q_vjp, _ = _load(n, (q_ref, k_ref, v_ref, run_ref), (omega_ref, lam_ref, pos_ref), cfg)
  _, state_run, _ = _runs(run_ref, n, C)
  dN, dD = pu.rows(dN_ref, n * C, C), pu.rows(dD_ref, n * C, C)
  dq, domega_ref[...], dlam_ref[...] = q_vjp(
      _dphi_q(x, dN, dD, *_load_state(S_ref, z_ref), state_run, tile0))
  pu.store_rows(dq_ref, n * C, dq)


def _dk_dv_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, dS_ref, dz_ref,
                  dN_ref, dD_ref, dk_ref, dv_ref, domega_ref, dlam_ref, *, cfg):
  """Backward phase 3, keys: chunk n's dk, dv and its parts of d omega, d lam_raw from the gradient
  of the state after it (G_{n+1}, g_{n+1})."""
  n, C = pl.program_id(2), cfg.chunk
  tile0 = (pl.program_id(3) == 0).astype(_F32)
  x, _, k_vjp = _load(n, (q_ref, k_ref, v_ref, run_ref), (omega_ref, lam_ref, pos_ref), cfg)
  _, _, last_run = _runs(run_ref, n, C)
  dN, dD = pu.rows(dN_ref, n * C, C), pu.rows(dD_ref, n * C, C)
  dphi_k, dv = _dphi_k_dv(x, dN, dD, *_load_state(dS_ref, dz_ref), last_run, tile0)
  dk, domega_ref[...], dlam_ref[...] = k_vjp(dphi_k)
  pu.store_rows(dk_ref, n * C, dk)
  pu.store_rows(dv_ref, n * C, dv)


def _specs(Tp, dp, cfg):
  """BlockSpecs over the grid (batch, head, chunk, value tile). Token arrays are whole rows (each
  program reads and writes its chunk's rows); chunk states are [B, H, N, 6, dp, Vp] and
  [B, H, N, 6, dp]."""
  BV = cfg.block_v
  return dict(
      qk=pl.BlockSpec((None, Tp, None, dp), lambda b, h, n, j: (b, 0, h, 0)),
      v=pl.BlockSpec((None, Tp, None, BV), lambda b, h, n, j: (b, 0, h, j)),
      row=pl.BlockSpec((None, Tp), lambda b, h, n, j: (b, 0)),
      param=pl.BlockSpec((None, 1, dp), lambda b, h, n, j: (h, 0, 0)),
      token=pl.BlockSpec((None, Tp, None), lambda b, h, n, j: (b, 0, h)),
      S=pl.BlockSpec((None, None, None, CHANNELS, dp, BV), lambda b, h, n, j: (b, h, n, 0, 0, j)),
      z=pl.BlockSpec((None, None, None, CHANNELS, dp), lambda b, h, n, j: (b, h, n, 0, 0)),
      # Per value tile: partial sums (or copies, for what does not depend on the tile).
      tile_z=pl.BlockSpec((None, None, None, None, CHANNELS, dp),
                          lambda b, h, n, j: (j, b, h, n, 0, 0)),
      tile_den=pl.BlockSpec((None, None, Tp, None), lambda b, h, n, j: (j, b, 0, h)),
      tile_qk=pl.BlockSpec((None, None, Tp, None, dp), lambda b, h, n, j: (j, b, 0, h, 0)),
      tile_param=pl.BlockSpec((None, None, None, None, 1, dp),
                              lambda b, h, n, j: (j, b, h, n, 0, 0)))


def _grid(q, v, cfg):
  B, Tp, H, _ = q.shape
  return B, H, Tp // cfg.chunk, v.shape[-1] // cfg.block_v


def _keep(run_BxTp, C):
  """keep_n [B, N]: chunk n's last run is the run of the state entering it (no reset inside)."""
  B, Tp = run_BxTp.shape
  last_BxN = run_BxTp.reshape(B, Tp // C, C)[:, :, -1]
  entering_BxN = jnp.concatenate([run_BxTp[:, :1], last_BxN[:, :-1]], axis=1)
  return last_BxN == entering_BxN


def _through_chunks(keep_BxN, W, w, S_edge, z_edge, cfg, *, reverse=False, dtype=_F32):
  """Phase 2 (``chunk_scan``): S and z held at every chunk (forward: entering it; reverse: after it)
  and where the walk ends, from the per-chunk terms W [B, H, N, 6, dp, Vp], w [B, H, N, 6, dp].

  S follows ``cfg.scan`` and comes in ``dtype``; the small z always by XLA, fp32.
  """
  B, H, N, _, dp, Vp = W.shape
  keep = jnp.broadcast_to(keep_BxN.astype(_F32)[:, None, :, None], (B, H, N, CHANNELS * dp))
  S, S_end = chunk_scan.chunk_scan(
      W.reshape(B, H, N, CHANNELS * dp, Vp), keep, S_edge.reshape(B, H, CHANNELS * dp, Vp),
      reverse=reverse, out_dtype=dtype, implementation=cfg.scan, interpret=cfg.interpret)
  z, z_end = chunk_scan.chunk_scan(w, keep[..., :CHANNELS], z_edge, reverse=reverse,
                                   implementation="xla")
  return S.reshape(W.shape), S_end.reshape(S_edge.shape), z, z_end


def _per_chunk_sums(kernel, spec_names, u, v, cfg, *args):
  """A kernel's per-chunk state terms over the chunk grid: [B, H, N, 6, dp, Vp] and the z terms
  [B, H, N, 6, dp] (value tile 0's copy), fp32. ``u`` (q or k) and ``v`` give the grid."""
  B, H, N, n_tiles = grid = _grid(u, v, cfg)
  Tp, dp, Vp = u.shape[1], u.shape[-1], v.shape[-1]
  s = _specs(Tp, dp, cfg)
  out_shape = (jax.ShapeDtypeStruct((B, H, N, CHANNELS, dp, Vp), _F32),
               jax.ShapeDtypeStruct((n_tiles, B, H, N, CHANNELS, dp), _F32))
  W, w = pu.call(kernel, cfg, grid, [s[name] for name in spec_names], [s["S"], s["tile_z"]],
                 out_shape, *args)
  return W, w[0]


def _chunk_states(k, v, pos, run, omega, lam_raw, S0, z0, cfg, dtype):
  """Phases 1-2: S_n at every chunk start [B, H, N, 6, dp, Vp] (in ``dtype``), S after the last
  chunk, and the same two for z ([B, H, N, 6, dp], [B, H, 6, dp]); fp32 otherwise."""
  W, w = _per_chunk_sums(_writes_kernel, ("qk", "v", "row", "row", "param", "param"), k, v, cfg,
                         k, v, pos, run, omega, lam_raw)
  return _through_chunks(_keep(run, cfg.chunk), W, w, S0, z0, cfg, dtype=dtype)


def _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg):
  """(o, den [B, Tp, H], S, z) in kernel layout."""
  S_start, S_end, z_start, z_end = _chunk_states(k, v, pos, run, omega, lam_raw, S0, z0, cfg,
                                                 q.dtype)
  grid = _grid(q, v, cfg)
  B, Tp, H, dp = q.shape
  s = _specs(Tp, dp, cfg)
  out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((grid[-1], B, Tp, H), _F32))
  o, den = pu.call(
      _output_kernel, cfg, grid,
      [s["qk"], s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"], s["S"], s["z"]],
      [s["v"], s["tile_den"]], out_shape,
      q, k, v, pos, run, omega, lam_raw, S_start, z_start)
  return o, den[0], S_end, z_end


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attend(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg: KernelConfig):
  """(o, S_T, z_T) of padded kernel-layout inputs: q, k [B, Tp, H, dp], v [B, Tp, H, Vp], pos and
  run [B, Tp], omega and lam_raw [H, 1, dp], S0 [B, H, 6, dp, Vp], z0 [B, H, 6, dp]."""
  o, _, S, z = _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  return o, S, z


def _attend_fwd(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg):
  o, den, S, z = _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  return (o, S, z), (q, k, v, pos, run, omega, lam_raw, S0, z0, o, den)


def _output_grads(do, o, den, c_eps):
  """dN = do / (D + c eps) [B, Tp, H, Vp] and dD = -(do · o) / (D + c eps) [B, Tp, H], fp32: the
  gradients of o = N / (D + c eps) w.r.t. its numerator and denominator."""
  inv_BxTxH = 1.0 / (den + c_eps)
  return do * inv_BxTxH[..., None], -jnp.sum(do * o.astype(_F32), axis=-1) * inv_BxTxH


def _state_grads(q, v, pos, run, omega, lam_raw, dN, dD, dS_end, dz_end, cfg):
  """Backward phases 1-2: (G_{n+1}, g_{n+1}) after every chunk, and (dS_0, dz_0)."""
  R, r = _per_chunk_sums(_read_grads_kernel, ("qk", "row", "row", "param", "param", "v", "token"),
                         q, v, cfg, q, pos, run, omega, lam_raw, dN, dD)
  dS, dS0, dz, dz0 = _through_chunks(_keep(run, cfg.chunk), R, r, dS_end, dz_end, cfg,
                                     reverse=True, dtype=v.dtype)
  return dS, dz, dS0, dz0


def _attend_bwd(cfg, residuals, cotangents):
  q, k, v, pos, run, omega, lam_raw, S0, z0, o, den = residuals
  do, dS_end, dz_end = (x.astype(_F32) for x in cotangents)
  dN, dD = _output_grads(do, o, den, cfg.c_eps)
  dN = dN.astype(v.dtype)  # the dots take it in v's dtype
  S, _, z, _ = _chunk_states(k, v, pos, run, omega, lam_raw, S0, z0, cfg, v.dtype)
  dS, dz, dS0, dz0 = _state_grads(q, v, pos, run, omega, lam_raw, dN, dD, dS_end, dz_end, cfg)
  B, H, N, n_tiles = grid = _grid(q, v, cfg)
  Tp, dp = q.shape[1], q.shape[-1]
  s = _specs(Tp, dp, cfg)
  partial_qk = jax.ShapeDtypeStruct((n_tiles, B, Tp, H, dp), _F32)
  partial_param = jax.ShapeDtypeStruct((n_tiles, B, H, N, 1, dp), _F32)
  inputs = [s["qk"], s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"], s["S"], s["z"],
            s["v"], s["token"]]
  args = (q, k, v, pos, run, omega, lam_raw)
  dq, d_omega_q, d_lam_q = pu.call(
      _dq_kernel, cfg, grid, inputs, [s["tile_qk"], s["tile_param"], s["tile_param"]],
      (partial_qk, partial_param, partial_param), *args, S, z, dN, dD)
  dk, dv, d_omega_k, d_lam_k = pu.call(
      _dk_dv_kernel, cfg, grid, inputs, [s["tile_qk"], s["v"], s["tile_param"], s["tile_param"]],
      (partial_qk, jax.ShapeDtypeStruct(v.shape, _F32), partial_param, partial_param),
      *args, dS, dz, dN, dD)
  return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype), None, None,
          (d_omega_q + d_omega_k).sum((0, 1, 3)), (d_lam_q + d_lam_k).sum((0, 1, 3)), dS0, dz0)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _check(q, v, state):
  B, T, H, d = q.shape
  expected = (B, H, CHANNELS * d, v.shape[-1])
  if state is not None and tuple(state.S.shape) != expected:
    raise ValueError(f"sanatan_p1_pallas: state.S has shape {tuple(state.S.shape)}, expected "
                     f"[B, H, 6d, dv] = {expected}")


def sanatan_p1_pallas(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                      lam_raw: jax.Array, *, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None,
                      state: SanatanState | None = None,
                      chunk_size: int | None = None, rotate: bool = True,
                      interpret: bool | None = None, block_v: int = 64,
                      num_warps: int = 8, num_stages: int = 2, scan: str = "pallas",
                      precision: str = "input") -> tuple[jax.Array, SanatanState]:
  """SANATAN p = 1, 6 channels (MATH §1.2) by the Pallas kernels; same function as
  ``sanatan_attention(..., p=1, channels=6)``.

  Args:
    q, k: raw [B, T, H, d] (already divided by sqrt(d)); v: [B, T, H, dv]; bf16 or fp32.
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1 offset by ``state.position``.
    segment_ids: optional [B, T] packed-document ids (api.py's convention).
    state: a SanatanState to continue from; None means zeros.
    chunk_size: tokens per chunk, a power of two (>= 16 when compiled); None means ``DEFAULT_CHUNK``.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    block_v, num_warps, num_stages: GPU tuning knobs (value tile width, Triton warps and stages);
      the defaults were the fastest found on the H200 at T = 8192.
    scan: how phase 2 solves the between-chunk recurrence, "pallas" or "xla" (``chunk_scan``).
    precision: "input" (dots take operands in the inputs' dtype), "tf32" or "float32" (the
      kernels run on fp32 copies and return fp32; ``pu.PRECISIONS``).

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 unless ``precision`` is "input") and the SanatanState
    after the last token (fp32 S, z).
  """
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, "sanatan_p1_pallas", "sanatan_attention(implementation='chunked')")
  chunk_size = DEFAULT_CHUNK if chunk_size is None else chunk_size
  if chunk_size < 1 or chunk_size & (chunk_size - 1):
    raise ValueError(f"sanatan_p1_pallas: chunk_size must be a power of two, got {chunk_size}")
  _check(q, v, state)
  pu.check_precision(precision, "sanatan_p1_pallas")
  q, k, v = pu.operands(precision, q, k, v)
  B, T, H, d = q.shape
  V = v.shape[-1]
  if positions is None:
    positions = default_positions(B, T, None if state is None else state.position)
  C = max(chunk_size, 1 if interpret else pu.MIN_DOT)
  dp, BV = pu.block_size(d, interpret), min(pu.block_size(V, interpret), block_v)
  Tp, Vp = pu.round_up(T, C), pu.round_up(V, BV)
  cfg = KernelConfig(chunk=C, block_v=BV, head_dim=d, length=T,
                     c_eps=features.score_scale(CHANNELS, "clean", d) * EPS,
                     interpret=interpret, num_warps=num_warps, num_stages=num_stages, scan=scan,
                     precision=precision)
  pad_qk = lambda x: pu.pad_axis(pu.pad_axis(x, 1, Tp), 3, dp)
  pos = positions.astype(jnp.int32) if rotate else jnp.zeros((B, T), jnp.int32)
  run = document_index(segment_ids, B, T)
  param = lambda p: pu.pad_axis(p.astype(_F32), 1, dp).reshape(H, 1, dp)
  S0, z0 = channel_major_state(state, B, H, d, dp, V, Vp)
  o, S, z = _attend(pad_qk(q), pad_qk(k), pu.pad_axis(pu.pad_axis(v, 1, Tp), 3, Vp),
                    pu.pad_axis(pos, 1, Tp), pu.pad_axis(run, 1, Tp, mode="edge"),
                    param(omega), param(lam_raw), S0, z0, cfg)
  S, z = interleaved_state(S, z, d, V)
  return o[:, :T, :, :V], SanatanState(S, z, positions[:, -1].astype(jnp.int32) + 1)
