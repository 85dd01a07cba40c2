"""Pallas (Triton lowering) fused-chunk kernels for BASED's Taylor linear attention (MATH §2.1).

Per head, with ``s = q·k / sqrt(d')`` and ``A = 1 + s + s²/2 = phi(q)·phi(k)`` (``full`` features
``[1, x / d'^(1/4), vec(x ⊗ x) / sqrt(2 d')]``, ``taylor.py``)::

    o_t = N_t / (D_t + eps),   N_t = sum_{j<=t} A_tj v_j,   D_t = sum_{j<=t} A_tj.

Chunks of C tokens split both sums in two parts:

* intra: pairs inside the chunk, straight from q kᵀ (no features). ``_intra_kernel`` and
  ``_intra_grad_kernel`` run over (batch, head, chunk, value tile), fully in parallel.
* state: phi(q_t) S_n and phi(q_t)·z_n with the state entering chunk n, ``S = sum phi(k) vᵀ`` and
  ``z = sum phi(k)``. The walk kernels run over (feature block, value tile, batch, head): a program
  owns ``features`` rows of phi and ``block_v`` value columns, carries its fp32 blocks of S and z
  through the chunks in registers (FLA's "fused_chunk" layout), so no state ever reaches HBM, and
  the grid has (1 + d'²/features) x dv/block_v programs per (row, head). Their parts of N and D
  (fp32) are summed and divided in XLA.

Feature blocks (``dp``: d' padded to a power of two). Block p < P - 1 holds the quadratic rows
(g, b) = x_g x_b / sqrt(2 d') for g in [p F/dp, (p + 1) F/dp) and b < dp; the last block holds the
linear rows x_b / d'^(1/4) (b < dp), the constant 1 (row dp) and zeros. A block is
``(x E1 + c1) ⊙ (x E2 + c2) ⊙ scale`` with 0/1 selection matrices E1, E2 [dp, F] made from the
program id: each dot copies one column per output (exact in fp32), one product forms the block, and
the backward's chain rule is the same two dots transposed.

Walks (dN = do / (D + eps), dD = -(do · o) / (D + eps), XLA):

* ``_forward_kernel``, chunks in order: the state part of N and D, then S += phi(K_n)ᵀ V_n,
  z += phi(K_n)ᵀ 1; it writes the final state.
* ``_dq_kernel``, chunks in order, recomputing the state: d phi(q_t) = S dN_t + z dD_t over the
  state's readers, through the chain rule to dq.
* ``_dkv_kernel``, chunks in reverse, carrying the gradient of the state after the chunk,
  (dS, dz) <- keep (dS, dz) + phi(Q_n)ᵀ (dN, dD) over the readers (from the final state's
  cotangent): d phi(k_j) = dS v_j + dz and dv_j = dSᵀ phi(k_j) over the chunk's last run; the carry
  left at the start is the initial state's gradient.

The intra backward: dA = dN vᵀ + dD on visible pairs, dq = (dA ⊙ (1 + s)) k / sqrt(d'),
dk = (dA ⊙ (1 + s))ᵀ q / sqrt(d'), dv = Aᵀ dN. Value tiles split dN and v; the terms in dD, which
every tile sees whole, are taken in tile 0 only; XLA sums the tiles' and blocks' parts of dq, dk
(fp32) and the blocks' parts of dv.

Packed documents: ``run`` (``segments.document_index``, non-decreasing per row) numbers the runs of
equal segment ids. A token reads the carried state only in the state's run (the run of the token
before its chunk; run 0 for the first chunk, which the incoming state continues); a chunk hands on
only its last run's writes and keeps the carried state only when that run is the state's.

Spans (``FusedTiles.spans``, ``lmcore.ops.common.spans``): a row of T tokens can run as G rows of
T / G, each walked from the state entering its span. Forward: ``_totals_kernel`` sums phi(k)ᵀ (v, 1)
over the last run of each part of a span (``FusedTiles.parts``; side by side) and ``spans.entering``
makes the spans' entering states. Backward: ``_entry_grad_kernel`` sums phi(q)ᵀ (dN, dD) over each
span's run 0 and ``spans.leaving_grads`` turns those and the final state's cotangent into the
gradients of the spans' leaving states, which the dk/dv walk starts from (a span's leaving state is
its total plus what it keeps of its entering state, so the totals' gradients need no kernel of their
own).

Precision: dots take operands in the inputs' dtype (bf16 in training; the fp32 states are cast for
their dots), accumulation is fp32, the features and their gradients are fp32 until a dot takes them.
Kernel state layout: ``full`` features, each row once; ``_rows`` maps it to and from TaylorState's
``feature`` layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from based_jax import taylor
from based_jax.ops.taylor_attention.base import (KERNEL_LAYOUTS, KERNEL_OUT_LAYOUTS, Options, Problem,
                                                 TaylorState, as_state)
from lmcore.ops.common import flops
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common import shard_map, spans
from lmcore.ops.common.backend import TRITON, Backend, check_power_of_two
from lmcore.ops.common.segments import document_index

_F32 = jnp.float32
_OP = "taylor_linear_attention(implementation='pallas_fused')"
# Compiled, from d' = 64 (feature blocks of 2 d' = 128 rows) a walk program exceeds shared memory.
MAX_KEY_DIM = 32
# The widest dv "auto" gives them: the widest timed (docs/BENCHMARKS.md, Taylor heads and lengths).
AUTO_MAX_VALUE_DIM = 512
# Stages of a kernel with 4-byte operands (fp32 inputs, the "tf32" and "float32" copies): at twice the
# shared memory per stage, three stages of 128-token chunks do not fit.
FP32_MAX_STAGES = 2


@dataclasses.dataclass(frozen=True)
class FusedTiles:
  """Tiling: ``chunk`` tokens per step (a power of two, >= 16 compiled), ``features`` rows of phi per
  walk program (a power of two; held between 2 dp and dp²), ``block_v`` value columns per program (a
  power of two), (Triton warps, pipeline stages) of the forward walk, the dq walk, the dk/dv walk and
  the intra kernels (4-byte operands run at most ``FP32_MAX_STAGES`` stages), ``spans``: how many
  spans each row is cut into (``lmcore.ops.common.spans``; 0: ``spans.count``'s rule, 1: none) and
  ``parts``: how many parts each span's totals are summed in (0: ``spans.parts``' rule; else a number
  that cuts a span into whole chunks).

  The defaults are the fastest tiling timed (docs/BENCHMARKS.md, Taylor kernel tilings;
  ``benchmarks.harness.TAYLOR_FUSED_TUNING``).
  """

  chunk: int = 128
  features: int = 64
  block_v: int = 64
  forward: tuple[int, int] = (8, 3)
  dq: tuple[int, int] = (8, 3)
  dkv: tuple[int, int] = (8, 3)
  intra: tuple[int, int] = (8, 2)
  spans: int = 0
  parts: int = 0

  def __post_init__(self):
    check_power_of_two("taylor_linear_attention tiles", chunk=self.chunk, features=self.features,
                       block_v=self.block_v)
    for name in ("forward", "dq", "dkv", "intra"):  # a config file's lists, as hashable pairs
      warps_stages = tuple(getattr(self, name))
      if len(warps_stages) != 2:
        raise ValueError(f"taylor_linear_attention tiles: {name} must be (warps, stages), got "
                         f"{getattr(self, name)!r}")
      object.__setattr__(self, name, warps_stages)


class KernelConfig(NamedTuple):
  """Static parameters of one kernel (``pu.call`` reads interpret, warps, stages and precision)."""

  chunk: int
  features: int
  block_v: int
  key_dim: int
  dp: int
  length: int
  padded_length: int
  documents: bool
  interpret: bool
  num_warps: int
  num_stages: int
  precision: str


class Static(NamedTuple):
  """What the custom VJP holds static: the four kernels' configs and eps."""

  forward: KernelConfig
  dq: KernelConfig
  dkv: KernelConfig
  intra: KernelConfig
  eps: float
  spans: int = 1
  parts: int = 1


