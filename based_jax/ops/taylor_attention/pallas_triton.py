"""Pallas (Triton lowering) kernels for BASED's Taylor linear attention (MATH §2.1), custom VJP.

Per head, with ``s_tj = q_t·k_j / sqrt(d')`` and ``A_tj = phi(q_t)·phi(k_j) = 1 + s + s²/2``
(``api.py``, without the decay ablation)::

    o_t = sum_{j<=t} A_tj v_j / (sum_{j<=t} A_tj + eps)

The denominator is one more value column: with ``ṽ = [v, 1]`` the kernels compute the unnormalised
``N_t = sum_j A_tj ṽ_j`` (fp32) and the wrapper divides ``N[:dv]`` by ``N[dv] + eps``; the state's
extra column is z. The features never exist as F-wide arrays. Inside the kernels the state of one
head is d' + 1 groups of [d', dv + 1] tiles and a constant row:

    group g < d':  X_g = sum_j (k_j ⊙ k_jg) ṽ_jᵀ   (quadratic part, read with sigma_g = 1 / (2 d'))
    group g = d':  X_g = sum_j k_j ṽ_jᵀ            (linear part, read with sigma_g = 1 / sqrt d')
    constant:      c   = sum_j ṽ_jᵀ                (a [1, dv + 1] row)

so that ``phi(q_t)·S = c + sum_g sigma_g (q_t ⊙ q_tg) X_g`` (q_t itself for g = d'): every product
is a 2-D dot. Query and key group g is ``_group``: x ⊙ x[:, g], or x for the linear group.

Chunk-parallel in three kernels per direction (chunks of C tokens, N = T / C of them):

1. ``_state_kernel``, grid (batch, head, group, value tile): one program carries one [d', BV]
   state tile across the chunks and writes the tile *entering* every chunk to HBM (in the input
   dtype; the final state in fp32). A step is one [d', C] x [C, BV] dot, so the sequential part
   is cheap and the grid has (d' + 1)·dv/BV times more programs than one per (batch, head).
2. ``_output_kernel``, grid (batch, head, chunk, value tile), fully parallel: the intra-chunk
   block straight from the raw q·kᵀ (1 + s + s²/2, no features) plus the read of the entering
   state, tile by tile.
3. Backward (``jax.custom_vjp``): the forward saves its inputs only. The backward recomputes the
   entering states with the same state kernel, runs it in reverse over (q, dN) for the gradient
   of the state entering each chunk (dS_n = keep_n dS_{n+1} + sum over chunk n's reads of
   sigma_g Q_gᵀ dN), then ``_grad_kernel`` (chunk-parallel) gives dq, dk and dṽ of every chunk.
   Value tiles return partial dq, dk (sums over their columns), added outside.

Precision: accumulation is fp32 everywhere, the final state fp32; the per-chunk tiles are stored
in the inputs' dtype and every dot takes operands in that dtype (as the SANATAN kernel does). With
bf16 inputs the denominator column z is therefore read at bf16 precision too (relative error about
2^-9, the size of the bf16 output's own rounding). The per-chunk tiles cost (d' + 1) d' Vp / C
values per token and head in HBM (Vp: dv + 1 padded to whole value tiles; 408 at d' = 16,
dv = 64, C = 64, block_v = 32).

Packed documents: ``run`` (``segments.document_index``, non-decreasing per row) numbers the runs
of equal segment ids; a token reads the entering state only while in the state's
run (the incoming state continues the first run), and a chunk hands on only its last run's writes,
dropping the carried state when that run began inside the chunk.

State layout outside: TaylorState's feature index (``taylor.taylor_features``, ``full`` or
``compact``). ``_slots`` maps it to kernel rows: full features one to one, a compact off-diagonal
pair (i < j) to both rows (i, j) and (j, i).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from based_jax import taylor
from based_jax.ops.taylor_attention.base import TaylorState, zero_state
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.segments import document_index

_F32 = jnp.float32


class KernelConfig(NamedTuple):
  """Static kernel parameters: chunk C, value tile BV, real key dim d' and length T."""

  chunk: int
  block_v: int
  key_dim: int
  length: int
  interpret: bool
  num_warps: int
  num_stages: int
  precision: str


