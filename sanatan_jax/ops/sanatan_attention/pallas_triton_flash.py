"""Pallas (Triton lowering) flash SANATAN kernels for the variants without a recurrence (MATH §1.1
step 6, §1.2): p >= 2, and the 4/3-channel ablations at any p. The backend ``pallas_flash``
(``PallasFlash``, tiles ``FlashTiles``).

Per head, the function of ``reference.parallel``::

    w_tj = [j <= t, same run] u_tj^p,  u_tj = (s_tj + shift) / c,  s_tj = Phi(q_t) · Phi(k_j)
    (4ch: max(s, 0)),  N_t = sum_j w_tj v_j,  n_t = sum_j w_tj,  o_t = N_t / (n_t + eps).

Features. The kernels take Phi's non-constant channels as inputs, each a [B, T, H, d] array in the
operands' dtype (5 for 6ch, 3 for 4ch, 2 for 3ch); the constant channel adds d to every score, as a
number. 6 channels: the factor kernels of pallas_triton_factors.py write (cos th_rot, sin th_rot) and
r, XLA forms the channels from them by ``base.factor_channel`` (``_factor_channels``), and the factor
kernels' VJP (``channel_grads``) takes the kernels' fp32 channel gradients to dq, dk, d omega and
d lam_raw. 4 and 3 channels: XLA's feature map (``base.sanatan_features``) and its VJP. Every score
is a sum of per-channel dots [rows, d] x [d, cols] accumulated in fp32, so every block is a power of
two wide. Features are inputs rather than computed inside the loops, where transcendentals would be
recomputed once per pair of blocks. The custom VJP keeps no features: its backward recomputes them
from q and k.

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

The feature gradients go back through the feature map as above to dq, dk, d omega and d lam_raw.

Packed documents follow api.py: ``runs`` (``segments.document_index``, non-decreasing per row)
number the maximal runs of equal segment ids, a token sees only keys of its own run, and loops
start (forward, dq) or stop (dk/dv) at a run's first or last token, so blocks wholly in other
documents are skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.ops.common import flops, shard_map
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.backend import TRITON, Backend, check_power_of_two
from lmcore.ops.common.layout import default_positions
from lmcore.ops.common.segments import document_index
from sanatan_jax import features
from sanatan_jax.ops.sanatan_attention import pallas_triton_factors as factor_kernels
from sanatan_jax.ops.sanatan_attention.base import (EPS, KERNEL_LAYOUTS, Options, Problem, after_cotangent,
                                                    factor_channel, sanatan_features, validate_options)

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockTiles:
  """One kernel's tiling: ``block`` rows per program (queries in the forward and dq kernels, keys
  in the dk/dv kernel), ``loop`` rows per step of its loop (keys, or queries), Triton warps and
  pipeline stages. Block lengths are powers of two (>= 16 when compiled)."""

  block: int
  loop: int
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    check_power_of_two("pallas_flash tiles", block=self.block, loop=self.loop)


@dataclasses.dataclass(frozen=True)
class FlashTiles:
  """The forward kernel's tiling, the dk/dv kernel's (``backward``) and the dq kernel's. The defaults
  are the bf16 tiling, the fastest measured (docs/BENCHMARKS.md, SANATAN p = 2 flash tilings)."""

  forward: BlockTiles = BlockTiles(128, 64, 4, 3)
  backward: BlockTiles = BlockTiles(128, 32, 8, 4)
  dq: BlockTiles = BlockTiles(128, 64, 8, 2)


# The tiling by the kernels' operand width in bytes (2: bf16 inputs; 4: fp32 inputs or precision
# "tf32"/"float32", which take twice the shared memory). ``benchmarks.harness.FLASH_TUNING`` lists the
# tilings timed.
TILES = {2: FlashTiles(),
         4: FlashTiles(forward=BlockTiles(32, 32, 4, 2), backward=BlockTiles(32, 32, 8, 2),
                       dq=BlockTiles(32, 32, 8, 2))}
# "auto" takes these kernels for heads up to this wide; wider tiles need more shared memory than a GPU
# has (docs/BENCHMARKS.md, SANATAN heads).
MAX_HEAD_DIM, MAX_VALUE_DIM = 64, 64


def default_tiles(dtype) -> FlashTiles:
  """The tiling for operands of ``dtype``."""
  return TILES[min(jnp.dtype(dtype).itemsize, 4)]


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
  dims, and whether the features come from the factor kernels (6 channels)."""

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
  """The non-constant channels of Phi(q) and of Phi(k), each [B, Tp, H, dp] and zero on padding: in
  the operands' dtype from the factor kernels (6 channels, ``_factor_channels``), else fp32 from XLA
  (``base.sanatan_features``, feature index ``channels · a + c`` split by channel c)."""
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
  [B, Tp, H, dp] in u's dtype and zero on padding: ``base.factor_channel`` of the factor kernels'
  (cos th_rot, sin th_rot) and r, formed in fp32 and rounded (as the fused kernels form them)."""
  f = factor_kernels.factors(u, omega, lam_raw, pos, rotate=st.rotate,
                             padded_length=st.padded_length, dp=st.dp,
                             interpret=st.forward.interpret)
  cos, sin, r = (x.astype(_F32) for x in (f.trig[..., 0, :], f.trig[..., 1, :], f.root))
  return tuple(factor_channel(c, cos, sin, r).astype(u.dtype) for c in range(1, 6))


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


def _kernel_config(tiles: BlockTiles, T: int, interpret: bool, **common) -> KernelConfig:
  smallest = 1 if interpret else pu.MIN_DOT
  block, loop = (max(min(size, pl.next_power_of_2(T)), smallest) for size in (tiles.block, tiles.loop))
  return KernelConfig(block=block, loop=loop, interpret=interpret, num_warps=tiles.num_warps,
                      num_stages=tiles.num_stages, **common)


def sanatan_flash_pallas(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                         lam_raw: jax.Array, *, positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None, p: int = 2, channels: int = 6,
                         three_channel: str = "clean", rotate: bool = True,
                         interpret: bool | None = None, tiles: FlashTiles | None = None,
                         precision: str = "input") -> jax.Array:
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

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 unless ``precision`` is "input").
  """
  op = "sanatan_flash_pallas"
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, op, "sanatan_attention(implementation='parallel')")
  pu.check_precision(precision, op)
  validate_options(p=p, channels=channels, three_channel=three_channel)
  q, k, v = pu.operands(precision, q, k, v)
  tiles = default_tiles(q.dtype) if tiles is None else tiles
  B, T, H, d = q.shape
  if positions is None:
    positions = default_positions(B, T)
  common = dict(head_dim=d, p=p, channels=channels, three_channel=three_channel,
                documents=segment_ids is not None, precision=precision)
  forward, backward, dq = (_kernel_config(t, T, interpret, **common)
                           for t in (tiles.forward, tiles.backward, tiles.dq))
  largest = max(max(c.block, c.loop) for c in (forward, backward, dq))
  st = Static(forward=forward, backward=backward, dq=dq, rotate=rotate, length=T,
              padded_length=pu.round_up(T, largest), dp=pu.block_size(d, interpret),
              Vp=pu.block_size(v.shape[-1], interpret), feature_kernels=channels == 6)
  # Edge-padding keeps padded tokens in the last run; causality hides them from real queries.
  run = pu.pad_axis(document_index(segment_ids, B, T), 1, st.padded_length, mode="edge")
  first, last = _document_bounds(run)
  return _flash(q, k, v, omega, lam_raw, positions.astype(jnp.int32), run, first, last, st)


