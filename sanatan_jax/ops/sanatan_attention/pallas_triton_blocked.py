"""Pallas (Triton lowering) blocked, flash-style SANATAN kernels for any power p (MATH §1.1 step 6).

Per head, with Phi the feature map of MATH §1.1 (6, 4 or 3 channels) computed *inside* the kernels
from raw q, k blocks (``base.feature_channels``), the function of ``reference.parallel`` and
``xla.blocked``::

    w_tj = [j <= t, same run] ((s_tj + shift) / c)^p,  s_tj = Phi(q_t) · Phi(k_j)  (4ch: max(s, 0)),
    N_t = sum_j w_tj v_j,   D_t = sum_j w_tj,   o_t = N_t / (D_t + eps).

p >= 2 has no recurrence, so the sums are taken block by block as in flash attention, but without
its running maximum: the weights lie in [0, 1] (scores divided by their maximum c), so fp32 sums of
them cannot overflow. Grid (query block, batch, head): a program computes its query block's
features once and loops (``lax.fori_loop``, traced bound) over the key blocks j <= its block,
computing the key features, the scores as a sum of per-channel dots [BQ, dp] x [dp, BK], the
causal + same-run mask and the weights, accumulating N [BQ, V] and D [BQ] in fp32. Query blocks run
last-to-first along the grid's first axis, so the longest programs start first. No T x T array
exists, in HBM or inside a kernel.

The constant channel Phi_a = 1 adds exactly d to the score of every pair of real tokens; it is
added as a number, not a dot (1/6 of the score work at 6 channels). Pairs with a padded token are
masked, since time padding sits after every real token.

Backward (``jax.custom_vjp``): the forward saves its inputs, o (in v's dtype) and D per token
(fp32). With dN = do / (D + eps) and dD = -(do · o) / (D + eps) (outside the kernels),
dw_tj = dN_t · v_j + dD_t, and ds_tj comes from ``jax.vjp`` of the same weight function inside the
kernel. Two kernels:

* key blocks, grid (key block, batch, head; block 0, which every query sees, first), looping over
  the query blocks that can see the block:
  dv_j = sum_t w_tj dN_t and d Phi(k_j) = sum_t ds_tj Phi(q_t), chained through the feature map
  (``jax.vjp``) into dk and per-program partial d omega, d lam_raw;
* query blocks, grid (query block, batch, head), looping over key blocks j <= its block:
  d Phi(q_t) = sum_j ds_tj Phi(k_j) into dq and partial d omega, d lam_raw.

The partial parameter gradients are summed outside. Positions and run ids get no gradient.

Packed documents follow api.py: ``runs`` (``segments.document_index``, non-decreasing per row)
number the maximal runs of equal segment ids, and a token sees only keys of its own run.
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
from sanatan_jax.ops.sanatan_attention.base import (EPS, block_feature_fn, check_blocked_options,
                                                    power_weights)

_F32 = jnp.float32
class KernelConfig(NamedTuple):
  """Static kernel parameters: blocks BQ, BK, real head dim and length, the power and variant."""

  block_q: int
  block_k: int
  head_dim: int
  length: int
  p: int
  channels: int
  three_channel: str
  interpret: bool
  num_warps: int
  num_stages: int
  precision: str


class _Block(NamedTuple):
  """A block of tokens inside a kernel: non-constant feature channels, token indices, run ids."""

  phi: tuple  # channels x [n, dp], input dtype
  index: jax.Array  # [n] int32
  run: jax.Array  # [n] int32


def _load(refs, params, start, size: int, cfg: KernelConfig, with_vjp: bool = False):
  """Rows ``start : start + size`` of a raw q or k ref as a _Block, and (if asked) the VJP of its
  features w.r.t. (u, omega, lam_raw)."""
  u_ref, pos_ref, run_ref = refs
  u = pu.rows(u_ref, start, size)
  fn = block_feature_fn(pu.rows(pos_ref, start, size), start, u.shape, cfg)
  args = (u.astype(_F32), *params)
  phi, vjp = jax.vjp(fn, *args) if with_vjp else (fn(*args), None)
  index = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
  return _Block(tuple(a.astype(u.dtype) for a in phi), index, pu.rows(run_ref, start, size)), vjp


def _scores(query: _Block, key: _Block, cfg: KernelConfig):
  """s_tj = Phi(q_t) · Phi(k_j), fp32 [BQ, BK]: d for the constant channel, a dot for each other."""
  return float(cfg.head_dim) + sum(pu.dot(a, b, trans_b=True) for a, b in zip(query.phi, key.phi))


def _visible(query: _Block, key: _Block):
  """[BQ, BK] bool: j <= t and the same run."""
  return ((query.index[:, None] >= key.index[None, :])
          & (query.run[:, None] == key.run[None, :]))


def _weights(s, visible, cfg: KernelConfig):
  """w = ((s + shift) / c)^p on visible pairs, else 0 (``base.power_weights``)."""
  return power_weights(s, visible, p=cfg.p, channels=cfg.channels,
                       three_channel=cfg.three_channel, d=cfg.head_dim)


def _weights_and_score_grads(query: _Block, key: _Block, v, dN, dD, cfg: KernelConfig):
  """w [BQ, BK] and ds = dL/ds [BQ, BK] from dw_tj = dN_t · v_j + dD_t (fp32)."""
  visible = _visible(query, key)
  w, w_vjp = jax.vjp(lambda s: _weights(s, visible, cfg), _scores(query, key, cfg))
  (ds,) = w_vjp(pu.dot(dN, v, trans_b=True) + dD[:, None])
  return w, ds


def _row_block(program: int, count: int, reverse: bool):
  """The block of rows program ``program`` of ``count`` owns (last-to-first when ``reverse``)."""
  return count - 1 - program if reverse else program


def _key_blocks_upto(i, cfg: KernelConfig):
  """How many key blocks hold a key at or before the last query of query block i."""
  return pl.cdiv((i + 1) * cfg.block_q, cfg.block_k)


def _forward_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, o_ref, den_ref, *,
                    cfg):
  BQ, BK = cfg.block_q, cfg.block_k
  i = _row_block(pl.program_id(0), q_ref.shape[0] // BQ, reverse=True)
  params = (omega_ref[...], lam_ref[...])
  query, _ = _load((q_ref, pos_ref, run_ref), params, i * BQ, BQ, cfg)

  def key_block(j, carry):
    num, den = carry
    key, _ = _load((k_ref, pos_ref, run_ref), params, j * BK, BK, cfg)
    v = pu.rows(v_ref, j * BK, BK)
    w = _weights(_scores(query, key, cfg), _visible(query, key), cfg)
    return num + pu.dot(w.astype(v.dtype), v), den + jnp.sum(w, axis=1)

  init = (jnp.zeros((BQ, v_ref.shape[1]), _F32), jnp.zeros((BQ,), _F32))
  num, den = jax.lax.fori_loop(0, _key_blocks_upto(i, cfg), key_block, init)
  o_ref[...] = (num / (den[:, None] + EPS)).astype(o_ref.dtype)
  den_ref[...] = den


def _dq_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, dN_ref, dD_ref,
               dq_ref, domega_ref, dlam_ref, *, cfg):
  BQ, BK = cfg.block_q, cfg.block_k
  i = _row_block(pl.program_id(0), q_ref.shape[0] // BQ, reverse=True)
  params = (omega_ref[...], lam_ref[...])
  query, q_vjp = _load((q_ref, pos_ref, run_ref), params, i * BQ, BQ, cfg, with_vjp=True)
  dN, dD = pu.rows(dN_ref, i * BQ, BQ), pu.rows(dD_ref, i * BQ, BQ)

  def key_block(j, dphi):
    key, _ = _load((k_ref, pos_ref, run_ref), params, j * BK, BK, cfg)
    _, ds = _weights_and_score_grads(query, key, pu.rows(v_ref, j * BK, BK), dN, dD, cfg)
    return tuple(g + pu.dot(ds.astype(b.dtype), b) for g, b in zip(dphi, key.phi))

  zeros = tuple(jnp.zeros(a.shape, _F32) for a in query.phi)
  dphi = jax.lax.fori_loop(0, _key_blocks_upto(i, cfg), key_block, zeros)
  dq_ref[...], domega_ref[...], dlam_ref[...] = q_vjp(dphi)


def _dkv_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, dN_ref, dD_ref,
                dk_ref, dv_ref, domega_ref, dlam_ref, *, cfg):
  BQ, BK = cfg.block_q, cfg.block_k
  j = _row_block(pl.program_id(0), k_ref.shape[0] // BK, reverse=False)
  params = (omega_ref[...], lam_ref[...])
  key, k_vjp = _load((k_ref, pos_ref, run_ref), params, j * BK, BK, cfg, with_vjp=True)
  v = pu.rows(v_ref, j * BK, BK)

  def query_block(i, carry):
    dphi, dv = carry
    query, _ = _load((q_ref, pos_ref, run_ref), params, i * BQ, BQ, cfg)
    dN, dD = pu.rows(dN_ref, i * BQ, BQ), pu.rows(dD_ref, i * BQ, BQ)
    w, ds = _weights_and_score_grads(query, key, v, dN, dD, cfg)
    dphi = tuple(g + pu.dot(ds.astype(a.dtype), a, trans_a=True) for g, a in zip(dphi, query.phi))
    return dphi, dv + pu.dot(w.astype(dN.dtype), dN, trans_a=True)

  init = (tuple(jnp.zeros(b.shape, _F32) for b in key.phi), jnp.zeros(v.shape, _F32))
  first = jax.lax.div(j * BK, BQ)  # the first query block holding a query at or after key j * BK
  dphi, dv = jax.lax.fori_loop(first, q_ref.shape[0] // BQ, query_block, init)
  dk_ref[...], domega_ref[...], dlam_ref[...] = k_vjp(dphi)
  dv_ref[...] = dv


def _specs(Tp, dp, Vp, size: int, reverse: bool):
  """BlockSpecs over the grid (row block n, batch, head): whole rows of the inputs, and each
  program's own block of ``size`` rows (or its own partial parameter gradient) for the outputs."""
  count = Tp // size
  row = lambda n: _row_block(n, count, reverse)
  seq = lambda width: pl.BlockSpec((None, Tp, None, width), lambda n, b, h: (b, 0, h, 0))
  block = lambda width: pl.BlockSpec((None, size, None, width), lambda n, b, h: (b, row(n), h, 0))
  return dict(
      qk=seq(dp), v=seq(Vp),
      row=pl.BlockSpec((None, Tp), lambda n, b, h: (b, 0)),
      token=pl.BlockSpec((None, Tp, None), lambda n, b, h: (b, 0, h)),
      param=pl.BlockSpec((None, 1, dp), lambda n, b, h: (h, 0, 0)),
      block_qk=block(dp), block_v=block(Vp),
      block_token=pl.BlockSpec((None, size, None), lambda n, b, h: (b, row(n), h)),
      partial=pl.BlockSpec((None, None, None, 1, dp), lambda n, b, h: (b, h, n, 0, 0)))


