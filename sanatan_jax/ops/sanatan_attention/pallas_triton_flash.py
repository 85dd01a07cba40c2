"""Pallas (Triton lowering) flash SANATAN kernels for the powers without a recurrence (MATH §1.1
step 6, §1.2): p >= 2, and the 4/3-channel ablations at any p.

Per head, the function of ``reference.parallel``::

    w_tj = [j <= t, same run] u_tj^p,  u_tj = (s_tj + shift) / c,  s_tj = Phi(q_t) · Phi(k_j)
    (4ch: max(s, 0)),  N_t = sum_j w_tj v_j,  n_t = sum_j w_tj,  o_t = N_t / (n_t + eps).

Features (``features``; "auto": the factor kernels below for 6 channels, else XLA). XLA computes
Phi(q), Phi(k) once per token (``base.sanatan_features``: the angles, roots and rotation in fp32, as
the reference does) and hands the kernels its non-constant channels,
each a [B, T, H, d] array in the operands' dtype (5 for 6ch, 3 for 4ch, 2 for 3ch); the constant
channel adds d to every score, as a number. Every score is a sum of per-channel dots
[rows, d] x [d, cols] accumulated in fp32, so every block is a power of two wide (the 5d-wide
contraction of 6ch is five dots of width d). Features are inputs of the kernels rather than
computed inside them: transcendentals in the loops would be recomputed once per pair of blocks, and
forming even the products r cos, r sin there costs registers the backward kernels do not have (they
hold 5 fp32 [block, d] accumulators). The custom VJP keeps no features: its backward recomputes them
from q and k. With ``features="kernels"`` (6 channels) the factor kernels of pallas_triton_factors.py
write (cos th_rot, sin th_rot) and r in the operands' dtype, XLA forms r cos and r sin from them,
and the factor kernels' VJP (``channel_grads``) takes the kernels' fp32 feature gradients to dq, dk,
d omega and d lam_raw: the fused p = 1 kernels' feature path, without XLA's fp32 intermediates. (The
gradients stay fp32: in bf16 the worst input gradient of the agreement check grew from 5.9e-3 to
7.9e-3, the XLA path's own bf16 error.)

Forward, grid (query block, batch, head), query blocks last-to-first so the longest programs start
first: a program loads its query features once and loops over the key blocks from its first
token's document start to its diagonal (``lax.fori_loop``, traced bounds), the blocks strictly
below the diagonal without the causal mask, accumulating N [BQ, V] and n [BQ] in fp32. The weights
lie in [0, 1] (scores divided by their maximum c), so no running maximum is needed. It writes o (in
v's dtype) and n (fp32); no T x T array exists.

Backward (``jax.custom_vjp``; the residuals are the inputs, o and n). With dN = do / (n + eps) and
dn = -(do · o) / (n + eps) (XLA), dw_tj = dN_t · v_j + dn_t and ds_tj = dw_tj p u_tj^(p-1) / c on
visible pairs (the VJP of the weight function). Two kernels, recomputing the scores, each with a
tiling of its own (``FlashTiles``):

* dq, grid (query block, batch, head): d Phi(q_t) = sum_j ds_tj Phi(k_j) over the same key blocks
  as the forward;
* dk/dv, grid (key block, batch, head), key block 0 first: over the query blocks from the
  diagonal to the end of the block's last document, in transposed form (scores [BK, BQ]):
  dv_j = sum_t w_tj dN_t, d Phi(k_j) = sum_t ds_tj Phi(q_t).

XLA takes the feature gradients through the feature map (its VJP) to dq, dk, d omega and d lam_raw.

Packed documents follow api.py: ``runs`` (``segments.document_index``, non-decreasing per row)
number the maximal runs of equal segment ids, a token sees only keys of its own run, and loops
start (forward, dq) or stop (dk/dv) at a run's first or last token, so blocks wholly in other
documents are skipped.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.layout import default_positions
from lmcore.ops.common.segments import document_index
from sanatan_jax import features
from sanatan_jax.ops.sanatan_attention import pallas_triton_factors as factor_kernels
from sanatan_jax.ops.sanatan_attention.base import (EPS, after_cotangent, check_blocked_options,
                                                    sanatan_features)

_F32 = jnp.float32


class Tiles(NamedTuple):
  """One kernel's tiling: ``block`` rows per program (queries in the forward and dq kernels, keys
  in the dk/dv kernel), ``loop`` rows per step of its loop (keys, or queries), Triton warps and
  pipeline stages. Block lengths are powers of two (>= 16 when compiled)."""

  block: int
  loop: int
  num_warps: int
  num_stages: int


class FlashTiles(NamedTuple):
  """The forward kernel's tiling, the dk/dv kernel's (``backward``) and the dq kernel's (None: the
  dk/dv kernel's)."""

  forward: Tiles
  backward: Tiles
  dq: Tiles | None = None

  @property
  def dq_tiles(self) -> Tiles:
    return self.backward if self.dq is None else self.dq


