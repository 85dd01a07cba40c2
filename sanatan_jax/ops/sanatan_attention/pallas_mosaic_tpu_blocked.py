"""Pallas (Mosaic TPU lowering) blocked, flash-style SANATAN kernels for any power p, with VJP.

The function is pallas_triton_blocked.py's (``reference.parallel``, ``xla.blocked``), per head, with
Phi the feature map of MATH §1.1 (6, 4 or 3 channels) computed inside the kernels from raw q, k::

    w_tj = [j <= t, same run] ((s_tj + shift) / c)^p,  s_tj = Phi(q_t) · Phi(k_j)  (4ch: max(s, 0)),
    N_t = sum_j w_tj v_j,   D_t = sum_j w_tj,   o_t = N_t / (D_t + eps).

TPU form (flash attention's on TPU). A TPU core runs the grid steps one after another, so the grid
is (batch·head, query block i, key block j) with the key axis last and "arbitrary" (sequential; the
first two are "parallel" and split over the cores of a chip). Per (batch·head, i) the fp32
accumulators N [BQ, V] and D [BQ, 1] live in VMEM scratch: zeroed at j = 0, increased by every key
block, turned into o and D at the last j. The query block's non-constant feature channels are
computed once, at j = 0, and cached in VMEM scratch (input dtype); the key block's are computed per
step. The weights lie in [0, 1] (scores divided by their maximum c), so there is no running maximum.
Key blocks entirely after the query block are skipped with ``pl.when``, and their index maps clamp
to the last visible block so that no new block is copied in for them.

Layout (the gated op's pallas_mosaic_tpu.py's): head-major [B·H, Tp, ·] in blocks of (BQ or BK, 128
m); time padded to whole blocks, d and dv to multiples of 128 lanes (zeros: features are masked to
zero on padded dims, padded values contribute nothing). Compiled blocks hold at least 128 tokens, so
the [1, BK] key-run row fills whole lanes. Positions and run ids are per batch row, as columns [Tp,
1] (queries, key features) and a row [1, Tp] (key runs). The constant channel Phi_a = 1 adds d to
every score as a number, not a dot (pallas_triton_blocked.py). Pairs with a padded token: a padded
query sees real keys, but its output is dropped and its cotangent is zero; padded keys sit after
every real query.

Backward (``jax.custom_vjp``): the forward saves its inputs, o (in v's dtype) and D [Tp, 1] fp32.
With dN = do / (D + eps) and dD = -(do · o) / (D + eps) (outside the kernels), dw_tj = dN_t · v_j +
dD_t, and ds_tj comes from ``jax.vjp`` of the same weight function inside the kernel. Two kernels:

* dq, grid (batch·head, i, j), j "arbitrary": d Phi(q_t) = sum_j ds_tj Phi(k_j) accumulated in VMEM,
  chained at the last j through the feature map (``jax.vjp``) into dq and per-program partial
  d omega, d lam_raw;
* dk/dv, grid (batch·head, j, i), i "arbitrary" (query blocks before the key block skipped and
  clamped): dv_j = sum_t w_tj dN_t and d Phi(k_j) = sum_t ds_tj Phi(q_t) in VMEM, the key block's
  features cached at the first i; dk and partial d omega, d lam_raw at the last i.

The partial parameter gradients are summed outside. Positions and run ids get no gradient.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.layout import default_positions, heads_first
from lmcore.ops.common.segments import document_index
from sanatan_jax.ops.sanatan_attention.base import (EPS, NON_CONSTANT_CHANNELS, block_feature_fn,
                                                    check_blocked_options, power_weights)

LANES = pu.TPU_LANES
_F32 = jnp.float32


class KernelConfig(NamedTuple):
  """Static kernel parameters (hashable: they key the compiled kernels).

  block_q, block_k: BQ, BK; head_dim, length: the real d and T; n_heads: H (positions and runs are
  per batch row); p, channels, three_channel: the kernel; interpret: ``pallas_call``'s argument.
  """

  block_q: int
  block_k: int
  head_dim: int
  length: int
  n_heads: int
  p: int
  channels: int
  three_channel: str
  interpret: Any

  @property
  def n_channels(self) -> int:
    """How many feature channels are dots (all but the constant one)."""
    return len(NON_CONSTANT_CHANNELS[self.channels])


class _Refs(NamedTuple):
  """The inputs every kernel gets, as blocks: raw q [BQ, dp], k [BK, dp], v [BK, Vp], query
  positions and runs [BQ, 1], key positions [BK, 1] and runs [1, BK] (int32), omega and lam_raw
  [1, dp] fp32."""

  q: Any
  k: Any
  v: Any
  pos_q: Any
  run_q: Any
  pos_k: Any
  run_k: Any
  omega: Any
  lam_raw: Any


def _features(u_ref, pos_ref, refs: _Refs, start, cfg: KernelConfig, with_vjp: bool = False):
  """The non-constant feature channels of a raw q or k block whose first token is ``start``
  (channels x [n, dp] in the input dtype, zero on padding), and (if asked) their VJP w.r.t.
  (u, omega, lam_raw)."""
  u = u_ref[...]
  # The Triton kernels' feature function (base.py); it takes the positions as a vector [n].
  fn = block_feature_fn(pos_ref[...][:, 0], start, u.shape, cfg)
  args = (u.astype(_F32), refs.omega[...], refs.lam_raw[...])
  phi, vjp = jax.vjp(fn, *args) if with_vjp else (fn(*args), None)
  return tuple(a.astype(u.dtype) for a in phi), vjp


def _cache(scratch, phi) -> None:
  """Stores a block's feature channels in a VMEM scratch buffer [channels, n, dp]."""
  for c, a in enumerate(phi):
    scratch[c] = a


