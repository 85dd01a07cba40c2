"""Pallas (Triton lowering) fused-chunk kernels for SANATAN p = 1, six channels (MATH §1.2): the
backend ``pallas_fused`` (``PallasFused``, tiles ``FusedTiles``).

Per head, the chunked form of MATH §1.2 with the state carried through the chunks inside one
program (FLA's "fused_chunk" layout): no chunk state ever reaches HBM. For chunk n with features
Phi(Q_n), Phi(K_n) (C x 6d), values V_n, the state (S, z) entering it and the visible mask
Mask (j <= t, same document)::

    A_n = Mask ⊙ Phi(Q_n) Phi(K_n)ᵀ,   N_n = A_n V_n + Phi(Q_n) S,   D_n = A_n 1 + Phi(Q_n) z,
    o = N / (D + c eps),               S <- S + Phi(K_n)ᵀ V_n,        z <- z + Phi(K_n)ᵀ 1.

Features. The factor kernels (pallas_triton_factors.py: fp32 inside, written in the operands' dtype)
compute, once per token, (cos th_rot, sin th_rot) [B, T, H, 2, d] and the roots r [B, T, H, d]: three
d-wide arrays where Phi is 6d wide. Each program forms its channels from them in registers by
``base.factor_channel`` (fp32 products rounded to the operands' dtype; the constant channel zero on
padding), so the channels, their states and their gradients are handled alike. With one channel per
program the constant channel (1 on every real head dim) has no program of its own: its score is the
count d on every visible pair and its state's rows move alike, so the forward and dv walks' first
program (channel 1) adds d to its scores and carries the channel's state as a few sums
(``_constant_flag``); the spans' totals and entry-gradient kernels' first program sums v and dN alike
and writes channel 0. It has no gradient, so the dq and dk walks leave it out, and the one thing its
dk programs would give, channel 0 of the initial state's gradient (the sums of dN and dD over each
row's first document), XLA adds, as it does channel 0 of the final state. The kernels write d Phi
channel-major [B, T, H, 6 or 5, d] (in channel groups); the factor kernels' VJP takes it through the
product rule to dq, dk, d omega and d lam_raw. The custom VJP keeps no features: its backward
recomputes the factors from q and k (unless asked to keep them, ``Options.remat`` False).

Programs. Grid (channel group, value tile, batch, head): a program owns ``KernelTiles.channels`` of
the six channels and ``block_v`` value columns, so 6 / channels x dv / block_v programs share a
(row, head) (5 x dv / block_v at one channel per program: the constant channel rides with channel
1). Its state is one fp32 [d, BV] block and one [d] normaliser per owned channel, in registers for
the whole walk. A score is a sum over channels, so each program computes its channels' part of A_n,
N_n and D_n; XLA sums the parts in fp32 and divides. Splitting the 6d-wide key axis keeps a
program's state small and multiplies the programs a GPU can run side by side, at the cost of
per-group copies of A_n V_n and of the value dots of the backward.

Forward (``_forward_kernel``), chunks in order: the outputs' parts, then the state update. It
writes the numerator and denominator parts and the state after the last token.

Backward (``jax.custom_vjp``; residuals: the inputs, o in v's dtype and the fp32 denominator D).
With dN = do / (D + c eps) and dD = -(do · o) / (D + c eps) (XLA), ds_tj = dN_t · v_j + dD_t on
visible pairs (p = 1: the weights are the scores):

* ``_dq_kernel``, chunks in order, recomputing the state: d Phi(q_t) = sum_j ds_tj Phi(k_j)
  + [t reads the state] (S dN_t + z dD_t);
* two walks in reverse chunk order, each carrying the gradient of the state after the chunk,
  (dS, dz) <- keep (dS, dz) + Phi(Q_n)ᵀ (dN, dD) over the chunk's readers (starting from the final
  state's cotangent): ``_dk_kernel``, d Phi(k_j) = sum_t ds_tj Phi(q_t) + [j writes] (dS v_j + dz),
  which also writes what is left at the start, the gradient of the initial state; ``_dv_kernel``,
  dv_j = sum_t A_tj dN_t + [j writes] dSᵀ Phi(k_j), which carries dS only. (Two walks rather than
  one keep each program's live blocks small enough for two programs per SM.)

Value tiles split dN and v; the terms in dD (which every tile sees whole) are taken in tile 0 only,
and XLA sums the tiles' parts of d Phi(q), d Phi(k) and of the initial z's gradient.

Packed documents follow api.py: ``runs`` (``segments.document_index``, non-decreasing per row)
number the maximal runs of equal segment ids. A token reads the carried state only in the state's
run (the run of the token before its chunk; the incoming state's for chunk 0, run 0), a chunk
hands on only its last run's writes, and keeps the carried state only when its last run is the
state's (else the state restarts from those writes).

Spans (``FusedTiles.spans``, ``lmcore.ops.common.spans``): with few (row, head) pairs a row of T
tokens runs as G rows of T / G, each walked from the state entering its span. Forward:
``_totals_kernel`` sums Phi(k)ᵀ (v, 1) over the last run of each part of a span (``FusedTiles.parts``
parts, side by side; one program per channel group and value tile, five groups at one channel per
program) and ``spans.entering`` makes the spans' entering states. Backward: ``_entry_grad_kernel``
sums Phi(q)ᵀ (dN, dD) over each span's run 0 (the gradient its own tokens give its entering state)
and ``spans.leaving_grads`` turns those and the final state's cotangent into the gradients of the
spans' leaving states, which the dk and dv walks start from. The totals need no backward of their
own: a span's leaving state is its total plus what it keeps of the state entering it, so its
total's gradient is its leaving state's, and the walks apply it.

Matmul operands are in the inputs' dtype (bf16 in training; the states and their gradients are
cast to it for the dots, as XLA "chunked" does), accumulations fp32. The feature gradients, the
numerator parts and the dv parts reach XLA in the operands' dtype (halving the walks' largest
writes), the denominator parts in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.ops.common import flops, shard_map, spans
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.backend import TRITON, Backend, check_power_of_two
from lmcore.ops.common.layout import default_positions
from lmcore.ops.common.segments import document_index
from sanatan_jax import features
from sanatan_jax.ops.sanatan_attention import pallas_triton_factors as factor_kernels
from sanatan_jax.ops.sanatan_attention.pallas_triton_factors import Factors
from sanatan_jax.ops.sanatan_attention.base import (EPS, KERNEL_LAYOUTS, STATE_LAYOUT, Options, Problem,
                                                    SanatanState, after_cotangent, channel_major_state,
                                                    factor_channel, interleaved_state)

CHANNELS = 6
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelTiles:
  """One walk's tiling: ``chunk`` tokens per step of a program's walk and ``block_v`` value columns
  per program (powers of two, >= 16 when compiled), ``channels`` feature channels per program (1, 2,
  3 or 6), Triton warps and pipeline stages."""

  chunk: int = 64
  block_v: int = 64
  channels: int = 1
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    check_power_of_two("pallas_fused tiles", chunk=self.chunk, block_v=self.block_v)
    if self.channels not in (1, 2, 3, 6):
      raise ValueError(f"pallas_fused tiles: channels per program must divide {CHANNELS} (1, 2, 3 or "
                       f"6), got {self.channels!r}")


@dataclasses.dataclass(frozen=True)
class FusedTiles:
  """The tilings of the forward walk, the dq walk and the dk and dv walks (one tiling for both);
  ``spans``: how many spans each row is cut into (``lmcore.ops.common.spans``; 0: ``spans.count``'s
  rule, 1: none); ``parts``: how many parts each span's totals are summed in (0: ``spans.parts``'
  rule). The defaults are the bf16 tiling, the fastest measured (docs/BENCHMARKS.md, SANATAN p = 1
  walks: tilings and layouts)."""

  forward: KernelTiles = KernelTiles()
  dq: KernelTiles = KernelTiles()
  dkv: KernelTiles = KernelTiles()
  spans: int = 0
  parts: int = 0

  def __post_init__(self):
    if self.spans:
      check_power_of_two("pallas_fused tiles (0: the rule)", spans=self.spans)
    if not isinstance(self.parts, int) or self.parts < 0:
      raise ValueError(f"pallas_fused tiles: parts must be 0 (the rule) or a positive count, got "
                       f"{self.parts!r}")

  @property
  def kernels(self) -> tuple[KernelTiles, KernelTiles, KernelTiles]:
    return self.forward, self.dq, self.dkv


# The tiling by the kernels' operand width in bytes (2: bf16 inputs; 4: fp32 inputs or precision
# "tf32"/"float32", whose chunks of 64 spill registers). ``benchmarks.harness.FUSED_TUNING`` lists the
# tilings timed.
TILES = {2: FusedTiles(),
         4: FusedTiles(forward=KernelTiles(32, 64, 1, 4, 2), dq=KernelTiles(32, 64, 1, 4, 2),
                       dkv=KernelTiles(32, 64, 1, 8, 2))}
# "auto" takes these kernels for heads up to this wide; past them XLA "chunked" is faster
# (docs/BENCHMARKS.md, SANATAN heads).
MAX_HEAD_DIM, MAX_VALUE_DIM = 128, 512


def default_tiles(dtype) -> FusedTiles:
  """The tiling for operands of ``dtype``."""
  return TILES[min(jnp.dtype(dtype).itemsize, 4)]


class KernelConfig(NamedTuple):
  """Static parameters of one kernel."""

  chunk: int
  block_v: int
  channels: int
  documents: bool
  interpret: bool
  num_warps: int
  num_stages: int
  precision: str
  length: int
  head_dim: int
  padded_length: int
  dp: int
  first_group: int = 0  # the grid's channel groups start here (1: the constant channel skipped)


class Static(NamedTuple):
  """What the custom VJP holds static: the three kernels' configs, the rotation flag, the real and
  padded lengths, the padded head and value dims, c · eps, whether the forward keeps the
  kernels' factors for the backward, the spans per row and the parts per span (``spans.parts``)."""

  forward: KernelConfig
  dq: KernelConfig
  dkv: KernelConfig
  rotate: bool
  length: int
  padded_length: int
  dp: int
  Vp: int
  c_eps: float
  keep_factors: bool
  spans: int = 1
  parts: int = 1


