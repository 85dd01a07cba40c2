"""Pallas (Triton) kernels for chunked gated linear attention (MATH §3, §4), with a custom VJP.

xla.py's function, per head, with b the chunk-local cumulative log gate and a_n = exp(b_C)::

    o_i     = scale * [(q_i ⊙ exp(b_i)) S_n  +  sum_{j<=i} (sum_k q_ik k_jk exp(b_ik - b_jk)) v_j]
    S_{n+1} = diag(a_n) S_n + W_n,     W_n = sum_j (k_j ⊙ exp(b_C - b_j)) v_jᵀ

in FLA's three phases, over the grid (batch, head, chunk, value tile): (1) every chunk's W_n [K, V]
fp32; (2) ``chunk_scan`` hands on every S_n in the inputs' dtype; (3) each chunk's outputs from S_n
and its intra-chunk block. Phases 1 and 3 run all chunks in parallel (the GPU fills at small B·H).
A per-key-channel gate uses xla.py's secondary chunking around the anchor r = b just before the
query sub-chunk. Exponents are <= 0 (masked to -inf before ``exp``). Documents (``doc_BxT``): a token
reads S_n only in the state's document; a chunk hands on only its last document's writes (a_n = 0
when a document starts inside it).

Backward: the forward saves its inputs only. One kernel writes W_n and R_n = sum_i (q_i ⊙ exp(b_i))
do_iᵀ (over the tokens reading S_n), two chunk scans give S_n and dS_n = diag(a_n) dS_{n+1} + R_n, one
kernel takes dq (from S_n), dk and dv (from dS_{n+1}); the state dots take fp32 operands in two bf16
parts (``pallas_utils.split_dot``); dg is ``base.gate_grad``. Several value tiles give partial dq, dk
summed outside. Default tiles: docs/BENCHMARKS.md, Gated linear attention kernel tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.ops.common import chunk_scan, shard_map
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.backend import TRITON, Backend, check_power_of_two
from lmcore.ops.gated_linear_attention.base import (KERNEL_LAYOUTS, OP, Options, Problem, chunked_flops,
                                                    gate_grad, kernel_inputs, pad_inputs)

CHUNK = 16
SUB_CHUNK = 16
# The widest heads "auto" gives these kernels (docs/BENCHMARKS.md, Gated linear attention heads).
MAX_KEY, MAX_VALUE = 128, 256
_F32 = jnp.float32


class KernelConfig(NamedTuple):
  """Static kernel parameters (they key the compiled kernels); ``sub_chunk`` is C for a scalar gate."""

  chunk: int
  sub_chunk: int
  block_v: int
  scale: float
  interpret: bool
  num_warps: int
  num_stages: int
  scan: str
  precision: str
  split: bool


class _Sub(NamedTuple):
  """One sub-chunk as loaded in a kernel: inputs, cumulative gate ``b`` and its anchor."""

  q: jax.Array  # [c, K] input dtype
  k: jax.Array  # [c, K]
  v: jax.Array  # [c, BV]
  b: jax.Array  # [c, G] fp32, chunk-local cumulative log gate
  anchor: jax.Array  # [1, G] fp32, b just before the sub-chunk (its off-diagonal reference)
  doc: jax.Array  # [c] int32
  do: jax.Array | None  # [c, BV] scale * dL/do (backward only)


def _load_chunk(refs, cfg: KernelConfig, do_ref=None):
  """Sub-chunks of the program's chunk of refs (q or None, k, v, g, doc), its total log gate [1, G]
  and its last document."""
  q_ref, k_ref, v_ref, g_ref, doc_ref = refs
  c = cfg.sub_chunk
  anchor = jnp.zeros((1, g_ref.shape[-1]), _F32)
  subs = []
  for i in range(cfg.chunk // c):
    start = i * c
    g = pu.rows(g_ref, start, c).astype(_F32)
    do = None
    if do_ref is not None:
      do = (cfg.scale * pu.rows(do_ref, start, c)).astype(v_ref.dtype)
    q = None if q_ref is None else pu.rows(q_ref, start, c)
    subs.append(_Sub(q, pu.rows(k_ref, start, c), pu.rows(v_ref, start, c),
                     anchor + jnp.cumsum(g, axis=0), anchor, pu.rows(doc_ref, start, c), do))
    anchor = anchor + jnp.sum(g, axis=0, keepdims=True)
  last_doc = functools.reduce(jnp.maximum, [jnp.max(s.doc) for s in subs])
  return subs, anchor, last_doc


def _visible(doc_i, doc_j, causal: bool):
  """[c, c] bool: key j is in query i's document (and j <= i on a diagonal block)."""
  same = doc_i[:, None] == doc_j[None, :]
  if not causal:
    return same
  c = doc_i.shape[0]
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (c, c))
  return same & (iota(0) >= iota(1))


