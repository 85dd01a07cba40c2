"""Pallas (Mosaic TPU lowering) flash SANATAN kernels for any power p, with VJP: the TPU form of
pallas_triton_flash.py (features once per token, causal and document block skipping).

Per head, the function of ``reference.parallel``::

    w_tj = [j <= t, same run] u_tj^p,  u_tj = (s_tj + shift) / c,  s_tj = Phi(q_t) · Phi(k_j)
    (4ch: max(s, 0)),  N_t = sum_j w_tj v_j,  D_t = sum_j w_tj,  o_t = N_t / (D_t + eps).

Features, packed. The kernels see Phi without its constant channel as one row of F = (channels - 1)·d
features per token, channel after channel (feature (c - 1)·d + a is channel c of dim a). A score is
a sum over channels of per-channel dots, so it is one dot over the packed row (at d = 64 the five
channels of 6ch fill 320 lanes, not five 128-lane tiles); the constant channel adds d to every
score, as a number. A block's features come from its raw q or k [n, d]: a 0/1 matmul in u's
dtype spreads u over the F lanes (lane (c - 1)·d + a gets u_a; exact, one product per lane), then,
in fp32, ``base.feature_channels`` (the Triton kernels' feature map, with omega and lam_raw spread
the same way) gives every channel on every lane and each lane keeps its own channel. Its VJP
(``jax.vjp`` in the kernel) ends in the transposed 0/1 matmul: du_a sums its F / d lanes.

Features are computed per token, never per block pair:

* a feature kernel writes the packed Phi(k) (forward; Phi(q) and Phi(k) in the backward) to HBM in
  the operands' dtype, for the kernels that stream them as inner blocks;
* each attention kernel computes its outer block's features itself, once, into VMEM, and the dq and
  dk/dv kernels take the VJP at the outer block's last step (dq or dk, and per-program partial
  d omega and d lam_raw, summed by XLA), so no feature gradient goes through HBM.

Grid. A TPU core runs grid steps one after another. Each kernel has an "outer" block kind (query
blocks of BQ tokens in the forward and dq kernels, key blocks of BK in the dk/dv kernel) whose
fp32 accumulators stay in VMEM while it visits the "inner" blocks it sees causally: outer block n
sees L(n) inner blocks (key blocks 0 .. the diagonal; query blocks the diagonal .. the end). Only
those pairs are grid steps: the grid is (batch·head, row, step), and row r runs outer block r's
L(r) steps, then outer block N - 1 - r's, L(r) + L(N - 1 - r) steps, the same for every row (the
causal triangle folded in two). An odd N's middle row runs its block once; the other half of that
row are idle steps whose index maps stay on its last block (nothing copied). Batch·head and row
are "parallel" (split over a chip's cores), the step axis "arbitrary". Blocks are square,
``default_block`` tokens (512 up to d = 128): fewer, larger blocks mean fewer copies of the inner
blocks (one per pair) and fewer grid steps. The weights lie in [0, 1] (scores divided by their
maximum c), so there is no running maximum.

Documents (``segments.document_index`` runs, non-decreasing per row; without ``segment_ids`` one
run). A query block and a key block meet iff the run of the key block's last token is >= the run
of the query block's first token, so a query block meets the key blocks from the one holding its
first token's document start, and a key block the query blocks up to the one holding its last
token's document end. Scalar-prefetched per-row tables hold those bounds; the pairs outside them
are skipped with ``pl.when``, their index maps clamped to the nearest block that is used (nothing
copied for them).

Backward (``jax.custom_vjp``; the residuals are the head-major inputs, o and D). With dN = do / (D +
eps) and dD = -(do · o) / (D + eps) (XLA), dw_tj = dN_t · v_j + dD_t and ds_tj from ``jax.vjp`` of
the weight function (``base.power_weights``). Two kernels recomputing the scores:

* dq, query-major: d Phi(q_t) = sum_j ds_tj Phi(k_j) in VMEM, then the feature VJP;
* dk/dv, key-major, in transposed form (scores [BK, BQ]): dv_j = sum_t w_tj dN_t (in its fp32
  output block) and d Phi(k_j) = sum_t ds_tj Phi(q_t) in VMEM, then the feature VJP.

Layout: head-major [B·H, Tp, width] with the real widths d, F and dv (a block spanning a whole
last dimension needs no 128-lane multiple); time padded to whole blocks (zeros). A padded query
sees real keys, but its output is dropped and its cotangent is zero; padded keys sit after every
real query (edge-padded runs keep them in the last document).

Diagonal pairs of square blocks (compiled: of at least 256 tokens) are computed as two tiles, the
first half of the queries against the first half of the keys and the second half against all of
them, so the quarter above the diagonal costs nothing; other masked entries are computed and
zeroed.

Each ``pallas_call`` passes a ``pl.CostEstimate`` of the work its steps do: the matmul FLOPs of
the entries computed (every causally visible block pair, less the diagonal quarters) at the dots'
logical sizes, and of the lane spreads; five transcendentals per feature computed (two cosines, two
sines, one tanh); the bytes its blocks move: outer blocks and outputs once, inner blocks once per
visible pair. With packed documents it is an upper bound: skipped pairs neither compute nor copy.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common.layout import default_positions, heads_first
from lmcore.ops.common.segments import document_index
from sanatan_jax.ops.sanatan_attention.base import (EPS, NON_CONSTANT_CHANNELS, after_cotangent,
                                                    check_blocked_options, feature_channels,
                                                    power_weights)

LANES = pu.TPU_LANES
_F32 = jnp.float32
_TRANSCENDENTALS_PER_FEATURE = 5
# The default block (``default_block``) is the largest of 512, 256 and 128 tokens with
# F·block <= FEATURE_LANES_X_BLOCK and dv·(bytes per v element)·block <= VALUE_BYTES_X_BLOCK: from
# compiling forward and backward for a TPU v4 (16 MiB of VMEM per core) at d x dv from 64 x 64 to
# 512 x 512, bf16 and fp32. 512 fits up to d = 128 (bf16 dv 512, fp32 dv 256); d = 256 needs 256,
# d = 512 128. Fewer, larger blocks cut the inner blocks' copies (each is read once per pair) and
# the grid steps; 1024 does not fit at d = 64.
FEATURE_LANES_X_BLOCK = 640 * 512
VALUE_BYTES_X_BLOCK = 1024 * 512


class KernelConfig(NamedTuple):
  """Static kernel parameters (hashable: they key the compiled kernels).

  block_q, block_k: BQ, BK; head_dim: d; n_heads: H (positions and runs are per batch row); p,
  channels, three_channel: the kernel; interpret: ``pallas_call``'s argument.
  """

  block_q: int
  block_k: int
  head_dim: int
  n_heads: int
  p: int
  channels: int
  three_channel: str
  interpret: Any

  @property
  def width(self) -> int:
    """F, the packed features per token."""
    return len(NON_CONSTANT_CHANNELS[self.channels]) * self.head_dim


class Static(NamedTuple):
  """What the custom VJP holds static: the kernels' config and the padded length Tp."""

  cfg: KernelConfig
  padded_length: int