def _sigma(g: int, d: int) -> float:
  """The read scale of group g: 1 / (2 d') for a quadratic tile, 1 / sqrt(d') for the linear one."""
  return d ** -0.5 if g == d else 0.5 / d


def _column(x_CxK, g: int):
  """x[:, g] as a [C, 1] column, by a masked row sum (Triton lowers no slicing of values)."""
  iota = jax.lax.broadcasted_iota(jnp.int32, x_CxK.shape, 1)
  return jnp.sum(jnp.where(iota == g, x_CxK, 0.0), axis=1, keepdims=True)


def _group(x_CxK, g: int, d: int):
  """Feature group g of a chunk of raw q or k (fp32): x ⊙ x[:, g] for g < d', x for g = d'."""
  return x_CxK if g == d else x_CxK * _column(x_CxK, g)


def _group_grad(dY_CxK, x_CxK, g: int, d: int):
  """The VJP of ``_group``: dY ⊙ x[:, g], plus in column g the row sums of dY ⊙ x."""
  if g == d:
    return dY_CxK
  iota = jax.lax.broadcasted_iota(jnp.int32, x_CxK.shape, 1)
  row_sum = jnp.sum(dY_CxK * x_CxK, axis=1, keepdims=True)
  return dY_CxK * _column(x_CxK, g) + jnp.where(iota == g, row_sum, 0.0)


def _chunk_runs(run_ref, n, C: int):
  """Run ids of chunk n [C], the run of the state entering it and the chunk's last run.

  Runs never decrease along a row, so the entering state belongs to the last run of chunk n - 1;
  for n = 0 it is the first token's run (the incoming state continues the first document).
  """
  run = pu.rows(run_ref, n * C, C)
  previous = jnp.max(pu.rows(run_ref, jnp.maximum(n - 1, 0) * C, C))
  first = jnp.min(pu.rows(run_ref, 0, C))
  return run, jnp.where(n > 0, previous, first), jnp.max(run)


def _intra(q_CxK, k_CxK, run_C, d: int):
  """s = q kᵀ / sqrt(d') [C, C] fp32 and the visible pairs (j <= i in the same run)."""
  C = run_C.shape[0]
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (C, C))
  visible = (run_C[:, None] == run_C[None, :]) & (iota(0) >= iota(1))
  return pu.dot(q_CxK, k_CxK, trans_b=True) * (d ** -0.5), visible


def _state_kernel(x_ref, w_ref, y_ref, run_ref, X0_ref, c0_ref, X_ref, c_ref, Xend_ref, cend_ref,
                  *, cfg: KernelConfig, reverse: bool):
  """One state tile (group g = program 2, one value tile) carried across every chunk.

  Forward (x = k, w = k[:, g] or 1, y = ṽ): X <- keep X + sum_{j in the chunk's last run}
  (x_j w_j)ᵀ y_j, with keep = (no new run starts in the chunk). Reverse (x = q, y = dN, chunks from
  last to first): the same with the chunk's reads (tokens of the entering state's run) and the
  read scale sigma_g, which turns X into the gradient of the state. The tile held when a chunk is
  reached goes to slot n of ``X_ref`` (rows n d' ...); the constant row (owned by the linear
  group's programs, zero in the others) likewise to row n of ``c_ref``.
  """
  C, dp, d = cfg.chunk, X0_ref.shape[0], cfg.key_dim
  n_chunks = x_ref.shape[0] // C
  dt = x_ref.dtype
  g = pl.program_id(2)
  owns_constant = (g == d).astype(_F32)
  # sigma_g by arithmetic on the float flag: with a scalar select (jnp.where) here, the Pallas
  # Triton lowering of JAX 0.11 handed the loop body the bool where the float belongs.
  scale = 0.5 / d + owns_constant * (d ** -0.5 - 0.5 / d) if reverse else 1.0

  def step(m, carry):
    X, c = carry
    n = n_chunks - 1 - m if reverse else m
    run, state_run, last_run = _chunk_runs(run_ref, n, C)
    pu.store_rows(X_ref, n * dp, X.astype(X_ref.dtype))
    pu.store_rows(c_ref, n, c.astype(c_ref.dtype))
    mine = (run == (state_run if reverse else last_run))[:, None]
    w = pu.rows(w_ref, n * C, C).astype(_F32)
    xw = jnp.where(mine, scale * pu.rows(x_ref, n * C, C).astype(_F32) * w, 0.0)
    y = pu.rows(y_ref, n * C, C)
    wy = jnp.where(mine, w * y.astype(_F32), 0.0)
    keep = last_run == state_run
    X = jnp.where(keep, X, 0.0) + pu.dot(xw.astype(dt), y.astype(dt), trans_a=True)
    c = jnp.where(keep, c, 0.0) + owns_constant * jnp.sum(wy, axis=0, keepdims=True)
    return X, c

  X, c = jax.lax.fori_loop(0, n_chunks, step, (X0_ref[...], c0_ref[...]))
  Xend_ref[...] = X
  cend_ref[...] = c