# In-kernel pieces.

class _Selection(NamedTuple):
  """This program's feature block: phi = (x E1 + c1 valid) ⊙ (x E2 + c2) ⊙ scale."""

  E1: jax.Array  # [dp, F], the inputs' dtype
  E2: jax.Array
  c1: jax.Array  # [F] fp32
  c2: jax.Array
  scale: jax.Array


def _quad_blocks(cfg: KernelConfig) -> int:
  return cfg.dp * cfg.dp // cfg.features


def _selection(dtype, cfg: KernelConfig) -> _Selection:
  """The selection of block ``program_id(0)`` (module docstring). Blocks are told apart by
  arithmetic on a float flag rather than by a scalar select."""
  F, dp, d = cfg.features, cfg.dp, cfg.key_dim
  p = pl.program_id(0)
  base = (p == _quad_blocks(cfg)).astype(_F32)
  row = jax.lax.broadcasted_iota(jnp.int32, (dp, F), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (dp, F), 1)
  quad_E1 = (row == p * (F // dp) + col // dp).astype(_F32)
  E1 = base * (row == col).astype(_F32) + (1.0 - base) * quad_E1
  E2 = (1.0 - base) * (row == col % dp).astype(_F32)
  j = jax.lax.broadcasted_iota(jnp.int32, (F,), 0)
  linear = jnp.where(j < dp, d ** -0.25, 1.0)
  return _Selection(E1.astype(dtype), E2.astype(dtype), base * (j == dp).astype(_F32),
                    base + jnp.zeros((F,), _F32), base * linear + (1.0 - base) * (2.0 * d) ** -0.5)


def _valid(n, cfg: KernelConfig):
  """[C] fp32: 1 on chunk n's real tokens (1.0 when nothing is padded)."""
  if cfg.padded_length == cfg.length:
    return 1.0
  token = n * cfg.chunk + jax.lax.broadcasted_iota(jnp.int32, (cfg.chunk,), 0)
  return (token < cfg.length).astype(_F32)


def _features(x_CxD, sel: _Selection, valid):
  """(phi [C, F] in x's dtype, a, b fp32) of chunk rows x: phi = a ⊙ b ⊙ scale."""
  valid_C = valid if isinstance(valid, float) else valid[:, None]
  a = pu.dot(x_CxD, sel.E1) + sel.c1[None, :] * valid_C
  b = pu.dot(x_CxD, sel.E2) + sel.c2[None, :]
  return (a * b * sel.scale[None, :]).astype(x_CxD.dtype), a, b


def _chain(dphi_CxF, a, b, sel: _Selection):
  """dx [C, dp] fp32 from d phi [C, F] (fp32): (dphi b scale) E1ᵀ + (dphi a scale) E2ᵀ."""
  dt = sel.E1.dtype
  da = (dphi_CxF * b * sel.scale[None, :]).astype(dt)
  db = (dphi_CxF * a * sel.scale[None, :]).astype(dt)
  return pu.dot(da, sel.E1, trans_b=True) + pu.dot(db, sel.E2, trans_b=True)


def _runs(run_ref, n, state_run, cfg: KernelConfig):
  """(reads [C, 1], writes [C, 1] bool or None, keep fp32, the chunk's last run) of chunk n."""
  if not cfg.documents:
    return None, None, 1.0, state_run
  run = pu.rows(run_ref, n * cfg.chunk, cfg.chunk)
  last = jnp.max(run)
  return ((run == state_run)[:, None], (run == last)[:, None], (last == state_run).astype(_F32),
          last)


def _state_run(run_ref, n, cfg: KernelConfig):
  """The run of the state entering chunk n: chunk n - 1's last run (0 for the first chunk)."""
  if not cfg.documents:
    return 0
  previous = pu.rows(run_ref, jnp.maximum(n - 1, 0) * cfg.chunk, cfg.chunk)
  return jnp.where(n > 0, jnp.max(previous), 0)


def _only(mask, x):
  return x if mask is None else jnp.where(mask, x, 0)


def _forward_kernel(q_ref, k_ref, v_ref, run_ref, S0_ref, z0_ref, num_ref, den_ref, S_ref, z_ref,
                    *, cfg: KernelConfig):
  """The state part of N, D of every chunk; the final S and z blocks."""
  C = cfg.chunk
  sel = _selection(q_ref.dtype, cfg)

  def step(n, carry):
    S, z, state_run = carry
    valid = _valid(n, cfg)
    v = pu.rows(v_ref, n * C, C)
    phi_q = _features(pu.rows(q_ref, n * C, C), sel, valid)[0]
    phi_k = _features(pu.rows(k_ref, n * C, C), sel, valid)[0]
    reads, writes, keep, last = _runs(run_ref, n, state_run, cfg)
    phi_q = _only(reads, phi_q)
    pu.store_rows(num_ref, n * C, pu.dot(phi_q, S.astype(v.dtype)))
    pu.store_rows(den_ref, n * C, jnp.sum(phi_q.astype(_F32) * z[None, :], axis=1))
    phi_k = _only(writes, phi_k)
    S = keep * S + pu.dot(phi_k, v, trans_a=True)
    z = keep * z + jnp.sum(phi_k.astype(_F32), axis=0)
    return S, z, last

  S, z, _ = jax.lax.fori_loop(0, cfg.padded_length // C, step,
                              (S0_ref[...], z0_ref[...], jnp.int32(0)))
  S_ref[...] = S
  z_ref[...] = z


def _dq_kernel(q_ref, k_ref, v_ref, run_ref, dN_ref, dD_ref, S0_ref, z0_ref, dq_ref,
               *, cfg: KernelConfig):
  """This block's and value tile's part of dq through the state reads."""
  C = cfg.chunk
  sel = _selection(q_ref.dtype, cfg)
  tile0 = (pl.program_id(1) == 0).astype(_F32)

  def step(n, carry):
    S, z, state_run = carry
    valid = _valid(n, cfg)
    v = pu.rows(v_ref, n * C, C)
    _, a_q, b_q = _features(pu.rows(q_ref, n * C, C), sel, valid)
    phi_k = _features(pu.rows(k_ref, n * C, C), sel, valid)[0]
    reads, writes, keep, last = _runs(run_ref, n, state_run, cfg)
    dN = _only(reads, pu.rows(dN_ref, n * C, C))
    dD = _only(reads, tile0 * pu.rows(dD_ref, n * C, C)[:, None])
    dphi_q = pu.dot(dN, S.astype(dN.dtype), trans_b=True) + dD * z[None, :]
    pu.store_rows(dq_ref, n * C, _chain(dphi_q, a_q, b_q, sel))
    phi_k = _only(writes, phi_k)
    S = keep * S + pu.dot(phi_k, v, trans_a=True)
    z = keep * z + jnp.sum(phi_k.astype(_F32), axis=0)
    return S, z, last

  jax.lax.fori_loop(0, cfg.padded_length // C, step, (S0_ref[...], z0_ref[...], jnp.int32(0)))


def _dkv_kernel(q_ref, k_ref, v_ref, run_ref, dN_ref, dD_ref, dS_ref, dz_ref, dk_ref, dv_ref,
                dS0_ref, dz0_ref, *, cfg: KernelConfig):
  """This block's parts of dk and dv through the state writes, and the initial state's gradient."""
  C = cfg.chunk
  n_chunks = cfg.padded_length // C
  sel = _selection(q_ref.dtype, cfg)
  tile0 = (pl.program_id(1) == 0).astype(_F32)

  def step(i, carry):
    dS, dz = carry  # the gradient of the state after chunk n
    n = n_chunks - 1 - i
    valid = _valid(n, cfg)
    v = pu.rows(v_ref, n * C, C)
    phi_q = _features(pu.rows(q_ref, n * C, C), sel, valid)[0]
    phi_k, a_k, b_k = _features(pu.rows(k_ref, n * C, C), sel, valid)
    reads, writes, keep, _ = _runs(run_ref, n, _state_run(run_ref, n, cfg), cfg)
    dN = pu.rows(dN_ref, n * C, C)
    dD = tile0 * pu.rows(dD_ref, n * C, C)[:, None]
    dS_dt = dS.astype(v.dtype)
    pu.store_rows(dv_ref, n * C, pu.dot(_only(writes, phi_k), dS_dt))
    dphi_k = _only(writes, pu.dot(v, dS_dt, trans_b=True) + dz[None, :])
    pu.store_rows(dk_ref, n * C, _chain(dphi_k, a_k, b_k, sel))
    phi_q = _only(reads, phi_q)
    dS = keep * dS + pu.dot(phi_q, dN, trans_a=True)
    dz = keep * dz + jnp.sum(phi_q.astype(_F32) * dD, axis=0)
    return dS, dz

  dS, dz = jax.lax.fori_loop(0, n_chunks, step, (dS_ref[...], tile0 * dz_ref[...]))
  dS0_ref[...] = dS
  dz0_ref[...] = dz


def _totals_kernel(k_ref, v_ref, run_ref, S_ref, z_ref, *, cfg: KernelConfig):
  """The S and z blocks a walk from zeros leaves after the row's last chunk (its sums over the row's
  last run), with no outputs on the way."""
  C = cfg.chunk
  sel = _selection(k_ref.dtype, cfg)

  def step(n, carry):
    S, z, state_run = carry
    v = pu.rows(v_ref, n * C, C)
    phi_k = _features(pu.rows(k_ref, n * C, C), sel, _valid(n, cfg))[0]
    _, writes, keep, last = _runs(run_ref, n, state_run, cfg)
    phi_k = _only(writes, phi_k)
    return (keep * S + pu.dot(phi_k, v, trans_a=True), keep * z + jnp.sum(phi_k.astype(_F32), axis=0),
            last)

  zeros = (jnp.zeros(S_ref.shape, _F32), jnp.zeros(z_ref.shape, _F32), jnp.int32(0))
  S, z, _ = jax.lax.fori_loop(0, cfg.padded_length // C, step, zeros)
  S_ref[...] = S
  z_ref[...] = z


def _entry_grad_kernel(q_ref, run_ref, dN_ref, dD_ref, dS_ref, dz_ref, *, cfg: KernelConfig):
  """The S and z blocks of the gradient that the row's tokens of run 0 give the state entering it,
  sum_t phi(q_t)ᵀ (dN_t, dD_t) over them (what the dk/dv walk adds to its carry at those tokens), with
  no outputs on the way."""
  C = cfg.chunk
  sel = _selection(q_ref.dtype, cfg)

  def step(n, carry):
    dS, dz = carry
    phi_q = _features(pu.rows(q_ref, n * C, C), sel, _valid(n, cfg))[0]
    if cfg.documents:
      phi_q = _only((pu.rows(run_ref, n * C, C) == 0)[:, None], phi_q)
    dN, dD = pu.rows(dN_ref, n * C, C), pu.rows(dD_ref, n * C, C)
    return (dS + pu.dot(phi_q, dN, trans_a=True),
            dz + jnp.sum(phi_q.astype(_F32) * dD[:, None], axis=0))

  zeros = (jnp.zeros(dS_ref.shape, _F32), jnp.zeros(dz_ref.shape, _F32))
  dS, dz = jax.lax.fori_loop(0, cfg.padded_length // C, step, zeros)
  dS_ref[...] = dS
  dz_ref[...] = dz


def _intra_scores(q, k, run_ref, cfg: KernelConfig):
  """(s [C, C] fp32, A on visible pairs: j <= t in the same run)."""
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (cfg.chunk, cfg.chunk))
  visible = iota(0) >= iota(1)
  if cfg.documents:
    run = run_ref[...]
    visible &= run[:, None] == run[None, :]
  s = pu.dot(q, k, trans_b=True) * (cfg.key_dim ** -0.5)
  return s, visible, jnp.where(visible, taylor.taylor_kernel(s), 0.0)


def _intra_kernel(q_ref, k_ref, v_ref, run_ref, num_ref, den_ref, *, cfg: KernelConfig):
  """N and D of one chunk's own pairs (one value tile)."""
  v = v_ref[...]
  _, _, A = _intra_scores(q_ref[...], k_ref[...], run_ref, cfg)
  num_ref[...] = pu.dot(A.astype(v.dtype), v)
  den_ref[...] = jnp.sum(A, axis=1)


def _intra_grad_kernel(q_ref, k_ref, v_ref, run_ref, dN_ref, dD_ref, dq_ref, dk_ref, dv_ref,
                       *, cfg: KernelConfig):
  """One chunk's own pairs' parts of dq, dk (this value tile's) and dv."""
  q, k, v, dN = q_ref[...], k_ref[...], v_ref[...], dN_ref[...]
  tile0 = (pl.program_id(3) == 0).astype(_F32)
  s, visible, A = _intra_scores(q, k, run_ref, cfg)
  dA = jnp.where(visible, pu.dot(dN, v, trans_b=True) + tile0 * dD_ref[...][:, None], 0.0)
  ds = (dA * (1.0 + s) * (cfg.key_dim ** -0.5)).astype(q.dtype)
  dq_ref[...] = pu.dot(ds, k)
  dk_ref[...] = pu.dot(ds, q, trans_a=True)
  dv_ref[...] = pu.dot(A.astype(v.dtype), dN, trans_a=True)


# Calls.

def _shape(*shape, dtype=_F32):
  return jax.ShapeDtypeStruct(shape, dtype)


class _WalkSpecs(NamedTuple):
  """BlockSpecs over the walks' grid (p, j, b, h): feature block, value tile, batch row, head."""

  qk: object  # [B, Tp, H, dp]
  v: object  # [B, Tp, H, Vp], value tile j
  row: object  # [B, Tp]
  token: object  # [B, Tp, H]
  S: object  # [B, H, P, F, Vp]
  z: object  # [B, H, P, F]
  tile_z: object  # [tiles, B, H, P, F]
  block_v: object  # [P, B, Tp, H, Vp]
  tile_token: object  # [tiles, P, B, Tp, H]
  tile_qk: object  # [P, tiles, B, Tp, H, dp]


def _walk_specs(cfg: KernelConfig) -> _WalkSpecs:
  Tp, dp, F, BV = cfg.padded_length, cfg.dp, cfg.features, cfg.block_v
  spec = pl.BlockSpec
  return _WalkSpecs(
      qk=spec((None, Tp, None, dp), lambda p, j, b, h: (b, 0, h, 0)),
      v=spec((None, Tp, None, BV), lambda p, j, b, h: (b, 0, h, j)),
      row=spec((None, Tp), lambda p, j, b, h: (b, 0)),
      token=spec((None, Tp, None), lambda p, j, b, h: (b, 0, h)),
      S=spec((None, None, None, F, BV), lambda p, j, b, h: (b, h, p, 0, j)),
      z=spec((None, None, None, F), lambda p, j, b, h: (b, h, p, 0)),
      tile_z=spec((None, None, None, None, F), lambda p, j, b, h: (j, b, h, p, 0)),
      block_v=spec((None, None, Tp, None, BV), lambda p, j, b, h: (p, b, 0, h, j)),
      tile_token=spec((None, None, None, Tp, None), lambda p, j, b, h: (j, p, b, 0, h)),
      tile_qk=spec((None, None, None, Tp, None, dp), lambda p, j, b, h: (p, j, b, 0, h, 0)))


def _walk_grid(v, cfg: KernelConfig):
  """(feature blocks, value tiles, B, H): the programs of one (row, head), which read the same
  tokens, run side by side."""
  B, _, H, Vp = v.shape
  return _quad_blocks(cfg) + 1, Vp // cfg.block_v, B, H


class _IntraSpecs(NamedTuple):
  """BlockSpecs over the intra kernels' grid (b, h, n, j): batch row, head, chunk, value tile."""

  qk: object  # [B, Tp, H, dp]
  v: object  # [B, Tp, H, Vp]
  run: object  # [B, Tp]
  token: object  # [B, Tp, H]
  tile_token: object  # [tiles, B, Tp, H]
  tile_qk: object  # [tiles, B, Tp, H, dp]


def _intra_specs(cfg: KernelConfig) -> _IntraSpecs:
  C, dp, BV = cfg.chunk, cfg.dp, cfg.block_v
  spec = pl.BlockSpec
  return _IntraSpecs(
      qk=spec((None, C, None, dp), lambda b, h, n, j: (b, n, h, 0)),
      v=spec((None, C, None, BV), lambda b, h, n, j: (b, n, h, j)),
      run=spec((None, C), lambda b, h, n, j: (b, n)),
      token=spec((None, C, None), lambda b, h, n, j: (b, n, h)),
      tile_token=spec((None, None, C, None), lambda b, h, n, j: (j, b, n, h)),
      tile_qk=spec((None, None, C, None, dp), lambda b, h, n, j: (j, b, n, h, 0)))


def _intra_grid(v, cfg: KernelConfig):
  B, Tp, H, Vp = v.shape
  return B, H, Tp // cfg.chunk, Vp // cfg.block_v


def _forward(q, k, v, run, S0, z0, st: Static):
  """(o [B, Tp, H, Vp] in v's dtype, D [B, Tp, H] fp32, final S [B, H, P, F, Vp], z [B, H, P, F])."""
  B, Tp, H, Vp = v.shape
  cfg, icfg = st.forward, st.intra
  grid = _walk_grid(v, cfg)
  P, tiles = grid[:2]
  w = _walk_specs(cfg)
  num, den, S, z = pu.call(
      _forward_kernel, cfg, grid, [w.qk, w.qk, w.v, w.row, w.S, w.z],
      [w.block_v, w.tile_token, w.S, w.tile_z],
      [_shape(P, B, Tp, H, Vp), _shape(tiles, P, B, Tp, H), _shape(*S0.shape), _shape(tiles, *z0.shape)],
      q, k, v, run, S0, z0)
  i = _intra_specs(icfg)
  num_intra, den_intra = pu.call(
      _intra_kernel, icfg, _intra_grid(v, icfg), [i.qk, i.qk, i.v, i.run], [i.v, i.tile_token],
      [_shape(B, Tp, H, Vp), _shape(Vp // icfg.block_v, B, Tp, H)], q, k, v, run)
  D = den_intra[0] + jnp.sum(den[0], axis=0)
  o = (num_intra + jnp.sum(num, axis=0)) / (D[..., None] + st.eps)
  return o.astype(v.dtype), D, S, z[0]


def _in_parts(x, st: Static):
  """[B', Tp, ...] kernel rows -> [B'·K, Tp / K, ...]: each row as K = ``st.parts`` rows, one per part."""
  return spans.to_rows(x, st.parts)


def _part_config(st: Static) -> KernelConfig:
  """The parts' kernels' config: the dk/dv walk's tiling over rows of one part."""
  L = st.dkv.padded_length // st.parts
  return st.dkv._replace(length=L, padded_length=L)


def _totals(k, v, run, st: Static):
  """Each part's sums over its last run, (S [B·K, H, P, F, Vp], z [B·K, H, P, F]) fp32, by
  ``_totals_kernel`` over rows of one part (``_in_parts``; runs counted from each part's first token)."""
  k, v, run, cfg = _in_parts(k, st), _in_parts(v, st), _in_parts(run, st), _part_config(st)
  run = run - run[:, :1]
  B, Tp, H, Vp = v.shape
  grid = _walk_grid(v, cfg)
  P, tiles = grid[:2]
  w = _walk_specs(cfg)
  S, z = pu.call(_totals_kernel, cfg, grid, [w.qk, w.v, w.row], [w.S, w.tile_z],
                 [_shape(B, H, P, cfg.features, Vp), _shape(tiles, B, H, P, cfg.features)], k, v, run)
  return S, z[0]


def _entry_grads(q, run, dN, dD, st: Static):
  """The gradients that each kernel row's own tokens give its entering state, (dS [B', H, P, F, Vp],
  dz [B', H, P, F]) fp32: ``_entry_grad_kernel`` over rows of one part, summed over the parts."""
  q, run, dN, dD = (_in_parts(x, st) for x in (q, run, dN, dD))
  cfg = _part_config(st)
  B, Tp, H, Vp = dN.shape
  grid = _walk_grid(dN, cfg)
  P, tiles = grid[:2]
  w = _walk_specs(cfg)
  dS, dz = pu.call(_entry_grad_kernel, cfg, grid, [w.qk, w.row, w.v, w.token], [w.S, w.tile_z],
                   [_shape(B, H, P, cfg.features, Vp), _shape(tiles, B, H, P, cfg.features)], q, run, dN, dD)
  whole = lambda x: jnp.sum(x.reshape(-1, st.parts, *x.shape[1:]), axis=1)
  return whole(dS), whole(dz[0])


def _entering(k, v, run, docs, S0, z0, st: Static):
  """The states entering the kernels' rows: the rows' own (S0, z0) unless each row is cut into
  ``st.spans`` spans (``lmcore.ops.common.spans``), whose entering states follow from the totals of
  their parts (``docs``: the parts' ``spans.Documents``)."""
  if st.spans == 1:
    return S0, z0
  return spans.entering_rows(_totals(k, v, run, st), (S0, z0), docs, st.spans, st.parts)


def _leaving_grads(q, run, dN, dD, docs, dS, dz, st: Static):
  """The gradients of the states leaving the kernels' rows, which the dk/dv walk starts from: the
  final state's cotangents (dS, dz), unless each row is cut into spans, whose leaving states' gradients
  follow from those that each span's tokens give its entering state (``spans.leaving_grads``)."""
  if st.spans == 1:
    return dS, dz
  return spans.leaving_row_grads(_entry_grads(q, run, dN, dD, st), (dS, dz), docs, st.spans, st.parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(q, k, v, run, docs, S0, z0, st: Static):
  """(o [B', Tp, H, Vp], final S, z in kernel layout) of padded q, k, v [B', Tp, ...], runs and the
  initial state [B, ...]. B' = B: one row per row; B' = B·G: each row cut into G = ``st.spans``
  spans, with runs counted from each span's first token and ``docs`` (``spans.documents``) saying how
  the spans' states pass on."""
  return _fused_fwd(q, k, v, run, docs, S0, z0, st)[0]


def _fused_fwd(q, k, v, run, docs, S0, z0, st: Static):
  E_S, E_z = _entering(k, v, run, docs, S0, z0, st)
  o, D, S, z = _forward(q, k, v, run, E_S, E_z, st)
  out = (o, spans.span(S, -1, st.spans), spans.span(z, -1, st.spans))
  return out, (q, k, v, run, docs, E_S, E_z, o, D)


def _fused_bwd(st: Static, residuals, cotangents):
  q, k, v, run, docs, E_S, E_z, o, D = residuals
  do, dS, dz = cotangents
  B, Tp, H, Vp = v.shape
  inv = 1.0 / (D + st.eps)
  do = do.astype(_F32)
  dN = (do * inv[..., None]).astype(v.dtype)
  dD = -jnp.sum(do * o.astype(_F32), axis=-1) * inv
  dS, dz = _leaving_grads(q, run, dN, dD, docs, dS.astype(_F32), dz.astype(_F32), st)
  cfg = st.dq
  grid = _walk_grid(v, cfg)
  P, tiles = grid[:2]
  w = _walk_specs(cfg)
  dq = pu.call(_dq_kernel, cfg, grid, [w.qk, w.qk, w.v, w.row, w.v, w.token, w.S, w.z], w.tile_qk,
               _shape(P, tiles, B, Tp, H, q.shape[-1]), q, k, v, run, dN, dD, E_S, E_z)
  cfg = st.dkv
  grid = _walk_grid(v, cfg)
  P, tiles = grid[:2]
  w = _walk_specs(cfg)
  dk, dv, dS0, dz0 = pu.call(
      _dkv_kernel, cfg, grid, [w.qk, w.qk, w.v, w.row, w.v, w.token, w.S, w.z],
      [w.tile_qk, w.block_v, w.S, w.tile_z],
      [_shape(P, tiles, B, Tp, H, q.shape[-1]), _shape(P, B, Tp, H, Vp), _shape(*E_S.shape),
       _shape(tiles, *E_z.shape)],
      q, k, v, run, dN, dD, dS, dz)
  icfg = st.intra
  i = _intra_specs(icfg)
  itiles = Vp // icfg.block_v
  dq_i, dk_i, dv_i = pu.call(
      _intra_grad_kernel, icfg, _intra_grid(v, icfg), [i.qk, i.qk, i.v, i.run, i.v, i.token],
      [i.tile_qk, i.tile_qk, i.v],
      [_shape(itiles, B, Tp, H, q.shape[-1])] * 2 + [_shape(B, Tp, H, Vp)], q, k, v, run, dN, dD)
  dq = jnp.sum(dq, axis=(0, 1)) + jnp.sum(dq_i, axis=0)
  dk = jnp.sum(dk, axis=(0, 1)) + jnp.sum(dk_i, axis=0)
  dv = jnp.sum(dv, axis=0) + dv_i
  dS0, dz0 = spans.span(dS0, 0, st.spans), spans.span(jnp.sum(dz0, axis=0), 0, st.spans)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dS0, dz0)


_fused.defvjp(_fused_fwd, _fused_bwd)


# State layout.

def _rows(d: int, dp: int, F: int, feature: taylor.Feature):
  """Static maps between TaylorState's ``feature`` layout and the kernels' rows.

  Returns ``row_full`` [P F] (the ``full`` feature each kernel row holds, -1 for none) and ``M``
  [F_full, F_feature] with S_full = M S_feature (``full``: the identity; ``compact``: an
  off-diagonal pair i < j is split equally between (i, j) and (j, i), each 1/sqrt 2 of it, the
  diagonal copied). The way back is S_feature = Mᵀ S_full, exact for the symmetric states the
  kernels hand on.
  """
  P = dp * dp // F + 1
  row_full = np.full(P * F, -1, np.int64)
  for r in range((P - 1) * F):  # quadratic rows: g = r // dp, b = r % dp
    g, b = divmod(r, dp)
    if g < d and b < d:
      row_full[r] = 1 + d + g * d + b
  base = (P - 1) * F
  row_full[base:base + d] = 1 + np.arange(d)
  row_full[base + dp] = 0
  width = taylor.feature_width(d, feature)
  M = np.zeros((taylor.feature_width(d, "full"), width))
  if feature == "full":
    np.fill_diagonal(M, 1.0)
  else:
    M[:1 + d, :1 + d] = np.eye(1 + d)
    c = 1 + d
    for i in range(d):
      for j in range(i, d):
        M[1 + d + i * d + j, c] = M[1 + d + j * d + i, c] = 1.0 if i == j else 2 ** -0.5
        c += 1
  return row_full, M.astype(np.float32)


def _to_kernel(x_BxHxFxW, row_full, M, P: int, F: int):
  """A state array in ``feature`` layout [B, H, F_feature, ...] -> kernel rows [B, H, P, F, ...]."""
  full = jnp.einsum("fc,bhc...->bhf...", M, x_BxHxFxW, precision=jax.lax.Precision.HIGHEST)
  rows = jnp.take(full, np.maximum(row_full, 0), axis=2)
  mask = (row_full >= 0).astype(np.float32).reshape(-1, *([1] * (x_BxHxFxW.ndim - 3)))
  return (rows * mask).reshape(*x_BxHxFxW.shape[:2], P, F, *x_BxHxFxW.shape[3:])


def _from_kernel(x_BxHxPxF, row_full, M):
  """Kernel rows [B, H, P, F, ...] -> ``feature`` layout [B, H, F_feature, ...]."""
  B, H, P, F = x_BxHxPxF.shape[:4]
  rows = x_BxHxPxF.reshape(B, H, P * F, *x_BxHxPxF.shape[4:])
  place = np.zeros(M.shape[0], np.int64)
  place[row_full[row_full >= 0]] = np.nonzero(row_full >= 0)[0]
  full = jnp.take(rows, place, axis=2)
  return jnp.einsum("fc,bhf...->bhc...", M, full, precision=jax.lax.Precision.HIGHEST)


def _kernel_config(tiles: FusedTiles, warps_stages: tuple[int, int], T: int, Tp: int, d: int, dp: int,
                   Vp: int, documents: bool, interpret: bool, precision: str, itemsize: int
                   ) -> KernelConfig:
  smallest = 1 if interpret else pu.MIN_DOT
  stages = warps_stages[1] if itemsize < 4 else min(warps_stages[1], FP32_MAX_STAGES)
  return KernelConfig(
      chunk=tiles.chunk, features=min(max(tiles.features, 2 * dp), dp * dp),
      block_v=max(min(tiles.block_v, Vp), smallest), key_dim=d, dp=dp, length=T, padded_length=Tp,
      documents=documents, interpret=interpret, num_warps=warps_stages[0],
      num_stages=stages, precision=precision)


def _parts(tiles: FusedTiles, length: int, count: int, chunk: int) -> int:
  """How many parts each span's totals are summed in: ``tiles.parts``, or ``spans.parts``' rule."""
  if not tiles.parts:
    return spans.parts(length, count, chunk)
  if (length // count) % (tiles.parts * chunk):
    raise ValueError(f"{_OP}: tiles.parts={tiles.parts} does not cut spans of {length // count} tokens "
                     f"into whole {chunk}-token chunks (0 for the default)")
  return tiles.parts


def taylor_fused_pallas(
    q: jax.Array, k: jax.Array, v: jax.Array, *, state: TaylorState | None = None,
    eps: float = 1e-12, feature: taylor.Feature = "compact", segment_ids: jax.Array | None = None,
    interpret: bool | None = None, tiles: FusedTiles = FusedTiles(), precision: str = "input"
    ) -> tuple[jax.Array, TaylorState]:
  """``taylor_linear_attention`` (no decay ablation) by the fused-chunk kernels; same results.

  Args:
    q, k: raw per-head projections [B, T, H, d'] (the feature map is formed in the kernels).
    v: values [B, T, H, dv]; bf16 or fp32.
    state: the TaylorState after a prefix (layout of ``feature``), or None for zeros.
    eps: added to the denominator.
    feature: ``compact`` or ``full``: only the layout of ``state`` and of the returned state.
    segment_ids: optional packed-document ids [B, T] (``api.py``'s convention).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    tiles: the tiling (``FusedTiles``); the chunk is capped at the next power of two >= T, the feature
      block held between 2 dp and dp², the value tile capped at the padded dv.
    precision: "input" (dots take operands in the inputs' dtype), "tf32" or "float32" (the kernels
      run on fp32 copies and return fp32; ``pu.PRECISIONS``).

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 unless ``precision`` is "input"); the fp32 TaylorState after
    the last token.
  """
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, _OP, "implementation='chunked'")
  pu.check_precision(precision, _OP)
  if not interpret and q.shape[-1] > MAX_KEY_DIM:
    raise ValueError(f"{_OP}: key dim d' = {q.shape[-1]} is wider than the fused kernels take "
                     f"({MAX_KEY_DIM}); use implementation='pallas_blocked' or 'chunked'")
  q, k, v = pu.operands(precision, q, k, v)
  B, T, H, d = q.shape
  V = v.shape[-1]
  state = as_state(state, q, v, feature)
  count = spans.count(B, H, T, tiles.chunk, tiles.spans)
  L = T // count  # tokens per kernel row
  dp, Vp = max(pu.block_size(d, interpret), 2), pu.block_size(V, interpret)
  chunk = max(min(tiles.chunk, pl.next_power_of_2(L)), 1 if interpret else pu.MIN_DOT)
  Tp = pu.round_up(L, chunk)
  make = functools.partial(_kernel_config, dataclasses.replace(tiles, chunk=chunk), T=L, Tp=Tp, d=d,
                           dp=dp, Vp=Vp, documents=segment_ids is not None, interpret=interpret,
                           precision=precision, itemsize=jnp.dtype(q.dtype).itemsize)
  st = Static(forward=make(tiles.forward), dq=make(tiles.dq), dkv=make(tiles.dkv), intra=make(tiles.intra),
              eps=eps, spans=count, parts=_parts(tiles, T, count, chunk))
  F = st.forward.features
  P = dp * dp // F + 1
  row_full, M = _rows(d, dp, F, feature)
  S0 = pu.pad_axis(_to_kernel(state.S, row_full, M, P, F), 4, Vp)
  z0 = _to_kernel(state.z, row_full, M, P, F)
  doc = document_index(segment_ids, B, T)
  docs = spans.documents(doc, count * st.parts) if count > 1 else None
  # Edge padding keeps padded tokens in the last run; their features are zero (the constant masked).
  run = pu.pad_axis(spans.renumbered(doc, count), 1, Tp, mode="edge")
  pad = lambda x, width: pu.pad_axis(pu.pad_axis(spans.to_rows(x, count), 1, Tp), 3, width)
  o, S, z = _fused(pad(q, dp), pad(k, dp), pad(v, Vp), run, docs, S0, z0, st)
  new = TaylorState(_from_kernel(S[..., :V], row_full, M), _from_kernel(z, row_full, M))
  return spans.from_rows(o[:, :L, :, :V], count), new


class PallasFused(Backend[FusedTiles]):
  """The fused-chunk Triton kernels as a backend (no decay ablation, d' <= ``MAX_KEY_DIM``), each
  device of the mesh in context on its own rows and heads (``shard_map.run_sharded``)."""

  platforms = TRITON
  tiles_type = FusedTiles
  requirement = f"no decay ablation and key dims up to {MAX_KEY_DIM}"

  def supports(self, problem: Problem) -> bool:
    return not problem.decay and problem.key_dim <= MAX_KEY_DIM

  def preferred(self, problem: Problem) -> bool:
    return problem.value_dim <= AUTO_MAX_VALUE_DIM

  def heuristic_config(self, problem: Problem) -> FusedTiles:
    del problem
    return FusedTiles()

  def flops_per_head(self, problem: Problem, tiles: FusedTiles | None = None) -> float:
    """The chunked count with the kernels' state rows, the ``full`` features whatever the layout."""
    chunk = self.config(problem, tiles).chunk
    return flops.chunked(taylor.feature_width(problem.key_dim, "full"), problem.value_dim + 1, chunk,
                         problem.length or chunk, score_width=problem.key_dim)

  def __call__(self, q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles: FusedTiles,
               options: Options = Options()):
    del decay, dt  # supports() keeps the decay ablation away
    kernel = functools.partial(taylor_fused_pallas, eps=eps, feature=feature, tiles=tiles,
                               precision=options.precision)
    inputs = dict(q=q, k=k, v=v, state=state, segment_ids=segment_ids)
    return shard_map.run_sharded(kernel, inputs, KERNEL_LAYOUTS, KERNEL_OUT_LAYOUTS)
