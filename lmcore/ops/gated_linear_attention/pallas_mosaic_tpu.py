"""Pallas (Mosaic TPU) kernels for chunked gated linear attention (MATH §3, §4), with a custom VJP.

xla.py's function, per head, with b the chunk-local cumulative log gate::

    o_i     = scale * [(q_i ⊙ exp(b_i)) S_n  +  sum_{j<=i} (sum_k q_ik k_jk exp(b_ik - b_jk)) v_j]
    S_{n+1} = diag(exp(b_C)) S_n + sum_j (k_j ⊙ exp(b_C - b_j)) v_jᵀ

A TPU core runs grid steps in order, so the grid is (batch·head, value tile, chunk), the chunk axis
last and "arbitrary", and the fp32 state tile is carried in VMEM scratch from chunk to chunk. The
state is kept transposed, Sᵀ [BV, K], so that gate vectors are rows over the key lanes as in q and k.
Arrays are head-major [B·H, T, ·]: T padded to whole chunks, K and V to multiples of 128 lanes
(zeros); compiled chunks hold at least 128 tokens so that [C, C] and [1, C] blocks fill whole lanes.
Mosaic has no cumulative sum: b is computed outside. A scalar gate makes the intra-chunk scores one
matmul times exp(b_i - b_j) (b passed as a column and a row); a per-key-channel gate uses secondary
chunking (earlier keys by one anchored matmul, keys inside the sub-chunk exactly in fp32, one at a
time). Exponents are masked to -inf before ``exp``; documents as in pallas_triton.py.

Backward: the forward saves its inputs and final state. A forward sweep recomputes the states for dq;
a reverse sweep carries dSᵀ in VMEM for dk, dv and dS_0; dg is ``base.gate_grad``. Several value
tiles give partial dq, dk summed outside.
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

from lmcore.ops.common import shard_map
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.backend import MOSAIC_TPU, Backend, check_power_of_two
from lmcore.ops.common.segments import ChunkDocuments, chunk_documents
from lmcore.ops.gated_linear_attention.base import (KERNEL_LAYOUTS, OP, Options, Problem, chunked_flops,
                                                    gate_grad, kernel_inputs, pad_inputs)

LANES, SUBLANES = pu.TPU_LANES, pu.TPU_SUBLANES
SUB_CHUNK = 16
_F32 = jnp.float32


class KernelConfig(NamedTuple):
  """Static kernel parameters (they key the compiled kernels); ``n_heads`` maps a batch·head row to
  its batch row's document arrays."""

  chunk: int
  sub_chunk: int
  block_v: int
  n_heads: int
  scalar_gate: bool
  scale: float
  interpret: Any
  split: bool


class _Seq(NamedTuple):
  """One chunk's input blocks (refs): head-major sequences and per-batch-row document arrays."""

  q: Any  # [C, Kp] input dtype
  k: Any  # [C, Kp]
  v: Any  # [C, BV]
  b: Any  # [C, G] fp32 chunk-local cumulative log gate
  doc: Any  # [C, 1] int32 document index
  doc_row: Any  # [1, C] int32, the same as a row
  reads: Any  # [C, 1] int32: 1 where the token is in the document of the state entering the chunk
  writes: Any  # [C, 1] int32: 1 where the token is in the chunk's last document
  b_row: Any  # [1, C] fp32, b as a row (scalar gate), else None


class _Chunk(NamedTuple):
  """One chunk as loaded in a kernel."""

  q: jax.Array  # [C, Kp] input dtype
  k: jax.Array  # [C, Kp]
  v: jax.Array  # [C, BV]
  b: jax.Array  # [C, G] fp32
  b_row: jax.Array | None  # [1, C] fp32 (scalar gate)
  doc: jax.Array  # [C, 1] int32
  doc_row: jax.Array  # [1, C] int32
  reads: jax.Array  # [C, 1] bool
  writes: jax.Array  # [C, 1] bool
  do: jax.Array | None  # [C, BV] scale * dL/do in the input dtype (backward only)