# In-kernel pieces.

class _Chunk(NamedTuple):
  """One chunk inside a kernel: the program's channels of Phi(q) and Phi(k) (tuples of [C, dp], in
  the operands' dtype; None where the kernel does not read them), values [C, BV] and run ids [C]
  (None without documents)."""

  phi_q: tuple | None
  phi_k: tuple | None
  v: jax.Array
  run: jax.Array | None


def _phi(refs, start, cfg: KernelConfig) -> tuple | None:
  """The program's channels of Phi for rows ``start : start + C`` from ``refs`` = (one trig ref
  per channel, the roots' ref, the program's first channel g·G; ``_operand``) (None: not read).
  Channel c = g·G + i is ``base.factor_channel`` of the trig ref its BlockSpec picked (cos or sin,
  ``_trig_index``) and r, formed in fp32 and rounded to the refs' dtype; the constant channel is zero
  on time and head-dim padding (the factors are zero there already)."""
  if refs is None:
    return None
  trig_refs, root_ref, first = refs
  C = cfg.chunk
  w = pu.rows(root_ref, start, C).astype(_F32)
  one = 1.0
  if cfg.padded_length != cfg.length or cfg.dp != cfg.head_dim:
    token = start + jax.lax.broadcasted_iota(jnp.int32, w.shape, 0)
    dim = jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
    one = ((token < cfg.length) & (dim < cfg.head_dim)).astype(_F32)
  phi = []
  for i, trig_ref in enumerate(trig_refs):
    trig = pu.rows(trig_ref, start, C).astype(_F32)
    phi.append(factor_channel(first + i, trig, trig, w, one).astype(trig_ref.dtype))
  return tuple(phi)


def _operand(trig_refs, root_ref, cfg: KernelConfig) -> tuple:
  """``_phi``'s refs of one operand; the program id is read here, outside the chunk loop."""
  return trig_refs, root_ref, (pl.program_id(0) + cfg.first_group) * cfg.channels


def _load(n, q_refs, k_refs, v_ref, run_ref, cfg: KernelConfig) -> _Chunk:
  """Chunk n of the program's refs (``q_refs`` or ``k_refs``: ``_phi``'s refs, None: not read)."""
  C = cfg.chunk
  run = pu.rows(run_ref, n * C, C) if cfg.documents else None
  return _Chunk(_phi(q_refs, n * C, cfg), _phi(k_refs, n * C, cfg), pu.rows(v_ref, n * C, C), run)


def _visible(run, cfg: KernelConfig, transposed: bool = False):
  """[C, C] j <= t (and the same run with documents); rows are queries t, or keys j when
  ``transposed``."""
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (cfg.chunk, cfg.chunk))
  mask = iota(0) <= iota(1) if transposed else iota(0) >= iota(1)
  if cfg.documents:
    mask &= run[:, None] == run[None, :]
  return mask


def _only(rows, phi: tuple) -> tuple:
  """``phi`` zeroed outside ``rows`` ([C] bool; None: all rows)."""
  if rows is None:
    return phi
  return tuple(jnp.where(rows[:, None], a, 0) for a in phi)


def _scores(rows: tuple, cols: tuple):
  """sum over the program's channels of rows_c cols_cᵀ, fp32 [C, C]."""
  s = pu.dot(rows[0], cols[0], trans_b=True)
  for a, b in zip(rows[1:], cols[1:]):
    s += pu.dot(a, b, trans_b=True)
  return s


def _reads(run, state_run):
  """[C] bool: the chunk's tokens in the carried state's run (None without documents)."""
  return None if run is None else run == state_run


def _chunk_end(x: _Chunk, state_run):
  """(keep, writes, last) of chunk ``x`` in a forward walk: its last run, the [C] tokens in it (None
  without documents) and whether the carried state is kept across the chunk (that run is the
  state's)."""
  if x.run is None:
    return 1.0, None, state_run
  last = jnp.max(x.run)
  return (last == state_run).astype(_F32), x.run == last, last


def _advance(x: _Chunk, S: tuple, z: tuple, state_run):
  """The carried state after chunk ``x``: S keep + Phi(K)ᵀ V and z keep + Phi(K)ᵀ 1 over the
  chunk's last run (keep: that run is the state's), and that run."""
  keep, writes, last = _chunk_end(x, state_run)
  phi_k = _only(writes, x.phi_k)
  S = tuple(keep * S_c + pu.dot(a, x.v, trans_a=True) for a, S_c in zip(phi_k, S))
  z = tuple(keep * z_c + jnp.sum(a.astype(_F32), axis=0) for a, z_c in zip(phi_k, z))
  return S, z, last


# Phi's constant channel where the grid leaves it out (``first_group`` 1). On the real head dims it is
# 1, so its score is the count d on every visible pair of real tokens and its state S_0 (z_0) has one
# row per real dim, all moving alike. The grid's first program (channel 1) carries it: it adds d to
# its scores and keeps (K, w, n): whether the initial state is still kept, and the sums of v and of
# real tokens over the carried state's run since then, so that sum_a S_0[a] = K sum_a S0_0[a] + d w
# (and z_0 alike with n). The other programs carry the same with a zero flag. Padded tokens come after
# every real one and are read by none (their outputs and gradients are dropped), so the walks need not
# tell them apart here; the final state's channel 0 is ``_constant_final_state``'s.