def _off_factors(x: _Sub, y: _Sub):
  """q_x ⊙ exp(b_x - r_x) and k_y ⊙ exp(r_x - b_y) (r_x: x's anchor), key sub-chunk y before x."""
  dt = x.q.dtype
  q_t = (x.q.astype(_F32) * jnp.exp(x.b - x.anchor)).astype(dt)
  k_t = (y.k.astype(_F32) * jnp.exp(x.anchor - y.b)).astype(dt)
  return q_t, k_t


def _diag_decay(x: _Sub, visible):
  """exp(b_i - b_j) on visible pairs, else 0: [c, c] (scalar gate) or [c, c, K] (per channel)."""
  if x.b.shape[-1] == 1:
    return jnp.exp(jnp.where(visible, x.b - x.b.reshape(1, -1), -jnp.inf))
  diff = x.b[:, None, :] - x.b[None, :, :]
  return jnp.exp(jnp.where(visible[:, :, None], diff, -jnp.inf))


def _diag_scores(x: _Sub, decay):
  """A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) inside one sub-chunk, fp32 [c, c]."""
  if decay.ndim == 2:
    return pu.dot(x.q, x.k, trans_b=True) * decay
  return jnp.sum(x.q.astype(_F32)[:, None, :] * x.k.astype(_F32)[None, :, :] * decay, axis=2)


def _off_scores(x: _Sub, y: _Sub):
  q_t, k_t = _off_factors(x, y)
  return jnp.where(_visible(x.doc, y.doc, False), pu.dot(q_t, k_t, trans_b=True), 0.0)


def _q_from_state(x: _Sub, state_doc):
  """q ⊙ exp(b) for tokens still in the state's document, else 0 (fp32)."""
  reads = (x.doc == state_doc)[:, None]
  return jnp.where(reads, x.q.astype(_F32) * jnp.exp(x.b), 0.0)


def _k_to_end(x: _Sub, b_end, last_doc):
  """k ⊙ exp(b_C - b) for tokens of the chunk's last document, else 0 (fp32)."""
  writes = (x.doc == last_doc)[:, None]
  return jnp.where(writes, x.k.astype(_F32) * jnp.exp(b_end - x.b), 0.0)


def _writes(subs, b_end, last_doc, split: bool):
  """W_n = sum_j (k_j ⊙ exp(b_C - b_j)) v_jᵀ over the chunk's last document: fp32 [K, BV]."""
  return sum(pu.split_dot(_k_to_end(x, b_end, last_doc), x.v, x.v.dtype, split, trans_a=True)
             for x in subs)


def _reads_grad(subs, state_doc, split: bool):
  """R_n = sum_i (q_i ⊙ exp(b_i)) do_iᵀ over the tokens reading S_n (do scaled): fp32 [K, BV]."""
  return sum(pu.split_dot(_q_from_state(x, state_doc), x.do, x.do.dtype, split, trans_a=True)
             for x in subs)


def _chunk_outputs(subs, S, state_doc):
  """Unscaled outputs [c, BV] fp32 per sub-chunk: the read of S_n plus the intra-chunk block."""
  dt = subs[0].v.dtype
  out = []
  for i, x in enumerate(subs):
    o = pu.dot(_q_from_state(x, state_doc).astype(dt), S.astype(dt))
    for y in subs[:i]:
      o += pu.dot(_off_scores(x, y).astype(dt), y.v)
    decay = _diag_decay(x, _visible(x.doc, x.doc, True))
    o += pu.dot(_diag_scores(x, decay).astype(dt), x.v)
    out.append(o)
  return out