def default_block(head_dim: int, value_dim: int, channels: int, dtype) -> int:
  """The block length the kernels use for queries and keys unless told (see FEATURE_LANES_X_BLOCK)."""
  width = len(NON_CONSTANT_CHANNELS[channels]) * head_dim
  value_bytes = value_dim * jnp.dtype(dtype).itemsize
  for block in (512, 256):
    if width * block <= FEATURE_LANES_X_BLOCK and value_bytes * block <= VALUE_BYTES_X_BLOCK:
      return block
  return LANES


# Iteration order.

def _div(a, b: int):
  """a // b for non-negative a: Python ints stay ints, traced ones use truncating division (what
  Mosaic's scalar core does)."""
  return a // b if isinstance(a, int) else jax.lax.div(a, b)


class _Tile(NamedTuple):
  """A part of a block pair: rows ``row : row + rows`` of the outer block, columns ``col : col +
  cols`` of the inner one."""

  row: int
  rows: int
  col: int
  cols: int


class _Order(NamedTuple):
  """One kernel's iteration order: ``n_outer`` outer blocks, of which block n sees the inner blocks
  ``first(n) .. first(n) + count(n) - 1``; ``key_major``: the outer blocks are key blocks."""

  key_major: bool
  n_outer: int
  n_inner: int
  cfg: KernelConfig

  @property
  def outer_size(self) -> int:
    return self.cfg.block_k if self.key_major else self.cfg.block_q

  @property
  def inner_size(self) -> int:
    return self.cfg.block_q if self.key_major else self.cfg.block_k

  def first(self, n):
    """Query-major: key block 0. Key-major: the query block holding key block n's first key."""
    return _div(n * self.cfg.block_k, self.cfg.block_q) if self.key_major else 0

  def count(self, n):
    """How many inner blocks outer block n sees causally."""
    if self.key_major:
      return self.n_inner - self.first(n)
    return _div((n + 1) * self.cfg.block_q - 1, self.cfg.block_k) + 1

  @property
  def rows(self) -> int:
    return -(-self.n_outer // 2)

  @property
  def steps(self) -> int:
    """Steps per row: the same for every row (``check``)."""
    return self.count(0) + self.count(self.n_outer - 1)

  def check(self) -> None:
    lengths = {self.count(r) + self.count(self.n_outer - 1 - r) for r in range(self.rows)}
    assert lengths == {self.steps}, (self, lengths)

  @property
  def pairs(self) -> int:
    """Causally visible (outer, inner) block pairs of one batch·head."""
    return sum(self.count(n) for n in range(self.n_outer))

  @property
  def splits_diagonal(self) -> bool:
    """Whether diagonal pairs skip their wholly masked quarter: square blocks, and compiled, halves
    of at least 128 lanes (the query-side rows of the dk/dv kernel are sliced along lanes)."""
    cfg = self.cfg
    return (cfg.block_q == cfg.block_k and cfg.block_q > 1
            and (cfg.interpret is not False or cfg.block_q >= 2 * LANES))

  def tiles(self, diagonal: bool) -> tuple[_Tile, ...]:
    """The parts of a pair's [outer, inner] block that are computed. A diagonal pair of square
    blocks is two: the first half of the query rows sees only the first half of the keys."""
    whole = (_Tile(0, self.outer_size, 0, self.inner_size),)
    if not (diagonal and self.splits_diagonal):
      return whole
    h = self.outer_size // 2
    if self.key_major:  # key rows: the first half sees every query, the second half the second
      return _Tile(0, h, 0, 2 * h), _Tile(h, h, h, h)
    return _Tile(0, h, 0, h), _Tile(h, h, 0, 2 * h)

  @property
  def entries(self) -> int:
    """[row, column] entries computed over the visible pairs of one batch·head."""
    area = lambda tiles: sum(t.rows * t.cols for t in tiles)
    diagonal = self.n_outer if self.splits_diagonal else 0
    return (self.pairs - diagonal) * area(self.tiles(False)) + diagonal * area(self.tiles(True))


class _Step(NamedTuple):
  """Grid step (row, step) of an ``_Order``: its outer and inner block, whether it is the outer
  block's first and last, and whether it computes (``live``: not idle, and the blocks meet)."""

  outer: Any
  inner: Any
  first: Any
  last: Any
  live: Any


def _step(row, step, order: _Order, bound=None) -> _Step:
  """Row ``row`` runs outer block ``row``, then outer block ``n_outer - 1 - row``; an odd count's
  middle row idles on its second half, parked on its last inner block. ``bound`` is the document
  bound of the outer block (the first key block a query block meets, or the last query block a key
  block meets); the returned inner block is clamped to it, so that skipped steps copy nothing."""
  count_first = order.count(row)
  second = step >= count_first
  outer = jnp.where(second, order.n_outer - 1 - row, row)
  offset = jnp.where(second, step - count_first, step)
  count = order.count(outer)
  active = jnp.logical_not(second & (outer == row))
  offset = jnp.where(active, offset, count - 1)
  inner = order.first(outer) + offset
  meets = True
  if bound is not None:
    meets = inner <= bound if order.key_major else inner >= bound
    inner = jnp.minimum(inner, bound) if order.key_major else jnp.maximum(inner, bound)
  return _Step(outer, inner, active & (offset == 0), active & (offset == count - 1),
               active & meets)


def _bounded_step(bh, row, step, table_ref, order: _Order) -> _Step:
  """``_step`` with the document bound of its outer block in batch·head ``bh``'s row
  (``_document_tables``)."""
  outer = _step(row, step, order).outer
  bound = table_ref[_div(bh, order.cfg.n_heads) * order.n_outer + outer]
  return _step(row, step, order, bound)


def _document_tables(run_BxTp, cfg: KernelConfig):
  """Per row, flattened int32: [B·nQ] the first key block each query block meets, [B·nK] the last
  query block each key block meets."""
  BQ, BK = cfg.block_q, cfg.block_k
  first_run_BxQ = run_BxTp[:, ::BQ]  # each query block's first token
  last_run_BxK = run_BxTp[:, BK - 1::BK]  # each key block's last token
  first_key_BxQ = jnp.sum(last_run_BxK[:, None, :] < first_run_BxQ[:, :, None], axis=2)
  later_BxK = jnp.sum(first_run_BxQ[:, None, :] > last_run_BxK[:, :, None], axis=2)
  last_query_BxK = first_run_BxQ.shape[1] - 1 - later_BxK
  return (first_key_BxQ.reshape(-1).astype(jnp.int32),
          last_query_BxK.reshape(-1).astype(jnp.int32))


# In-kernel pieces.

def _lane_spread(cfg: KernelConfig, dtype):
  """The 0/1 matrix [d, F] that puts dim a on lane (c - 1)·d + a of every channel c."""
  d, F = cfg.head_dim, cfg.width
  dim = jax.lax.broadcasted_iota(jnp.int32, (d, F), 0)
  lane = jax.lax.broadcasted_iota(jnp.int32, (d, F), 1)
  return functools.reduce(jnp.logical_or, [lane == dim + c * d for c in range(F // d)]).astype(dtype)


def _feature_fn(pos_n, cfg: KernelConfig):
  """(u [n, F], omega [1, F], lam_raw [1, F], all spread over the lanes) -> the packed
  non-constant channels [n, F] (fp32) of tokens at positions ``pos_n`` [n]: every channel of
  ``base.feature_channels`` on every lane, each lane keeping its own."""
  d, F = cfg.head_dim, cfg.width

  def fn(u, omega, lam_raw):
    channels = feature_channels(u, omega, lam_raw, pos_n, True)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, F), 1)
    phi = jnp.zeros(u.shape, _F32)
    for c, channel in enumerate(NON_CONSTANT_CHANNELS[cfg.channels]):
      phi = jnp.where((lane >= c * d) & (lane < (c + 1) * d), channels[channel], phi)
    return phi

  return fn


def _features(u_ref, pos_ref, omega_ref, lam_ref, cfg: KernelConfig, with_vjp: bool = False):
  """The packed features (fp32 [n, F]) of a block of raw q or k [n, d] and, if asked, their VJP:
  d phi -> (du [n, d], d omega [1, F], d lam_raw [1, F]), fp32.

  u is spread over the lanes by a matmul in its own dtype (exact: one product per lane); the VJP
  sums each dim's lanes by the transposed matmul, on the lane gradients in u's dtype (rounded
  like every other dot operand of the kernels).
  """
  u = u_ref[...]
  spread = _lane_spread(cfg, u.dtype)
  fn = _feature_fn(pos_ref[...][:, 0], cfg)
  args = (pu.dot(u, spread), omega_ref[...], lam_ref[...])
  if not with_vjp:
    return fn(*args), None
  phi, lanes_vjp = jax.vjp(fn, *args)

  def vjp(dphi):
    du_lanes, d_omega, d_lam = lanes_vjp(dphi)
    return pu.dot(du_lanes.astype(u.dtype), spread, trans_b=True), d_omega, d_lam

  return phi, vjp


def _scores(rows, cols, cfg: KernelConfig):
  """s = d + rows colsᵀ over the packed features, fp32 [n_rows, n_cols] (d: the constant channel)."""
  return float(cfg.head_dim) + pu.dot(rows, cols, trans_b=True)


def _visible(step: _Step, tile: _Tile, run_rows, run_cols, order: _Order):
  """[rows, cols] mask of ``tile``'s pairs that are causal and in the same run; rows are queries,
  or keys when ``order.key_major`` (then ``run_rows`` is a column of key runs)."""
  cfg = order.cfg
  shape = (tile.rows, tile.cols)
  rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + tile.row
  cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + tile.col
  if order.key_major:
    causal = step.outer * cfg.block_k + rows <= step.inner * cfg.block_q + cols
  else:
    causal = step.outer * cfg.block_q + rows >= step.inner * cfg.block_k + cols
  return causal & (run_rows == run_cols)


def _on_live_tiles(step: _Step, order: _Order, work) -> None:
  """Runs ``work(tile)`` for the tiles of a live step: the diagonal pair's two, or the whole pair."""

  def run(diagonal: bool):
    def body():
      for tile in order.tiles(diagonal):
        work(tile)
    return body

  if not order.splits_diagonal:
    pl.when(step.live)(run(False))
    return
  diagonal = step.outer == step.inner
  pl.when(step.live & diagonal)(run(True))
  pl.when(step.live & jnp.logical_not(diagonal))(run(False))


def _rows(ref, start: int, size: int):
  """Rows ``start : start + size`` of a [n, width] block."""
  return ref[pl.ds(start, size), :]


def _lanes(ref, start: int, size: int):
  """Lanes ``start : start + size`` of a [1, n] block."""
  return ref[:, pl.ds(start, size)]


def _weight_fn(mask, cfg: KernelConfig):
  return lambda s: power_weights(s, mask, p=cfg.p, channels=cfg.channels,
                                 three_channel=cfg.three_channel, d=cfg.head_dim)


def _feature_kernel(u_ref, pos_ref, omega_ref, lam_ref, phi_ref, *, cfg: KernelConfig):
  phi_ref[...] = _features(u_ref, pos_ref, omega_ref, lam_ref, cfg)[0].astype(phi_ref.dtype)


def _forward_kernel(first_key_ref, q_ref, pos_q_ref, run_q_ref, omega_ref, lam_ref, phi_k_ref,
                    v_ref, run_k_ref, o_ref, den_ref, phi_q_scratch, num_scratch, *,
                    order: _Order):
  cfg = order.cfg
  step = _bounded_step(*(pl.program_id(a) for a in range(3)), first_key_ref, order)

  @pl.when(step.first)
  def _():
    phi_q = _features(q_ref, pos_q_ref, omega_ref, lam_ref, cfg)[0]
    phi_q_scratch[...] = phi_q.astype(phi_q_scratch.dtype)
    num_scratch[...] = jnp.zeros(num_scratch.shape, _F32)
    den_ref[...] = jnp.zeros(den_ref.shape, _F32)

  def work(t: _Tile):
    s = _scores(_rows(phi_q_scratch, t.row, t.rows), _rows(phi_k_ref, t.col, t.cols), cfg)
    mask = _visible(step, t, _rows(run_q_ref, t.row, t.rows), _lanes(run_k_ref, t.col, t.cols),
                    order)
    w = _weight_fn(mask, cfg)(s)
    v = _rows(v_ref, t.col, t.cols)
    rows = pl.ds(t.row, t.rows)
    num_scratch[rows, :] += pu.dot(w.astype(v.dtype), v)
    den_ref[rows, :] += jnp.sum(w, axis=1, keepdims=True)

  _on_live_tiles(step, order, work)

  @pl.when(step.last)
  def _():
    o_ref[...] = (num_scratch[...] / (den_ref[...] + EPS)).astype(o_ref.dtype)


def _dq_kernel(first_key_ref, q_ref, pos_q_ref, run_q_ref, omega_ref, lam_ref, dN_ref, dD_ref,
               phi_k_ref, v_ref, run_k_ref, dq_ref, domega_ref, dlam_ref, phi_q_scratch,
               dphi_scratch, *, order: _Order):
  cfg = order.cfg
  step = _bounded_step(*(pl.program_id(a) for a in range(3)), first_key_ref, order)
  outer = (q_ref, pos_q_ref, omega_ref, lam_ref)

  @pl.when(step.first)
  def _():
    phi_q_scratch[...] = _features(*outer, cfg)[0].astype(phi_q_scratch.dtype)
    dphi_scratch[...] = jnp.zeros(dphi_scratch.shape, _F32)

  def work(t: _Tile):
    phi_k = _rows(phi_k_ref, t.col, t.cols)
    s = _scores(_rows(phi_q_scratch, t.row, t.rows), phi_k, cfg)
    mask = _visible(step, t, _rows(run_q_ref, t.row, t.rows), _lanes(run_k_ref, t.col, t.cols),
                    order)
    _, w_vjp = jax.vjp(_weight_fn(mask, cfg), s)
    dw = (pu.dot(_rows(dN_ref, t.row, t.rows), _rows(v_ref, t.col, t.cols), trans_b=True)
          + _rows(dD_ref, t.row, t.rows))
    (ds,) = w_vjp(dw)
    dphi_scratch[pl.ds(t.row, t.rows), :] += pu.dot(ds.astype(phi_k.dtype), phi_k)

  _on_live_tiles(step, order, work)

  @pl.when(step.last)
  def _():
    _, features_vjp = _features(*outer, cfg, with_vjp=True)
    _store_grads((dq_ref, domega_ref, dlam_ref), features_vjp(dphi_scratch[...]))


def _store_grads(refs, grads) -> None:
  """The outer block's feature VJP (fp32) into its output refs, each in the ref's dtype."""
  for ref, grad in zip(refs, grads):
    ref[...] = grad.astype(ref.dtype)


def _dkv_kernel(last_query_ref, k_ref, pos_k_ref, run_k_ref, omega_ref, lam_ref, v_ref, phi_q_ref,
                run_q_ref, dN_ref, dD_ref, dk_ref, dv_ref, domega_ref, dlam_ref, phi_k_scratch,
                dphi_scratch, *, order: _Order):
  """Transposed: scores, weights and their gradients are [BK, BQ], keys along the rows; the
  query-side runs and dD come as rows [1, BQ], the key runs as a column [BK, 1]."""
  cfg = order.cfg
  step = _bounded_step(*(pl.program_id(a) for a in range(3)), last_query_ref, order)
  outer = (k_ref, pos_k_ref, omega_ref, lam_ref)

  @pl.when(step.first)
  def _():
    phi_k_scratch[...] = _features(*outer, cfg)[0].astype(phi_k_scratch.dtype)
    dphi_scratch[...] = jnp.zeros(dphi_scratch.shape, _F32)
    dv_ref[...] = jnp.zeros(dv_ref.shape, _F32)

  def work(t: _Tile):
    phi_q, dN = _rows(phi_q_ref, t.col, t.cols), _rows(dN_ref, t.col, t.cols)
    s = _scores(_rows(phi_k_scratch, t.row, t.rows), phi_q, cfg)
    mask = _visible(step, t, _rows(run_k_ref, t.row, t.rows), _lanes(run_q_ref, t.col, t.cols),
                    order)
    w, w_vjp = jax.vjp(_weight_fn(mask, cfg), s)
    dw = (pu.dot(_rows(v_ref, t.row, t.rows), dN, trans_b=True)
          + _lanes(dD_ref, t.col, t.cols))
    (ds,) = w_vjp(dw)
    rows = pl.ds(t.row, t.rows)
    dv_ref[rows, :] += pu.dot(w.astype(dN.dtype), dN)
    dphi_scratch[rows, :] += pu.dot(ds.astype(phi_q.dtype), phi_q)

  _on_live_tiles(step, order, work)

  @pl.when(step.last)
  def _():
    _, features_vjp = _features(*outer, cfg, with_vjp=True)
    _store_grads((dk_ref, domega_ref, dlam_ref), features_vjp(dphi_scratch[...]))


# Calls.

class _Operand(NamedTuple):
  """A kernel operand and how it is blocked. ``side``: "outer" or "inner" (which block index picks
  its block). ``layout``: "tokens" ([B·H, Tp, width], blocks of rows), "column" ([B, Tp, 1], per
  batch row), "row" ([B or B·H, 1, Tp], blocks of lanes; ``per_head``: indexed by batch·head, not
  batch row), "param" ([H, 1, F], the head's) or "partial" ([B·H, n_outer, 1, F], the outer
  block's own)."""

  array: Any
  side: str = "outer"
  layout: str = "tokens"
  per_head: bool = True


def _block_spec(x: _Operand, order: _Order) -> pl.BlockSpec:
  """``x``'s blocks over the grid (batch·head, row, step) of ``order``."""
  H = order.cfg.n_heads
  size = order.outer_size if x.side == "outer" else order.inner_size

  def index_map(bh, row, step, table_ref):
    # Index maps run on the scalar core at every step: each computes only what it needs.
    if x.layout == "param":
      return bh % H, 0, 0
    if x.side == "outer":
      block = _step(row, step, order).outer
    else:
      block = _bounded_step(bh, row, step, table_ref, order).inner
    if x.layout == "partial":
      return bh, block, 0, 0
    batch = bh if x.per_head and x.layout != "column" else _div(bh, H)
    return (batch, 0, block) if x.layout == "row" else (batch, block, 0)

  width = x.array.shape[-1]
  shape = {"tokens": (None, size, width), "column": (None, size, 1), "row": (None, 1, size),
           "param": (None, 1, width), "partial": (None, None, 1, width)}[x.layout]
  return pl.BlockSpec(shape, index_map)


def _block_bytes(operands, side: str, layouts=("tokens", "column", "row")) -> int:
  """Bytes per token of the operands of ``layouts`` on ``side``."""
  total = 0
  for x in operands:
    if x.side == side and x.layout in layouts:
      width = 1 if x.layout == "row" else x.array.shape[-1]
      total += width * x.array.dtype.itemsize
  return total


def _feature_work(tokens: int, cfg: KernelConfig, vjp: bool) -> tuple[int, int]:
  """(matmul FLOPs, transcendentals) of the packed features of ``tokens`` tokens (and their VJP)."""
  flops = 2 * tokens * cfg.head_dim * cfg.width * (2 if vjp else 1)
  return flops, _TRANSCENDENTALS_PER_FEATURE * tokens * cfg.width


def _cost(order: _Order, operands, outputs, flops_per_entry: int, feature_passes: int,
          table) -> pl.CostEstimate:
  """The work of the grid's steps: ``flops_per_entry`` matmul FLOPs per [query, key] entry computed
  (``_Order.entries``), the outer blocks' features ``feature_passes`` times (the second with its
  VJP); bytes: outer blocks and outputs once, parameters once per batch·head, inner blocks once per
  visible pair, the table."""
  cfg = order.cfg
  BH = operands[0].array.shape[0]
  outer_tokens = order.n_outer * order.outer_size
  pair_flops = order.entries * flops_per_entry
  feature_flops, transcendentals = 0, 0
  for n in range(feature_passes):
    flops, count = _feature_work(outer_tokens, cfg, vjp=n == 1)
    feature_flops, transcendentals = feature_flops + flops, transcendentals + count
  per_head = (outer_tokens * (_block_bytes(operands, "outer") + _block_bytes(outputs, "outer"))
              + order.pairs * order.inner_size * _block_bytes(operands, "inner")
              + _block_bytes(operands, "outer", ("param",))
              + order.n_outer * _block_bytes(outputs, "outer", ("partial",)))
  return pl.CostEstimate(flops=BH * (pair_flops + feature_flops), transcendentals=BH * transcendentals,
                         bytes_accessed=BH * per_head + table.size * table.dtype.itemsize)


def _call(kernel, order: _Order, table, operands, outputs, flops_per_entry: int,
          feature_passes: int, scratch=()):
  """Runs ``kernel(table_ref, *operand_refs, *output_refs, *scratch, order=order)`` over the grid
  (batch·head, row, step); ``outputs`` are ``_Operand``s of ShapeDtypeStructs on the outer side."""
  order.check()
  BH = operands[0].array.shape[0]
  out_shape = tuple(x.array for x in outputs)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(BH, order.rows, order.steps),
      in_specs=[_block_spec(x, order) for x in operands],
      out_specs=[_block_spec(x, order) for x in outputs],
      scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch])
  return pl.pallas_call(
      functools.partial(kernel, order=order), grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=_cost(order, operands, outputs, flops_per_entry, feature_passes, table),
      interpret=order.cfg.interpret)(table, *(x.array for x in operands))


