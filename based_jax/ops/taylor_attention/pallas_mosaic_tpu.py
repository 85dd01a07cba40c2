"""Pallas (Mosaic TPU lowering) kernels for BASED's Taylor linear attention (MATH §2.1), custom VJP.

Per head, with ``s_tj = q_t·k_j / sqrt(d')`` and ``A_tj = phi(q_t)·phi(k_j) = 1 + s + s²/2``
(``api.py``, without the decay ablation)::

    o_t = sum_{j<=t} A_tj v_j / (sum_{j<=t} A_tj + eps)

The denominator is one more value column: with ``ṽ = [v, 1]`` the kernels compute
``N_t = sum_j A_tj ṽ_j`` (fp32) and the wrapper divides ``N[:dv]`` by ``N[dv] + eps``; the state's
extra column is z.

TPU form. A TPU core runs the grid steps one after another, so the grid is (batch·head, value tile,
chunk) with the chunk axis last and "arbitrary" (sequential; the first two are "parallel"), and the
fp32 state tile X [Fp, BV] lives in a VMEM scratch buffer carried across the chunk steps (loaded
from the initial state at chunk 0, written out after the last)::

    N_n     = Phi(q_n) X_n + (A_n masked) ṽ_n        (intra block 1 + s + s²/2 straight from q kᵀ)
    X_{n+1} = keep_n X_n + Phi(k_n)ᵀ ṽ_n

Feature layout. d' = 16 fills an eighth of the 128 lanes, so d' + 1 tiles of d' rows would contract
over 16 on the MXU. Here a chunk's features are one lane-dense [C, Fp] block:
taylor.py's *compact* features (F = 1 + d' + d'(d' + 1)/2 = 153 at d' = 16, zero-padded to
Fp = 256 lanes), so reading and writing the state is one [C, Fp] x [Fp, BV] matmul each. The block
is built with no 3-D array or reshape: with x̃ = [x, 1] (the 1 put in lane d' of the zero-padded x),
feature m is w_m x̃_a x̃_b for a pair a_m <= b_m (``_pairs``: (d', d') the constant, (i, d') the
linear, (i, j) the quadratic features), so

    Phi(x) = (x̃ Ra) ⊙ (x̃ Rb) ⊙ w

with 0/1 selection matrices Ra, Rb [Kp, Fp] (two MXU matmuls, exact: one nonzero per column) and
the scales w [1, Fp] in fp32; its VJP is two matmuls with Raᵀ and Rbᵀ. The kernel state is thus the
compact TaylorState itself (S with z as the extra column), padded. The full layout maps to it by the
constant M with phi_compact = M phi_full and back by Mᵀ; the antisymmetric part of a full state,
which no query reads, goes around the kernels (kept unless a new document starts).

Packed documents: ``segments.document_index`` numbers the runs of equal ids and
``segments.chunk_documents`` gives the per-token masks; a token reads the carried state only while
in the state's run (the incoming state continues the first run), a chunk hands on only its last
run's writes, and keep_n = 0 where a run starts inside chunk n.

Backward (``jax.custom_vjp``): the forward saves its inputs only. A forward sweep recomputes X_n to
get dq; a reverse sweep (the chunk index maps run backwards) carries dX in VMEM,
dX_n = keep_n dX_{n+1} + Phi(q_n)ᵀ dN_n over the reading tokens, for dk, dṽ and dX_0. With several
value tiles the dq, dk of each tile are partial sums added outside.

Layout and padding: head-major [B·H, Tp, ·]; q, k zero-padded from d' to Kp (d' + 1 rounded up to
128 lanes), ṽ from dv + 1 to whole value tiles (128 columns when compiled), time to whole chunks
(padded tokens have ṽ = 0 and write nothing). Compiled chunks hold at least 128 tokens, so that the
[C, C] score block and the [1, C] run row fill whole lanes. Precision: fp32 accumulation and state;
every matmul takes operands in the inputs' dtype, so with bf16 inputs the features and the state are
read at bf16 precision.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from based_jax import taylor
from based_jax.ops.taylor_attention.base import (KERNEL_LAYOUTS, KERNEL_OUT_LAYOUTS, Options, Problem,
                                                 TaylorState, zero_state)
from lmcore.ops.common import flops
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common import shard_map
from lmcore.ops.common.backend import MOSAIC_TPU, Backend, check_power_of_two
from lmcore.ops.common.layout import heads_first
from lmcore.ops.common.segments import ChunkDocuments, chunk_documents, document_index

LANES = 128  # a TPU vector register is (8 sublanes, 128 lanes)
_F32 = jnp.float32
_OP = "taylor_linear_attention(implementation='pallas_tpu')"


class KernelConfig(NamedTuple):
  """Static kernel parameters (hashable: they key the compiled kernels).

  chunk: tokens per chunk C; block_v: value columns per grid step BV; key_dim: d' (the lane that
  holds x̃'s 1); n_heads: H (the run arrays are per batch row); interpret: ``pallas_call``'s
  ``interpret`` argument.
  """

  chunk: int
  block_v: int
  key_dim: int
  n_heads: int
  interpret: Any


class _Seq(NamedTuple):
  """A grid step's input blocks (refs): one chunk of the head-major sequences and of the
  per-batch-row run arrays, and the feature maps (the same block at every step)."""

  q: Any  # [C, Kp] input dtype, zero past d'
  k: Any  # [C, Kp]
  v: Any  # [C, BV] ṽ
  run: Any  # [C, 1] int32 run index
  run_row: Any  # [1, C] int32, the same as a row
  reads: Any  # [C, 1] int32: 1 where the token is in the run of the state entering the chunk
  writes: Any  # [C, 1] int32: 1 where the token is in the chunk's last run
  select_a: Any  # [Kp, Fp] input dtype: Ra
  select_b: Any  # [Kp, Fp]: Rb
  scale: Any  # [1, Fp] fp32: w


class _Chunk(NamedTuple):
  """One chunk as loaded in a kernel."""

  q: jax.Array  # [C, Kp] input dtype
  k: jax.Array  # [C, Kp]
  v: jax.Array  # [C, BV]
  run: jax.Array  # [C, 1] int32
  run_row: jax.Array  # [1, C] int32
  reads: jax.Array  # [C, 1] bool
  writes: jax.Array  # [C, 1] bool
  maps: tuple  # (Ra, Rb, w)
  dN: jax.Array | None  # [C, BV] dL/dN in the input dtype (backward only)


def _split(refs):
  """The kernel's refs as (_Seq of the step's inputs, the remaining refs)."""
  n_seq = len(_Seq._fields)
  return _Seq(*refs[:n_seq]), refs[n_seq:]


def _load(seq: _Seq, dN_ref=None) -> _Chunk:
  return _Chunk(seq.q[...], seq.k[...], seq.v[...], seq.run[...], seq.run_row[...],
                seq.reads[...] != 0, seq.writes[...] != 0,
                (seq.select_a[...], seq.select_b[...], seq.scale[...]),
                None if dN_ref is None else dN_ref[...])


# The feature block.

def _pairs(d: int) -> list[tuple[int, int, float]]:
  """(a_m, b_m, w_m): taylor.py's compact feature m is w_m x̃_a x̃_b with x̃ = [x, 1] (index d' is
  the 1): the constant, the linear x / d'^(1/4), then x_i x_j / sqrt(d') for i <= j (i = j: over
  sqrt(2 d')), in ``taylor_features``' order."""
  pairs = [(d, d, 1.0)] + [(i, d, d ** -0.25) for i in range(d)]
  return pairs + [(i, j, (2 * d) ** -0.5 if i == j else d ** -0.5)
                  for i in range(d) for j in range(i, d)]


def feature_maps(d: int, Kp: int, Fp: int, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Ra, Rb [Kp, Fp] (``dtype``; Ra[a_m, m] = Rb[b_m, m] = 1) and w [1, Fp] fp32; zero past F."""
  select_a, select_b, scale = np.zeros((Kp, Fp)), np.zeros((Kp, Fp)), np.zeros((1, Fp))
  for m, (a, b, w) in enumerate(_pairs(d)):
    select_a[a, m], select_b[b, m], scale[0, m] = 1.0, 1.0, w
  return jnp.asarray(select_a, dtype), jnp.asarray(select_b, dtype), jnp.asarray(scale, _F32)


def _with_one(x_CxK, d: int):
  """x̃: x with its (zero) lane d' set to 1."""
  return jnp.where(jax.lax.broadcasted_iota(jnp.int32, x_CxK.shape, 1) == d, 1.0, x_CxK)


def _selected(x_CxK, maps, d: int):
  """(x̃ Ra, x̃ Rb) [C, Fp] fp32: the two factors of every feature."""
  select_a, select_b, _ = maps
  x = _with_one(x_CxK, d)
  return pu.dot(x, select_a), pu.dot(x, select_b)


def features(x_CxK, maps, d: int):
  """Phi(x) = (x̃ Ra) ⊙ (x̃ Rb) ⊙ w [C, Fp] fp32: ``taylor_features(x, "compact")``, zero-padded."""
  factor_a, factor_b = _selected(x_CxK, maps, d)
  return factor_a * factor_b * maps[2]


def _features_grad(dPhi_CxF, x_CxK, maps, d: int):
  """The VJP of ``features`` [C, Kp] fp32 (zero in lane d', whose 1 is a constant)."""
  select_a, select_b, scale = maps
  factor_a, factor_b = _selected(x_CxK, maps, d)
  dw, dt = dPhi_CxF * scale, x_CxK.dtype
  dx = (pu.dot((dw * factor_b).astype(dt), select_a, trans_b=True)
        + pu.dot((dw * factor_a).astype(dt), select_b, trans_b=True))
  return jnp.where(jax.lax.broadcasted_iota(jnp.int32, dx.shape, 1) == d, 0.0, dx)


# Per-chunk pieces.

def _intra(ch: _Chunk, d: int):
  """s = q kᵀ / sqrt(d') [C, C] fp32 and the visible pairs (j <= i in the same run)."""
  C = ch.run.shape[0]
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (C, C))
  visible = (iota(0) >= iota(1)) & (ch.run == ch.run_row)
  return pu.dot(ch.q, ch.k, trans_b=True) * (d ** -0.5), visible


def _scores(s, visible):
  """A = 1 + s + s²/2 on visible pairs, else 0 [C, C] fp32."""
  return jnp.where(visible, taylor.taylor_kernel(s), 0.0)


def _dscores(ch: _Chunk, s, visible, d: int):
  """dL/d(q kᵀ) of the intra block: (dN ṽᵀ) (1 + s) / sqrt(d') on visible pairs (input dtype)."""
  dA = jnp.where(visible, pu.dot(ch.dN, ch.v, trans_b=True), 0.0)
  return (dA * (1.0 + s) * (d ** -0.5)).astype(ch.q.dtype)


def _read_features(ch: _Chunk, d: int):
  """Phi(q) for tokens still in the state's run, else 0 (input dtype) [C, Fp]."""
  return jnp.where(ch.reads, features(ch.q, ch.maps, d), 0.0).astype(ch.q.dtype)


def _write_features(ch: _Chunk, d: int):
  """Phi(k) for tokens of the chunk's last run, else 0 (input dtype) [C, Fp]."""
  return jnp.where(ch.writes, features(ch.k, ch.maps, d), 0.0).astype(ch.k.dtype)


def _kept(X, ch: _Chunk):
  """X, or 0 where a run starts inside the chunk (its last token no longer reads the state)."""
  return jnp.where(ch.reads[-1:], X, 0.0)


# Kernels. Grid (batch·head, value tile, chunk); the last ref is the fp32 [Fp, BV] VMEM scratch.

def _forward_kernel(*refs, cfg: KernelConfig):
  seq, (X0_ref, N_ref, X_end_ref, X_ref) = _split(refs)
  n, d = pl.program_id(2), cfg.key_dim

  @pl.when(n == 0)
  def _():
    X_ref[...] = X0_ref[...]

  ch = _load(seq)
  X, dt = X_ref[...], ch.q.dtype
  s, visible = _intra(ch, d)
  N_ref[...] = (pu.dot(_read_features(ch, d), X.astype(dt))
                + pu.dot(_scores(s, visible).astype(dt), ch.v))
  X_ref[...] = _kept(X, ch) + pu.dot(_write_features(ch, d), ch.v, trans_a=True)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    X_end_ref[...] = X_ref[...]


def _dq_kernel(*refs, cfg: KernelConfig):
  """Forward sweep: dq (partial over this value tile) from the recomputed chunk states."""
  seq, (X0_ref, dN_ref, dq_ref, X_ref) = _split(refs)
  d = cfg.key_dim

  @pl.when(pl.program_id(2) == 0)
  def _():
    X_ref[...] = X0_ref[...]

  ch = _load(seq, dN_ref)
  X, dt = X_ref[...], ch.q.dtype
  s, visible = _intra(ch, d)
  dPhi = jnp.where(ch.reads, pu.dot(ch.dN, X.astype(dt), trans_b=True), 0.0)
  dq_ref[...] = (_features_grad(dPhi, ch.q, ch.maps, d)
                 + pu.dot(_dscores(ch, s, visible, d), ch.k)).astype(dq_ref.dtype)
  X_ref[...] = _kept(X, ch) + pu.dot(_write_features(ch, d), ch.v, trans_a=True)


def _dkv_kernel(*refs, cfg: KernelConfig):
  """Reverse sweep: dk (partial over this value tile), dṽ and dX_0, carrying dX."""
  seq, (dX_end_ref, dN_ref, dk_ref, dv_ref, dX0_ref, dX_ref) = _split(refs)
  m, d = pl.program_id(2), cfg.key_dim

  @pl.when(m == 0)
  def _():
    dX_ref[...] = dX_end_ref[...]

  ch = _load(seq, dN_ref)
  dX, dt = dX_ref[...], ch.q.dtype
  s, visible = _intra(ch, d)
  dv_ref[...] = (pu.dot(_write_features(ch, d), dX.astype(dt))
                 + pu.dot(_scores(s, visible).astype(dt), ch.dN, trans_a=True)).astype(dv_ref.dtype)
  dPhi = jnp.where(ch.writes, pu.dot(ch.v, dX.astype(dt), trans_b=True), 0.0)
  dk_ref[...] = (_features_grad(dPhi, ch.k, ch.maps, d)
                 + pu.dot(_dscores(ch, s, visible, d), ch.q, trans_a=True)).astype(dk_ref.dtype)
  dX_ref[...] = _kept(dX, ch) + pu.dot(_read_features(ch, d), ch.dN, trans_a=True)

  @pl.when(m == pl.num_programs(2) - 1)
  def _():
    dX0_ref[...] = dX_ref[...]


class _Sweep(NamedTuple):
  """One pass over the chunks, forward or in reverse: the chunk inputs in ``_Seq`` order with
  their BlockSpecs, and the BlockSpecs of value-shaped [C, BV] blocks (N, dN, dṽ), of per-value-tile
  partial sums [C, Kp] (dq, dk) and of the state tile [Fp, BV]."""

  args: list
  specs: list
  values: pl.BlockSpec
  partial: pl.BlockSpec
  state: pl.BlockSpec


def _sweep(q, k, v, runs: ChunkDocuments, Fp: int, cfg: KernelConfig, reverse: bool) -> _Sweep:
  BH, Tp, Kp = q.shape
  C, BV, H = cfg.chunk, cfg.block_v, cfg.n_heads
  N = Tp // C
  chunk = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  seq = pl.BlockSpec((None, C, Kp), lambda bh, j, n: (bh, chunk(n), 0))
  values = pl.BlockSpec((None, C, BV), lambda bh, j, n: (bh, chunk(n), j))
  column = pl.BlockSpec((None, C, 1), lambda bh, j, n: (bh // H, chunk(n), 0))
  row = pl.BlockSpec((None, 1, C), lambda bh, j, n: (bh // H, 0, chunk(n)))
  maps = feature_maps(cfg.key_dim, Kp, Fp, q.dtype)
  whole = [pl.BlockSpec(x.shape, lambda bh, j, n: (0, 0)) for x in maps]
  args = [q, k, v, runs.doc, runs.doc_row, runs.reads, runs.writes, *maps]
  specs = [seq, seq, values, column, row, column, column, *whole]
  partial = pl.BlockSpec((None, None, C, Kp), lambda bh, j, n: (j, bh, chunk(n), 0))
  state = pl.BlockSpec((None, Fp, BV), lambda bh, j, n: (bh, 0, j))
  return _Sweep(args, specs, values, partial, state)


def _cost(kernel, cfg: KernelConfig, grid, specs, arrays, Fp: int) -> pl.CostEstimate:
  """``kernel``'s matmul FLOPs over ``grid`` (padded lanes and masked entries included, the feature
  map's selection matmuls too), no transcendentals, and the bytes its blocks move
  (``pu.pipeline_bytes`` of ``arrays``, inputs then outputs, in blocks ``specs``)."""
  C, BV, Kp = cfg.chunk, cfg.block_v, arrays[0].shape[-1]
  # One dot of each shape: q kᵀ-like [C, C] blocks over Kp lanes, [C, C] blocks against BV values,
  # a selection x̃ R [C, Kp] x [Kp, Fp] (two per feature map, two per feature VJP) and a state product.
  score, value, select, state = 2 * C * C * Kp, 2 * C * C * BV, 2 * C * Kp * Fp, 2 * C * Fp * BV
  per_step = {_forward_kernel: score + value + 4 * select + 2 * state,
              _dq_kernel: 2 * score + value + 6 * select + 2 * state,
              _dkv_kernel: 2 * score + 2 * value + 8 * select + 3 * state}[kernel]
  return pl.CostEstimate(flops=math.prod(grid) * per_step, transcendentals=0,
                         bytes_accessed=pu.pipeline_bytes(grid, specs, arrays))


def _call(kernel, cfg: KernelConfig, sweep: _Sweep, extra_args, extra_specs, out_specs,
          out_shape, Fp: int):
  """Runs ``kernel`` over the grid (B·H, value tiles, chunks) with an fp32 [Fp, BV] VMEM scratch."""
  BH, Tp, _ = sweep.args[0].shape
  n_tiles = sweep.args[2].shape[-1] // cfg.block_v
  grid, in_specs = (BH, n_tiles, Tp // cfg.chunk), sweep.specs + extra_specs
  out_list = list(out_specs) if isinstance(out_specs, (list, tuple)) else [out_specs]
  cost = _cost(kernel, cfg, grid, in_specs + out_list,
               [*sweep.args, *extra_args, *jax.tree.leaves(out_shape)], Fp)
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((Fp, cfg.block_v), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=cfg.interpret)(*sweep.args, *extra_args)


def _forward(q, k, v, runs, X0, cfg):
  """(N [BH, Tp, Vp] fp32, X after the last chunk [BH, Fp, Vp] fp32)."""
  Fp = X0.shape[1]
  s = _sweep(q, k, v, runs, Fp, cfg, reverse=False)
  out_shape = (jax.ShapeDtypeStruct(v.shape, _F32), jax.ShapeDtypeStruct(X0.shape, _F32))
  return _call(_forward_kernel, cfg, s, [X0], [s.state], [s.values, s.state], out_shape, Fp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(q, k, v, runs, X0, cfg):
  return _forward(q, k, v, runs, X0, cfg)


def _fused_fwd(q, k, v, runs, X0, cfg):
  return _forward(q, k, v, runs, X0, cfg), (q, k, v, runs, X0)


def _fused_bwd(cfg, residuals, cotangents):
  q, k, v, runs, X0 = residuals
  dN, dX_end = cotangents
  Fp, n_tiles = X0.shape[1], v.shape[-1] // cfg.block_v
  dN = dN.astype(v.dtype)
  # One value tile: dq and dk are whole, written in q's dtype (they are rounded to it anyway); several
  # are partial sums, added in fp32. dv is written in v's dtype.
  partial = jax.ShapeDtypeStruct((n_tiles, *q.shape), q.dtype if n_tiles == 1 else _F32)
  s = _sweep(q, k, v, runs, Fp, cfg, reverse=False)
  dq = _call(_dq_kernel, cfg, s, [X0, dN], [s.state, s.values], s.partial, partial, Fp)
  s = _sweep(q, k, v, runs, Fp, cfg, reverse=True)
  dk, dv, dX0 = _call(
      _dkv_kernel, cfg, s, [dX_end.astype(_F32), dN], [s.state, s.values],
      [s.partial, s.values, s.state],
      (partial, jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(X0.shape, _F32)), Fp)
  return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype), None, dX0)


_fused.defvjp(_fused_fwd, _fused_bwd)


# State layouts.

def full_to_compact(d: int) -> np.ndarray:
  """M [F_compact, F_full] with ``taylor_features(x, "compact") = M taylor_features(x, "full")``:
  a pair i < j is (x_i x_j + x_j x_i) / sqrt 2 of the full quadratic features."""
  M = np.zeros((taylor.feature_width(d, "compact"), taylor.feature_width(d, "full")))
  quadratic = lambda i, j: 1 + d + i * d + j
  for m, (a, b, _) in enumerate(_pairs(d)):
    if b == d:
      M[m, 0 if a == d else 1 + a] = 1.0
    elif a == b:
      M[m, quadratic(a, a)] = 1.0
    else:
      M[m, quadratic(a, b)] = M[m, quadratic(b, a)] = 0.5 ** 0.5
  return M


def _to_kernel_state(S_BxHxFxW, d: int, feature):
  """A state in ``feature``'s layout -> the compact layout [B, H, F_compact, W] the kernels use."""
  if feature == "compact":
    return S_BxHxFxW
  return jnp.einsum("cf,bhfw->bhcw", full_to_compact(d), S_BxHxFxW,
                    precision=jax.lax.Precision.HIGHEST)


def _from_kernel_state(X_BxHxFxW, S0_BxHxFxW, keep_B, d: int, feature):
  """The kernels' final compact state -> ``feature``'s layout. A full state gets back the
  antisymmetric part of the initial one (Mᵀ M keeps only the symmetric part) while it is kept."""
  if feature == "compact":
    return X_BxHxFxW
  M = full_to_compact(d)
  linear_map = functools.partial(jnp.einsum, "fc,bhcw->bhfw", precision=jax.lax.Precision.HIGHEST)
  unread = S0_BxHxFxW - linear_map(M.T @ M, S0_BxHxFxW)
  return linear_map(M.T, X_BxHxFxW) + keep_B[:, None, None, None] * unread


def _check_sizes(chunk_size: int, block_v: int, compiled: bool) -> None:
  """Raises ValueError for block sizes the kernels (or, when compiled, the TPU tiles) reject."""
  check_power_of_two(_OP, chunk_size=chunk_size)
  if compiled and block_v % LANES:
    raise ValueError(f"{_OP}: on TPU block_v must be a multiple of {LANES}, got {block_v}")


def taylor_linear_attention_tpu(
    q: jax.Array, k: jax.Array, v: jax.Array, *,
    state: TaylorState | None = None, eps: float = 1e-12,
    feature: taylor.Feature = "compact", chunk_size: int = 64,
    segment_ids: jax.Array | None = None, interpret: bool | pltpu.InterpretParams | None = None,
    block_v: int = LANES) -> tuple[jax.Array, TaylorState]:
  """``taylor_linear_attention`` (no decay ablation) computed by the TPU kernels; same results.

  Args:
    q, k: raw per-head projections [B, T, H, d'] (the feature map is applied in the kernels).
    v: values [B, T, H, dv]; bf16 or fp32 (matmuls in the inputs' dtype, fp32 accumulation).
    state: the TaylorState after a prefix (layout of ``feature``), or None for zeros.
    eps: added to the denominator.
    feature: ``compact`` or ``full``: only the layout of ``state`` and of the returned state.
    chunk_size: tokens per chunk, a power of two (compiled: at least 128 are used).
    segment_ids: optional packed-document ids [B, T] (``api.py``'s convention).
    interpret: True (Pallas' generic interpreter), ``pltpu.InterpretParams()`` (the TPU
      simulator), False (compile; TPU only) or None (compile exactly on a TPU).
    block_v: value columns per grid step over dv + 1 (a multiple of 128 when compiled).

  Returns:
    o [B, T, H, dv] in v's dtype; the fp32 TaylorState after the last token.
  """
  interpret = pu.resolve_tpu_interpret(interpret, _OP,
                                        "implementation='chunked'")
  _check_sizes(chunk_size, block_v, compiled=not interpret)
  B, T, H, d = q.shape
  V = v.shape[-1]
  if state is None:
    state = zero_state(B, H, d, V, feature)
  C = chunk_size if interpret else max(chunk_size, LANES)
  F = taylor.feature_width(d, "compact")
  Tp, Kp, Vp, Fp = (pu.round_up(T, C), pu.round_up(d + 1, LANES), pu.round_up(V + 1, block_v),
                    pu.round_up(F, LANES))
  cfg = KernelConfig(chunk=C, block_v=block_v, key_dim=d, n_heads=H, interpret=interpret)
  run = document_index(segment_ids, B, T)
  v_aug = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
  S0 = jnp.concatenate([state.S.astype(_F32), state.z.astype(_F32)[..., None]], axis=-1)
  X0 = pu.pad_axis(pu.pad_axis(_to_kernel_state(S0, d, feature), 2, Fp), 3, Vp)
  N, X = _fused(heads_first(q, Tp, Kp), heads_first(k, Tp, Kp), heads_first(v_aug, Tp, Vp),
                chunk_documents(run, Tp, C), X0.reshape(B * H, Fp, Vp), cfg)
  N = jnp.swapaxes(N.reshape(B, H, Tp, Vp)[:, :, :T], 1, 2)
  o = N[..., :V] / (N[..., V:V + 1] + eps)
  X = X.reshape(B, H, Fp, Vp)[:, :, :F, :V + 1]
  S = _from_kernel_state(X, S0, (run[:, -1] == 0).astype(_F32), d, feature)
  return o.astype(v.dtype), TaylorState(S[..., :V], S[..., V])


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """``chunk`` tokens per chunk (a power of two; at least ``LANES`` are used when compiled) and
  ``block_v`` value columns per grid step over dv + 1 (a multiple of ``LANES`` when compiled)."""

  chunk: int = 64
  block_v: int = LANES

  def __post_init__(self):
    check_power_of_two("taylor_linear_attention tiles", chunk=self.chunk, block_v=self.block_v)


class PallasTpu(Backend[MosaicTiles]):
  """The Mosaic TPU kernels as a backend (no decay ablation; named, not "auto": no TPU has timed
  them), each device of the mesh in context on its own rows and heads (``shard_map.run_sharded``)."""

  platforms = MOSAIC_TPU
  tiles_type = MosaicTiles
  requirement = "no decay ablation"

  def supports(self, problem: Problem) -> bool:
    return not problem.decay

  def heuristic_config(self, problem: Problem) -> MosaicTiles:
    del problem
    return MosaicTiles()

  def flops_per_head(self, problem: Problem, tiles: MosaicTiles | None = None) -> float:
    """The chunked count with the compact features; compiled chunks hold at least ``LANES`` tokens."""
    chunk = self.config(problem, tiles).chunk
    if problem.platform != "cpu":
      chunk = max(chunk, LANES)
    return flops.chunked(taylor.feature_width(problem.key_dim, "compact"), problem.value_dim + 1, chunk,
                         problem.length or chunk, score_width=problem.key_dim)

  def __call__(self, q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles: MosaicTiles,
               options: Options = Options()):
    del decay, dt  # supports() keeps the decay ablation away
    if options.precision != "input":
      raise ValueError(f"{_OP}: kernel_precision={options.precision!r} is for the GPU kernels; the TPU "
                       "kernels compute in the inputs' dtype: use kernel_precision='input', or pass fp32 "
                       "inputs")
    kernel = functools.partial(taylor_linear_attention_tpu, eps=eps, feature=feature, chunk_size=tiles.chunk,
                               block_v=tiles.block_v)
    inputs = dict(q=q, k=k, v=v, state=state, segment_ids=segment_ids)
    return shard_map.run_sharded(kernel, inputs, KERNEL_LAYOUTS, KERNEL_OUT_LAYOUTS)
