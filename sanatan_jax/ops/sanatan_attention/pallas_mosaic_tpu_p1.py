"""Pallas (Mosaic TPU lowering) kernels for SANATAN p = 1, six channels (MATH §1.2), with VJP: the
backend ``pallas_tpu`` (``PallasTpu``, tiles ``MosaicTiles``).

The function is ``reference.recurrent``'s write-then-read recurrence, per head::

    S_t = S_{t-1} + Phi(k_t) v_tᵀ,   z_t = z_{t-1} + Phi(k_t),
    o_t = Phi(q_t)ᵀ S_t / (Phi(q_t)ᵀ z_t + c eps),

computed in chunks (intra-chunk causal block + fp32 state).

Features. XLA computes Phi's factors cos th_rot, sin th_rot and r with features.py's functions
(``base.rotated_angles_and_roots``, fp32) and hands them to the kernels in the operands' dtype; the
kernels form the channels from them by ``base.factor_channel``, so the 6d-wide features never reach
HBM, and take the channels' gradients back to the factors by autodiff of ``factor_channel``
(``jax.vjp``); XLA's autodiff takes those on to q, k, omega and lam_raw.

TPU form, as the gated op's pallas_mosaic_tpu.py: a TPU core runs grid steps one after another, so
the grid is (batch·head, value tile, chunk) with the chunk axis last and "arbitrary" (sequential;
the first two are "parallel"), and the fp32 state lives in a VMEM scratch buffer carried from one
chunk's step to the next (loaded from the initial state at chunk 0, written out after the last).
Arrays are head-major, [B·H, T, ·], time padded to whole chunks; compiled chunks hold at least 128
tokens.

Lane-paired channels. The factors come with every head dimension twice, [x | x], padded to Dp = 2d
rounded up to 128 lanes: lane a holds channel c = p of dimension a (W = 1) and lane d + a channel
c = 3 + p (W = r), so three [C, Dp] arrays

    P_p = factor_channel(p + 3 [lane >= d], cos, sin, r),   p = 0, 1, 2,

hold all six channels, and sum_p P_p(q) · P_p(k) = sum_a (1 + rq rk)(1 + cos(th_q - th_k)). The
state is three [Dp, BV] tiles. At the paper's d = 64 this fills 128 lanes exactly: half the matmul
work and state of six separately lane-padded channels. Padded lanes have zero factors, hence zero
channels.

Normaliser as a value column (the gated op's ``normalize=True`` trick): v gets a ones column, so the
last used column of the numerator N is the denominator, and z rides in S as its column V; the
kernels are plain (unnormalised) linear attention and o = N[:V] / (N[V] + c eps) is taken outside,
where XLA differentiates it. Padded tokens have v = 0 (ones column included) and zero output
cotangents, so they neither write nor receive gradients.

Packed documents (runs of equal segment ids, ``segments.document_index``) follow api.py, through
the document masks of ``segments.chunk_documents``: a token reads the carried state only while in
the state's run, and a chunk hands on only its last run's writes.

Backward (``jax.custom_vjp`` over the factors, values and initial state): the forward saves its
inputs only. A forward sweep recomputes the chunk states for d Phi(q); a reverse sweep (the chunk
index maps run backwards) carries dS in VMEM for d Phi(k), dv and dS_0; each kernel takes d Phi
through ``factor_channel``'s VJP to the factors. With several value tiles the factors' gradients of each
tile are partial sums added outside.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lmcore.ops.common import flops, shard_map
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.backend import MOSAIC_TPU, Backend, check_power_of_two
from lmcore.ops.common.layout import default_positions, heads_first
from lmcore.ops.common.segments import ChunkDocuments, chunk_documents, document_index
from sanatan_jax import features
from sanatan_jax.ops.sanatan_attention.base import (EPS, KERNEL_LAYOUTS, STATE_LAYOUT, Options, Problem,
                                                    SanatanState, factor_channel, rotated_angles_and_roots)

LANES = pu.TPU_LANES
CHANNELS = 6
PAIRS = 3  # feature arrays of two channels each
FACTORS = 3  # cos th_rot, sin th_rot, r
_F32 = jnp.float32


class KernelConfig(NamedTuple):
  """Static kernel parameters: chunk C, value tile BV, real head dim d, H (the document arrays are
  per batch row) and ``pallas_call``'s ``interpret``."""

  chunk: int
  block_v: int
  head_dim: int
  n_heads: int
  interpret: Any