# Tilings per GPU (``device_kind``; "default" for any other) and operand width in bytes (2: bf16
# inputs; 4: fp32 inputs or precision "tf32"/"float32"). H200, bf16, 8 x 2048, 12 heads of 64, fwd+bwd
# in one process (docs/BENCHMARKS.md): three pipeline stages in both kernels 3.45 ms against 3.89 at
# two; backward blocks of 64 rows 4.0-5.7 ms. Tiled apart (GPU time, eight rounds): dq loops of 64
# keys at two stages, dk/dv at four and a 4-warp forward 3.04 ms against 3.11 for one backward tiling
# (dq loops of 64 at three stages exceed the shared memory; dk/dv loops of 64 3.34). At d = dv = 64 an
# sm_90 Triton compile of the bf16
# two-stage tiling keeps the forward at 127 registers and 176 KiB of shared memory, dq at 236
# registers and dk/dv at 255 with a 16-byte spill (both 144 KiB): the backward kernels hold 5 fp32
# [block, d] accumulators, and 128-row blocks give each of 8 warps' two warpgroups its own 64 rows.
# fp32 operands take twice the shared memory; the fp32 tiling compiles without spills (TF32 and IEEE
# dots) within 104 KiB. benchmarks.harness.FLASH_TUNING lists the tilings timed.
TILES = {"default": {2: FlashTiles(forward=Tiles(128, 64, 4, 3), backward=Tiles(128, 32, 8, 4),
                                   dq=Tiles(128, 64, 8, 2)),
                     4: FlashTiles(forward=Tiles(32, 32, 4, 2), backward=Tiles(32, 32, 8, 2))}}


# Where the feature channels come from: XLA's feature map, or the factor kernels (6 channels); "auto":
# the factor kernels for 6 channels, else XLA. H200, bf16, 8 x 2048, 12 heads of 64, GPU time in two
# processes (docs/BENCHMARKS.md): 2.92-2.93 ms against 3.01-3.02 from XLA; the 184M p = 2 step 207.3K
# against 203.1K tok/s in 1.3 GiB less.
FEATURE_SOURCES = ("auto", "xla", "kernels")


def resolve_features(features: str, channels: int) -> str:
  """The source ``features`` names: "auto" is "kernels" for 6 channels, else "xla"."""
  if features != "auto":
    return features
  return "kernels" if channels == 6 else "xla"


def default_tiles(dtype) -> FlashTiles:
  """The ``TILES`` entry of the first device's kind (else the default one) for operands of
  ``dtype``."""
  kind = getattr(jax.devices()[0], "device_kind", "")
  return TILES.get(kind, TILES["default"])[jnp.dtype(dtype).itemsize]


class KernelConfig(NamedTuple):
  """Static parameters of one kernel: its tiling, the real head dim, the power and variant, and
  whether rows pack documents (run masks, document loop bounds)."""

  block: int
  loop: int
  head_dim: int
  p: int
  channels: int
  three_channel: str
  documents: bool
  interpret: bool
  num_warps: int
  num_stages: int
  precision: str