def _dq_chunk(subs, S, state_doc, split: bool):
  """dq of one chunk from scale * do, the state at the chunk start and the intra-chunk scores."""
  dt = subs[0].q.dtype
  out = []
  for i, x in enumerate(subs):
    reads = (x.doc == state_doc)[:, None]
    dq = jnp.where(reads, pu.split_dot(x.do, S, dt, split, trans_b=True) * jnp.exp(x.b), 0.0)
    for y in subs[:i]:
      dA = jnp.where(_visible(x.doc, y.doc, False), pu.dot(x.do, y.v, trans_b=True), 0.0)
      _, k_t = _off_factors(x, y)
      dq += pu.dot(dA.astype(dt), k_t) * jnp.exp(x.b - x.anchor)
    visible = _visible(x.doc, x.doc, True)
    dA = jnp.where(visible, pu.dot(x.do, x.v, trans_b=True), 0.0)
    decay = _diag_decay(x, visible)
    if decay.ndim == 2:
      dq += pu.dot((dA * decay).astype(dt), x.k)
    else:
      dq += jnp.sum(dA[:, :, None] * x.k.astype(_F32)[None, :, :] * decay, axis=1)
    out.append(dq)
  return out


def _dkv_chunk(subs, dS, b_end, last_doc, split: bool):
  """dk, dv of one chunk from dS (the gradient of the state after it) and the later queries."""
  dt = subs[0].q.dtype
  out = []
  for j, y in enumerate(subs):
    writes = (y.doc == last_doc)[:, None]
    dv = pu.split_dot(_k_to_end(y, b_end, last_doc), dS, dt, split)
    dk = jnp.where(writes, pu.split_dot(y.v, dS, dt, split, trans_b=True) * jnp.exp(b_end - y.b), 0.0)
    for x in subs[j + 1:]:
      q_t, k_t = _off_factors(x, y)
      visible = _visible(x.doc, y.doc, False)
      A = jnp.where(visible, pu.dot(q_t, k_t, trans_b=True), 0.0)
      dA = jnp.where(visible, pu.dot(x.do, y.v, trans_b=True), 0.0)
      dv += pu.dot(A.astype(dt), x.do, trans_a=True)
      dk += pu.dot(dA.astype(dt), q_t, trans_a=True) * jnp.exp(x.anchor - y.b)
    visible = _visible(y.doc, y.doc, True)
    decay = _diag_decay(y, visible)
    dv += pu.dot(_diag_scores(y, decay).astype(dt), y.do, trans_a=True)
    dA = jnp.where(visible, pu.dot(y.do, y.v, trans_b=True), 0.0)
    if decay.ndim == 2:
      dk += pu.dot((dA * decay).astype(dt), y.q, trans_a=True)
    else:
      dk += jnp.sum(dA[:, :, None] * y.q.astype(_F32)[:, None, :] * decay, axis=0)
    out.append((dk, dv))
  return out


def _state_doc(doc_ref, prev_doc_ref):
  """The document of S_n: the previous chunk's last one, or the first token's for chunk 0."""
  n = pl.program_id(2)
  return jnp.where(n > 0, jnp.max(prev_doc_ref[...]), jnp.min(doc_ref[...]))


def _writes_kernel(k_ref, v_ref, g_ref, doc_ref, W_ref, *, cfg):
  """Phase 1: W_n, what chunk n adds to the state ([K, BV] fp32)."""
  subs, b_end, last_doc = _load_chunk((None, k_ref, v_ref, g_ref, doc_ref), cfg)
  W_ref[...] = _writes(subs, b_end, last_doc, split=False)  # the forward keeps one rounding


def _outputs_kernel(q_ref, k_ref, v_ref, g_ref, doc_ref, prev_doc_ref, S_ref, o_ref, *, cfg):
  """Phase 3: chunk n's outputs from S_n (the state at its start) and its intra-chunk block."""
  subs, _, _ = _load_chunk((q_ref, k_ref, v_ref, g_ref, doc_ref), cfg)
  for i, o in enumerate(_chunk_outputs(subs, S_ref[...], _state_doc(doc_ref, prev_doc_ref))):
    pu.store_rows(o_ref, i * cfg.sub_chunk, cfg.scale * o)