def _split(refs, cfg: KernelConfig):
  """The kernel's refs as (_Seq of the chunk inputs, the remaining refs)."""
  n_seq = len(_Seq._fields) - (0 if cfg.scalar_gate else 1)
  seq = _Seq(*refs[:n_seq], *([] if cfg.scalar_gate else [None]))
  return seq, refs[n_seq:]


def _load(seq: _Seq, do_ref=None) -> _Chunk:
  return _Chunk(seq.q[...], seq.k[...], seq.v[...], seq.b[...],
                None if seq.b_row is None else seq.b_row[...], seq.doc[...], seq.doc_row[...],
                seq.reads[...] != 0, seq.writes[...] != 0, None if do_ref is None else do_ref[...])


def _iota(shape, axis):
  return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _visible_rows(doc_rows, start: int, doc_row):
  """[c, C] bool: query i (c rows from ``start``, documents ``doc_rows`` [c, 1]) sees key j of the
  chunk (documents ``doc_row`` [1, C]): j <= i and the same document."""
  rows, C = doc_rows.shape[0], doc_row.shape[1]
  causal = start + _iota((rows, C), 0) >= _iota((rows, C), 1)
  return causal & (doc_rows == doc_row)


def _b_end(ch: _Chunk):
  """The chunk's total log gate [1, G]."""
  return ch.b[-1:]


def _q_from_state(ch: _Chunk):
  """q ⊙ exp(b) for tokens still in the state's document, else 0 (fp32) [C, Kp]."""
  return jnp.where(ch.reads, ch.q.astype(_F32) * jnp.exp(ch.b), 0.0)


def _k_to_end(ch: _Chunk):
  """k ⊙ exp(b_C - b) for tokens of the chunk's last document, else 0 (fp32) [C, Kp]."""
  return jnp.where(ch.writes, ch.k.astype(_F32) * jnp.exp(_b_end(ch) - ch.b), 0.0)


def _decayed(S_T, ch: _Chunk):
  """diag(exp(b_C)) S, transposed [BV, Kp]; zero when a document starts inside the chunk."""
  return jnp.where(ch.reads[-1:], S_T * jnp.exp(_b_end(ch)), 0.0)


def _advance(S_T, ch: _Chunk, split: bool):
  """Sᵀ after the chunk: decay (or reset at a new document), then add its last document's writes."""
  return _decayed(S_T, ch) + pu.split_dot(ch.v, _k_to_end(ch), ch.v.dtype, split, trans_a=True)


def _retreat(dS_T, ch: _Chunk, split: bool):
  """dSᵀ before the chunk from dSᵀ after it: the decay's transpose plus the chunk's state reads."""
  return _decayed(dS_T, ch) + pu.split_dot(ch.do, _q_from_state(ch), ch.do.dtype, split, trans_a=True)


# Scalar gate: one decay matrix.

def _scalar_decay(ch: _Chunk):
  """exp(b_i - b_j) on visible pairs, else 0: [C, C] fp32."""
  visible = _visible_rows(ch.doc, 0, ch.doc_row)
  return jnp.exp(jnp.where(visible, ch.b - ch.b_row, -jnp.inf))


def _scores_scalar(ch: _Chunk, cfg: KernelConfig):
  return pu.dot(ch.q, ch.k, trans_b=True) * _scalar_decay(ch)


def _dA_scalar(ch: _Chunk):
  """(do_i · v_j) exp(b_i - b_j) on visible pairs [C, C] (input dtype)."""
  return (pu.dot(ch.do, ch.v, trans_b=True) * _scalar_decay(ch)).astype(ch.q.dtype)


def _dq_intra_scalar(ch: _Chunk, cfg: KernelConfig):
  return pu.dot(_dA_scalar(ch), ch.k)