def _cached(scratch, cfg: KernelConfig) -> tuple:
  """The channels of a [channels, n, dp] scratch buffer as a tuple of [n, dp] arrays."""
  return tuple(scratch[c] for c in range(cfg.n_channels))


def _sees(i, j, cfg: KernelConfig):
  """Whether query block i holds a query at or after the first key of key block j."""
  return (i + 1) * cfg.block_q > j * cfg.block_k


def _last_key_block(i, cfg: KernelConfig):
  """The last key block that query block i sees."""
  return jax.lax.div((i + 1) * cfg.block_q - 1, cfg.block_k)


def _first_query_block(j, cfg: KernelConfig):
  """The first query block that sees key block j."""
  return jax.lax.div(j * cfg.block_k, cfg.block_q)


def _scores_and_weight_fn(i, j, phi_q, phi_k, refs: _Refs, cfg: KernelConfig):
  """For query block i and key block j: the scores s_tj = d + the per-channel dots, fp32 [BQ, BK],
  and the weight function s -> w (``base.power_weights`` with the causal and same-run mask)."""
  shape = (cfg.block_q, cfg.block_k)
  causal = (i * cfg.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
            >= j * cfg.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1))
  visible = causal & (refs.run_q[...] == refs.run_k[...])
  s = float(cfg.head_dim) + sum(pu.dot(a, b, trans_b=True) for a, b in zip(phi_q, phi_k))
  return s, lambda s: power_weights(s, visible, p=cfg.p, channels=cfg.channels,
                                    three_channel=cfg.three_channel, d=cfg.head_dim)


def _weights_and_score_grads(i, j, phi_q, phi_k, refs: _Refs, dN, dD, cfg: KernelConfig):
  """w [BQ, BK] and ds = dL/ds [BQ, BK] from dw_tj = dN_t · v_j + dD_t (fp32)."""
  s, weight_fn = _scores_and_weight_fn(i, j, phi_q, phi_k, refs, cfg)
  w, w_vjp = jax.vjp(weight_fn, s)
  (ds,) = w_vjp(pu.dot(dN, refs.v[...], trans_b=True) + dD)
  return w, ds