def _writes_and_reads_grad_kernel(q_ref, k_ref, v_ref, g_ref, doc_ref, prev_doc_ref, do_ref,
                                  W_ref, R_ref, *, cfg):
  """Backward phase 1: W_n (the states are recomputed) and R_n."""
  subs, b_end, last_doc = _load_chunk((q_ref, k_ref, v_ref, g_ref, doc_ref), cfg, do_ref)
  W_ref[...] = _writes(subs, b_end, last_doc, cfg.split)
  R_ref[...] = _reads_grad(subs, _state_doc(doc_ref, prev_doc_ref), cfg.split)


def _grads_kernel(q_ref, k_ref, v_ref, g_ref, doc_ref, prev_doc_ref, do_ref, S_ref, dS_ref,
                  dq_ref, dk_ref, dv_ref, *, cfg):
  """Backward phase 3: dq of chunk n from S_n, dk and dv from dS_{n+1}, with the intra-chunk terms."""
  subs, b_end, last_doc = _load_chunk((q_ref, k_ref, v_ref, g_ref, doc_ref), cfg, do_ref)
  c = cfg.sub_chunk
  for i, dq in enumerate(_dq_chunk(subs, S_ref[...], _state_doc(doc_ref, prev_doc_ref), cfg.split)):
    pu.store_rows(dq_ref, i * c, dq)
  for j, (dk, dv) in enumerate(_dkv_chunk(subs, dS_ref[...], b_end, last_doc, cfg.split)):
    pu.store_rows(dk_ref, j * c, dk)
    pu.store_rows(dv_ref, j * c, dv)


def _chunk_specs(K, G, cfg):
  """BlockSpecs over the grid (batch, head, chunk, value tile); ``prev_doc``: the previous chunk's
  documents (chunk 0's own for chunk 0); ``state``: a [K, BV] tile of the [B, H, N, K, V] states."""
  C, BV = cfg.chunk, cfg.block_v
  rows = lambda width: pl.BlockSpec((None, C, None, width), lambda b, h, n, j: (b, n, h, 0))
  return dict(
      q=rows(K), g=rows(G),
      v=pl.BlockSpec((None, C, None, BV), lambda b, h, n, j: (b, n, h, j)),
      doc=pl.BlockSpec((None, C), lambda b, h, n, j: (b, n)),
      prev_doc=pl.BlockSpec((None, C), lambda b, h, n, j: (b, jnp.maximum(n - 1, 0))),
      state=pl.BlockSpec((None, None, None, K, BV), lambda b, h, n, j: (b, h, n, 0, j)),
      partial=pl.BlockSpec((None, None, C, None, K), lambda b, h, n, j: (j, b, n, h, 0)))


def _chunk_decays(g, doc, C):
  """a_n = exp(sum of g over chunk n) per gate channel, 0 where a document starts inside chunk n
  (the state is reset there): [B, H, N, G, 1] fp32, to scale the rows of [K, V] states."""
  B, Tp, H, G = g.shape
  N = Tp // C
  total_BxNxHxG = g.reshape(B, N, C, H, G).sum(axis=2)
  doc_BxNxC = doc.reshape(B, N, C)
  state_doc_BxN = jnp.concatenate([doc_BxNxC[:, :1, 0], doc_BxNxC[:, :-1, -1]], axis=1)
  keeps_BxN = doc_BxNxC[:, :, -1] == state_doc_BxN
  decay_BxNxHxG = jnp.where(keeps_BxN[:, :, None, None], jnp.exp(total_BxNxHxG), 0.0)
  return jnp.moveaxis(decay_BxNxHxG, 1, 2)[..., None]