def _output_kernel(q_ref, k_ref, v_ref, run_ref, X_ref, c_ref, o_ref, *, cfg: KernelConfig):
  """N of one chunk and value tile: intra-chunk block plus the read of the entering state."""
  d = cfg.key_dim
  run, state_run, _ = _chunk_runs(run_ref, pl.program_id(2), cfg.chunk)
  q, k, v = q_ref[...], k_ref[...], v_ref[...]
  dt = q.dtype
  s, visible = _intra(q, k, run, d)
  A = jnp.where(visible, taylor.taylor_kernel(s), 0.0)
  reads = (run == state_run)[:, None]
  q_read = jnp.where(reads, q.astype(_F32), 0.0)
  o = pu.dot(A.astype(dt), v.astype(dt)) + jnp.where(reads, c_ref[...].astype(_F32), 0.0)
  for g in range(d + 1):
    o += _sigma(g, d) * pu.dot(_group(q_read, g, d).astype(dt), X_ref[g].astype(dt))
  o_ref[...] = o


def _grad_kernel(q_ref, k_ref, v_ref, dN_ref, run_ref, X_ref, dX_ref, dc_ref,
                 dq_ref, dk_ref, dv_ref, *, cfg: KernelConfig):
  """dq, dk (partial: this value tile's columns) and dṽ of one chunk.

  From the state entering the chunk (X), the gradient of the state leaving it (dX, dc), the
  intra-chunk block and dN. With dA = dN ṽᵀ on visible pairs and dA/ds = 1 + s, the intra part
  is dq = (dA ⊙ (1 + s)) k / sqrt(d'), dk = (dA ⊙ (1 + s))ᵀ q / sqrt(d'), dṽ = Aᵀ dN.
  """
  d = cfg.key_dim
  run, state_run, last_run = _chunk_runs(run_ref, pl.program_id(2), cfg.chunk)
  q, k, v = q_ref[...], k_ref[...], v_ref[...]
  dt = q.dtype
  dN = dN_ref[...].astype(dt)
  s, visible = _intra(q, k, run, d)
  A = jnp.where(visible, taylor.taylor_kernel(s), 0.0)
  dA = jnp.where(visible, pu.dot(dN, v, trans_b=True), 0.0)
  ds = (dA * (1.0 + s) * (d ** -0.5)).astype(dt)
  dq = pu.dot(ds, k)
  dk = pu.dot(ds, q, trans_a=True)
  reads = (run == state_run)[:, None]
  writes = (run == last_run)[:, None]
  q32, k32 = q.astype(_F32), k.astype(_F32)
  k_write = jnp.where(writes, k32, 0.0)
  dv = pu.dot(A.astype(dt), dN, trans_a=True) + jnp.where(writes, dc_ref[...].astype(_F32), 0.0)
  for g in range(d + 1):
    X, dX = X_ref[g].astype(dt), dX_ref[g].astype(dt)
    dQ = jnp.where(reads, _sigma(g, d) * pu.dot(dN, X, trans_b=True), 0.0)
    dq += _group_grad(dQ, q32, g, d)
    dW = jnp.where(writes, pu.dot(v, dX, trans_b=True), 0.0)
    dk += _group_grad(dW, k32, g, d)
    dv += pu.dot(_group(k_write, g, d).astype(dt), dX)
  dq_ref[...] = dq
  dk_ref[...] = dk
  dv_ref[...] = dv