def _dk_intra_scalar(ch: _Chunk, cfg: KernelConfig):
  return pu.dot(_dA_scalar(ch), ch.q, trans_a=True)


# Per-key-channel gate: secondary chunking.

class _Sub(NamedTuple):
  """Query rows start : start + c of a chunk and their factors around the anchor r = b_{start-1}."""

  start: int
  q: jax.Array  # [c, Kp] fp32
  b: jax.Array  # [c, Kp] fp32
  doc: jax.Array  # [c, 1] int32
  do: jax.Array | None  # [c, BV] input dtype
  to_anchor: jax.Array  # [c, Kp] fp32: exp(b - r)
  from_anchor: jax.Array  # [C, Kp] fp32: exp(r - b_j) for keys j before the sub-chunk, else 0

  def q_anchored(self, dtype):
    return (self.q * self.to_anchor).astype(dtype)


def _subs(ch: _Chunk, c: int) -> list[_Sub]:
  C, Kp = ch.q.shape
  q32 = ch.q.astype(_F32)
  before_start = lambda start: _iota((C, 1), 0) < start
  subs = []
  for start in range(0, C, c):
    rows = slice(start, start + c)
    anchor = ch.b[start - 1:start] if start else jnp.zeros((1, Kp), _F32)
    from_anchor = jnp.exp(jnp.where(before_start(start), anchor - ch.b, -jnp.inf))
    subs.append(_Sub(start, q32[rows], ch.b[rows], ch.doc[rows],
                     None if ch.do is None else ch.do[rows], jnp.exp(ch.b[rows] - anchor),
                     from_anchor))
  return subs


def _diag_decay(x: _Sub, ch: _Chunk, j: int):
  """[c, Kp]: exp(b_i - b_j) for the sub-chunk's rows i that see key j (i >= j, same document)."""
  sees = (x.start + _iota((x.q.shape[0], 1), 0) >= j) & (x.doc == ch.doc[j:j + 1])
  return jnp.exp(jnp.where(sees, x.b - ch.b[j:j + 1], -jnp.inf))


def _diag_dA(x: _Sub, v32, j: int):
  """do_i · v_j for the sub-chunk's rows [c, 1] fp32 (masked later by ``_diag_decay``)."""
  return jnp.sum(x.do.astype(_F32) * v32[j:j + 1], axis=1, keepdims=True)


def _off_dA(x: _Sub, ch: _Chunk):
  """do_i · v_j on the sub-chunk's visible pairs [c, C] (input dtype)."""
  visible = _visible_rows(x.doc, x.start, ch.doc_row)
  return jnp.where(visible, pu.dot(x.do, ch.v, trans_b=True), 0.0).astype(ch.q.dtype)


def _scores_channel(ch: _Chunk, cfg: KernelConfig):
  """A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) on visible pairs, fp32 [C, C]."""
  dt = ch.q.dtype
  k32 = ch.k.astype(_F32)
  blocks = []
  for x in _subs(ch, cfg.sub_chunk):
    A = pu.dot(x.q_anchored(dt), (k32 * x.from_anchor).astype(dt), trans_b=True)
    column = _iota(A.shape, 1)
    for j in range(x.start, x.start + cfg.sub_chunk):
      a_j = jnp.sum(x.q * k32[j:j + 1] * _diag_decay(x, ch, j), axis=1, keepdims=True)
      A = jnp.where(column == j, a_j, A)
    blocks.append(jnp.where(_visible_rows(x.doc, x.start, ch.doc_row), A, 0.0))
  return jnp.concatenate(blocks, axis=0)


def _dq_intra_channel(ch: _Chunk, cfg: KernelConfig):
  dt = ch.q.dtype
  k32, v32 = ch.k.astype(_F32), ch.v.astype(_F32)
  blocks = []
  for x in _subs(ch, cfg.sub_chunk):
    dq = pu.dot(_off_dA(x, ch), (k32 * x.from_anchor).astype(dt)) * x.to_anchor
    for j in range(x.start, x.start + cfg.sub_chunk):
      dq += _diag_dA(x, v32, j) * k32[j:j + 1] * _diag_decay(x, ch, j)
    blocks.append(dq)
  return jnp.concatenate(blocks, axis=0)