def _scan_states(decay_BxHxNxGx1, x_BxHxNxKxV, edge_BxHxKxV, cfg, *, reverse: bool, dtype):
  """Phase 2 (``chunk_scan``): S_{n+1} = a_n S_n + W_n from S_0 = edge, or in reverse dS_n = a_n
  dS_{n+1} + R_n from dS_N = edge. Returns every chunk's held state in ``dtype`` and the end, fp32."""
  a_BxHxNxK = jnp.broadcast_to(decay_BxHxNxGx1[..., 0], x_BxHxNxKxV.shape[:4])
  return chunk_scan.chunk_scan(x_BxHxNxKxV, a_BxHxNxK, edge_BxHxKxV, reverse=reverse,
                               out_dtype=dtype, implementation=cfg.scan, interpret=cfg.interpret)


def _chunk_grid(q, v, cfg):
  B, Tp, H, _ = q.shape
  return (B, H, Tp // cfg.chunk, v.shape[-1] // cfg.block_v)


def _forward(q, k, v, g, doc, S0, cfg):
  """(o [B, Tp, H, V], S_N [B, H, K, V]), fp32, by phases 1 to 3."""
  B, Tp, H, K = q.shape
  grid = _chunk_grid(q, v, cfg)
  s = _chunk_specs(K, g.shape[-1], cfg)
  per_chunk = jax.ShapeDtypeStruct((B, H, grid[2], K, v.shape[-1]), _F32)
  W_BxHxNxKxV = pu.call(_writes_kernel, cfg, grid, [s["q"], s["v"], s["g"], s["doc"]],
                        s["state"], per_chunk, k, v, g, doc)
  S_BxHxNxKxV, S_end = _scan_states(_chunk_decays(g, doc, cfg.chunk), W_BxHxNxKxV, S0, cfg,
                                    reverse=False, dtype=q.dtype)
  o = pu.call(_outputs_kernel, cfg, grid,
              [s["q"], s["q"], s["v"], s["g"], s["doc"], s["prev_doc"], s["state"]], s["v"],
              jax.ShapeDtypeStruct((B, Tp, H, v.shape[-1]), _F32),
              q, k, v, g, doc, doc, S_BxHxNxKxV)
  return o, S_end


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gla(q, k, v, g, doc, S0, cfg):
  return _forward(q, k, v, g, doc, S0, cfg)


def _gla_fwd(q, k, v, g, doc, S0, cfg):
  return _forward(q, k, v, g, doc, S0, cfg), (q, k, v, g, doc, S0)


def _gla_bwd(cfg, residuals, cotangents):
  """Recomputes the states S_n (phases 1 and 2), scans the gradients dS_n in reverse, then takes
  dq, dk, dv of every chunk in parallel."""
  q, k, v, g, doc, S0 = residuals
  do, dS_end = (x.astype(_F32) for x in cotangents)
  B, Tp, H, K = q.shape
  V = v.shape[-1]
  grid = _chunk_grid(q, v, cfg)
  s = _chunk_specs(K, g.shape[-1], cfg)
  per_chunk = jax.ShapeDtypeStruct((B, H, grid[2], K, V), _F32)
  W_BxHxNxKxV, R_BxHxNxKxV = pu.call(
      _writes_and_reads_grad_kernel, cfg, grid,
      [s["q"], s["q"], s["v"], s["g"], s["doc"], s["prev_doc"], s["v"]], [s["state"], s["state"]],
      (per_chunk, per_chunk), q, k, v, g, doc, doc, do)
  decay = _chunk_decays(g, doc, cfg.chunk)
  states = _F32 if cfg.split else q.dtype  # split: the grads kernel splits fp32 states itself
  S_BxHxNxKxV, S_end = _scan_states(decay, W_BxHxNxKxV, S0, cfg, reverse=False, dtype=states)
  dS_BxHxNxKxV, dS0 = _scan_states(decay, R_BxHxNxKxV, dS_end, cfg, reverse=True, dtype=states)
  partial = jax.ShapeDtypeStruct((grid[3], B, Tp, H, K), _F32)
  dq, dk, dv = pu.call(
      _grads_kernel, cfg, grid,
      [s["q"], s["q"], s["v"], s["g"], s["doc"], s["prev_doc"], s["v"], s["state"], s["state"]],
      [s["partial"], s["partial"], s["v"]],
      (partial, partial, jax.ShapeDtypeStruct((B, Tp, H, V), _F32)),
      q, k, v, g, doc, doc, do, S_BxHxNxKxV, dS_BxHxNxKxV)
  dq, dk = dq.sum(0), dk.sum(0)
  dg = gate_grad(q, k, dq, dk, jnp.sum(S_end * dS_end, axis=-1), g.shape[-1])
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg, None, dS0


_gla.defvjp(_gla_fwd, _gla_bwd)


def chunked(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, *, scale: float, doc_BxT,
            chunk_size: int = CHUNK, interpret: bool | None = None, block_v: int = 64,
            sub_chunk: int = SUB_CHUNK, num_warps: int = 8, num_stages: int = 2,
            scan: str = "pallas", precision: str = "input", split: bool = True):
  """The backend contract of ``base`` by the kernels: T padded to whole chunks, K and V to power-of-two
  blocks (at least 16 compiled). ``scan``: phase 2 by "pallas" or "xla"; ``precision``: the dots'
  operands (``pallas_utils.PRECISIONS``); ``split``: the backward's state dots in two parts."""
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, OP, "implementation='chunked' (XLA)")
  check_power_of_two(OP, chunk_size=chunk_size)
  pu.check_precision(precision, OP)
  q_BxTxHxK, k_BxTxHxK, v_BxTxHxV = pu.operands(precision, q_BxTxHxK, k_BxTxHxK, v_BxTxHxV)
  B, T, H, K = q_BxTxHxK.shape
  V, G = v_BxTxHxV.shape[-1], g_BxTxHxG.shape[-1]
  C = max(chunk_size, 1 if interpret else pu.MIN_DOT)
  Kp, BV = pu.block_size(K, interpret), min(pu.block_size(V, interpret), block_v)
  Tp, Vp = pu.round_up(T, C), pu.round_up(V, BV)
  cfg = KernelConfig(chunk=C, sub_chunk=min(sub_chunk, C) if G > 1 else C, block_v=BV, scale=float(scale),
                     interpret=interpret, num_warps=num_warps, num_stages=num_stages, scan=scan,
                     precision=precision, split=split)
  q, k, v, g, S0 = pad_inputs(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, Tp, Kp, Vp)
  doc = pu.pad_axis(doc_BxT.astype(jnp.int32), 1, Tp, mode="edge")
  o, S = _gla(q, k, v, g, doc, S0, cfg)
  return o[:, :T, :, :V], S[:, :, :K, :V]