class Static(NamedTuple):
  """What the custom VJP holds static: the forward kernel's config, the dk/dv kernel's
  (``backward``) and the dq kernel's, the rotation flag, the real and padded lengths, the padded head
  dims, and whether the features come from the factor kernels (``features="kernels"``)."""

  forward: KernelConfig
  backward: KernelConfig
  dq: KernelConfig
  rotate: bool
  length: int
  padded_length: int
  dp: int
  Vp: int
  feature_kernels: bool


def feature_count(channels: int) -> int:
  """How many non-constant channels a variant has (all but Phi_a's leading 1)."""
  return channels - 1


def _features(q, k, omega, lam_raw, pos, st: Static) -> tuple[tuple, tuple]:
  """The non-constant channels of Phi(q) and of Phi(k), each [B, Tp, H, dp] and zero on padding:
  fp32 from XLA (``base.sanatan_features``, feature index ``channels · a + c`` split by channel c),
  or in the operands' dtype from the factor kernels (``_factor_channels``)."""
  if st.feature_kernels:
    return _factor_channels(q, omega, lam_raw, pos, st), _factor_channels(k, omega, lam_raw, pos, st)
  channels = st.forward.channels
  phi = sanatan_features(q, k, omega, lam_raw, pos, channels=channels, rotate=st.rotate)

  def split(phi_BxTxHxF):
    B, T, H, F = phi_BxTxHxF.shape
    phi_BxTxHxdxC = phi_BxTxHxF.reshape(B, T, H, F // channels, channels)
    return tuple(pu.pad_axis(pu.pad_axis(phi_BxTxHxdxC[..., c], 1, st.padded_length), 3, st.dp)
                 for c in range(1, channels))

  return tuple(split(x) for x in phi)


def _factor_channels(u, omega, lam_raw, pos, st: Static) -> tuple:
  """The five non-constant channels of the 6-channel Phi(u) (cos, sin, r, r cos, r sin), each
  [B, Tp, H, dp] in u's dtype and zero on padding: the factor kernels' (cos th_rot, sin th_rot) and
  r, and their products formed in fp32 by XLA and rounded (as the fused kernels form them)."""
  f = factor_kernels.factors(u, omega, lam_raw, pos, rotate=st.rotate,
                             padded_length=st.padded_length, dp=st.dp,
                             interpret=st.forward.interpret)
  cos, sin, r = f.trig[..., 0, :], f.trig[..., 1, :], f.root
  times = lambda a, b: (a.astype(_F32) * b.astype(_F32)).astype(u.dtype)
  return cos, sin, r, times(r, cos), times(r, sin)


# In-kernel pieces.

def _scores(rows, cols, cfg: KernelConfig):
  """s = d + sum_c rows_c cols_cᵀ over the channels, fp32 [n_rows, n_cols] (d: the constant
  channel; each dot adds to the sum so far, which Triton turns into one accumulator)."""
  s = float(cfg.head_dim)
  for a, b in zip(rows, cols):
    s = pu.dot(a, b, trans_b=True) + s
  return s


def _weights(s, mask, cfg: KernelConfig):
  """w = u^p with u = (s + shift) / c (``features.unit_scores``, as a product with 1 / c), 0 where
  ``mask`` (None: everywhere visible) is False."""
  if cfg.channels == 4:
    s = jnp.maximum(s, 0.0)
  inv_c = 1.0 / features.score_scale(cfg.channels, cfg.three_channel, cfg.head_dim)
  shift = features.score_shift(cfg.channels, cfg.three_channel, cfg.head_dim)
  u = s * inv_c if shift == 0.0 else s * inv_c + shift * inv_c
  w = u**cfg.p
  return w if mask is None else jnp.where(mask, w, 0.0)


def _weights_and_grads(s, mask, dw, cfg: KernelConfig):
  """w and ds = dw · dw/ds, both fp32 like ``s``."""
  w, vjp = jax.vjp(lambda s: _weights(s, mask, cfg), s)
  return w, vjp(dw)[0]


def _mask(rows_index, cols_index, rows_run, cols_run, causal: bool, transposed: bool,
          cfg: KernelConfig):
  """[n_rows, n_cols] visibility (query >= key when ``causal``; the same run with documents), or
  None when every pair is visible. Rows are queries, or keys when ``transposed``."""
  mask = None
  if causal:
    later = jnp.greater_equal if not transposed else jnp.less_equal
    mask = later(rows_index[:, None], cols_index[None, :])
  if cfg.documents:
    same = rows_run[:, None] == cols_run[None, :]
    mask = same if mask is None else mask & same
  return mask


def _block(refs, run_ref, start, size: int, cfg: KernelConfig):
  """Rows ``start : start + size``: the feature channels (tuple), token indices and run ids (None
  without documents)."""
  phi = tuple(pu.rows(ref, start, size) for ref in refs)
  index = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
  run = pu.rows(run_ref, start, size) if cfg.documents else None
  return phi, index, run


def _key_loops(body, q_start, first_ref, init, cfg: KernelConfig):
  """Runs ``body(causal)(j, carry)`` over the key blocks query block ``q_start`` sees: from its
  first token's document start (0 without documents) through the blocks wholly before its first
  query (no causal mask), then the blocks up to its diagonal (causal mask)."""
  BQ, BK = cfg.block, cfg.loop
  start = 0
  if cfg.documents:
    start = jnp.min(pu.rows(first_ref, q_start, BQ)) // BK
  full_end = jnp.maximum((q_start + 1) // BK, start)
  carry = jax.lax.fori_loop(start, full_end, body(False), init)
  return jax.lax.fori_loop(full_end, pl.cdiv(q_start + BQ, BK), body(True), carry)


def _query_loops(body, k_start, last_ref, n_query_blocks: int, init, cfg: KernelConfig):
  """Runs ``body(causal)(i, carry)`` over the query blocks that see key block ``k_start``: those
  holding its diagonal (causal mask), then those wholly after its last key (no causal mask), up
  to its last token's document end (the sequence end without documents)."""
  BK, BQ = cfg.block, cfg.loop
  stop = n_query_blocks
  if cfg.documents:
    stop = jnp.max(pu.rows(last_ref, k_start, BK)) // BQ + 1
  full_start = pl.cdiv(k_start + BK - 1, BQ)
  carry = jax.lax.fori_loop(k_start // BQ, jnp.minimum(full_start, stop), body(True), init)
  return jax.lax.fori_loop(full_start, stop, body(False), carry)


def _store(refs, values) -> None:
  for ref, value in zip(refs, values):
    ref[...] = value


def _forward_kernel(*refs, cfg: KernelConfig):
  nf = feature_count(cfg.channels)
  q_refs, k_refs = refs[:nf], refs[nf:2 * nf]
  v_ref, run_ref, first_ref, o_ref, n_ref = refs[2 * nf:]
  BQ, BK = cfg.block, cfg.loop
  q_start = (q_refs[0].shape[0] // BQ - 1 - pl.program_id(0)) * BQ
  phi_q, q_index, q_run = _block(q_refs, run_ref, q_start, BQ, cfg)

  def body(causal):
    def step(j, carry):
      num, den = carry
      phi_k, k_index, k_run = _block(k_refs, run_ref, j * BK, BK, cfg)
      v = pu.rows(v_ref, j * BK, BK)
      mask = _mask(q_index, k_index, q_run, k_run, causal, False, cfg)
      w = _weights(_scores(phi_q, phi_k, cfg), mask, cfg)
      return num + pu.dot(w.astype(v.dtype), v), den + jnp.sum(w, axis=1)
    return step

  init = (jnp.zeros((BQ, v_ref.shape[1]), _F32), jnp.zeros((BQ,), _F32))
  num, den = _key_loops(body, q_start, first_ref, init, cfg)
  o_ref[...] = (num / (den[:, None] + EPS)).astype(o_ref.dtype)
  n_ref[...] = den


def _dq_kernel(*refs, cfg: KernelConfig):
  nf = feature_count(cfg.channels)
  q_refs, k_refs = refs[:nf], refs[nf:2 * nf]
  v_ref, run_ref, first_ref, dN_ref, dn_ref = refs[2 * nf:2 * nf + 5]
  out_refs = refs[2 * nf + 5:]
  BQ, BK = cfg.block, cfg.loop
  q_start = (q_refs[0].shape[0] // BQ - 1 - pl.program_id(0)) * BQ
  phi_q, q_index, q_run = _block(q_refs, run_ref, q_start, BQ, cfg)
  dN, dn = pu.rows(dN_ref, q_start, BQ), pu.rows(dn_ref, q_start, BQ)

  def body(causal):
    def step(j, dphi):
      phi_k, k_index, k_run = _block(k_refs, run_ref, j * BK, BK, cfg)
      dw = pu.dot(dN, pu.rows(v_ref, j * BK, BK), trans_b=True) + dn[:, None]
      mask = _mask(q_index, k_index, q_run, k_run, causal, False, cfg)
      _, ds = _weights_and_grads(_scores(phi_q, phi_k, cfg), mask, dw, cfg)
      ds = ds.astype(phi_k[0].dtype)
      return tuple(g + pu.dot(ds, b) for g, b in zip(dphi, phi_k))
    return step

  init = tuple(jnp.zeros(a.shape, _F32) for a in phi_q)
  dphi = _key_loops(body, q_start, first_ref, init, cfg)
  _store(out_refs, dphi)


def _dkv_kernel(*refs, cfg: KernelConfig):
  nf = feature_count(cfg.channels)
  q_refs, k_refs = refs[:nf], refs[nf:2 * nf]
  v_ref, run_ref, last_ref, dN_ref, dn_ref = refs[2 * nf:2 * nf + 5]
  dk_refs, dv_ref = refs[2 * nf + 5:-1], refs[-1]
  BK, BQ = cfg.block, cfg.loop
  k_start = pl.program_id(0) * BK
  phi_k, k_index, k_run = _block(k_refs, run_ref, k_start, BK, cfg)
  v = pu.rows(v_ref, k_start, BK)

  def body(causal):
    def step(i, carry):
      dphi, dv = carry
      phi_q, q_index, q_run = _block(q_refs, run_ref, i * BQ, BQ, cfg)
      dN, dn = pu.rows(dN_ref, i * BQ, BQ), pu.rows(dn_ref, i * BQ, BQ)
      dw = pu.dot(v, dN, trans_b=True) + dn[None, :]
      mask = _mask(k_index, q_index, k_run, q_run, causal, True, cfg)
      w, ds = _weights_and_grads(_scores(phi_k, phi_q, cfg), mask, dw, cfg)
      ds = ds.astype(phi_q[0].dtype)
      dphi = tuple(g + pu.dot(ds, a) for g, a in zip(dphi, phi_q))
      return dphi, dv + pu.dot(w.astype(dN.dtype), dN)
    return step

  init = (tuple(jnp.zeros(b.shape, _F32) for b in phi_k), jnp.zeros(v.shape, _F32))
  dphi, dv = _query_loops(body, k_start, last_ref, q_refs[0].shape[0] // BQ, init, cfg)
  _store(dk_refs, dphi)
  dv_ref[...] = dv


# Calls.

def _specs(Tp, dp, Vp, size: int, reverse: bool):
  """BlockSpecs over the grid (row block n, batch, head): whole rows of the inputs, and each
  program's own ``size`` rows of the outputs (row block ``count - 1 - n`` when ``reverse``)."""
  count = Tp // size
  row = (lambda n: count - 1 - n) if reverse else (lambda n: n)
  return dict(
      seq=lambda width: pl.BlockSpec((None, Tp, None, width), lambda n, b, h: (b, 0, h, 0)),
      row=pl.BlockSpec((None, Tp), lambda n, b, h: (b, 0)),
      token=pl.BlockSpec((None, Tp, None), lambda n, b, h: (b, 0, h)),
      block=lambda width: pl.BlockSpec((None, size, None, width),
                                       lambda n, b, h: (b, row(n), h, 0)),
      block_token=pl.BlockSpec((None, size, None), lambda n, b, h: (b, row(n), h)))


def _input_specs(s, nf: int, dp: int, Vp: int, with_grads: bool):
  """Specs of (Phi(q) channels, Phi(k) channels, v, runs, document bounds[, dN, dn])."""
  specs = [s["seq"](dp)] * (2 * nf) + [s["seq"](Vp), s["row"], s["row"]]
  return specs + ([s["seq"](Vp), s["token"]] if with_grads else [])


def _forward(phi_q, phi_k, v, run, first, st: Static):
  """o [B, Tp, H, Vp] in v's dtype and n [B, Tp, H] fp32."""
  cfg = st.forward
  B, Tp, H, _ = v.shape
  s = _specs(Tp, st.dp, st.Vp, cfg.block, reverse=True)
  out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, Tp, H), _F32))
  return pu.call(_forward_kernel, cfg, (Tp // cfg.block, B, H),
                 _input_specs(s, len(phi_q), st.dp, st.Vp, False),
                 [s["block"](st.Vp), s["block_token"]], out_shape, *phi_q, *phi_k, v, run, first)


def _backward(phi_q, phi_k, v, run, first, last, dN, dn, st: Static):
  """The feature gradients of q and of k (fp32 channel tuples) and dv [B, Tp, H, Vp] (fp32)."""
  B, Tp, H, _ = v.shape
  nf = len(phi_q)
  grads = lambda width, count: tuple(jax.ShapeDtypeStruct((B, Tp, H, width), _F32)
                                     for _ in range(count))
  cfg = st.dq
  s = _specs(Tp, st.dp, st.Vp, cfg.block, reverse=True)
  dphi_q = pu.call(_dq_kernel, cfg, (Tp // cfg.block, B, H),
                   _input_specs(s, nf, st.dp, st.Vp, True), [s["block"](st.dp)] * nf,
                   grads(st.dp, nf), *phi_q, *phi_k, v, run, first, dN, dn)
  cfg = st.backward
  s = _specs(Tp, st.dp, st.Vp, cfg.block, reverse=False)
  *dphi_k, dv = pu.call(_dkv_kernel, cfg, (Tp // cfg.block, B, H),
                        _input_specs(s, nf, st.dp, st.Vp, True),
                        [s["block"](st.dp)] * nf + [s["block"](st.Vp)],
                        grads(st.dp, nf) + grads(st.Vp, 1), *phi_q, *phi_k, v, run, last, dN, dn)
  return tuple(dphi_q), tuple(dphi_k), dv


def _pad_tokens(x, st: Static):
  return pu.pad_axis(pu.pad_axis(x, 1, st.padded_length), 3, st.Vp)


def _cast(phi, dtype) -> tuple:
  return tuple(x.astype(dtype) for x in phi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _flash(q, k, v, omega, lam_raw, pos, run, first, last, st: Static):
  """o [B, T, H, dv] of raw q, k [B, T, H, d], v, omega and lam_raw [H, d]; positions [B, T] and
  the padded run ids, document starts and ends [B, Tp]."""
  return _flash_fwd(q, k, v, omega, lam_raw, pos, run, first, last, st)[0]


def _flash_fwd(q, k, v, omega, lam_raw, pos, run, first, last, st: Static):
  phi_q, phi_k = _features(q, k, omega, lam_raw, pos, st)
  o, n = _forward(_cast(phi_q, q.dtype), _cast(phi_k, k.dtype), _pad_tokens(v, st), run, first,
                  st)
  return o[:, :st.length, :, :v.shape[-1]], (q, k, v, omega, lam_raw, pos, run, first, last, o, n)


def _flash_bwd(st: Static, residuals, do):
  """dN = do / (n + eps) and dn = -(do · o) / (n + eps) in XLA, the kernels, then the feature
  map's VJP (XLA's, or the factor kernels' ``channel_grads``)."""
  q, k, v, omega, lam_raw, pos, run, first, last, o, n = residuals
  q, k, omega, lam_raw = after_cotangent((q, k, omega, lam_raw), do)
  if st.feature_kernels:
    phi_q, phi_k = _features(q, k, omega, lam_raw, pos, st)
    features_vjp = functools.partial(_factor_channel_vjp, q, k, omega, lam_raw, pos, st)
  else:
    (phi_q, phi_k), features_vjp = jax.vjp(lambda *a: _features(*a, pos, st), q, k, omega, lam_raw)
  inv_BxTxH = 1.0 / (n + EPS)
  do = _pad_tokens(do.astype(_F32), st)
  dN = (do * inv_BxTxH[..., None]).astype(v.dtype)
  dn = -jnp.sum(do * o.astype(_F32), axis=-1) * inv_BxTxH
  dphi_q, dphi_k, dv = _backward(_cast(phi_q, q.dtype), _cast(phi_k, k.dtype), _pad_tokens(v, st),
                                 run, first, last, dN, dn, st)
  dq, dk, d_omega, d_lam = features_vjp((dphi_q, dphi_k))
  dv = dv[:, :st.length, :, :v.shape[-1]].astype(v.dtype)
  return dq, dk, dv, d_omega, d_lam, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _factor_channel_vjp(q, k, omega, lam_raw, pos, st: Static, dphi):
  """(dq, dk, d omega, d lam_raw) from the channel gradients (dphi_q, dphi_k) of
  ``_factor_channels`` by the factor kernels' VJP."""
  grads = functools.partial(factor_kernels.channel_grads, omega=omega, lam_raw=lam_raw,
                            positions=pos, rotate=st.rotate, interpret=st.forward.interpret)
  (dq, d_omega_q, d_lam_q), (dk, d_omega_k, d_lam_k) = (grads(u, dphi_channels=d)
                                                        for u, d in zip((q, k), dphi))
  return dq, dk, d_omega_q + d_omega_k, d_lam_q + d_lam_k


def _document_bounds(run_BxTp):
  """The first and the last token index of every token's run, int32 [B, Tp] each."""
  Tp = run_BxTp.shape[1]
  index = jnp.arange(Tp, dtype=jnp.int32)[None]
  starts = jnp.concatenate([jnp.ones_like(run_BxTp[:, :1], bool),
                            run_BxTp[:, 1:] != run_BxTp[:, :-1]], axis=1)
  ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)
  first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  last = jax.lax.cummin(jnp.where(ends, index, Tp - 1), axis=1, reverse=True)
  return first, last


def _kernel_config(tiles: Tiles, T: int, interpret: bool, **common) -> KernelConfig:
  smallest = 1 if interpret else pu.MIN_DOT
  block, loop = (max(min(size, pl.next_power_of_2(T)), smallest) for size in tiles[:2])
  return KernelConfig(block=block, loop=loop, interpret=interpret, num_warps=tiles.num_warps,
                      num_stages=tiles.num_stages, **common)


def check_features(features: str, channels: int, op: str, name: str = "features") -> None:
  """Raises ValueError for a feature source (the option ``name``) not in ``FEATURE_SOURCES`` or
  "kernels" with a channel variant other than 6 (the factor kernels make the 6-channel map's
  factors)."""
  if features not in FEATURE_SOURCES:
    raise ValueError(f"{op}: {name} must be one of {', '.join(FEATURE_SOURCES)}, got {features!r}")
  if features == "kernels" and channels != 6:
    raise ValueError(f"{op}: {name}='kernels' needs channels=6 (got {channels}); use "
                     f"{name}='xla' for the 4- and 3-channel variants")


def _check_tiles(tiles: FlashTiles, op: str) -> None:
  for name, kernel in tiles._asdict().items():
    if kernel is None:
      continue
    for field in ("block", "loop"):
      size = getattr(kernel, field)
      if size < 1 or size & (size - 1):
        raise ValueError(f"{op}: tiles.{name}.{field} must be a power of two, got {size}")


def sanatan_flash_pallas(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                         lam_raw: jax.Array, *, positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None, p: int = 2, channels: int = 6,
                         three_channel: str = "clean", rotate: bool = True,
                         interpret: bool | None = None, tiles: FlashTiles | None = None,
                         precision: str = "input", features: str = "auto") -> jax.Array:
  """SANATAN attention at any power p and channel variant (MATH §1.1) by the flash Pallas
  kernels; the output of ``sanatan_attention(..., implementation="parallel")``. No state (p >= 2
  and the 4/3-channel ablations have no constant-size state).

  Args:
    q, k: raw [B, T, H, d] (already divided by sqrt(d)); v: [B, T, H, dv]; bf16 or fp32.
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1.
    segment_ids: optional [B, T] packed-document ids (api.py's convention).
    p, channels, three_channel: the kernel (MATH §1.1 steps 5-6); any positive integer p.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    tiles: the kernels' tiling (``FlashTiles``: forward, dk/dv and dq); None means ``default_tiles``
      of the operands' dtype. Blocks are capped at the next power of two >= T.
    precision: "input" (dots take operands in the inputs' dtype), "tf32" or "float32" (the
      kernels run on fp32 copies and return fp32; ``pu.PRECISIONS``).
    features: where the feature channels come from (``FEATURE_SOURCES``): "xla" (the feature map in
      fp32, rounded to the operands' dtype; its VJP by XLA), "kernels" (6 channels only: the factor
      kernels of pallas_triton_factors.py, the products r cos and r sin by XLA, and the VJP by the
      factor kernels) or "auto" ("kernels" for 6 channels, else "xla"; ``resolve_features``).

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 unless ``precision`` is "input").
  """
  op = "sanatan_flash_pallas"
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, op, "sanatan_attention(implementation='parallel')")
  pu.check_precision(precision, op)
  q, k, v = pu.operands(precision, q, k, v)
  tiles = default_tiles(q.dtype) if tiles is None else tiles
  _check_tiles(tiles, op)
  check_blocked_options(p, channels, three_channel, tiles.forward.block, tiles.forward.loop, op=op)
  check_features(features, channels, op)
  B, T, H, d = q.shape
  if positions is None:
    positions = default_positions(B, T)
  common = dict(head_dim=d, p=p, channels=channels, three_channel=three_channel,
                documents=segment_ids is not None, precision=precision)
  forward, backward, dq = (_kernel_config(t, T, interpret, **common)
                           for t in (tiles.forward, tiles.backward, tiles.dq_tiles))
  largest = max(max(c.block, c.loop) for c in (forward, backward, dq))
  st = Static(forward=forward, backward=backward, dq=dq, rotate=rotate, length=T,
              padded_length=pu.round_up(T, largest), dp=pu.block_size(d, interpret),
              Vp=pu.block_size(v.shape[-1], interpret),
              feature_kernels=resolve_features(features, channels) == "kernels")
  # Edge-padding keeps padded tokens in the last run; causality hides them from real queries.
  run = pu.pad_axis(document_index(segment_ids, B, T), 1, st.padded_length, mode="edge")
  first, last = _document_bounds(run)
  return _flash(q, k, v, omega, lam_raw, positions.astype(jnp.int32), run, first, last, st)