def _dk_intra_channel(ch: _Chunk, cfg: KernelConfig):
  dt, c = ch.q.dtype, cfg.sub_chunk
  v32 = ch.v.astype(_F32)
  dk = jnp.zeros(ch.k.shape, _F32)
  diagonal = []
  for x in _subs(ch, c):
    dk += pu.dot(_off_dA(x, ch), x.q_anchored(dt), trans_a=True) * x.from_anchor
    block = jnp.zeros(x.q.shape, _F32)
    for j in range(x.start, x.start + c):
      row = jnp.sum(_diag_dA(x, v32, j) * x.q * _diag_decay(x, ch, j), axis=0, keepdims=True)
      block = jnp.where(_iota((c, 1), 0) == j - x.start, row, block)
    diagonal.append(block)
  return dk + jnp.concatenate(diagonal, axis=0)


def _intra(cfg: KernelConfig):
  """(scores, dq_intra, dk_intra) for the config's gate shape."""
  if cfg.scalar_gate:
    return _scores_scalar, _dq_intra_scalar, _dk_intra_scalar
  return _scores_channel, _dq_intra_channel, _dk_intra_channel


# Kernels. Grid (batch·head, value tile, chunk); the last ref is the fp32 VMEM state scratch.

def _forward_kernel(*refs, cfg: KernelConfig):
  seq, (S0_ref, o_ref, ST_ref, S_ref) = _split(refs, cfg)
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    S_ref[...] = S0_ref[...]

  ch = _load(seq)
  S_T = S_ref[...]
  scores, _, _ = _intra(cfg)
  o = (pu.dot(_q_from_state(ch).astype(ch.q.dtype), S_T.astype(ch.q.dtype), trans_b=True)
       + pu.dot(scores(ch, cfg).astype(ch.v.dtype), ch.v))
  o_ref[...] = cfg.scale * o
  S_ref[...] = _advance(S_T, ch, split=False)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    ST_ref[...] = S_ref[...]


def _dq_kernel(*refs, cfg: KernelConfig):
  """Forward sweep: dq (partial over this value tile) from the recomputed chunk states."""
  seq, (S0_ref, do_ref, dq_ref, S_ref) = _split(refs, cfg)

  @pl.when(pl.program_id(2) == 0)
  def _():
    S_ref[...] = S0_ref[...]

  ch = _load(seq, do_ref)
  S_T = S_ref[...]
  _, dq_intra, _ = _intra(cfg)
  from_state = pu.split_dot(ch.do, S_T, ch.do.dtype, cfg.split) * jnp.exp(ch.b)
  dq_ref[...] = jnp.where(ch.reads, from_state, 0.0) + dq_intra(ch, cfg)
  S_ref[...] = _advance(S_T, ch, cfg.split)


def _dkv_kernel(*refs, cfg: KernelConfig):
  """Reverse sweep: dk (partial over this value tile), dv and dS_0, carrying dSᵀ."""
  seq, (dST_ref, do_ref, dk_ref, dv_ref, dS0_ref, dS_ref) = _split(refs, cfg)
  m = pl.program_id(2)

  @pl.when(m == 0)
  def _():
    dS_ref[...] = dST_ref[...]

  ch = _load(seq, do_ref)
  dS_T = dS_ref[...]
  dt = ch.q.dtype
  scores, _, dk_intra = _intra(cfg)
  dv_ref[...] = (pu.split_dot(_k_to_end(ch), dS_T, dt, cfg.split, trans_b=True)
                 + pu.dot(scores(ch, cfg).astype(dt), ch.do, trans_a=True))
  to_end = pu.split_dot(ch.v, dS_T, dt, cfg.split) * jnp.exp(_b_end(ch) - ch.b)
  dk_ref[...] = jnp.where(ch.writes, to_end, 0.0) + dk_intra(ch, cfg)
  dS_ref[...] = _retreat(dS_T, ch, cfg.split)

  @pl.when(m == pl.num_programs(2) - 1)
  def _():
    dS0_ref[...] = dS_ref[...]