class _Inputs(NamedTuple):
  """The kernels' head-major inputs: raw q, k [B·H, Tp, d], v [B·H, Tp, dv]; positions and runs
  [B, Tp] int32; omega and lam_raw spread over the packed lanes, [H, 1, F] fp32."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  pos: jax.Array
  run: jax.Array
  omega: jax.Array
  lam_raw: jax.Array


def _orders(st: Static) -> tuple[_Order, _Order]:
  """The query-major order (forward, dq) and the key-major one (dk/dv)."""
  n_q, n_k = st.padded_length // st.cfg.block_q, st.padded_length // st.cfg.block_k
  return _Order(False, n_q, n_k, st.cfg), _Order(True, n_k, n_q, st.cfg)


def _packed_features(u, x: _Inputs, st: Static):
  """The packed features [B·H, Tp, F] of raw q or k ``u`` in its dtype (the feature kernel, in
  blocks of BQ tokens)."""
  cfg = st.cfg
  BH, Tp, d = u.shape
  BT, F, H = cfg.block_q, cfg.width, cfg.n_heads
  tokens = lambda width: pl.BlockSpec((None, BT, width), lambda bh, n: (bh, n, 0))
  param = pl.BlockSpec((None, 1, F), lambda bh, n: (bh % H, 0, 0))
  flops, transcendentals = _feature_work(BH * Tp, cfg, vjp=False)
  return pl.pallas_call(
      functools.partial(_feature_kernel, cfg=cfg), grid=(BH, Tp // BT),
      in_specs=[tokens(d), pl.BlockSpec((None, BT, 1), lambda bh, n: (bh // H, n, 0)), param, param],
      out_specs=tokens(F), out_shape=jax.ShapeDtypeStruct((BH, Tp, F), u.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      cost_estimate=pl.CostEstimate(
          flops=flops, transcendentals=transcendentals,
          bytes_accessed=BH * (Tp * (d * u.dtype.itemsize + 4 + F * u.dtype.itemsize) + 8 * F)),
      interpret=cfg.interpret)(u, x.pos[:, :, None], x.omega, x.lam_raw)


def _forward(x: _Inputs, st: Static):
  """o [B·H, Tp, dv] in v's dtype and D [B·H, Tp, 1] fp32."""
  cfg = st.cfg
  BH, Tp, V = x.v.shape
  first_key, _ = _document_tables(x.run, cfg)
  operands = [_Operand(x.q), _Operand(x.pos[:, :, None], layout="column"),
              _Operand(x.run[:, :, None], layout="column"), _Operand(x.omega, layout="param"),
              _Operand(x.lam_raw, layout="param"), _Operand(_packed_features(x.k, x, st), "inner"),
              _Operand(x.v, "inner"), _Operand(x.run[:, None, :], "inner", "row", per_head=False)]
  outputs = [_Operand(jax.ShapeDtypeStruct(x.v.shape, x.v.dtype)),
             _Operand(jax.ShapeDtypeStruct((BH, Tp, 1), _F32))]
  scratch = [((cfg.block_q, cfg.width), x.q.dtype), ((cfg.block_q, V), _F32)]
  return _call(_forward_kernel, _orders(st)[0], first_key, operands, outputs,
               2 * (cfg.width + V), 1, scratch)