def _input_specs(s):
  return [s["qk"], s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"]]


def _forward(q, k, v, pos, run, omega, lam_raw, cfg):
  """o [B, Tp, H, Vp] in v's dtype and D [B, Tp, H] fp32."""
  B, Tp, H, dp = q.shape
  s = _specs(Tp, dp, v.shape[-1], cfg.block_q, reverse=True)
  out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, Tp, H), _F32))
  return pu.call(_forward_kernel, cfg, (Tp // cfg.block_q, B, H), _input_specs(s),
                 [s["block_v"], s["block_token"]], out_shape, q, k, v, pos, run, omega, lam_raw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(q, k, v, pos, run, omega, lam_raw, cfg):
  return _forward(q, k, v, pos, run, omega, lam_raw, cfg)[0]


def _fused_fwd(q, k, v, pos, run, omega, lam_raw, cfg):
  o, den = _forward(q, k, v, pos, run, omega, lam_raw, cfg)
  return o, (q, k, v, pos, run, omega, lam_raw, o, den)


def _fused_bwd(cfg, residuals, do):
  q, k, v, pos, run, omega, lam_raw, o, den = residuals
  B, Tp, H, dp = q.shape
  Vp = v.shape[-1]
  inv_BxTxH = 1.0 / (den + EPS)
  do = do.astype(_F32)
  dN = (do * inv_BxTxH[..., None]).astype(v.dtype)
  dD = -jnp.sum(do * o.astype(_F32), axis=-1) * inv_BxTxH
  args = (q, k, v, pos, run, omega, lam_raw, dN, dD)
  rows = lambda width: jax.ShapeDtypeStruct((B, Tp, H, width), _F32)
  partial = lambda size: jax.ShapeDtypeStruct((B, H, Tp // size, 1, dp), _F32)

  s = _specs(Tp, dp, Vp, cfg.block_q, reverse=True)
  dq, d_omega_q, d_lam_q = pu.call(
      _dq_kernel, cfg, (Tp // cfg.block_q, B, H), _input_specs(s) + [s["v"], s["token"]],
      [s["block_qk"], s["partial"], s["partial"]],
      (rows(dp), partial(cfg.block_q), partial(cfg.block_q)), *args)
  s = _specs(Tp, dp, Vp, cfg.block_k, reverse=False)
  dk, dv, d_omega_k, d_lam_k = pu.call(
      _dkv_kernel, cfg, (Tp // cfg.block_k, B, H), _input_specs(s) + [s["v"], s["token"]],
      [s["block_qk"], s["block_v"], s["partial"], s["partial"]],
      (rows(dp), rows(Vp), partial(cfg.block_k), partial(cfg.block_k)), *args)
  d_omega = d_omega_q.sum((0, 2)) + d_omega_k.sum((0, 2))
  d_lam = d_lam_q.sum((0, 2)) + d_lam_k.sum((0, 2))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_omega, d_lam)


_fused.defvjp(_fused_fwd, _fused_bwd)


def sanatan_blocked_pallas(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                           lam_raw: jax.Array, *, positions: jax.Array | None = None,
                           segment_ids: jax.Array | None = None, p: int = 2, channels: int = 6,
                           three_channel: str = "clean", rotate: bool = True,
                           interpret: bool | None = None, block_q: int = 32, block_k: int = 32,
                           num_warps: int = 4, num_stages: int = 2,
                           precision: str = "input") -> jax.Array:
  """SANATAN attention at any power p and channel variant (MATH §1.1) by the blocked Pallas
  kernels; the output of ``sanatan_attention(..., implementation="blocked")``. No state: the
  kernels run whole sequences (p >= 2 and the 4/3-channel ablations have no constant-size state).

  Args:
    q, k: raw [B, T, H, d] (already divided by sqrt(d)); v: [B, T, H, dv]; bf16 or fp32.
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1.
    segment_ids: optional [B, T] packed-document ids (api.py's convention).
    p, channels, three_channel: the kernel (MATH §1.1 steps 5-6); any positive integer p.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    block_q, block_k: query and key block lengths, powers of two (>= 16 when compiled; capped at
      the next power of two >= T).
    num_warps, num_stages: Triton tuning knobs.
    precision: "input" (dots take operands in the inputs' dtype), "tf32" or "float32" (the
      kernels run on fp32 copies and return fp32; ``pu.PRECISIONS``).

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 unless ``precision`` is "input").
  """
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, "sanatan_blocked_pallas",
                   "sanatan_attention(implementation='blocked')")
  check_blocked_options(p, channels, three_channel, block_q, block_k,
                        op="sanatan_blocked_pallas")
  pu.check_precision(precision, "sanatan_blocked_pallas")
  q, k, v = pu.operands(precision, q, k, v)
  B, T, H, d = q.shape
  V = v.shape[-1]
  if positions is None:
    positions = default_positions(B, T)
  smallest = 1 if interpret else pu.MIN_DOT
  BQ, BK = (max(min(size, pl.next_power_of_2(T)), smallest) for size in (block_q, block_k))
  dp, Vp = pu.block_size(d, interpret), pu.block_size(V, interpret)
  Tp = pu.round_up(T, max(BQ, BK))
  cfg = KernelConfig(block_q=BQ, block_k=BK, head_dim=d, length=T, p=p, channels=channels,
                     three_channel=three_channel, interpret=interpret, num_warps=num_warps,
                     num_stages=num_stages, precision=precision)
  pad_qk = lambda x: pu.pad_axis(pu.pad_axis(x, 1, Tp), 3, dp)
  pos = positions.astype(jnp.int32) if rotate else jnp.zeros((B, T), jnp.int32)
  # Edge-padding keeps padded tokens in the last run; causality hides them from real queries.
  run = pu.pad_axis(document_index(segment_ids, B, T), 1, Tp, mode="edge")
  param = lambda x: pu.pad_axis(x.astype(_F32), 1, dp).reshape(H, 1, dp)
  o = _fused(pad_qk(q), pad_qk(k), pu.pad_axis(pu.pad_axis(v, 1, Tp), 3, Vp),
             pu.pad_axis(pos, 1, Tp), run, param(omega), param(lam_raw), cfg)
  return o[:, :T, :, :V]