def _constant_flag(cfg: KernelConfig):
  """1.0 in the program that carries the constant channel, 0.0 in the others; None when the grid keeps
  the channel (``first_group`` 0)."""
  if not cfg.first_group:
    return None
  return (pl.program_id(0) == 0).astype(_F32)


def _real_rows(x, size: int):
  """sum over the first ``size`` rows of ``x`` (the real head dims of a [dp, ...] block), fp32."""
  dim = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.sum(jnp.where(dim < size, x.astype(_F32), 0.0), axis=0)


def _row_sum(x, rows):
  """sum over the [C] rows of ``x`` ([C] or [C, BV]) in fp32, only ``rows`` ([C] bool; None: all)."""
  x = x.astype(_F32)
  if rows is not None:
    x = jnp.where(rows if x.ndim == 1 else rows[:, None], x, 0.0)
  return jnp.sum(x, axis=0)


def _advance_constant(x: _Chunk, carry, state_run, cfg: KernelConfig):
  """(K, w, n) after chunk ``x``."""
  K, w, n = carry
  keep, writes, _ = _chunk_end(x, state_run)
  count = jnp.float32(cfg.chunk) if writes is None else _row_sum(writes, None)
  return keep * K, keep * w + _row_sum(x.v, writes), keep * n + count


def _chunk_runs(run_ref, n, cfg: KernelConfig):
  """The run of the state entering chunk n and the chunk's last run. Runs are non-decreasing, so
  the state entering chunk n > 0 is in chunk n - 1's last run, the initial one in run 0."""
  C = cfg.chunk
  previous = pu.rows(run_ref, jnp.maximum(n - 1, 0) * C, C)
  state_run = jnp.where(n > 0, jnp.max(previous), 0)
  return state_run, jnp.max(pu.rows(run_ref, n * C, C))


def _split(refs, *counts) -> list[tuple]:
  """``refs`` cut into consecutive tuples of ``counts`` refs."""
  groups, start = [], 0
  for count in counts:
    groups.append(tuple(refs[start:start + count]))
    start += count
  return groups