def _forward_kernel(*refs, cfg: KernelConfig):
  n_in = len(_Refs._fields)
  r = _Refs(*refs[:n_in])
  o_ref, den_ref, phi_q_scratch, num_scratch, den_scratch = refs[n_in:]
  i, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    _cache(phi_q_scratch, _features(r.q, r.pos_q, r, i * cfg.block_q, cfg)[0])
    num_scratch[...] = jnp.zeros(num_scratch.shape, _F32)
    den_scratch[...] = jnp.zeros(den_scratch.shape, _F32)

  @pl.when(_sees(i, j, cfg))
  def _():
    phi_k, _ = _features(r.k, r.pos_k, r, j * cfg.block_k, cfg)
    s, weight_fn = _scores_and_weight_fn(i, j, _cached(phi_q_scratch, cfg), phi_k, r, cfg)
    w = weight_fn(s)
    v = r.v[...]
    num_scratch[...] += pu.dot(w.astype(v.dtype), v)
    den_scratch[...] += jnp.sum(w, axis=1, keepdims=True)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    den = den_scratch[...]
    o_ref[...] = (num_scratch[...] / (den + EPS)).astype(o_ref.dtype)
    den_ref[...] = den


def _dq_kernel(*refs, cfg: KernelConfig):
  n_in = len(_Refs._fields)
  r = _Refs(*refs[:n_in])
  dN_ref, dD_ref, dq_ref, domega_ref, dlam_ref, phi_q_scratch, dphi_scratch = refs[n_in:]
  i, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    _cache(phi_q_scratch, _features(r.q, r.pos_q, r, i * cfg.block_q, cfg)[0])
    dphi_scratch[...] = jnp.zeros(dphi_scratch.shape, _F32)

  @pl.when(_sees(i, j, cfg))
  def _():
    phi_k, _ = _features(r.k, r.pos_k, r, j * cfg.block_k, cfg)
    _, ds = _weights_and_score_grads(i, j, _cached(phi_q_scratch, cfg), phi_k, r, dN_ref[...],
                                     dD_ref[...], cfg)
    for c, b in enumerate(phi_k):
      dphi_scratch[c] += pu.dot(ds.astype(b.dtype), b)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    _, q_vjp = _features(r.q, r.pos_q, r, i * cfg.block_q, cfg, with_vjp=True)
    dq_ref[...], domega_ref[...], dlam_ref[...] = q_vjp(_cached(dphi_scratch, cfg))


def _dkv_kernel(*refs, cfg: KernelConfig):
  n_in = len(_Refs._fields)
  r = _Refs(*refs[:n_in])
  (dN_ref, dD_ref, dk_ref, dv_ref, domega_ref, dlam_ref, phi_k_scratch, dphi_scratch,
   dv_scratch) = refs[n_in:]
  j, i = pl.program_id(1), pl.program_id(2)

  @pl.when(i == 0)
  def _():
    _cache(phi_k_scratch, _features(r.k, r.pos_k, r, j * cfg.block_k, cfg)[0])
    dphi_scratch[...] = jnp.zeros(dphi_scratch.shape, _F32)
    dv_scratch[...] = jnp.zeros(dv_scratch.shape, _F32)

  @pl.when(_sees(i, j, cfg))
  def _():
    phi_q, _ = _features(r.q, r.pos_q, r, i * cfg.block_q, cfg)
    dN = dN_ref[...]
    w, ds = _weights_and_score_grads(i, j, phi_q, _cached(phi_k_scratch, cfg), r, dN, dD_ref[...],
                                     cfg)
    for c, a in enumerate(phi_q):
      dphi_scratch[c] += pu.dot(ds.astype(a.dtype), a, trans_a=True)
    dv_scratch[...] += pu.dot(w.astype(dN.dtype), dN, trans_a=True)

  @pl.when(i == pl.num_programs(2) - 1)
  def _():
    _, k_vjp = _features(r.k, r.pos_k, r, j * cfg.block_k, cfg, with_vjp=True)
    dk_ref[...], domega_ref[...], dlam_ref[...] = k_vjp(_cached(dphi_scratch, cfg))
    dv_ref[...] = dv_scratch[...]


