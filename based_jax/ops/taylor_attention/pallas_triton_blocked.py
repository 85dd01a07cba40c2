"""Pallas (Triton lowering) blocked, flash-style kernels for BASED's Taylor linear attention
(MATH §2.1) over whole sequences, custom VJP: the quadratic form, for training at moderate T.

Per head, with ``s_tj = q_t·k_j / sqrt(d')`` and ``A_tj = 1 + s + s²/2`` (taylor.taylor_kernel) on
visible pairs (j <= t, same run), the kernels compute the unnormalised sums

    N_t = sum_j A_tj v_j   [dv],      D_t = sum_j A_tj,

block by block: grid (query block, batch, head), a program loops (``lax.fori_loop``, traced bound)
over the key blocks j <= its block, one [BQ, d'] x [d', BK] dot for s and one [BQ, BK] x [BK, dv]
dot for N per step, in fp32; no T x T array exists. A >= 1/2 everywhere, so no running maximum is
needed. The work is T² (d' + dv) per head; a program holds a head's whole (padded) dv, which bounds
dv (``MAX_VALUE_DIM``).

``taylor_linear_attention_blocked`` (the backend ``pallas_blocked``): without a prefix state the
forward kernel also divides, writing o = N / (D + eps) in v's dtype and D (fp32), and the backward
forms dN = do / (D + eps) and dD = -(do · o) / (D + eps) in XLA; with one it adds what the state
contributes to N and D and divides in XLA, so the kernels take no state. Backward: with the
cotangents dN (passed in the operands' dtype) and dD, dA_tj = dN_t · v_j + dD_t on visible pairs
and dA/ds = 1 + s,

    dq_t = sum_j dA_tj (1 + s_tj) k_j / sqrt(d'),   dk_j = sum_t dA_tj (1 + s_tj) q_t / sqrt(d'),
    dv_j = sum_t A_tj dN_t,

a query-block kernel for dq (looping over key blocks j <= its block) and a key-block kernel for
dk, dv (looping over the query blocks that see it), each writing its gradients in the operands'
dtype. The forward saves its inputs (and o and D where it divides).

Padding: time is padded to whole blocks with the last run id, so padded keys sit after every real
query (causality hides them); padded queries are sliced off.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from based_jax import taylor
from based_jax.ops.taylor_attention.base import (KERNEL_LAYOUTS, KERNEL_OUT_LAYOUTS, Options, Problem,
                                                 TaylorState, as_state, parallel_final_state, state_reads)
from lmcore.ops.common import flops
from lmcore.ops.common import pallas_utils as pu
from lmcore.ops.common import shard_map
from lmcore.ops.common.backend import TRITON, Backend, check_power_of_two
from lmcore.ops.common.segments import document_index

_F32 = jnp.float32
_OP = "taylor_linear_attention(implementation='pallas_blocked')"
# Compiled, a program holds a head's whole padded dv in shared memory: dv = 512 does not fit.
MAX_VALUE_DIM = 256  # (docs/BENCHMARKS.md, Taylor heads and lengths)
# Where "auto" takes these kernels (``PallasBlocked.preferred``; the fused-chunk ones elsewhere):
AUTO_MAX_KEY_DIM = 64  # the widest key timed (docs/BENCHMARKS.md, Taylor heads and lengths)
BLOCKED_BELOW = 8192  # faster below this length (docs/BENCHMARKS.md, Taylor heads and lengths)
BLOCKED_ABOVE_KEY_DIM = 16  # and at any length for wider keys (docs/BENCHMARKS.md, Taylor heads and lengths)


class KernelConfig(NamedTuple):
  """Static kernel parameters: query and key blocks, the real key dim d', Triton knobs, and ``eps``:
  None, the forward writes N (fp32); a number, it writes o = N / (D + eps) in v's dtype."""

  block_q: int
  block_k: int
  key_dim: int
  interpret: bool
  num_warps: int
  num_stages: int
  precision: str
  eps: float | None = None


def _scores(q, k, q_start, k_start, run_q, run_k, d: int):
  """s = q kᵀ / sqrt(d') [BQ, BK] fp32 and the visible pairs (key at or before query, same run)."""
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (q.shape[0], k.shape[0]))
  visible = (q_start + iota(0) >= k_start + iota(1)) & (run_q[:, None] == run_k[None, :])
  return pu.dot(q, k, trans_b=True) * (d ** -0.5), visible