def _with_group_column(x_BxTxHxK, cfg: KernelConfig):
  """[x[..., :d'], 1] [B, Tp, H, d' + 1]: the per-token weight w of each group (0 past T)."""
  B, Tp, H, _ = x_BxTxHxK.shape
  valid = (jnp.arange(Tp) < cfg.length).astype(x_BxTxHxK.dtype)
  ones = jnp.broadcast_to(valid[None, :, None, None], (B, Tp, H, 1))
  return jnp.concatenate([x_BxTxHxK[..., :cfg.key_dim], ones], axis=-1)


def _states(x, y, run, X0, c0, cfg: KernelConfig, *, reverse: bool):
  """Tiles entering every chunk [B, H, G, N d', Vp], constant rows [B, H, G, N, Vp] (x's dtype)
  and the final tiles and rows (fp32) of ``_state_kernel``."""
  B, Tp, H, dp = x.shape
  G, Vp, BV = cfg.key_dim + 1, y.shape[-1], cfg.block_v
  N = Tp // cfg.chunk
  seq = lambda width, col: pl.BlockSpec((None, Tp, None, width),
                                        lambda b, h, g, j: (b, 0, h, col(g, j)))
  tile = lambda rows: pl.BlockSpec((None, None, None, rows, BV), lambda b, h, g, j: (b, h, g, 0, j))
  in_specs = [seq(dp, lambda g, j: 0), seq(1, lambda g, j: g), seq(BV, lambda g, j: j),
              pl.BlockSpec((None, Tp), lambda b, h, g, j: (b, 0)), tile(dp), tile(1)]
  out_shape = (jax.ShapeDtypeStruct((B, H, G, N * dp, Vp), x.dtype),
               jax.ShapeDtypeStruct((B, H, G, N, Vp), x.dtype),
               jax.ShapeDtypeStruct(X0.shape, _F32), jax.ShapeDtypeStruct(c0.shape, _F32))
  kernel = functools.partial(_state_kernel, reverse=reverse)
  return pu.call(kernel, cfg, (B, H, G, Vp // BV), in_specs,
                 [tile(N * dp), tile(N), tile(dp), tile(1)], out_shape,
                 x, _with_group_column(x, cfg), y, run, X0, c0)


def _chunk_specs(Tp, dp, cfg: KernelConfig):
  """BlockSpecs over the grid (batch, head, chunk, value tile)."""
  C, BV, G = cfg.chunk, cfg.block_v, cfg.key_dim + 1
  return dict(
      qk=pl.BlockSpec((None, C, None, dp), lambda b, h, n, j: (b, n, h, 0)),
      v=pl.BlockSpec((None, C, None, BV), lambda b, h, n, j: (b, n, h, j)),
      run=pl.BlockSpec((None, Tp), lambda b, h, n, j: (b, 0)),
      X=pl.BlockSpec((None, None, G, dp, BV), lambda b, h, n, j: (b, h, 0, n, j)),
      # The constant row lives in the linear group's slot (g = d').
      c=pl.BlockSpec((None, None, None, 1, BV), lambda b, h, n, j: (b, h, G - 1, n, j)),
      partial=pl.BlockSpec((None, None, C, None, dp), lambda b, h, n, j: (j, b, n, h, 0)))


def _forward(q, k, v, run, X0, c0, cfg: KernelConfig):
  """(N [B, Tp, H, Vp] fp32, final tiles, final constant rows)."""
  B, Tp, H, dp = q.shape
  Vp = v.shape[-1]
  X, c, X_end, c_end = _states(k, v, run, X0, c0, cfg, reverse=False)
  s = _chunk_specs(Tp, dp, cfg)
  o = pu.call(_output_kernel, cfg,
              (B, H, Tp // cfg.chunk, Vp // cfg.block_v),
              [s["qk"], s["qk"], s["v"], s["run"], s["X"], s["c"]], s["v"],
              jax.ShapeDtypeStruct((B, Tp, H, Vp), _F32), q, k, v, run, X, c)
  return o, X_end, c_end


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused(q, k, v, run, X0, c0, cfg):
  return _forward(q, k, v, run, X0, c0, cfg)


def _fused_fwd(q, k, v, run, X0, c0, cfg):
  return _forward(q, k, v, run, X0, c0, cfg), (q, k, v, run, X0, c0)


def _fused_bwd(cfg, residuals, cotangents):
  q, k, v, run, X0, c0 = residuals
  dN, dX_end, dc_end = (x.astype(_F32) for x in cotangents)
  B, Tp, H, dp = q.shape
  Vp = v.shape[-1]
  n_tiles = Vp // cfg.block_v
  X, _, _, _ = _states(k, v, run, X0, c0, cfg, reverse=False)
  dX, dc, dX0, dc0 = _states(q, dN, run, dX_end, dc_end, cfg, reverse=True)
  s = _chunk_specs(Tp, dp, cfg)
  partial = jax.ShapeDtypeStruct((n_tiles, B, Tp, H, dp), _F32)
  dq, dk, dv = pu.call(
      _grad_kernel, cfg, (B, H, Tp // cfg.chunk, n_tiles),
      [s["qk"], s["qk"], s["v"], s["v"], s["run"], s["X"], s["X"], s["c"]],
      [s["partial"], s["partial"], s["v"]],
      (partial, partial, jax.ShapeDtypeStruct(v.shape, _F32)),
      q, k, v, dN, run, X, dX, dc)
  return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype), None,
          dX0, dc0)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _slots(d: int, dp: int, feature: taylor.Feature):
  """Static maps between TaylorState's feature index f and the kernel's rows s = g dp + b.

  Returns ``row_feature`` [G dp] (the f each kernel row holds, -1 for padding), ``row_scale``
  [G dp] (kernel row = scale · S[f]) and ``feature_rows`` [F - 1, 2] (the two kernel rows whose
  mean, divided by the scale, is S[f] for f >= 1; the same row twice unless a compact pair).
  """
  row_feature = np.full((d + 1) * dp, -1, np.int64)
  row_scale = np.zeros((d + 1) * dp)
  rows_of = {}
  for b in range(d):  # the linear part: phi = x / d'^(1/4), kernel row X_d'[b] = sum k_b v
    row_feature[d * dp + b], row_scale[d * dp + b] = 1 + b, d ** 0.25
  for g in range(d):
    for b in range(d):
      i, j = min(g, b), max(g, b)
      if feature == "full":
        f, scale = 1 + d + g * d + b, np.sqrt(2.0 * d)
      else:  # row i of the upper triangle starts at i d - i (i - 1) / 2
        f = 1 + d + i * d - i * (i - 1) // 2 + (j - i)
        scale = np.sqrt(2.0 * d) if i == j else np.sqrt(d)
      row_feature[g * dp + b], row_scale[g * dp + b] = f, scale
  for s, f in enumerate(row_feature):
    if f >= 1:
      rows_of.setdefault(int(f), []).append(s)
  feature_rows = np.array([[rows_of[f][0], rows_of[f][-1]]
                           for f in range(1, taylor.feature_width(d, feature))], np.int64)
  return row_feature, row_scale, feature_rows


def _to_kernel_state(S_BxHxFxW, d: int, dp: int, Vp: int, feature):
  """TaylorState's [B, H, F, W] (W = dv + 1: S and z) -> tiles [B, H, G, dp, Vp] and constant
  rows [B, H, G, 1, Vp] (the constant in the linear group's row, zeros elsewhere)."""
  B, H, _, W = S_BxHxFxW.shape
  row_feature, row_scale, _ = _slots(d, dp, feature)
  rows = jnp.take(S_BxHxFxW, np.maximum(row_feature, 0), axis=2)
  X = (rows * row_scale.astype(np.float32)[:, None]).reshape(B, H, d + 1, dp, W)
  c = jnp.zeros((B, H, d + 1, 1, W), _F32).at[:, :, d, 0].set(S_BxHxFxW[:, :, 0])
  return pu.pad_axis(X, 4, Vp), pu.pad_axis(c, 4, Vp)


def _from_kernel_state(X, c, d: int, W: int, feature):
  """The inverse of ``_to_kernel_state``, dropping padding: [B, H, F, W] fp32."""
  B, H, G, dp, _ = X.shape
  _, row_scale, feature_rows = _slots(d, dp, feature)
  X = X[..., :W].reshape(B, H, G * dp, W)
  scale = row_scale[feature_rows[:, 0]].astype(np.float32)[:, None]
  mean = 0.5 * (jnp.take(X, feature_rows[:, 0], axis=2) + jnp.take(X, feature_rows[:, 1], axis=2))
  return jnp.concatenate([c[:, :, d, :, :W], mean / scale], axis=2)


def taylor_linear_attention_pallas(
    q: jax.Array, k: jax.Array, v: jax.Array, *,
    state: TaylorState | None = None, eps: float = 1e-12,
    feature: taylor.Feature = "compact", chunk_size: int = 64,
    segment_ids: jax.Array | None = None, interpret: bool | None = None, block_v: int = 32,
    num_warps: int = 4, num_stages: int = 2, precision: str = "input"
    ) -> tuple[jax.Array, TaylorState]:
  """``taylor_linear_attention`` (no decay ablation) computed by the Pallas kernels; same results.

  Args:
    q, k: raw per-head projections [B, T, H, d'] (the feature map is applied in the kernels).
    v: values [B, T, H, dv]; bf16 or fp32 (dots in the inputs' dtype, fp32 accumulation).
    state: the TaylorState after a prefix (layout of ``feature``), or None for zeros.
    eps: added to the denominator.
    feature: ``compact`` or ``full``: only the layout of ``state`` and of the returned state.
    chunk_size: tokens per chunk, a power of two (>= 16 when compiled).
    segment_ids: optional packed-document ids [B, T] (``api.py``'s convention).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    block_v, num_warps, num_stages: GPU tuning knobs (value tile width over dv + 1 columns,
      Triton warps and stages).
    precision: "input" (dots take operands in the inputs' dtype), "tf32" or "float32" (the
      kernels run on fp32 copies and return fp32; ``pu.PRECISIONS``).

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 unless ``precision`` is "input"); the fp32 TaylorState
    after the last token.
  """
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, "taylor_linear_attention(implementation='pallas')",
                   "implementation='chunked'")
  if chunk_size < 1 or chunk_size & (chunk_size - 1):
    raise ValueError(f"taylor_linear_attention(implementation='pallas'): chunk_size must be a "
                     f"power of two, got {chunk_size}")
  pu.check_precision(precision, "taylor_linear_attention(implementation='pallas')")
  q, k, v = pu.operands(precision, q, k, v)
  B, T, H, d = q.shape
  V = v.shape[-1]
  if state is None:
    state = zero_state(B, H, d, V, feature)
  C = max(chunk_size, 1 if interpret else pu.MIN_DOT)
  dp, BV = pu.block_size(d, interpret), min(pu.block_size(V + 1, interpret), block_v)
  Tp, Vp = pu.round_up(T, C), pu.round_up(V + 1, BV)
  cfg = KernelConfig(chunk=C, block_v=BV, key_dim=d, length=T, interpret=interpret,
                     num_warps=num_warps, num_stages=num_stages, precision=precision)
  run = document_index(segment_ids, B, T)
  v_aug = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
  S_aug = jnp.concatenate([state.S.astype(_F32), state.z.astype(_F32)[..., None]], axis=-1)
  X0, c0 = _to_kernel_state(S_aug, d, dp, Vp, feature)
  pad_qk = lambda x: pu.pad_axis(pu.pad_axis(x, 1, Tp), 3, dp)
  N, X, c = _fused(pad_qk(q), pad_qk(k), pu.pad_axis(pu.pad_axis(v_aug, 1, Tp), 3, Vp),
                   pu.pad_axis(run, 1, Tp, mode="edge"), X0, c0, cfg)
  o = N[:, :T, :, :V] / (N[:, :T, :, V:V + 1] + eps)
  S_aug = _from_kernel_state(X, c, d, V + 1, feature)
  return o.astype(v.dtype), TaylorState(S_aug[..., :V], S_aug[..., V])