def _forward_kernel(*refs, cfg: KernelConfig):
  """Refs: the factors of q and of k (``_phi``), v, runs, initial S and z channels (then channel 0's
  where the grid leaves it out); outputs: the numerator and denominator parts, final S and z
  channels."""
  G = cfg.channels
  flag = _constant_flag(cfg)
  (q_trig, (q_root,), k_trig, (k_root,), (v_ref,), (run_ref,), S0_refs, z0_refs, constant_refs,
   (num_ref,), (den_ref,), S_refs, z_refs) = _split(refs, G, 1, G, 1, 1, 1, G, G, 0 if flag is None else 2,
                                                    1, 1, G, G)
  q_refs, k_refs = _operand(q_trig, q_root, cfg), _operand(k_trig, k_root, cfg)
  C, d = cfg.chunk, float(cfg.head_dim)
  if flag is not None:
    S0_sum, z0_sum = (_real_rows(r[...], cfg.head_dim) for r in constant_refs)

  def step(n, carry):
    S, z, state_run, constant = carry
    x = _load(n, q_refs, k_refs, v_ref, run_ref, cfg)
    s = _scores(x.phi_q, x.phi_k)
    if flag is not None:
      s += flag * d
    s = jnp.where(_visible(x.run, cfg), s, 0.0)
    num = pu.dot(s.astype(x.v.dtype), x.v)
    den = jnp.sum(s, axis=1)
    reads = _reads(x.run, state_run)
    if flag is not None:
      K, w, count = constant
      from_v, from_z = flag * (K * S0_sum + d * w), flag * (K * z0_sum + d * count)
      num += from_v[None, :] if reads is None else jnp.where(reads[:, None], from_v[None, :], 0.0)
      den += from_z if reads is None else jnp.where(reads, from_z, 0.0)
      constant = _advance_constant(x, constant, state_run, cfg)
    for a, S_c, z_c in zip(_only(reads, x.phi_q), S, z):
      num += pu.dot(a, S_c.astype(a.dtype))
      den += jnp.sum(a.astype(_F32) * z_c[None, :], axis=1)
    pu.store_rows(num_ref, n * C, num.astype(num_ref.dtype))
    pu.store_rows(den_ref, n * C, den)
    return *_advance(x, S, z, state_run), constant

  constant = () if flag is None else (jnp.float32(1.0), jnp.zeros((cfg.block_v,), _F32), jnp.float32(0.0))
  init = (tuple(r[...] for r in S0_refs), tuple(r[...] for r in z0_refs), jnp.int32(0), constant)
  S, z, _, _ = jax.lax.fori_loop(0, v_ref.shape[0] // C, step, init)
  for ref, value in zip(S_refs + z_refs, S + z):
    ref[...] = value


def _dq_kernel(*refs, cfg: KernelConfig):
  """Refs: the factors of k (``_phi``), v, runs, dN, dD, initial S and z channels; outputs:
  d Phi(q) channels."""
  G = cfg.channels
  (k_trig, (k_root,), (v_ref,), (run_ref,), (dN_ref,), (dD_ref,), S0_refs, z0_refs,
   dq_refs) = _split(refs, G, 1, 1, 1, 1, 1, G, G, G)
  k_refs = _operand(k_trig, k_root, cfg)
  C = cfg.chunk
  tile0 = (pl.program_id(1) == 0).astype(_F32)

  def step(n, carry):
    S, z, state_run = carry
    x = _load(n, None, k_refs, v_ref, run_ref, cfg)
    dN, dD = pu.rows(dN_ref, n * C, C), tile0 * pu.rows(dD_ref, n * C, C)
    ds = jnp.where(_visible(x.run, cfg), pu.dot(dN, x.v, trans_b=True) + dD[:, None], 0.0)
    ds = ds.astype(x.phi_k[0].dtype)
    reads = _reads(x.run, state_run)
    if reads is not None:  # only the state's run reads it
      dN, dD = jnp.where(reads[:, None], dN, 0), jnp.where(reads, dD, 0.0)
    for ref, b, S_c, z_c in zip(dq_refs, x.phi_k, S, z):
      from_state = pu.dot(dN, S_c.astype(dN.dtype), trans_b=True) + dD[:, None] * z_c[None, :]
      pu.store_rows(ref, n * C, (pu.dot(ds, b) + from_state).astype(ref.dtype))
    return _advance(x, S, z, state_run)

  init = (tuple(r[...] for r in S0_refs), tuple(r[...] for r in z0_refs), jnp.int32(0))
  jax.lax.fori_loop(0, v_ref.shape[0] // C, step, init)


def _reverse_runs(x: _Chunk, run_ref, n, cfg: KernelConfig):
  """(keep, writes, reads) of chunk n for the reverse walks: the carried state's gradient is kept
  across the chunk when its last run is the state's; ``writes`` marks the chunk's last run,
  ``reads`` the state's run (1.0, None, None without documents)."""
  if x.run is None:
    return 1.0, None, None
  state_run, last = _chunk_runs(run_ref, n, cfg)
  return (last == state_run).astype(_F32), x.run == last, x.run == state_run


def _dv_kernel(*refs, cfg: KernelConfig):
  """Refs: the factors of q and of k (``_phi``), runs, dN, the final state's cotangent S channels (then
  channel 0's where the grid leaves it out); output: the dv part. Chunks in reverse order, carrying
  the gradient dS of the state after the chunk: dv_j = sum_t A_tj dN_t + [j writes] dSᵀ Phi(k_j).
  The constant channel's dS_0 rows move alike: the program that carries it keeps u = sum_a dS_0[a]
  (u <- keep u + d sum_t dN_t over the readers) and adds d to its scores (dN is zero on padding)."""
  G = cfg.channels
  flag = _constant_flag(cfg)
  (q_trig, (q_root,), k_trig, (k_root,), (run_ref,), (dN_ref,), dS_refs, constant_refs,
   (dv_ref,)) = _split(refs, G, 1, G, 1, 1, 1, G, 0 if flag is None else 1, 1)
  q_refs, k_refs = _operand(q_trig, q_root, cfg), _operand(k_trig, k_root, cfg)
  C, d = cfg.chunk, float(cfg.head_dim)
  n_chunks = dN_ref.shape[0] // C

  def step(i, carry):
    dS, u = carry
    n = n_chunks - 1 - i
    run = pu.rows(run_ref, n * C, C) if cfg.documents else None
    x = _Chunk(_phi(q_refs, n * C, cfg), _phi(k_refs, n * C, cfg), None, run)
    dN = pu.rows(dN_ref, n * C, C)
    keep, writes, reads = _reverse_runs(x, run_ref, n, cfg)
    s = _scores(x.phi_k, x.phi_q)
    if flag is not None:
      s += flag * d
    s = jnp.where(_visible(x.run, cfg, transposed=True), s, 0.0)
    dv = pu.dot(s.astype(dN.dtype), dN)
    for b, dS_c in zip(_only(writes, x.phi_k), dS):
      dv += pu.dot(b, dS_c.astype(b.dtype))
    if flag is not None:
      dv += flag * (u[None, :] if writes is None else jnp.where(writes[:, None], u[None, :], 0.0))
      u = keep * u + d * _row_sum(dN, reads)
    pu.store_rows(dv_ref, n * C, dv.astype(dv_ref.dtype))
    dS = tuple(keep * dS_c + pu.dot(a, dN, trans_a=True) for a, dS_c in zip(_only(reads, x.phi_q), dS))
    return dS, u

  u = () if flag is None else _real_rows(constant_refs[0][...], cfg.head_dim)
  jax.lax.fori_loop(0, n_chunks, step, (tuple(r[...] for r in dS_refs), u))


def _dk_kernel(*refs, cfg: KernelConfig):
  """Refs: the factors of q (``_phi``), v, runs, dN, dD, the final state's cotangent channels;
  outputs: d Phi(k) channels, the initial S and z channels' gradients. Chunks in reverse order,
  carrying (dS, dz) <- keep (dS, dz) + Phi(Q_n)ᵀ (dN, dD) over the chunk's readers:
  d Phi(k_j) = sum_t ds_tj Phi(q_t) + [j writes] (dS v_j + dz)."""
  G = cfg.channels
  (q_trig, (q_root,), (v_ref,), (run_ref,), (dN_ref,), (dD_ref,), dS_refs, dz_refs, dk_refs, dS0_refs,
   dz0_refs) = _split(refs, G, 1, 1, 1, 1, 1, G, G, G, G, G)
  q_refs = _operand(q_trig, q_root, cfg)
  C = cfg.chunk
  n_chunks = v_ref.shape[0] // C
  tile0 = (pl.program_id(1) == 0).astype(_F32)

  def step(i, carry):
    dS, dz = carry  # the gradient of the state after chunk n
    n = n_chunks - 1 - i
    x = _load(n, q_refs, None, v_ref, run_ref, cfg)
    dN, dD = pu.rows(dN_ref, n * C, C), tile0 * pu.rows(dD_ref, n * C, C)
    dt = x.v.dtype
    keep, writes, reads = _reverse_runs(x, run_ref, n, cfg)
    visible = _visible(x.run, cfg, transposed=True)  # rows: keys
    ds = jnp.where(visible, pu.dot(x.v, dN, trans_b=True) + dD[None, :], 0.0).astype(dt)
    for ref, a, dS_c, dz_c in zip(dk_refs, x.phi_q, dS, dz):
      to_state = pu.dot(x.v, dS_c.astype(dt), trans_b=True) + dz_c[None, :]
      if writes is not None:
        to_state = jnp.where(writes[:, None], to_state, 0.0)
      pu.store_rows(ref, n * C, (pu.dot(ds, a) + to_state).astype(ref.dtype))
    phi_q = _only(reads, x.phi_q)
    dS = tuple(keep * dS_c + pu.dot(a, dN, trans_a=True) for a, dS_c in zip(phi_q, dS))
    dz = tuple(keep * dz_c + jnp.sum(a.astype(_F32) * dD[:, None], axis=0)
               for a, dz_c in zip(phi_q, dz))
    return dS, dz

  init = (tuple(r[...] for r in dS_refs), tuple(tile0 * r[...] for r in dz_refs))
  dS, dz = jax.lax.fori_loop(0, n_chunks, step, init)
  for ref, value in zip(dS0_refs + dz0_refs, dS + dz):
    ref[...] = value


def _store_constant(refs, x, y, cfg: KernelConfig) -> None:
  """Channel 0 of a state (or state gradient) whose rows all hold ``x`` [BV] and ``y`` on the real
  head dims, written by the program that carries the constant channel (``_constant_flag``) into
  ``refs`` = ([dp, BV] block, [dp] block)."""
  S_ref, z_ref = refs
  real = jax.lax.broadcasted_iota(jnp.int32, z_ref.shape, 0) < cfg.head_dim

  @pl.when(pl.program_id(0) == 0)
  def _():
    S_ref[...] = jnp.where(real[:, None], x[None, :], 0.0)
    z_ref[...] = jnp.where(real, y, 0.0)


def _totals_kernel(*refs, cfg: KernelConfig):
  """Refs: the factors of k (``_phi``), v, runs; outputs: the S and z channels that a walk from zeros
  leaves after the row's last chunk (its sums over the row's last run), with no outputs on the way;
  where the grid leaves the constant channel out, its channel 0 ([dp, BV] and [dp]) from the first
  program, which sums v and the tokens over the last run (``_advance_constant``)."""
  G = cfg.channels
  flag = _constant_flag(cfg)
  (k_trig, (k_root,), (v_ref,), (run_ref,), S_refs, z_refs, constant_refs) = _split(
      refs, G, 1, 1, 1, G, G, 0 if flag is None else 2)
  k_refs = _operand(k_trig, k_root, cfg)
  C = cfg.chunk

  def step(n, carry):
    S, z, state_run, constant = carry
    x = _load(n, None, k_refs, v_ref, run_ref, cfg)
    if flag is not None:
      constant = _advance_constant(x, constant, state_run, cfg)
    return *_advance(x, S, z, state_run), constant

  zeros = lambda refs: tuple(jnp.zeros(r.shape, _F32) for r in refs)
  constant = () if flag is None else (jnp.float32(0.0), jnp.zeros((cfg.block_v,), _F32), jnp.float32(0.0))
  S, z, _, constant = jax.lax.fori_loop(0, v_ref.shape[0] // C, step,
                                        (zeros(S_refs), zeros(z_refs), jnp.int32(0), constant))
  for ref, value in zip(S_refs + z_refs, S + z):
    ref[...] = value
  if flag is not None:
    _store_constant(constant_refs, *constant[1:], cfg)


def _entry_grad_kernel(*refs, cfg: KernelConfig):
  """Refs: the factors of q (``_phi``), runs, dN, dD; outputs: the S and z channels of the gradient
  that the row's tokens of run 0 give the state entering it, sum_t Phi(q_t)ᵀ (dN_t, dD_t) over them
  (what the dk walk adds to its carry at those tokens), with no outputs on the way; where the grid
  leaves the constant channel out, its channel 0 from the first program: (sum_t dN_t, sum_t dD_t) on
  each real head dim."""
  G = cfg.channels
  flag = _constant_flag(cfg)
  (q_trig, (q_root,), (run_ref,), (dN_ref,), (dD_ref,), S_refs, z_refs, constant_refs) = _split(
      refs, G, 1, 1, 1, 1, G, G, 0 if flag is None else 2)
  q_refs = _operand(q_trig, q_root, cfg)
  C = cfg.chunk

  def step(n, carry):
    dS, dz, constant = carry
    phi_q = _phi(q_refs, n * C, cfg)
    dN, dD = pu.rows(dN_ref, n * C, C), pu.rows(dD_ref, n * C, C)
    first = pu.rows(run_ref, n * C, C) == 0 if cfg.documents else None
    dS = tuple(dS_c + pu.dot(a, dN, trans_a=True) for a, dS_c in zip(_only(first, phi_q), dS))
    dz = tuple(dz_c + jnp.sum(a.astype(_F32) * dD[:, None], axis=0)
               for a, dz_c in zip(_only(first, phi_q), dz))
    if flag is not None:
      constant = (constant[0] + _row_sum(dN, first), constant[1] + _row_sum(dD, first))
    return dS, dz, constant

  zeros = lambda refs: tuple(jnp.zeros(r.shape, _F32) for r in refs)
  constant = () if flag is None else (jnp.zeros((cfg.block_v,), _F32), jnp.float32(0.0))
  dS, dz, constant = jax.lax.fori_loop(0, dN_ref.shape[0] // C, step,
                                       (zeros(S_refs), zeros(z_refs), constant))
  for ref, value in zip(S_refs + z_refs, dS + dz):
    ref[...] = value
  if flag is not None:
    _store_constant(constant_refs, *constant, cfg)


# Calls.

class _Specs(NamedTuple):
  """BlockSpecs over the grid (g, j, b, h): channel group, value tile, batch row, head. Token
  arrays are whole rows (a program reads and writes its chunks' rows)."""

  trig: object  # i -> cos or sin [B, Tp, H, 2, dp] for channel g·G + i
  root: object  # [B, Tp, H, dp]
  v: object  # [B, Tp, H, Vp], value tile j
  row: object  # [B, Tp]
  token: object  # [B, Tp, H]
  S: object  # i -> [B, H, 6, dp, Vp]
  z: object  # i -> [B, H, 6, dp]
  group_v: object  # [groups, B, Tp, H, Vp]: per-group parts over value tiles
  tile_token: object  # [tiles, groups, B, Tp, H]
  group_S: object  # [groups, B, H, dp, Vp]: channel i of each group
  tile_z: object  # [tiles, groups, B, H, dp]
  tile_phi: object  # [tiles, B, Tp, H, groups, dp]: channel g·G + i of each group
  S_constant: object  # [B, H, 6, dp, Vp]: channel 0
  z_constant: object  # [B, H, 6, dp]: channel 0
  out_S0: object  # [B, H, dp, Vp]: channel 0 written by the first program (``_store_constant``)
  out_z0: object  # [tiles, B, H, dp]: likewise


def _trig_index(c):
  """Which of (cos, sin) channel c reads: U = (1, cos, sin)[c mod 3] (channel 0 and 3 read cos and
  ignore it)."""
  return jnp.maximum(c % 3 - 1, 0)


def _specs(Tp: int, dp: int, cfg: KernelConfig) -> _Specs:
  """The specs over the grid; inputs read channel group g + ``cfg.first_group``, outputs are indexed by
  the grid's own g."""
  G, BV, first = cfg.channels, cfg.block_v, cfg.first_group
  spec = pl.BlockSpec
  return _Specs(
      trig=lambda i: spec((None, Tp, None, None, dp),
                          lambda g, j, b, h: (b, 0, h, _trig_index((g + first) * G + i), 0)),
      root=spec((None, Tp, None, dp), lambda g, j, b, h: (b, 0, h, 0)),
      v=spec((None, Tp, None, BV), lambda g, j, b, h: (b, 0, h, j)),
      row=spec((None, Tp), lambda g, j, b, h: (b, 0)),
      token=spec((None, Tp, None), lambda g, j, b, h: (b, 0, h)),
      S=lambda i: spec((None, None, None, dp, BV), lambda g, j, b, h: (b, h, (g + first) * G + i, 0, j)),
      z=lambda i: spec((None, None, None, dp), lambda g, j, b, h: (b, h, (g + first) * G + i, 0)),
      group_v=spec((None, None, Tp, None, BV), lambda g, j, b, h: (g, b, 0, h, j)),
      tile_token=spec((None, None, None, Tp, None), lambda g, j, b, h: (j, g, b, 0, h)),
      group_S=spec((None, None, None, dp, BV), lambda g, j, b, h: (g, b, h, 0, j)),
      tile_z=spec((None, None, None, None, dp), lambda g, j, b, h: (j, g, b, h, 0)),
      tile_phi=spec((None, None, Tp, None, None, dp), lambda g, j, b, h: (j, b, 0, h, g, 0)),
      S_constant=spec((None, None, None, dp, BV), lambda g, j, b, h: (b, h, 0, 0, j)),
      z_constant=spec((None, None, None, dp), lambda g, j, b, h: (b, h, 0, 0)),
      out_S0=spec((None, None, dp, BV), lambda g, j, b, h: (b, h, 0, j)),
      out_z0=spec((None, None, None, dp), lambda g, j, b, h: (j, b, h, 0)))


def _grid(v, st: Static, cfg: KernelConfig):
  """(channel groups from ``cfg.first_group``, value tiles, B, H). The Triton launch runs the first two
  fastest, so the programs of one (row, head), which read the same values, run side by side."""
  B, _, H, _ = v.shape
  return CHANNELS // cfg.channels - cfg.first_group, st.Vp // cfg.block_v, B, H


def _channels(parts, axis: int):
  """Per-channel results of the kernels, one array per channel index i within a group, each with
  the groups first [groups, ...] -> one array with the 6 channels (c = g·G + i) at ``axis``."""
  groups = parts[0].shape[0]
  x = jnp.stack(parts, axis=1)
  x = x.reshape(groups * len(parts), *x.shape[2:])
  return jnp.moveaxis(x, 0, axis)


def _feature_grads(parts, dtype) -> list:
  """The kernels' feature gradients, one array per channel index i within a group, each
  [tiles, B, Tp, H, groups, dp] -> [B, Tp, H, groups, dp] in ``dtype`` (channel c = g·G + i of part
  i, ``pallas_triton_factors.factor_grads``'s layout): the tiles' parts summed in fp32 where there
  are several."""
  return [x[0] if x.shape[0] == 1 else _tile_sum(x).astype(dtype) for x in parts]


def _shape(*shape, dtype=_F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _tile_sum(x):
  """The sum of parts [parts, ...] (value tiles or channel groups) in fp32."""
  return jnp.sum(x.astype(_F32), axis=0)


def _factor_specs(s: _Specs, G: int) -> list:
  """The in_specs of one operand's factors: G trig blocks, then the roots."""
  return [s.trig(i) for i in range(G)] + [s.root]


def _factor_args(factors: Factors, G: int) -> list:
  return [factors.trig] * G + [factors.root]


def _forward(fq: Factors, fk: Factors, v, run, S0, z0, st: Static):
  """Forward kernel: o [B, Tp, H, Vp] in v's dtype, D [B, Tp, H] and the final (S, z), fp32."""
  cfg = _without_constant(st.forward)
  B, Tp, H, _ = v.shape
  G, grid = cfg.channels, _grid(v, st, cfg)
  groups, tiles = grid[:2]
  s = _specs(Tp, st.dp, cfg)
  each = lambda make: [make(i) for i in range(G)]
  constant = [s.S_constant, s.z_constant] if cfg.first_group else []
  in_specs = _factor_specs(s, G) * 2 + [s.v, s.row] + each(s.S) + each(s.z) + constant
  out_specs = [s.group_v, s.tile_token] + [s.group_S] * G + [s.tile_z] * G
  out_shape = ([_shape(groups, B, Tp, H, st.Vp, dtype=v.dtype), _shape(tiles, groups, B, Tp, H)]
               + [_shape(groups, B, H, st.dp, st.Vp)] * G + [_shape(tiles, groups, B, H, st.dp)] * G)
  num, den, *state = pu.call(_forward_kernel, cfg, grid, in_specs, out_specs, out_shape,
                             *_factor_args(fq, G), *_factor_args(fk, G), v, run, *[S0] * G,
                             *[z0] * G, *[S0, z0][:len(constant)])
  den = jnp.sum(den[0], axis=0)
  o = _tile_sum(num) / (den[..., None] + st.c_eps)
  S = _channels(state[:G], 2)
  z = _channels([x[0] for x in state[G:]], 2)
  if cfg.first_group:
    S, z = _with_constant(*_constant_final_state(v, run, S0, z0, st), S, z)
  return o.astype(v.dtype), den, S, z


def _constant_final_state(v, run, S0, z0, st: Static):
  """Channel 0 of the state after each kernel row, where the forward's grid leaves it out: the sums of
  (v, 1) over the row's last run (real tokens), after the initial state's where the row is one run."""
  real_BxTpxH = jnp.broadcast_to((jnp.arange(run.shape[1]) < st.length)[None, :, None], v.shape[:3])
  return _constant_channel(run == run[:, -1:], run, v, real_BxTpxH, S0, z0, st)


def _constant_channel(tokens_BxTp, run, x_BxTpxHxV, y_BxTpxH, S, z, st: Static):
  """Channel 0 ([B', H, dp, Vp] and [B', H, dp], fp32) of a state, or state gradient, of the kernel
  rows to which Phi's constant channel (1 on the real head dims) adds sum_t (x_t, y_t) over ``tokens``
  on each real dim, kept on top of (S, z)'s channel 0 where the row is one run."""
  whole_B = run[:, -1] == 0
  dims = (jnp.arange(st.dp) < st.forward.head_dim).astype(_F32)
  x_BxHxV = jnp.sum(jnp.where(tokens_BxTp[:, :, None, None], x_BxTpxHxV.astype(_F32), 0.0), axis=1)
  y_BxH = jnp.sum(jnp.where(tokens_BxTp[:, :, None], y_BxTpxH.astype(_F32), 0.0), axis=1)
  S = dims[:, None] * x_BxHxV[:, :, None, :] + jnp.where(whole_B[:, None, None, None], S[:, :, 0], 0.0)
  z = dims * y_BxH[:, :, None] + jnp.where(whole_B[:, None, None], z[:, :, 0], 0.0)
  return S, z


def _without_constant(cfg: KernelConfig) -> KernelConfig:
  """``cfg`` without the programs of Phi's constant channel where it is a group of its own (one channel
  per program). Its scores are the count d and its state's rows move alike, so the forward and dv walks
  and the spans' totals and entry-gradient kernels fold it into the grid's first program
  (``_constant_flag``); its feature gradients are never used (the
  channel has no parameters), so the dq and dk walks skip it, and the one thing its dk programs give,
  the initial state's channel 0, is ``_constant_entry_grads``."""
  return cfg._replace(first_group=1) if cfg.channels == 1 else cfg


def _dq(fk: Factors, v, run, dN, dD, S0, z0, st: Static):
  """dq kernel: d Phi(q) in the features' dtype, as G parts [B, Tp, H, groups, dp] (``_feature_grads``)
  from channel ``first`` on, and ``first``."""
  cfg = _without_constant(st.dq)
  B, Tp, H, _ = v.shape
  G, grid = cfg.channels, _grid(v, st, cfg)
  groups, tiles = grid[:2]
  s = _specs(Tp, st.dp, cfg)
  in_specs = (_factor_specs(s, G) + [s.v, s.row, s.v, s.token]
              + [s.S(i) for i in range(G)] + [s.z(i) for i in range(G)])
  dtype = fk.trig.dtype
  parts = pu.call(_dq_kernel, cfg, grid, in_specs, [s.tile_phi] * G,
                  [_shape(tiles, B, Tp, H, groups, st.dp, dtype=dtype)] * G,
                  *_factor_args(fk, G), v, run, dN, dD, *[S0] * G, *[z0] * G)
  return _feature_grads(parts, dtype), cfg.first_group * G


def _constant_entry_grads(run, dN, dD, dS, dz, st: Static):
  """Channel 0 of the gradients of the states entering the kernel rows, which the dk walk would carry:
  sum_t (dN_t, dD_t) over the row's run-0 tokens, plus the leaving state's gradient (dS, dz channel 0)
  where the row is one run (``_constant_channel``)."""
  return _constant_channel(run == 0, run, dN, dD, dS, dz, st)


def _dkv(fq: Factors, fk: Factors, v, run, dN, dD, dS, dz, st: Static):
  """The dk and dv walks: d Phi(k) in the features' dtype, as G parts [B, Tp, H, groups, dp]
  (``_feature_grads``) from channel ``first`` on, ``first``, dv [B, Tp, H, Vp] and the initial state's
  gradients (S, z in kernel layout), fp32."""
  B, Tp, H, _ = v.shape
  cfg = _without_constant(st.dkv)
  G, grid = cfg.channels, _grid(v, st, cfg)
  groups, tiles = grid[:2]
  s = _specs(Tp, st.dp, cfg)
  each = lambda make: [make(i) for i in range(G)]
  constant = [s.S_constant] if cfg.first_group else []
  dv = pu.call(_dv_kernel, cfg, grid, _factor_specs(s, G) * 2 + [s.row, s.v] + each(s.S) + constant,
               s.group_v, _shape(groups, B, Tp, H, st.Vp, dtype=v.dtype), *_factor_args(fq, G),
               *_factor_args(fk, G),
               run, dN, *[dS] * (G + len(constant)))
  in_specs = _factor_specs(s, G) + [s.v, s.row, s.v, s.token] + each(s.S) + each(s.z)
  out_specs = [s.tile_phi] * G + [s.group_S] * G + [s.tile_z] * G
  dtype = fq.trig.dtype
  out_shape = ([_shape(tiles, B, Tp, H, groups, st.dp, dtype=dtype)] * G
               + [_shape(groups, B, H, st.dp, st.Vp)] * G + [_shape(tiles, groups, B, H, st.dp)] * G)
  out = pu.call(_dk_kernel, cfg, grid, in_specs, out_specs, out_shape,
                *_factor_args(fq, G), v, run, dN, dD, *[dS] * G, *[dz] * G)
  dphi_k, dS0 = out[:G], _channels(out[G:2 * G], 2)
  dz0 = _channels([jnp.sum(x, axis=0) for x in out[2 * G:]], 2)
  if cfg.first_group:
    dS0, dz0 = _with_constant(*_constant_entry_grads(run, dN, dD, dS, dz, st), dS0, dz0)
  return _feature_grads(dphi_k, dtype), cfg.first_group * G, _tile_sum(dv), dS0, dz0


def _in_parts(x, st: Static):
  """[B', Tp, ...] kernel rows -> [B'·K, Tp / K, ...]: each row as K = ``st.parts`` rows, one per part."""
  return spans.to_rows(x, st.parts)


def _part_config(st: Static) -> KernelConfig:
  """The parts' kernels' config: the dk and dv walks' tiling over rows of one part, without the
  constant channel's programs where it is a group of its own (the first program carries it)."""
  L = st.padded_length // st.parts
  return _without_constant(st.dkv._replace(length=L, padded_length=L))


def _state_outputs(s: _Specs, grid, B: int, st: Static, cfg: KernelConfig) -> tuple[list, list]:
  """(out_specs, out_shape) of a kernel that writes one state per program (``_totals_kernel``,
  ``_entry_grad_kernel``): G S channels, G z channels per value tile, then channel 0's where the grid
  leaves it out."""
  G, (groups, tiles, _, H) = cfg.channels, grid
  specs = [s.group_S] * G + [s.tile_z] * G + ([s.out_S0, s.out_z0] if cfg.first_group else [])
  shape = ([_shape(groups, B, H, st.dp, st.Vp)] * G + [_shape(tiles, groups, B, H, st.dp)] * G
           + ([_shape(B, H, st.dp, st.Vp), _shape(tiles, B, H, st.dp)] if cfg.first_group else []))
  return specs, shape


def _states(out, cfg: KernelConfig):
  """``_state_outputs``' arrays -> (S [B, H, 6, dp, Vp], z [B, H, 6, dp]) fp32 (value tile 0's z)."""
  G = cfg.channels
  S, z = _channels(out[:G], 2), _channels([x[0] for x in out[G:2 * G]], 2)
  if cfg.first_group:
    S, z = _with_constant(out[2 * G], out[2 * G + 1][0], S, z)
  return S, z


def _with_constant(S_c, z_c, S, z):
  """(S, z) of channels 1..5 [B, H, 5, ...] with channel 0 (S_c, z_c) [B, H, ...] put first."""
  return jnp.concatenate([S_c[:, :, None], S], 2), jnp.concatenate([z_c[:, :, None], z], 2)


def _totals(fk: Factors, v, run, st: Static):
  """Each part's sums over its last run, (S [B·K, H, 6, dp, Vp], z [B·K, H, 6, dp]) fp32, by
  ``_totals_kernel`` over rows of one part (``_in_parts``; runs counted from each part's first token)."""
  parts = lambda x: _in_parts(x, st)
  fk, v, run, cfg = jax.tree.map(parts, fk), parts(v), parts(run), _part_config(st)
  run = run - run[:, :1]
  B, Tp, _, _ = v.shape
  grid = _grid(v, st, cfg)
  s = _specs(Tp, st.dp, cfg)
  out_specs, out_shape = _state_outputs(s, grid, B, st, cfg)
  out = pu.call(_totals_kernel, cfg, grid, _factor_specs(s, cfg.channels) + [s.v, s.row], out_specs,
                out_shape, *_factor_args(fk, cfg.channels), v, run)
  return _states(out, cfg)


def _entry_grads(fq: Factors, run, dN, dD, st: Static):
  """The gradients that each kernel row's own tokens give its entering state, (dS [B', H, 6, dp,
  Vp], dz [B', H, 6, dp]) fp32: ``_entry_grad_kernel`` over rows of one part, summed over the parts."""
  parts = lambda x: _in_parts(x, st)
  fq, run, dN, dD, cfg = jax.tree.map(parts, fq), parts(run), parts(dN), parts(dD), _part_config(st)
  B, Tp, _, _ = dN.shape
  grid = _grid(dN, st, cfg)
  s = _specs(Tp, st.dp, cfg)
  out_specs, out_shape = _state_outputs(s, grid, B, st, cfg)
  out = pu.call(_entry_grad_kernel, cfg, grid, _factor_specs(s, cfg.channels) + [s.row, s.v, s.token],
                out_specs, out_shape, *_factor_args(fq, cfg.channels), run, dN, dD)
  whole = lambda x: jnp.sum(x.reshape(-1, st.parts, *x.shape[1:]), axis=1)
  return jax.tree.map(whole, _states(out, cfg))


def _entering(fk: Factors, v, run, docs, S0, z0, st: Static):
  """The states entering the kernels' rows: the rows' own (S0, z0) unless each row is cut into
  ``st.spans`` spans (``lmcore.ops.common.spans``), whose entering states follow from the totals of
  their parts (``docs``: the parts' ``spans.Documents``)."""
  if st.spans == 1:
    return S0, z0
  return spans.entering_rows(_totals(fk, v, run, st), (S0, z0), docs, st.spans, st.parts)


def _leaving_grads(fq: Factors, run, dN, dD, docs, dS, dz, st: Static):
  """The gradients of the states leaving the kernels' rows, which the dk and dv walks start from: the
  final state's cotangents (dS, dz), unless each row is cut into spans, whose leaving states' gradients
  follow from those that each span's tokens give its entering state (``spans.leaving_grads``)."""
  if st.spans == 1:
    return dS, dz
  return spans.leaving_row_grads(_entry_grads(fq, run, dN, dD, st), (dS, dz), docs, st.spans, st.parts)


def _factors(q, k, omega, lam_raw, pos, st: Static) -> tuple[Factors, Factors]:
  """The factors of Phi(q) and of Phi(k) in the operands' dtype, padded (``factor_kernels.factors``):
  three d-wide arrays per operand where Phi is 6d wide, computed once per token."""
  one = functools.partial(factor_kernels.factors, omega=omega, lam_raw=lam_raw, positions=pos,
                          rotate=st.rotate, padded_length=st.padded_length, dp=st.dp,
                          interpret=st.forward.interpret)
  return one(q), one(k)


def _pad_tokens(x, st: Static):
  return pu.pad_axis(pu.pad_axis(x, 1, st.padded_length), 3, st.Vp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _fused(q, k, v, omega, lam_raw, pos, run, docs, S0, z0, st: Static):
  """(o [B', T, H, dv], S, z) of raw q, k [B', T, H, d], v, omega and lam_raw [H, d], positions
  [B', T], padded run ids [B', Tp] and the initial state in kernel layout (S0 [B, H, 6, dp, Vp], z0
  [B, H, 6, dp]); S and z are the final state in the same layout. B' = B: one row per row;
  B' = B·G: each row cut into G = ``st.spans`` spans, with runs counted from each span's first
  token and ``docs`` (``spans.documents``) saying how the spans' states pass on."""
  return _fused_fwd(q, k, v, omega, lam_raw, pos, run, docs, S0, z0, st)[0]


def _fused_fwd(q, k, v, omega, lam_raw, pos, run, docs, S0, z0, st: Static):
  fq, fk = _factors(q, k, omega, lam_raw, pos, st)
  vp = _pad_tokens(v, st)
  E_S, E_z = _entering(fk, vp, run, docs, S0, z0, st)
  o, den, S, z = _forward(fq, fk, vp, run, E_S, E_z, st)
  out = (o[:, :st.length, :, :v.shape[-1]], spans.span(S, -1, st.spans), spans.span(z, -1, st.spans))
  kept = (fq, fk) if st.keep_factors else None
  # The barrier keeps o in v's dtype for the backward: without it XLA drops the round trip through
  # bf16 and keeps the fp32 quotient, twice the bytes to write, hold and read.
  o = jax.lax.optimization_barrier(o)
  return out, (q, k, v, omega, lam_raw, pos, run, docs, S0, z0, E_S, E_z, o, den, kept)


def _fused_bwd(st: Static, residuals, cotangents):
  """dN = do / (D + c eps) and dD = -(do · o) / (D + c eps) in XLA, the dq, dk and dv walks, then the
  factor kernels' VJP (product rule and chain rule, ``factor_kernels.factor_grads``). The walks read the
  forward's factors when it kept them (``Static.keep_factors``), else factors recomputed here."""
  q, k, v, omega, lam_raw, pos, run, docs, S0, z0, E_S, E_z, o, den, kept = residuals
  do, dS, dz = cotangents
  q, k, omega, lam_raw = after_cotangent((q, k, omega, lam_raw), do)
  fq, fk = kept if kept is not None else _factors(q, k, omega, lam_raw, pos, st)
  inv_BxTxH = 1.0 / (den + st.c_eps)
  do = _pad_tokens(do.astype(_F32), st)
  dN = (do * inv_BxTxH[..., None]).astype(v.dtype)
  dD = -jnp.sum(do * o.astype(_F32), axis=-1) * inv_BxTxH
  vp = _pad_tokens(v, st)
  dphi_q, first_q = _dq(fk, vp, run, dN, dD, E_S, E_z, st)
  dS, dz = _leaving_grads(fq, run, dN, dD, docs, dS.astype(_F32), dz.astype(_F32), st)
  dphi_k, first_k, dv, dS0, dz0 = _dkv(fq, fk, vp, run, dN, dD, dS, dz, st)
  dS0, dz0 = spans.span(dS0, 0, st.spans), spans.span(dz0, 0, st.spans)
  grads = functools.partial(factor_kernels.factor_grads, omega=omega, lam_raw=lam_raw, positions=pos,
                            rotate=st.rotate, interpret=st.forward.interpret)
  dq, d_omega_q, d_lam_q = grads(q, dphi_parts=dphi_q, first_channel=first_q)
  dk, d_omega_k, d_lam_k = grads(k, dphi_parts=dphi_k, first_channel=first_k)
  dv = dv[:, :st.length, :, :v.shape[-1]].astype(v.dtype)
  return dq, dk, dv, d_omega_q + d_omega_k, d_lam_q + d_lam_k, None, None, None, dS0, dz0


_fused.defvjp(_fused_fwd, _fused_bwd)


def _kernel_config(tiles: KernelTiles, T: int, d: int, Vp: int, documents: bool, interpret: bool,
                   precision: str) -> KernelConfig:
  """``tiles`` with the chunk capped at the next power of two >= T and the value tile at Vp (both
  >= 16 when compiled); the padded length is set once every kernel's chunk is known."""
  smallest = 1 if interpret else pu.MIN_DOT
  return KernelConfig(chunk=max(min(tiles.chunk, pl.next_power_of_2(T)), smallest),
                      block_v=max(min(tiles.block_v, Vp), smallest), channels=tiles.channels,
                      documents=documents, interpret=interpret, num_warps=tiles.num_warps,
                      num_stages=tiles.num_stages, precision=precision, length=T, head_dim=d,
                      padded_length=T, dp=pu.block_size(d, interpret))


def _check(q, v, state, op: str) -> None:
  B, _, H, d = q.shape
  expected = (B, H, CHANNELS * d, v.shape[-1])
  if state is not None and tuple(state.S.shape) != expected:
    raise ValueError(f"{op}: state.S has shape {tuple(state.S.shape)}, expected [B, H, 6d, dv] = "
                     f"{expected}")


def _parts(T: int, count: int, chunk: int, requested: int) -> int:
  """The parts each span's totals are summed in: ``requested`` (it must cut the span into whole
  chunks: ValueError otherwise), or ``spans.parts``' rule for 0."""
  if not requested:
    return spans.parts(T, count, chunk)
  if (T // count) % (requested * chunk):
    raise ValueError(f"pallas_fused tiles: parts={requested} does not cut spans of {T // count} tokens "
                     f"into whole chunks of {chunk}")
  return requested


def sanatan_fused_pallas(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                         lam_raw: jax.Array, *, positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None, state: SanatanState | None = None,
                         rotate: bool = True, interpret: bool | None = None,
                         tiles: FusedTiles | None = None, precision: str = "input",
                         remat: bool = True) -> tuple[jax.Array, SanatanState]:
  """SANATAN p = 1, 6 channels (MATH §1.2) by the fused-chunk Pallas kernels; the function of
  ``sanatan_attention(..., p=1, channels=6)``.

  Args:
    q, k: raw [B, T, H, d] (already divided by sqrt(d)); v: [B, T, H, dv]; bf16 or fp32.
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1 offset by ``state.position``.
    segment_ids: optional [B, T] packed-document ids (api.py's convention).
    state: a SanatanState to continue from; None means zeros.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    tiles: the kernels' tilings; None means ``default_tiles`` of the operands' dtype. Chunks are capped
      at the next power of two >= T, value tiles at the padded dv.
    precision: "input" (dots take operands in the inputs' dtype), "tf32" or "float32" (the
      kernels run on fp32 copies and return fp32; ``pu.PRECISIONS``).
    remat: the backward recomputes the factors of Phi from q and k; False keeps the forward's
      (3d values per token, head and operand in the kernels' dtype) until the backward.

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 unless ``precision`` is "input") and the SanatanState
    after the last token (fp32 S, z).
  """
  op = "sanatan_fused_pallas"
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, op, "sanatan_attention(implementation='chunked')")
  pu.check_precision(precision, op)
  if tiles is None:
    tiles = default_tiles(pu.operands(precision, q)[0].dtype)
  _check(q, v, state, op)
  q, k, v = pu.operands(precision, q, k, v)
  B, T, H, d = q.shape
  V = v.shape[-1]
  if positions is None:
    positions = default_positions(B, T, None if state is None else state.position)
  count = spans.count(B, H, T, max(t.chunk for t in tiles.kernels), tiles.spans)
  L = T // count  # tokens per kernel row
  Vp = pu.block_size(V, interpret)
  make = functools.partial(_kernel_config, T=L, d=d, Vp=Vp, documents=segment_ids is not None,
                           interpret=interpret, precision=precision)
  configs = [make(t) for t in tiles.kernels]
  chunk = max(c.chunk for c in configs)
  Lp = pu.round_up(L, chunk)
  forward, dq, dkv = (c._replace(padded_length=Lp) for c in configs)
  st = Static(forward=forward, dq=dq, dkv=dkv, rotate=rotate, length=L, padded_length=Lp,
              dp=forward.dp, Vp=Vp, c_eps=features.score_scale(CHANNELS, "clean", d) * EPS,
              keep_factors=not remat, spans=count,
              parts=_parts(T, count, chunk, tiles.parts) if count > 1 else 1)
  doc = document_index(segment_ids, B, T)
  docs = spans.documents(doc, count * st.parts) if count > 1 else None
  # Edge-padding keeps padded (zero-feature) tokens in the last run: they neither reset the state
  # nor add to it.
  run = pu.pad_axis(spans.renumbered(doc, count), 1, st.padded_length, mode="edge")
  S0, z0 = channel_major_state(state, B, H, d, st.dp, V, Vp)
  rows = lambda x: spans.to_rows(x, count)
  o, S, z = _fused(rows(q), rows(k), rows(v), omega, lam_raw, rows(positions.astype(jnp.int32)), run,
                   docs, S0, z0, st)
  o = spans.from_rows(o, count)
  S, z = interleaved_state(S, z, d, V)
  return o, SanatanState(S, z, positions[:, -1].astype(jnp.int32) + 1)


class PallasFused(Backend[FusedTiles]):
  """The fused-chunk Triton kernels as a backend (p = 1 with 6 channels), each device of the mesh in
  context on its own rows and heads (``shard_map.run_sharded``)."""

  platforms = TRITON
  tiles_type = FusedTiles
  requirement = "p = 1 with 6 channels"

  def supports(self, problem: Problem) -> bool:
    return problem.constant_state

  def preferred(self, problem: Problem) -> bool:
    return problem.head_dim <= MAX_HEAD_DIM and problem.value_dim <= MAX_VALUE_DIM

  def heuristic_config(self, problem: Problem) -> FusedTiles:
    return default_tiles(problem.dtype)

  def flops_per_head(self, problem: Problem, tiles: FusedTiles | None = None) -> float:
    chunk = self.config(problem, tiles).forward.chunk
    return flops.chunked(problem.feature_dim, problem.value_dim + 1, chunk, problem.length or chunk)

  def __call__(self, q, k, v, omega, lam_raw, *, positions, segment_ids, state, tiles: FusedTiles,
               options: Options):
    kernel = functools.partial(sanatan_fused_pallas, rotate=options.rotate, tiles=tiles,
                               precision=options.precision, remat=options.remat)
    inputs = dict(q=q, k=k, v=v, omega=omega, lam_raw=lam_raw, positions=positions,
                  segment_ids=segment_ids, state=state)
    return shard_map.run_sharded(kernel, inputs, KERNEL_LAYOUTS, ("BTH", STATE_LAYOUT))