class _Specs(NamedTuple):
  """BlockSpecs over a grid (batch·head, a, b): the ``_Refs`` inputs, dN [BQ, Vp] and dD [BQ, 1]
  of the query block, outputs of the query block (width dp or Vp, or a column), of the key block,
  and each (batch·head, a) program's own partial parameter gradient [1, dp]."""

  inputs: list
  dN: pl.BlockSpec
  dD: pl.BlockSpec
  query: Any  # width -> BlockSpec
  key: Any  # width -> BlockSpec
  partial: pl.BlockSpec


def _specs(dp: int, Vp: int, cfg: KernelConfig, query_major: bool) -> _Specs:
  """Query-major grids (a = query block i, b = key block j) clamp j to the last visible key block;
  key-major grids (a = j, b = i) clamp i to the first query block that sees j."""
  BQ, BK, H = cfg.block_q, cfg.block_k, cfg.n_heads
  if query_major:
    blocks = lambda a, b: (a, jnp.minimum(b, _last_key_block(a, cfg)))
  else:
    blocks = lambda a, b: (jnp.maximum(b, _first_query_block(a, cfg)), a)
  query = lambda width: pl.BlockSpec((None, BQ, width), lambda bh, a, b: (bh, blocks(a, b)[0], 0))
  key = lambda width: pl.BlockSpec((None, BK, width), lambda bh, a, b: (bh, blocks(a, b)[1], 0))
  row_q = pl.BlockSpec((None, BQ, 1), lambda bh, a, b: (bh // H, blocks(a, b)[0], 0))
  row_k = pl.BlockSpec((None, BK, 1), lambda bh, a, b: (bh // H, blocks(a, b)[1], 0))
  run_k = pl.BlockSpec((None, 1, BK), lambda bh, a, b: (bh // H, 0, blocks(a, b)[1]))
  param = pl.BlockSpec((None, 1, dp), lambda bh, a, b: (bh % H, 0, 0))
  inputs = [query(dp), key(dp), key(Vp), row_q, row_q, row_k, run_k, param, param]
  partial = pl.BlockSpec((None, None, 1, dp), lambda bh, a, b: (bh, a, 0, 0))
  return _Specs(inputs, query(Vp), query(1), query, key, partial)


def _visible_pairs(n_query_blocks: int, n_key_blocks: int, cfg: KernelConfig) -> int:
  """How many (query block, key block) steps of one batch·head are not skipped (``_sees``)."""
  return sum(min(((i + 1) * cfg.block_q - 1) // cfg.block_k, n_key_blocks - 1) + 1
             for i in range(n_query_blocks))


def _cost(kernel, cfg: KernelConfig, args: tuple, grads: tuple, out_shape) -> pl.CostEstimate:
  """``kernel``'s matmul FLOPs (per visible block pair, padded lanes and masked entries included),
  its transcendentals (five per lane of every feature block computed) and the bytes its blocks move:
  the outer grid axis's blocks and the outputs once, the inner axis's once per visible pair."""
  q, k, v = args[:3]
  BH, Tp, dp = q.shape
  BQ, BK, Vp, n = cfg.block_q, cfg.block_k, v.shape[-1], cfg.n_channels
  pairs = _visible_pairs(Tp // BQ, Tp // BK, cfg)  # per batch·head
  # One dot of each shape per pair: the block's scores over one channel's dp lanes, against Vp values.
  score, value = 2 * BQ * BK * dp, 2 * BQ * BK * Vp
  per_pair = {_forward_kernel: n * score + value, _dq_kernel: 2 * n * score + value,
              _dkv_kernel: 2 * n * score + 2 * value}[kernel]
  # Bytes per token of a query block (raw q, position, run; the backward's dN and dD) and of a key
  # block (raw k, v, position, run). The dk/dv kernel's outer axis is the key blocks.
  query_token = dp * q.dtype.itemsize + 8 + sum(g.shape[-1] * g.dtype.itemsize for g in grads)
  key_token = dp * k.dtype.itemsize + Vp * v.dtype.itemsize + 8
  outer, inner, inner_block = query_token, key_token, BK
  if kernel is _dkv_kernel:
    outer, inner, inner_block = key_token, query_token, BQ
  # Feature blocks: the outer side's once per block (twice in the backward, for the VJP), the inner
  # side's at every visible pair.
  feature_rows = Tp * (1 if kernel is _forward_kernel else 2) + pairs * inner_block
  outputs = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(out_shape))
  return pl.CostEstimate(
      flops=BH * pairs * per_pair, transcendentals=BH * 5 * feature_rows * dp,
      bytes_accessed=BH * (Tp * outer + pairs * inner_block * inner + 2 * dp * 4) + outputs)


def _call(kernel, cfg: KernelConfig, query_major: bool, args: tuple, grads: tuple, out_specs,
          out_shape, scratch):
  """Runs ``kernel`` over the grid (B·H, query blocks, key blocks) if ``query_major``, else (B·H,
  key blocks, query blocks), on the ``_Refs`` inputs ``args`` and the backward's (dN, dD)
  ``grads``; ``out_specs`` maps the ``_Specs`` to the output specs; ``scratch`` lists the VMEM
  buffers' (shape, dtype)."""
  BH, Tp, _ = args[0].shape
  blocks = (Tp // cfg.block_q, Tp // cfg.block_k)
  specs = _specs(args[0].shape[-1], args[2].shape[-1], cfg, query_major)
  in_specs = specs.inputs + ([specs.dN, specs.dD] if grads else [])
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=(BH, *(blocks if query_major else blocks[::-1])),
      in_specs=in_specs, out_specs=out_specs(specs), out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=_cost(kernel, cfg, args, grads, out_shape), interpret=cfg.interpret)(*args, *grads)


def _forward(args, cfg: KernelConfig):
  """o [BH, Tp, Vp] in v's dtype and D [BH, Tp, 1] fp32."""
  q, _, v = args[:3]
  BH, Tp, dp = q.shape
  BQ, Vp = cfg.block_q, v.shape[-1]
  out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((BH, Tp, 1), _F32))
  scratch = [((cfg.n_channels, BQ, dp), q.dtype), ((BQ, Vp), _F32), ((BQ, 1), _F32)]
  return _call(_forward_kernel, cfg, True, args, (), lambda s: [s.query(Vp), s.query(1)],
               out_shape, scratch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _fused(q, k, v, pos_q, run_q, pos_k, run_k, omega, lam_raw, cfg):
  return _forward((q, k, v, pos_q, run_q, pos_k, run_k, omega, lam_raw), cfg)[0]


def _fused_fwd(q, k, v, pos_q, run_q, pos_k, run_k, omega, lam_raw, cfg):
  args = (q, k, v, pos_q, run_q, pos_k, run_k, omega, lam_raw)
  o, den = _forward(args, cfg)
  return o, (args, o, den)


def _fused_bwd(cfg, residuals, do):
  args, o, den = residuals
  q, k, v = args[:3]
  BH, Tp, dp = q.shape
  Vp, n = v.shape[-1], cfg.n_channels
  inv = 1.0 / (den + EPS)
  do = do.astype(_F32)
  dN = (do * inv).astype(v.dtype)
  dD = -jnp.sum(do * o.astype(_F32), axis=-1, keepdims=True) * inv
  rows = lambda width: jax.ShapeDtypeStruct((BH, Tp, width), _F32)
  partial = lambda size: jax.ShapeDtypeStruct((BH, Tp // size, 1, dp), _F32)

  BQ, BK = cfg.block_q, cfg.block_k
  dq, d_omega_q, d_lam_q = _call(
      _dq_kernel, cfg, True, args, (dN, dD), lambda s: [s.query(dp), s.partial, s.partial],
      (rows(dp), partial(BQ), partial(BQ)), [((n, BQ, dp), q.dtype), ((n, BQ, dp), _F32)])
  dk, dv, d_omega_k, d_lam_k = _call(
      _dkv_kernel, cfg, False, args, (dN, dD),
      lambda s: [s.key(dp), s.key(Vp), s.partial, s.partial],
      (rows(dp), rows(Vp), partial(BK), partial(BK)),
      [((n, BK, dp), k.dtype), ((n, BK, dp), _F32), ((BK, Vp), _F32)])
  per_head = lambda x: x.reshape(-1, cfg.n_heads, *x.shape[1:]).sum((0, 2))
  d_omega = per_head(d_omega_q) + per_head(d_omega_k)
  d_lam = per_head(d_lam_q) + per_head(d_lam_k)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None,
          d_omega, d_lam)


_fused.defvjp(_fused_fwd, _fused_bwd)


def sanatan_blocked_tpu(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                        lam_raw: jax.Array, *, positions: jax.Array | None = None,
                        segment_ids: jax.Array | None = None, p: int = 2, channels: int = 6,
                        three_channel: str = "clean", rotate: bool = True,
                        interpret: bool | pltpu.InterpretParams | None = None,
                        block_q: int = LANES, block_k: int = LANES) -> jax.Array:
  """SANATAN attention at any power p and channel variant (MATH §1.1) by the Mosaic TPU kernels;
  ``sanatan_blocked_pallas``'s contract (the output of ``sanatan_attention(...,
  implementation="blocked")``), no state.

  Args:
    q, k: raw [B, T, H, d] (already divided by sqrt(d)); v: [B, T, H, dv]; bf16 or fp32.
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1.
    segment_ids: optional [B, T] packed-document ids (api.py's convention).
    p, channels, three_channel: the kernel (MATH §1.1 steps 5-6); any positive integer p.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    interpret: True runs Pallas' generic interpreter, a ``pltpu.InterpretParams`` the TPU
      simulator; None interprets off TPU; False compiles (TPU only).
    block_q, block_k: query and key block lengths, powers of two. Compiled, at least 128;
      interpreted, any (capped at the next power of two >= T), so that tests cross many blocks.

  Returns:
    o [B, T, H, dv] in v's dtype.
  """
  interpret = pu.resolve_tpu_interpret(interpret, "sanatan_blocked_tpu",
                                        "sanatan_attention(implementation='blocked')")
  check_blocked_options(p, channels, three_channel, block_q, block_k, op="sanatan_blocked_tpu")
  B, T, H, d = q.shape
  V = v.shape[-1]
  if positions is None:
    positions = default_positions(B, T)
  fit = lambda size: min(size, pl.next_power_of_2(T)) if interpret else max(size, LANES)
  BQ, BK = fit(block_q), fit(block_k)
  Tp, dp, Vp = pu.round_up(T, max(BQ, BK)), pu.round_up(d, LANES), pu.round_up(V, LANES)
  cfg = KernelConfig(block_q=BQ, block_k=BK, head_dim=d, length=T, n_heads=H, p=p,
                     channels=channels, three_channel=three_channel, interpret=interpret)
  pos = positions.astype(jnp.int32) if rotate else jnp.zeros((B, T), jnp.int32)
  pos_column = pu.pad_axis(pos, 1, Tp)[:, :, None]
  # Edge-padding keeps padded tokens in the last run; causality hides them from real queries.
  run = pu.pad_axis(document_index(segment_ids, B, T), 1, Tp, mode="edge")
  param = lambda x: pu.pad_axis(x.astype(_F32), 1, dp).reshape(H, 1, dp)
  o = _fused(heads_first(q, Tp, dp), heads_first(k, Tp, dp), heads_first(v, Tp, Vp),
             pos_column, run[:, :, None], pos_column, run[:, None, :], param(omega),
             param(lam_raw), cfg)
  return jnp.swapaxes(o.reshape(B, H, Tp, Vp)[:, :, :T, :V], 1, 2)