def _key_blocks_upto(i, cfg: KernelConfig):
  """How many key blocks hold a key at or before the last query of query block i."""
  return pl.cdiv((i + 1) * cfg.block_q, cfg.block_k)


def _query_block(count: int):
  """The query block of this program: last to first along the grid, so the longest start first."""
  return count - 1 - pl.program_id(0)


def _forward_kernel(q_ref, k_ref, v_ref, run_ref, N_ref, D_ref, *, cfg: KernelConfig):
  BQ, BK = cfg.block_q, cfg.block_k
  i = _query_block(q_ref.shape[0] // BQ)
  q, run_q = pu.rows(q_ref, i * BQ, BQ), pu.rows(run_ref, i * BQ, BQ)

  def key_block(j, carry):
    N, D = carry
    v = pu.rows(v_ref, j * BK, BK)
    s, visible = _scores(q, pu.rows(k_ref, j * BK, BK), i * BQ, j * BK, run_q,
                         pu.rows(run_ref, j * BK, BK), cfg.key_dim)
    A = jnp.where(visible, taylor.taylor_kernel(s), 0.0)
    return N + pu.dot(A.astype(v.dtype), v), D + jnp.sum(A, axis=1)

  init = (jnp.zeros((BQ, v_ref.shape[1]), _F32), jnp.zeros((BQ,), _F32))
  N, D = jax.lax.fori_loop(0, _key_blocks_upto(i, cfg), key_block, init)
  N_ref[...] = N if cfg.eps is None else (N / (D[:, None] + cfg.eps)).astype(N_ref.dtype)
  D_ref[...] = D


def _score_grads(q, k, v, dN, dD, q_start, k_start, run_q, run_k, d: int):
  """A [BQ, BK] and dL/ds [BQ, BK] (fp32) of one block pair."""
  s, visible = _scores(q, k, q_start, k_start, run_q, run_k, d)
  A = jnp.where(visible, taylor.taylor_kernel(s), 0.0)
  dA = pu.dot(dN, v, trans_b=True) + dD[:, None]
  return A, jnp.where(visible, dA * (1.0 + s), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, run_ref, dN_ref, dD_ref, dq_ref, *, cfg: KernelConfig):
  BQ, BK, d = cfg.block_q, cfg.block_k, cfg.key_dim
  i = _query_block(q_ref.shape[0] // BQ)
  q, run_q = pu.rows(q_ref, i * BQ, BQ), pu.rows(run_ref, i * BQ, BQ)
  dN, dD = pu.rows(dN_ref, i * BQ, BQ).astype(q.dtype), pu.rows(dD_ref, i * BQ, BQ)

  def key_block(j, dq):
    k = pu.rows(k_ref, j * BK, BK)
    _, ds = _score_grads(q, k, pu.rows(v_ref, j * BK, BK), dN, dD, i * BQ, j * BK, run_q,
                         pu.rows(run_ref, j * BK, BK), d)
    return dq + pu.dot(ds.astype(k.dtype), k)

  dq = jax.lax.fori_loop(0, _key_blocks_upto(i, cfg), key_block, jnp.zeros(q.shape, _F32))
  dq_ref[...] = (dq * (d ** -0.5)).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, run_ref, dN_ref, dD_ref, dk_ref, dv_ref, *,
                cfg: KernelConfig):
  BQ, BK, d = cfg.block_q, cfg.block_k, cfg.key_dim
  j = pl.program_id(0)
  k, v, run_k = pu.rows(k_ref, j * BK, BK), pu.rows(v_ref, j * BK, BK), pu.rows(run_ref, j * BK, BK)

  def query_block(i, carry):
    dk, dv = carry
    q = pu.rows(q_ref, i * BQ, BQ)
    dN = pu.rows(dN_ref, i * BQ, BQ).astype(v.dtype)
    A, ds = _score_grads(q, k, v, dN, pu.rows(dD_ref, i * BQ, BQ), i * BQ, j * BK,
                         pu.rows(run_ref, i * BQ, BQ), run_k, d)
    return (dk + pu.dot(ds.astype(q.dtype), q, trans_a=True),
            dv + pu.dot(A.astype(dN.dtype), dN, trans_a=True))

  first = jax.lax.div(j * BK, BQ)  # the first query block holding a query at or after key j * BK
  init = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
  dk, dv = jax.lax.fori_loop(first, q_ref.shape[0] // BQ, query_block, init)
  dk_ref[...] = (dk * (d ** -0.5)).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(Tp, dp, Vp, size: int):
  """BlockSpecs over the grid (row block, batch, head): whole rows of the inputs, each program's
  own block of ``size`` rows of the outputs (its grid index, or reversed for query blocks)."""
  seq = lambda width: pl.BlockSpec((None, Tp, None, width), lambda n, b, h: (b, 0, h, 0))
  return dict(
      qk=seq(dp), v=seq(Vp), row=pl.BlockSpec((None, Tp), lambda n, b, h: (b, 0)),
      token=pl.BlockSpec((None, Tp, None), lambda n, b, h: (b, 0, h)),
      block=lambda width, row: pl.BlockSpec((None, size, None, width),
                                            lambda n, b, h: (b, row(n), h, 0)),
      block_token=lambda row: pl.BlockSpec((None, size, None), lambda n, b, h: (b, row(n), h)))


def _forward(q, k, v, run, cfg: KernelConfig):
  """(N [B, Tp, H, Vp], D [B, Tp, H]), fp32; with ``cfg.eps``, (o = N / (D + eps) in v's dtype, D)."""
  B, Tp, H, dp = q.shape
  Vp, count = v.shape[-1], Tp // cfg.block_q
  s = _specs(Tp, dp, Vp, cfg.block_q)
  reverse = lambda n: count - 1 - n
  first = _F32 if cfg.eps is None else v.dtype
  out_shape = (jax.ShapeDtypeStruct((B, Tp, H, Vp), first), jax.ShapeDtypeStruct((B, Tp, H), _F32))
  return pu.call(_forward_kernel, cfg, (count, B, H), [s["qk"], s["qk"], s["v"], s["row"]],
                 [s["block"](Vp, reverse), s["block_token"](reverse)], out_shape, q, k, v, run)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sums(q, k, v, run, cfg):
  return _forward(q, k, v, run, cfg)


def _sums_fwd(q, k, v, run, cfg):
  return _forward(q, k, v, run, cfg), (q, k, v, run)


def _sums_bwd(cfg, residuals, cotangents):
  return (*_grads(*residuals, *cotangents, cfg), None)


def _grads(q, k, v, run, dN, dD, cfg: KernelConfig):
  """dq, dk, dv (the operands' dtypes) from the cotangents of N and D, by the dq and dk/dv kernels."""
  B, Tp, H, dp = q.shape
  Vp = v.shape[-1]
  # dN in the operands' dtype: the kernels round it to that dtype before every dot anyway, so this
  # only halves its reads. The gradients leave the kernels in the operands' dtype.
  args = (q, k, v, run, dN.astype(v.dtype), dD.astype(_F32))
  count_q, count_k = Tp // cfg.block_q, Tp // cfg.block_k
  s = _specs(Tp, dp, Vp, cfg.block_q)
  in_specs = [s["qk"], s["qk"], s["v"], s["row"], s["v"], s["token"]]
  dq = pu.call(_dq_kernel, cfg, (count_q, B, H), in_specs,
               s["block"](dp, lambda n: count_q - 1 - n),
               jax.ShapeDtypeStruct(q.shape, q.dtype), *args)
  s = _specs(Tp, dp, Vp, cfg.block_k)
  identity = lambda n: n
  dk, dv = pu.call(_dkv_kernel, cfg, (count_k, B, H), in_specs,
                   [s["block"](dp, identity), s["block"](Vp, identity)],
                   (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                   *args)
  return dq, dk, dv


_sums.defvjp(_sums_fwd, _sums_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _normalised(q, k, v, run, cfg):
  """o = N / (D + cfg.eps) in v's dtype, divided in the forward kernel (no prefix state to add)."""
  return _forward(q, k, v, run, cfg)[0]


def _normalised_fwd(q, k, v, run, cfg):
  o, D = _forward(q, k, v, run, cfg)
  return o, (q, k, v, run, o, D)


def _normalised_bwd(cfg, residuals, do):
  """dN = do / (D + eps) and dD = -(do · o) / (D + eps), then the kernels of ``_sums``."""
  q, k, v, run, o, D = residuals
  inv_BxTpxH = 1.0 / (D + cfg.eps)
  do = do.astype(_F32)
  dN = do * inv_BxTpxH[..., None]
  dD = -jnp.sum(do * o.astype(_F32), axis=-1) * inv_BxTpxH
  return (*_grads(q, k, v, run, dN, dD, cfg), None)


_normalised.defvjp(_normalised_fwd, _normalised_bwd)


# Triton pipeline stages by operand width in bytes: the fastest timed for 2 (docs/BENCHMARKS.md, Taylor
# kernel tilings); 4-byte operands need twice the shared memory per stage.
STAGES = {2: 3, 4: 2}


def taylor_sums_blocked(q: jax.Array, k: jax.Array, v: jax.Array, run: jax.Array, *,
                        interpret: bool | None = None, block_q: int = 64, block_k: int = 64,
                        num_warps: int = 4, num_stages: int | None = None, precision: str = "input"
                        ) -> tuple[jax.Array, jax.Array]:
  """N [B, T, H, dv] and D [B, T, H] (fp32) of the module docstring by the blocked kernels.

  Args:
    q, k: raw per-head projections [B, T, H, d'] (the kernel 1 + s + s²/2 is applied inside).
    v: values [B, T, H, dv]; bf16 or fp32.
    run: int [B, T] document index (``segments.document_index``; all zeros for one document).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    block_q, block_k: query and key block lengths, powers of two (>= 16 when compiled; capped at
      the next power of two >= T).
    num_warps, num_stages: Triton tuning knobs; num_stages None: ``STAGES`` for the operands' width.
    precision: "input" (dots take operands in the inputs' dtype), "tf32" or "float32" (the
      kernels run on fp32 copies; ``pu.PRECISIONS``).
  """
  args, cfg = _prepare(q, k, v, run, interpret=interpret, block_q=block_q, block_k=block_k,
                       num_warps=num_warps, num_stages=num_stages, precision=precision)
  N, D = _sums(*args, cfg)
  T, V = q.shape[1], v.shape[-1]
  return N[:, :T, :, :V], D[:, :T]


def taylor_normalised_blocked(q: jax.Array, k: jax.Array, v: jax.Array, run: jax.Array, *,
                              eps: float, **options) -> jax.Array:
  """o = N / (D + eps) [B, T, H, dv] in the kernels' operand dtype (v's for "input" precision, else
  fp32), divided in the forward kernel; ``options`` and the gradients as ``taylor_sums_blocked``'s,
  whose sums it normalises (a prefix state's reads cannot be added: they go through those sums)."""
  args, cfg = _prepare(q, k, v, run, **options)
  return _normalised(*args, cfg._replace(eps=eps))[:, :q.shape[1], :, :v.shape[-1]]


def _prepare(q, k, v, run, *, interpret: bool | None = None, block_q: int = 64, block_k: int = 64,
             num_warps: int = 4, num_stages: int | None = None, precision: str = "input"):
  """The kernels' padded operands (q, k, v, run) and their ``KernelConfig``; checks the options."""
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, _OP, "implementation='parallel'")
  pu.check_precision(precision, _OP)
  check_power_of_two(_OP, block_q=block_q, block_k=block_k)
  q, k, v = pu.operands(precision, q, k, v)
  if num_stages is None:
    num_stages = STAGES[jnp.dtype(q.dtype).itemsize]
  T, d, V = q.shape[1], q.shape[3], v.shape[-1]
  smallest = 1 if interpret else pu.MIN_DOT
  BQ, BK = (max(min(size, pl.next_power_of_2(T)), smallest) for size in (block_q, block_k))
  dp, Vp = pu.block_size(d, interpret), pu.block_size(V, interpret)
  Tp = pu.round_up(T, max(BQ, BK))
  cfg = KernelConfig(block_q=BQ, block_k=BK, key_dim=d, interpret=interpret, num_warps=num_warps,
                     num_stages=num_stages, precision=precision)
  pad_qk = lambda x: pu.pad_axis(pu.pad_axis(x, 1, Tp), 3, dp)
  args = (pad_qk(q), pad_qk(k), pu.pad_axis(pu.pad_axis(v, 1, Tp), 3, Vp),
          pu.pad_axis(run.astype(jnp.int32), 1, Tp, mode="edge"))
  return args, cfg


def taylor_linear_attention_blocked(
    q: jax.Array, k: jax.Array, v: jax.Array, *, state: TaylorState | None = None,
    eps: float = 1e-12, feature: taylor.Feature = "compact", segment_ids: jax.Array | None = None,
    precision: str = "input", **kernel_options) -> tuple[jax.Array, TaylorState]:
  """``taylor_linear_attention`` (no decay ablation) by the blocked kernels: without a prefix state o
  straight from the forward kernel (``taylor_normalised_blocked``), with one their sums N, D plus the
  state's read for document 0's tokens, divided in XLA; o in v's dtype ("input") or fp32; the final
  state by ``base.parallel_final_state`` (XLA, dropped by jit when unused). ``kernel_options``
  go to ``taylor_sums_blocked`` (interpret, block sizes, Triton knobs)."""
  doc_BxT = document_index(segment_ids, q.shape[0], q.shape[1])
  zero_decay_H = jnp.zeros(q.shape[2:3], _F32)
  out_dtype = pu.output_dtype(v.dtype, precision)
  final = lambda state: parallel_final_state(k, v, state, zero_decay_H, doc_BxT, feature=feature)
  if state is None:  # nothing to add to the sums: the forward kernel divides
    o_BxTxHxV = taylor_normalised_blocked(q, k, v, doc_BxT, eps=eps, precision=precision,
                                          **kernel_options)
    return o_BxTxHxV.astype(out_dtype), final(as_state(None, q, v, feature))
  num_BxTxHxV, den_BxTxH = taylor_sums_blocked(q, k, v, doc_BxT, precision=precision,
                                               **kernel_options)
  first_BxTx1, (read_S_BxTxHxV, read_z_BxTxH) = state_reads(q, state, doc_BxT, feature)
  num_BxTxHxV += first_BxTx1[..., None] * read_S_BxTxHxV
  den_BxTxH += first_BxTx1 * read_z_BxTxH
  o_BxTxHxV = num_BxTxHxV / (den_BxTxH[..., None] + eps)
  return o_BxTxHxV.astype(out_dtype), final(as_state(state, q, v, feature))


@dataclasses.dataclass(frozen=True)
class BlockedTiles:
  """``block_q`` queries and ``block_k`` keys per step (powers of two, >= 16 when compiled; capped at
  the next power of two >= T), Triton warps and pipeline stages (None: ``STAGES`` for the operands'
  width). The defaults are the fastest timed (docs/BENCHMARKS.md, Taylor kernel tilings)."""

  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int | None = None

  def __post_init__(self):
    check_power_of_two("taylor_linear_attention tiles", block_q=self.block_q, block_k=self.block_k)


class PallasBlocked(Backend[BlockedTiles]):
  """The blocked Triton kernels as a backend (no decay ablation, dv <= ``MAX_VALUE_DIM``), each device
  of the mesh in context on its own rows and heads (``shard_map.run_sharded``)."""

  platforms = TRITON
  tiles_type = BlockedTiles
  requirement = f"no decay ablation and value dims up to {MAX_VALUE_DIM}"

  def supports(self, problem: Problem) -> bool:
    return not problem.decay and problem.value_dim <= MAX_VALUE_DIM

  def preferred(self, problem: Problem) -> bool:
    short = problem.length is not None and problem.length < BLOCKED_BELOW
    return problem.key_dim <= AUTO_MAX_KEY_DIM and (short or problem.key_dim > BLOCKED_ABOVE_KEY_DIM)

  def heuristic_config(self, problem: Problem) -> BlockedTiles:
    del problem
    return BlockedTiles()

  def flops_per_head(self, problem: Problem, tiles: BlockedTiles | None = None) -> float:
    return flops.quadratic(problem.key_dim, problem.value_dim + 1, problem.length or 1)

  def __call__(self, q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles: BlockedTiles,
               options: Options = Options()):
    del decay, dt  # supports() keeps the decay ablation away
    kernel = functools.partial(taylor_linear_attention_blocked, eps=eps, feature=feature,
                               precision=options.precision, **dataclasses.asdict(tiles))
    inputs = dict(q=q, k=k, v=v, state=state, segment_ids=segment_ids)
    return shard_map.run_sharded(kernel, inputs, KERNEL_LAYOUTS, KERNEL_OUT_LAYOUTS)