class _Seq(NamedTuple):
  """One chunk's input refs."""

  q: Any  # [3, C, Dp] factors of q (cos, sin, r), each dimension twice, input dtype
  k: Any  # [3, C, Dp]
  v: Any  # [C, BV] values with the ones column
  doc: Any  # [C, 1] int32 run index
  doc_row: Any  # [1, C] int32, the same as a row
  reads: Any  # [C, 1] int32: 1 where the token is in the run of the state entering the chunk
  writes: Any  # [C, 1] int32: 1 where the token is in the chunk's last run


class _Chunk(NamedTuple):
  """One chunk as loaded in a kernel."""

  phi_q: tuple  # PAIRS x [C, Dp] input dtype
  phi_k: tuple  # PAIRS x [C, Dp]
  v: jax.Array  # [C, BV]
  visible: jax.Array  # [C, C] bool: j <= i and the same run
  reads: jax.Array  # [C, 1] bool
  writes: jax.Array  # [C, 1] bool
  keep: jax.Array  # [1, 1] bool: the state's run goes on through the chunk (its last token reads)


def _pairs(cos, sin, r, head_dim: int) -> tuple:
  """P_0, P_1, P_2 (fp32 [C, Dp]) from lane-doubled factors (fp32 [C, Dp]): lane a holds channel p of
  dimension a, lane d + a channel 3 + p (``base.factor_channel``)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, cos.shape[1]), 1)
  half = 3 * (lane >= head_dim).astype(jnp.int32)
  return tuple(factor_channel(p + half, cos, sin, r) for p in range(PAIRS))


def _phi(f_ref, cfg: KernelConfig, differentiate: bool):
  """Channels of a chunk's q or k factors in their dtype, and their VJP (to the factors, fp32) when
  ``differentiate``, else None."""
  fn = functools.partial(_pairs, head_dim=cfg.head_dim)
  factors = tuple(f_ref[i].astype(_F32) for i in range(FACTORS))
  phi, vjp = jax.vjp(fn, *factors) if differentiate else (fn(*factors), None)
  return tuple(x.astype(f_ref.dtype) for x in phi), vjp


def _load(seq: _Seq, cfg: KernelConfig, vjp_of: str | None = None):
  """(_Chunk, the VJP of Phi(q) if ``vjp_of`` is "q", of Phi(k) if "k", else None)."""
  phi_q, q_vjp = _phi(seq.q, cfg, vjp_of == "q")
  phi_k, k_vjp = _phi(seq.k, cfg, vjp_of == "k")
  C = cfg.chunk
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (C, C))
  visible = (iota(0) >= iota(1)) & (seq.doc[...] == seq.doc_row[...])
  # The last token's flag is loaded from the ref: a row slice of an in-register i1 mask would be a
  # sublane extract.
  chunk = _Chunk(phi_q, phi_k, seq.v[...], visible, seq.reads[...] != 0, seq.writes[...] != 0,
                 seq.reads[C - 1:, :] != 0)
  return chunk, q_vjp or k_vjp


def _masked(phi, mask):
  return tuple(jnp.where(mask, a, 0) for a in phi)


def _scores(x: _Chunk):
  """s_ij = Phi(q_i) · Phi(k_j) on visible pairs, else 0: fp32 [C, C]."""
  s = sum(pu.dot(a, b, trans_b=True) for a, b in zip(x.phi_q, x.phi_k))
  return jnp.where(x.visible, s, 0.0)


def _numerator(x: _Chunk, S):
  """N = s v + Phi(q) S (state term for tokens of the state's run), fp32 [C, BV]."""
  dt = x.v.dtype
  N = pu.dot(_scores(x).astype(dt), x.v)
  for a, S_p in zip(_masked(x.phi_q, x.reads), S):
    N += pu.dot(a, S_p.astype(dt))
  return N


def _advance(S, x: _Chunk):
  """S after the chunk: kept (or reset at a new run), plus its last run's Phi(k) vᵀ."""
  return tuple(jnp.where(x.keep, S_p, 0.0) + pu.dot(b, x.v, trans_a=True)
               for S_p, b in zip(S, _masked(x.phi_k, x.writes)))


def _retreat(dS, x: _Chunk, dN):
  """dS before the chunk from dS after it: kept (or cut at a new run), plus Phi(q) dNᵀ of the
  tokens that read the state."""
  return tuple(jnp.where(x.keep, dS_p, 0.0) + pu.dot(a, dN, trans_a=True)
               for dS_p, a in zip(dS, _masked(x.phi_q, x.reads)))


def _dA(x: _Chunk, dN):
  """dL/ds_ij = dN_i · v_j on visible pairs [C, C] (input dtype)."""
  return jnp.where(x.visible, pu.dot(dN, x.v, trans_b=True), 0.0).astype(x.v.dtype)


def _dphi_q(x: _Chunk, dN, S):
  """d Phi(q) [PAIRS x [C, Dp] fp32] from the intra-chunk block and the state at the start."""
  dt, dA = x.v.dtype, _dA(x, dN)
  return tuple(pu.dot(dA, b) + jnp.where(x.reads, pu.dot(dN, S_p.astype(dt), trans_b=True), 0.0)
               for b, S_p in zip(x.phi_k, S))


def _dphi_k(x: _Chunk, dN, dS):
  """d Phi(k) [PAIRS x [C, Dp] fp32] from later queries of the chunk and dS after it."""
  dt, dA = x.v.dtype, _dA(x, dN)
  return tuple(
      pu.dot(dA, a, trans_a=True)
      + jnp.where(x.writes, pu.dot(x.v, dS_p.astype(dt), trans_b=True), 0.0)
      for a, dS_p in zip(x.phi_q, dS))


def _dv(x: _Chunk, dN, dS):
  """dv [C, BV] fp32: sᵀ dN plus the last run's Phi(k) dS."""
  dt = x.v.dtype
  dv = pu.dot(_scores(x).astype(dt), dN, trans_a=True)
  for b, dS_p in zip(_masked(x.phi_k, x.writes), dS):
    dv += pu.dot(b, dS_p.astype(dt))
  return dv


def _tiles(S_ref):
  return tuple(S_ref[p] for p in range(PAIRS))


def _store(S_ref, S) -> None:
  for p in range(PAIRS):
    S_ref[p] = S[p]


def _first_step(carry_ref, init_ref) -> None:
  @pl.when(pl.program_id(2) == 0)
  def _():
    carry_ref[...] = init_ref[...]


def _last_step(out_ref, carry_ref) -> None:
  @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
  def _():
    out_ref[...] = carry_ref[...]


# Kernels. Grid (batch·head, value tile, chunk); the last ref is the fp32 VMEM state scratch.

def _split(refs):
  """The kernel's refs as (_Seq of the chunk inputs, the remaining refs)."""
  n_seq = len(_Seq._fields)
  return _Seq(*refs[:n_seq]), refs[n_seq:]


def _forward_kernel(*refs, cfg: KernelConfig):
  seq, (S0_ref, N_ref, ST_ref, S_ref) = _split(refs)
  _first_step(S_ref, S0_ref)
  x, _ = _load(seq, cfg)
  S = _tiles(S_ref)
  N_ref[...] = _numerator(x, S)
  _store(S_ref, _advance(S, x))
  _last_step(ST_ref, S_ref)


def _dq_kernel(*refs, cfg: KernelConfig):
  """Forward sweep: the gradients of q's factors through Phi(q) (partial over this value tile)."""
  seq, (S0_ref, dN_ref, dq_ref, S_ref) = _split(refs)
  _first_step(S_ref, S0_ref)
  x, q_vjp = _load(seq, cfg, vjp_of="q")
  S = _tiles(S_ref)
  _store_factors(dq_ref, q_vjp(_dphi_q(x, dN_ref[...], S)))
  _store(S_ref, _advance(S, x))


def _dkv_kernel(*refs, cfg: KernelConfig):
  """Reverse sweep: the gradients of k's factors through Phi(k) (partial), dv and dS_0, carrying dS."""
  seq, (dST_ref, dN_ref, dk_ref, dv_ref, dS0_ref, dS_ref) = _split(refs)
  _first_step(dS_ref, dST_ref)
  x, k_vjp = _load(seq, cfg, vjp_of="k")
  dN, dS = dN_ref[...], _tiles(dS_ref)
  _store_factors(dk_ref, k_vjp(_dphi_k(x, dN, dS)))
  dv_ref[...] = _dv(x, dN, dS).astype(dv_ref.dtype)
  _store(dS_ref, _retreat(dS, x, dN))
  _last_step(dS0_ref, dS_ref)


def _store_factors(ref, grads) -> None:
  for i, g in enumerate(grads):
    ref[i] = g.astype(ref.dtype)


class _Sweep(NamedTuple):
  """One pass over the chunks, forward or in reverse: the chunk inputs in ``_Seq`` order with
  their BlockSpecs, and the BlockSpecs of value-shaped [C, BV] blocks (N, dN, dv), of per-tile
  partial sums of the factors' gradients [3, C, Dp] and of the state [3, Dp, BV]."""

  args: list
  specs: list
  values: pl.BlockSpec
  partial: pl.BlockSpec
  state: pl.BlockSpec


def _sweep(fq, fk, v, docs: ChunkDocuments, cfg: KernelConfig, reverse: bool) -> _Sweep:
  BH, _, Tp, Dp = fq.shape
  C, BV, H = cfg.chunk, cfg.block_v, cfg.n_heads
  N = Tp // C
  chunk = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  factors = pl.BlockSpec((None, FACTORS, C, Dp), lambda bh, j, n: (bh, 0, chunk(n), 0))
  values = pl.BlockSpec((None, C, BV), lambda bh, j, n: (bh, chunk(n), j))
  column = pl.BlockSpec((None, C, 1), lambda bh, j, n: (bh // H, chunk(n), 0))
  row = pl.BlockSpec((None, 1, C), lambda bh, j, n: (bh // H, 0, chunk(n)))
  args = [fq, fk, v, docs.doc, docs.doc_row, docs.reads, docs.writes]
  specs = [factors, factors, values, column, row, column, column]
  return _Sweep(
      args, specs, values,
      partial=pl.BlockSpec((None, None, FACTORS, C, Dp), lambda bh, j, n: (j, bh, 0, chunk(n), 0)),
      state=pl.BlockSpec((None, PAIRS, Dp, BV), lambda bh, j, n: (bh, 0, 0, j)))


def _cost(kernel, cfg: KernelConfig, grid, specs, arrays) -> pl.CostEstimate:
  """``kernel``'s matmul FLOPs over ``grid`` (padded lanes and masked entries included) and the bytes
  its blocks move (``pu.pipeline_bytes`` of ``arrays``, inputs then outputs, in blocks ``specs``)."""
  C, BV, Dp = cfg.chunk, cfg.block_v, arrays[0].shape[-1]
  # One dot of each shape: a [C, C] block against Dp lanes, against BV values, and a state product.
  score, value, state = 2 * C * C * Dp, 2 * C * C * BV, 2 * C * Dp * BV
  per_step = {_forward_kernel: PAIRS * score + value + 2 * PAIRS * state,
              _dq_kernel: PAIRS * score + value + 2 * PAIRS * state,
              _dkv_kernel: 2 * PAIRS * score + 2 * value + 3 * PAIRS * state}[kernel]
  return pl.CostEstimate(flops=math.prod(grid) * per_step, transcendentals=0,
                         bytes_accessed=pu.pipeline_bytes(grid, specs, arrays))


def _call(kernel, cfg: KernelConfig, sweep: _Sweep, extra_args, extra_specs, out_specs,
          out_shape):
  """Runs ``kernel`` over (B·H, value tiles, chunks) with an fp32 [3, Dp, BV] VMEM scratch."""
  BH, _, Tp, Dp = sweep.args[0].shape
  n_tiles = sweep.args[2].shape[-1] // cfg.block_v
  grid, in_specs = (BH, n_tiles, Tp // cfg.chunk), sweep.specs + extra_specs
  cost = _cost(kernel, cfg, grid, in_specs + list(out_specs),
               [*sweep.args, *extra_args, *jax.tree.leaves(out_shape)])
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((PAIRS, Dp, cfg.block_v), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=cfg.interpret)(*sweep.args, *extra_args)


def _forward(fq, fk, v, docs, S0, cfg):
  """(N [B·H, Tp, Vp], S_T [B·H, 3, Dp, Vp]), fp32."""
  s = _sweep(fq, fk, v, docs, cfg, reverse=False)
  out_shape = (jax.ShapeDtypeStruct(v.shape, _F32), jax.ShapeDtypeStruct(S0.shape, _F32))
  return _call(_forward_kernel, cfg, s, [S0], [s.state], [s.values, s.state], out_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(fq, fk, v, docs, S0, cfg):
  """(N, S_T) of the factors fq, fk [B·H, 3, Tp, Dp], values v [B·H, Tp, Vp] (with the ones
  column), the document arrays and the initial state S0 [B·H, 3, Dp, Vp] (fp32)."""
  return _forward(fq, fk, v, docs, S0, cfg)


def _fused_fwd(fq, fk, v, docs, S0, cfg):
  return _forward(fq, fk, v, docs, S0, cfg), (fq, fk, v, docs, S0)


def _fused_bwd(cfg, residuals, cotangents):
  fq, fk, v, docs, S0 = residuals
  dN, dS_T = cotangents
  n_tiles = v.shape[-1] // cfg.block_v
  dN, dS_T = dN.astype(v.dtype), dS_T.astype(_F32)
  # One value tile: the factors' gradients are whole, written in their dtype (they are rounded to it
  # anyway); several are partial sums, added in fp32.
  partial = jax.ShapeDtypeStruct((n_tiles, *fq.shape), fq.dtype if n_tiles == 1 else _F32)
  s = _sweep(fq, fk, v, docs, cfg, reverse=False)
  dfq, = _call(_dq_kernel, cfg, s, [S0, dN], [s.state, s.values], [s.partial], (partial,))
  s = _sweep(fq, fk, v, docs, cfg, reverse=True)
  dfk, dv, dS0 = _call(
      _dkv_kernel, cfg, s, [dS_T, dN], [s.state, s.values], [s.partial, s.values, s.state],
      (partial, jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(S0.shape, _F32)))
  return (dfq.sum(0).astype(fq.dtype), dfk.sum(0).astype(fk.dtype), dv.astype(v.dtype), None, dS0)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check(chunk_size: int, block_v: int, compiled: bool, q, v, state) -> None:
  """Raises ValueError for block sizes the kernels (or, compiled, the TPU tiles) reject and for a
  state of the wrong shape."""
  if chunk_size < 1 or chunk_size & (chunk_size - 1):
    raise ValueError(f"sanatan_p1_tpu: chunk_size must be a power of two, got {chunk_size}")
  if compiled and block_v % LANES:
    raise ValueError(
        f"sanatan_p1_tpu: on TPU block_v must be a multiple of {LANES}, got {block_v}")
  B, T, H, d = q.shape
  expected = (B, H, CHANNELS * d, v.shape[-1])
  if state is not None and tuple(state.S.shape) != expected:
    raise ValueError(f"sanatan_p1_tpu: state.S has shape {tuple(state.S.shape)}, expected "
                     f"[B, H, 6d, dv] = {expected}")


def _twice(x_xd: jax.Array) -> jax.Array:
  """[..., d] -> [..., 2d]: every head dimension twice, [x | x] (one copy per W of ``_pairs``)."""
  return jnp.concatenate([x_xd, x_xd], axis=-1)


def _factors(u, omega, lam_raw, positions, *, rotate: bool, Tp: int, Dp: int):
  """The kernels' factors of raw u [B, T, H, d]: (cos th_rot, sin th_rot, r) by XLA in fp32
  (``base.rotated_angles_and_roots``), each lane-doubled, head-major and padded, [B·H, 3, Tp, Dp] in
  u's dtype."""
  theta_rot, r = rotated_angles_and_roots(u, omega, lam_raw, positions, rotate=rotate)
  parts = (jnp.cos(theta_rot), jnp.sin(theta_rot), r)
  return jnp.stack([heads_first(_twice(x).astype(u.dtype), Tp, Dp) for x in parts], axis=1)


def _to_kernel_state(state, B, H, d, V, Dp, Vp):
  """SanatanState's S [B, H, 6d, V] and z [B, H, 6d] (index 6a + c) -> the kernels' fp32
  [B·H, 3, Dp, Vp]: z as value column V; channel c = 3 h + p (h = 0: W = 1, h = 1: W = r) at
  row h d + a of tile p. Zeros for no state."""
  if state is None:
    return jnp.zeros((B * H, PAIRS, Dp, Vp), _F32)
  V1 = V + 1
  S = jnp.concatenate([state.S.astype(_F32), state.z.astype(_F32)[..., None]], axis=-1)
  S = S.reshape(B, H, d, 2, PAIRS, V1).transpose(0, 1, 4, 3, 2, 5).reshape(B * H, PAIRS, 2 * d, V1)
  return pu.pad_axis(pu.pad_axis(S, 2, Dp), 3, Vp)


def _from_kernel_state(S, B, H, d, V):
  """The inverse of ``_to_kernel_state``: (S [B, H, 6d, V], z [B, H, 6d])."""
  S = S[:, :, :, :2 * d, :V + 1].reshape(B, H, PAIRS, 2, d, V + 1).transpose(0, 1, 4, 3, 2, 5)
  S = S.reshape(B, H, CHANNELS * d, V + 1)
  return S[..., :V], S[..., V]


def sanatan_p1_tpu(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                   lam_raw: jax.Array, *, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None,
                   state: SanatanState | None = None, chunk_size: int = LANES,
                   rotate: bool = True, interpret: bool | pltpu.InterpretParams | None = None,
                   block_v: int = LANES) -> tuple[jax.Array, SanatanState]:
  """SANATAN p = 1, 6 channels (MATH §1.2) by the Mosaic TPU kernels; same function and results
  as ``sanatan_attention(..., p=1, channels=6)``.

  Args:
    q, k: raw [B, T, H, d] (already divided by sqrt(d)); v: [B, T, H, dv]; bf16 or fp32.
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1 offset by ``state.position``.
    segment_ids: optional [B, T] packed-document ids (api.py's convention).
    state: a SanatanState to continue from; None means zeros.
    chunk_size: tokens per chunk, a power of two; compiled, at least 128 are used.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    interpret: True (Pallas' generic interpreter), a ``pltpu.InterpretParams`` (the TPU
      simulator), False (compile; TPU only) or None (interpret unless on a TPU).
    block_v: value columns per grid step (dv + 1 with the normaliser column is padded to a
      multiple); compiled, a multiple of 128.

  Returns:
    o [B, T, H, dv] in v's dtype and the SanatanState after the last token (fp32 S, z).
  """
  interpret = pu.resolve_tpu_interpret(interpret, "sanatan_p1_tpu",
                                        "sanatan_attention(implementation='chunked')")
  _check(chunk_size, block_v, not interpret, q, v, state)
  B, T, H, d = q.shape
  V = v.shape[-1]
  if positions is None:
    positions = default_positions(B, T, None if state is None else state.position)
  C = chunk_size if interpret else max(chunk_size, LANES)
  Tp, Dp, Vp = pu.round_up(T, C), pu.round_up(2 * d, LANES), pu.round_up(V + 1, block_v)
  cfg = KernelConfig(chunk=C, block_v=block_v, head_dim=d, n_heads=H, interpret=interpret)
  factors = functools.partial(_factors, omega=omega, lam_raw=lam_raw, positions=positions, rotate=rotate,
                              Tp=Tp, Dp=Dp)
  v1 = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
  N, S = _fused(factors(q), factors(k), heads_first(v1, Tp, Vp),
                chunk_documents(document_index(segment_ids, B, T), Tp, C),
                _to_kernel_state(state, B, H, d, V, Dp, Vp), cfg)
  N_BxTxHxV = jnp.swapaxes(N.reshape(B, H, Tp, Vp)[:, :, :T, :V + 1], 1, 2)
  c_eps = features.score_scale(CHANNELS, "clean", d) * EPS
  o = N_BxTxHxV[..., :V] / (N_BxTxHxV[..., V:] + c_eps)
  S, z = _from_kernel_state(S.reshape(B, H, PAIRS, Dp, Vp), B, H, d, V)
  return o.astype(v.dtype), SanatanState(S, z, positions[:, -1].astype(jnp.int32) + 1)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """``chunk`` tokens per chunk (at least 128 when compiled), ``block_v`` value columns per grid step
  (a multiple of 128 when compiled)."""

  chunk: int = LANES
  block_v: int = LANES

  def __post_init__(self):
    check_power_of_two("pallas_tpu tiles", chunk=self.chunk, block_v=self.block_v)


class PallasTpu(Backend[MosaicTiles]):
  """The Mosaic TPU kernels as a backend (p = 1 with 6 channels; named, not "auto": no TPU has timed
  them), each device of the mesh in context on its own rows and heads (``shard_map.run_sharded``)."""

  platforms = MOSAIC_TPU
  tiles_type = MosaicTiles
  requirement = "p = 1 with 6 channels"

  def supports(self, problem: Problem) -> bool:
    return problem.constant_state

  def heuristic_config(self, problem: Problem) -> MosaicTiles:
    del problem
    return MosaicTiles()

  def flops_per_head(self, problem: Problem, tiles: MosaicTiles | None = None) -> float:
    chunk = self.config(problem, tiles).chunk
    if problem.platform == "tpu":
      chunk = max(chunk, LANES)
    return flops.chunked(problem.feature_dim, problem.value_dim + 1, chunk, problem.length or chunk)

  def __call__(self, q, k, v, omega, lam_raw, *, positions, segment_ids, state, tiles: MosaicTiles,
               options: Options):
    if options.precision != "input":
      raise ValueError(f"sanatan_attention: kernel_precision={options.precision!r} is for the GPU kernels; "
                       "the TPU kernels compute in the inputs' dtype: use kernel_precision='input', or "
                       "pass fp32 inputs")
    kernel = functools.partial(sanatan_p1_tpu, chunk_size=tiles.chunk, block_v=tiles.block_v,
                               rotate=options.rotate)
    inputs = dict(q=q, k=k, v=v, omega=omega, lam_raw=lam_raw, positions=positions,
                  segment_ids=segment_ids, state=state)
    return shard_map.run_sharded(kernel, inputs, KERNEL_LAYOUTS, ("BTH", STATE_LAYOUT))