def _local_cumsum(g, C: int):
  """b: the cumulative sum of g inside each chunk of C tokens, fp32 [BH, Tp, G]."""
  BH, Tp, G = g.shape
  return jnp.cumsum(g.reshape(BH, Tp // C, C, G), axis=2).reshape(BH, Tp, G)


class _Sweep(NamedTuple):
  """One pass over the chunks, forward or in reverse: the chunk inputs in ``_Seq`` order with
  their BlockSpecs, and the BlockSpecs of value-shaped [C, BV] blocks (o, do, dv), of per-value-tile
  partial sums [C, Kp] (dq, dk) and of the state tile [BV, Kp]."""

  args: list
  specs: list
  values: pl.BlockSpec
  partial: pl.BlockSpec
  state: pl.BlockSpec


def _sweep(q, k, v, g, docs: ChunkDocuments, cfg: KernelConfig, reverse: bool) -> _Sweep:
  BH, Tp, Kp = q.shape
  C, BV, H = cfg.chunk, cfg.block_v, cfg.n_heads
  N = Tp // C
  chunk = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  seq = lambda width: pl.BlockSpec((None, C, width), lambda bh, j, n: (bh, chunk(n), 0))
  values = pl.BlockSpec((None, C, BV), lambda bh, j, n: (bh, chunk(n), j))
  column = pl.BlockSpec((None, C, 1), lambda bh, j, n: (bh // H, chunk(n), 0))
  row = pl.BlockSpec((None, 1, C), lambda bh, j, n: (bh // H, 0, chunk(n)))
  b = _local_cumsum(g, C)
  args = [q, k, v, b, docs.doc, docs.doc_row, docs.reads, docs.writes]
  specs = [seq(Kp), seq(Kp), values, seq(b.shape[-1]), column, row, column, column]
  if cfg.scalar_gate:
    args.append(b.reshape(BH, 1, Tp))
    specs.append(pl.BlockSpec((None, 1, C), lambda bh, j, n: (bh, 0, chunk(n))))
  partial = pl.BlockSpec((None, None, C, Kp), lambda bh, j, n: (j, bh, chunk(n), 0))
  state = pl.BlockSpec((None, BV, Kp), lambda bh, j, n: (bh, j, 0))
  return _Sweep(args, specs, values, partial, state)


def _cost(kernel, cfg: KernelConfig, grid, specs, arrays) -> pl.CostEstimate:
  """``kernel``'s matmul FLOPs over ``grid`` (padded lanes and masked entries included; not the
  per-channel gate's exact diagonal blocks, which are elementwise), its exponentials and the bytes
  its blocks move (``pu.pipeline_bytes`` of ``arrays``, inputs then outputs, in blocks ``specs``)."""
  C, c, BV, Kp = cfg.chunk, cfg.sub_chunk, cfg.block_v, arrays[0].shape[-1]
  # One dot of each shape: a [C, C] block against Kp lanes, against BV values, and a state product;
  # the backward's state products in two parts (``cfg.split``, inputs below fp32) are two dots each,
  # three for dv's (both operands split).
  score, value, state = 2 * C * C * Kp, 2 * C * C * BV, 2 * C * Kp * BV
  split = cfg.split and arrays[0].dtype != _F32
  per_step = {_forward_kernel: score + value + 2 * state,
              _dq_kernel: score + value + (4 if split else 2) * state,
              _dkv_kernel: 2 * score + 2 * value + (7 if split else 3) * state}[kernel]
  # exp of the gates per token (one per lane with per-channel gates), and of the intra-chunk decays:
  # a [C, C] matrix, or per sub-chunk the anchored factors of the chunk and its exact diagonal.
  per_token = C * (1 if cfg.scalar_gate else Kp)
  intra = C * C if cfg.scalar_gate else (C // c) * (C + c + c * c) * Kp
  exps = {_forward_kernel: 2 * per_token + intra, _dq_kernel: 2 * per_token + intra,
          _dkv_kernel: 3 * per_token + 2 * intra}[kernel]
  steps = math.prod(grid)
  return pl.CostEstimate(flops=steps * per_step, transcendentals=steps * exps,
                         bytes_accessed=pu.pipeline_bytes(grid, specs, arrays))


def _call(kernel, cfg: KernelConfig, sweep: _Sweep, extra_args, extra_specs, out_specs,
          out_shape):
  """Runs ``kernel`` over the grid (B·H, value tiles, chunks) with an fp32 [BV, Kp] VMEM scratch."""
  BH, Tp, Kp = sweep.args[0].shape
  n_tiles = sweep.args[2].shape[-1] // cfg.block_v
  grid, in_specs = (BH, n_tiles, Tp // cfg.chunk), sweep.specs + extra_specs
  out_list = list(out_specs) if isinstance(out_specs, (list, tuple)) else [out_specs]
  cost = _cost(kernel, cfg, grid, in_specs + out_list,
               [*sweep.args, *extra_args, *jax.tree.leaves(out_shape)])
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((cfg.block_v, Kp), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=cfg.interpret)(*sweep.args, *extra_args)


def _forward(q, k, v, g, docs, S0_T, cfg):
  s = _sweep(q, k, v, g, docs, cfg, reverse=False)
  out_shape = (jax.ShapeDtypeStruct(v.shape, _F32), jax.ShapeDtypeStruct(S0_T.shape, _F32))
  return _call(_forward_kernel, cfg, s, [S0_T], [s.state], [s.values, s.state], out_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused(q, k, v, g, docs, S0_T, cfg):
  return _forward(q, k, v, g, docs, S0_T, cfg)


def _fused_fwd(q, k, v, g, docs, S0_T, cfg):
  o, S_end_T = _forward(q, k, v, g, docs, S0_T, cfg)
  return (o, S_end_T), (q, k, v, g, docs, S0_T, S_end_T)


def _fused_bwd(cfg, residuals, cotangents):
  q, k, v, g, docs, S0_T, S_end_T = residuals
  do, dS_end_T = cotangents
  n_tiles = v.shape[-1] // cfg.block_v
  do = (cfg.scale * do).astype(v.dtype)
  dS_end_T = dS_end_T.astype(_F32)
  partial = jax.ShapeDtypeStruct((n_tiles, *q.shape), _F32)
  s = _sweep(q, k, v, g, docs, cfg, reverse=False)
  dq = _call(_dq_kernel, cfg, s, [S0_T, do], [s.state, s.values], s.partial, partial)
  s = _sweep(q, k, v, g, docs, cfg, reverse=True)
  dk, dv, dS0_T = _call(
      _dkv_kernel, cfg, s, [dS_end_T, do], [s.state, s.values], [s.partial, s.values, s.state],
      (partial, jax.ShapeDtypeStruct(v.shape, _F32), jax.ShapeDtypeStruct(S0_T.shape, _F32)))
  dq, dk = dq.sum(0), dk.sum(0)
  dg = gate_grad(q, k, dq, dk, jnp.sum(S_end_T * dS_end_T, axis=1), g.shape[-1])
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg, None, dS0_T


_fused.defvjp(_fused_fwd, _fused_bwd)


def chunked(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, *, scale: float, doc_BxT,
            chunk_size: int = 64, interpret: bool | pltpu.InterpretParams | None = None,
            block_v: int = LANES, sub_chunk: int = SUB_CHUNK, split: bool = True):
  """The backend contract of ``base`` by the kernels. Compiled, chunks hold max(chunk_size, 128)
  tokens and ``block_v`` is a multiple of 128; interpreted (``interpret=True``, a
  ``pltpu.InterpretParams``, or None off TPU) any powers of two run. ``split``: the backward's state
  dots in two parts (``pallas_utils.split_dot``)."""
  interpret = pu.resolve_tpu_interpret(interpret, OP, "implementation='chunked'")
  check_power_of_two(OP, chunk_size=chunk_size, sub_chunk=sub_chunk)
  if not interpret and (block_v % LANES or sub_chunk % SUBLANES):
    raise ValueError(f"gated_linear_attention: on TPU block_v must be a multiple of {LANES} and "
                     f"sub_chunk of {SUBLANES}, got block_v={block_v}, sub_chunk={sub_chunk}")
  B, T, H, K = q_BxTxHxK.shape
  V, G = v_BxTxHxV.shape[-1], g_BxTxHxG.shape[-1]
  C = chunk_size if interpret else max(chunk_size, LANES)
  Tp, Kp, Vp = pu.round_up(T, C), pu.round_up(K, LANES), pu.round_up(V, block_v)
  cfg = KernelConfig(chunk=C, sub_chunk=min(sub_chunk, C), block_v=block_v, n_heads=H,
                     scalar_gate=G == 1, scale=float(scale), interpret=interpret, split=split)
  q, k, v, g, S0 = pad_inputs(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, Tp, Kp, Vp)
  heads = lambda x: jnp.swapaxes(x, 1, 2).reshape(B * H, Tp, x.shape[-1])
  S0_T = jnp.swapaxes(S0, 2, 3).reshape(B * H, Vp, Kp)
  o, S_T = _fused(heads(q), heads(k), heads(v), heads(g), chunk_documents(doc_BxT, Tp, C), S0_T, cfg)
  o_BxTxHxV = jnp.swapaxes(o.reshape(B, H, Tp, Vp)[:, :, :T, :V], 1, 2)
  return o_BxTxHxV, jnp.swapaxes(S_T.reshape(B, H, Vp, Kp)[:, :, :V, :K], 2, 3)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """Tokens per chunk (>= 128 compiled) and per diagonal block (per-key-channel gates), value columns
  per grid step (a multiple of 128 compiled)."""

  chunk: int = 64
  sub_chunk: int = SUB_CHUNK
  block_v: int = LANES

  def __post_init__(self):
    check_power_of_two("gated_linear_attention tiles", chunk=self.chunk, sub_chunk=self.sub_chunk,
                       block_v=self.block_v)


class PallasMosaicTpu(Backend[MosaicTiles]):
  """The Mosaic kernels (named, not "auto": no TPU has timed them), each device of the mesh on its own
  rows and heads (``shard_map``)."""

  platforms = MOSAIC_TPU
  tiles_type = MosaicTiles

  def heuristic_config(self, problem: Problem) -> MosaicTiles:
    del problem
    return MosaicTiles()

  def flops_per_head(self, problem: Problem, tiles: MosaicTiles | None = None) -> float:
    chunk = self.config(problem, tiles).chunk
    return chunked_flops(problem, max(chunk, LANES) if problem.platform == "tpu" else chunk)

  def __call__(self, q, k, v, g, S0, *, scale: float, doc_BxT, tiles: MosaicTiles, options: Options):
    pu.check_tpu_precision(options.precision, OP)
    kernel = functools.partial(chunked, scale=scale, chunk_size=tiles.chunk, sub_chunk=tiles.sub_chunk,
                               block_v=tiles.block_v, split=options.split_state)
    return shard_map.run_sharded(kernel, kernel_inputs(q, k, v, g, S0, doc_BxT), KERNEL_LAYOUTS,
                                 ("BTH", "BH"))