def _backward(x: _Inputs, dN, dD, st: Static):
  """dq, dk [B·H, Tp, d] in q's and k's dtypes, dv [B·H, Tp, dv] and d omega, d lam_raw [H, F]
  (spread) in fp32."""
  cfg = st.cfg
  BH, Tp, V = x.v.shape
  d, F = cfg.head_dim, cfg.width
  query_major, key_major = _orders(st)
  first_key, last_query = _document_tables(x.run, cfg)
  phi_q, phi_k = _packed_features(x.q, x, st), _packed_features(x.k, x, st)
  rows = lambda width, dtype=_F32: _Operand(jax.ShapeDtypeStruct((BH, Tp, width), dtype))
  partial = lambda order: _Operand(jax.ShapeDtypeStruct((BH, order.n_outer, 1, F), _F32),
                                   layout="partial")
  pos, run_column = x.pos[:, :, None], x.run[:, :, None]
  run_row = _Operand(x.run[:, None, :], "inner", "row", per_head=False)
  params = [_Operand(x.omega, layout="param"), _Operand(x.lam_raw, layout="param")]
  dq, domega_q, dlam_q = _call(
      _dq_kernel, query_major, first_key,
      [_Operand(x.q), _Operand(pos, layout="column"), _Operand(run_column, layout="column"),
       *params, _Operand(dN), _Operand(dD), _Operand(phi_k, "inner"), _Operand(x.v, "inner"),
       run_row],
      [rows(d, x.q.dtype), partial(query_major), partial(query_major)], 2 * (2 * F + V), 2,
      [((cfg.block_q, F), x.q.dtype), ((cfg.block_q, F), _F32)])
  dk, dv, domega_k, dlam_k = _call(
      _dkv_kernel, key_major, last_query,
      [_Operand(x.k), _Operand(pos, layout="column"), _Operand(run_column, layout="column"),
       *params, _Operand(x.v), _Operand(phi_q, "inner"), run_row, _Operand(dN, "inner"),
       _Operand(jnp.swapaxes(dD, 1, 2), "inner", "row")],
      [rows(d, x.k.dtype), rows(V), partial(key_major), partial(key_major)], 2 * (2 * F + 2 * V), 2,
      [((cfg.block_k, F), x.k.dtype), ((cfg.block_k, F), _F32)])
  per_head = lambda g: g.reshape(-1, cfg.n_heads, *g.shape[1:]).sum((0, 2))[:, 0]
  return (dq, dk, dv, per_head(domega_q) + per_head(domega_k),
          per_head(dlam_q) + per_head(dlam_k))