class PallasFlash(Backend[FlashTiles]):
  """The flash Triton kernels as a backend (every variant without a constant state), each device of
  the mesh in context on its own rows and heads (``shard_map.run_sharded``)."""

  platforms = TRITON
  tiles_type = FlashTiles
  requirement = "p >= 2 or 4 or 3 channels (no constant-size state)"

  def supports(self, problem: Problem) -> bool:
    return not problem.constant_state

  def preferred(self, problem: Problem) -> bool:
    return problem.head_dim <= MAX_HEAD_DIM and problem.value_dim <= MAX_VALUE_DIM

  def heuristic_config(self, problem: Problem) -> FlashTiles:
    return default_tiles(problem.dtype)

  def flops_per_head(self, problem: Problem, tiles: FlashTiles | None = None) -> float:
    return flops.quadratic(problem.feature_dim, problem.value_dim + 1, problem.length or 1)

  def __call__(self, q, k, v, omega, lam_raw, *, positions, segment_ids, state, tiles: FlashTiles,
               options: Options):
    del state  # None: ``supports`` admits no variant with a state
    kernel = functools.partial(sanatan_flash_pallas, p=options.p, channels=options.channels,
                               three_channel=options.three_channel, rotate=options.rotate, tiles=tiles,
                               precision=options.precision)
    inputs = dict(q=q, k=k, v=v, omega=omega, lam_raw=lam_raw, positions=positions,
                  segment_ids=segment_ids)
    return shard_map.run_sharded(kernel, inputs, KERNEL_LAYOUTS, "BTH"), None