@dataclasses.dataclass(frozen=True)
class TritonTiles:
  """Tokens per chunk and per diagonal block (per-key-channel gates), value columns per program
  (powers of two, >= 16 compiled), Triton warps and stages."""

  chunk: int = CHUNK
  sub_chunk: int = SUB_CHUNK
  block_v: int = 64
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    check_power_of_two("gated_linear_attention tiles", chunk=self.chunk, sub_chunk=self.sub_chunk,
                       block_v=self.block_v)


class PallasTriton(Backend[TritonTiles]):
  """The Triton kernels, each device of the mesh on its own rows and heads (``shard_map``)."""

  platforms = TRITON
  tiles_type = TritonTiles

  def preferred(self, problem: Problem) -> bool:
    return problem.key_dim <= MAX_KEY and problem.value_dim <= MAX_VALUE

  def heuristic_config(self, problem: Problem) -> TritonTiles:
    del problem
    return TritonTiles()

  def flops_per_head(self, problem: Problem, tiles: TritonTiles | None = None) -> float:
    return chunked_flops(problem, self.config(problem, tiles).chunk)

  def __call__(self, q, k, v, g, S0, *, scale: float, doc_BxT, tiles: TritonTiles, options: Options):
    kernel = functools.partial(chunked, scale=scale, chunk_size=tiles.chunk, sub_chunk=tiles.sub_chunk,
                               block_v=tiles.block_v, num_warps=tiles.num_warps,
                               num_stages=tiles.num_stages, precision=options.precision,
                               split=options.split_state)
    return shard_map.run_sharded(kernel, kernel_inputs(q, k, v, g, S0, doc_BxT), KERNEL_LAYOUTS,
                                 ("BTH", "BH"))