# The custom VJP.

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _attention(x: _Inputs, st: Static):
  """o [B·H, Tp, dv] in v's dtype."""
  return _forward(x, st)[0]


def _attention_fwd(x: _Inputs, st: Static):
  o, den = _forward(x, st)
  return o, (x, o, den)


def _attention_bwd(st: Static, residuals, do):
  """dN = do / (D + eps) and dD = -(do · o) / (D + eps) in XLA, then the kernels. The inputs pass
  an optimisation barrier with ``do`` (``base.after_cotangent``), so that XLA neither reuses the
  forward's Phi(k) nor computes the features before the cotangent exists."""
  x, o, den = residuals
  x = _Inputs(*after_cotangent(tuple(x), do))
  inv = 1.0 / (den + EPS)
  do = do.astype(_F32)
  dN = (do * inv).astype(x.v.dtype)
  dD = -jnp.sum(do * o.astype(_F32), axis=-1, keepdims=True) * inv
  dq, dk, dv, d_omega, d_lam = _backward(x, dN, dD, st)
  return (_Inputs(dq.astype(x.q.dtype), dk.astype(x.k.dtype), dv.astype(x.v.dtype), None, None,
                  d_omega[:, None].astype(x.omega.dtype), d_lam[:, None].astype(x.lam_raw.dtype)),)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _spread(x_Hxd: jax.Array, cfg: KernelConfig) -> jax.Array:
  """[H, d] -> [H, 1, F] fp32: dim a's value on lane (c - 1)·d + a of every channel c (its
  transpose sums the lanes of each dim)."""
  return jnp.tile(x_Hxd.astype(_F32), (1, cfg.width // cfg.head_dim))[:, None, :]


def sanatan_blocked_tpu(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                        lam_raw: jax.Array, *, positions: jax.Array | None = None,
                        segment_ids: jax.Array | None = None, p: int = 2, channels: int = 6,
                        three_channel: str = "clean", rotate: bool = True,
                        interpret: bool | pltpu.InterpretParams | None = None,
                        block_q: int | None = None, block_k: int | None = None) -> jax.Array:
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
    block_q, block_k: query and key block lengths, powers of two; None means ``default_block``.
      Compiled, at least 128; interpreted, any (capped at the next power of two >= T), so that
      tests cross many blocks.

  Returns:
    o [B, T, H, dv] in v's dtype.
  """
  interpret = pu.resolve_tpu_interpret(interpret, "sanatan_blocked_tpu",
                                        "sanatan_attention(implementation='blocked')")
  check_blocked_options(p, channels, three_channel, block_q or LANES, block_k or LANES,
                        op="sanatan_blocked_tpu")
  B, T, H, d = q.shape
  block = default_block(d, v.shape[-1], channels, v.dtype)
  block_q, block_k = block_q or block, block_k or block
  if positions is None:
    positions = default_positions(B, T)
  fit = lambda size: min(size, pl.next_power_of_2(T)) if interpret else max(size, LANES)
  BQ, BK = fit(block_q), fit(block_k)
  cfg = KernelConfig(block_q=BQ, block_k=BK, head_dim=d, n_heads=H, p=p, channels=channels,
                     three_channel=three_channel, interpret=interpret)
  Tp = pu.round_up(T, max(BQ, BK))
  # Rotation by position 0 is none: the "no lambda" ablation.
  pos = positions.astype(jnp.int32) if rotate else jnp.zeros((B, T), jnp.int32)
  x = _Inputs(q=heads_first(q, Tp, d), k=heads_first(k, Tp, d), v=heads_first(v, Tp, v.shape[-1]),
              pos=pu.pad_axis(pos, 1, Tp),
              # Edge-padding keeps padded tokens in the last run; causality hides them from real
              # queries.
              run=pu.pad_axis(document_index(segment_ids, B, T), 1, Tp, mode="edge"),
              omega=_spread(omega, cfg), lam_raw=_spread(lam_raw, cfg))
  o = _attention(x, Static(cfg=cfg, padded_length=Tp))
  return jnp.swapaxes(o.reshape(B, H, Tp, -1)[:, :, :T], 1, 2)
