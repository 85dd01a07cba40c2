"""The XLA backends of SANATAN attention (MATH §1.1 step 6, §1.2).

* ``parallel`` (``Parallel``, tiles ``ParallelTiles``): ``reference.parallel``'s sum in blocks of query
  rows, each against the keys up to its last row (the causal half only), with a custom VJP that
  recomputes the scores in the backward pass, once by query blocks (dPhi(q)) and once by key blocks
  against the queries at or after them (dPhi(k), dv), so no gradient is accumulated across blocks:
  the residuals are the features and values, never a T x T array. Any p and channels.
* ``chunked`` (``Chunked``, tiles ``ChunkTiles``; p = 1, 6ch): chunked linear attention on whole
  arrays: every chunk's intra-chunk block and state update as batched einsums, the states entering
  the chunks as a (document-gated) prefix sum over chunks in blocks of masked matmuls
  (``chunk_prefix_sum``: linear in the number of chunks); by default its backward pass recomputes all
  of this from the inputs (``Options.remat``), keeping no features, blocks or state stacks.

Matmul operands stay in the inputs' dtype (bf16 in training) with fp32 accumulation; fp32 inputs
multiply at full fp32 precision (``dot``). States and normalisers are fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common import flops, pallas_utils
from lmcore.ops.common.backend import Backend, ChunkTiles
from lmcore.ops.common.chunk_prefix import chunk_prefix_sum, prefix_block
from lmcore.ops.common.segments import chunk_documents
from sanatan_jax.ops.sanatan_attention import base
from sanatan_jax.ops.sanatan_attention.base import EPS, F32, Options, Problem, SanatanState

# The chunked form's chunk, the faster of 64 and 128 (docs/BENCHMARKS.md, SANATAN p = 1 kernels).
CHUNK = 128
# The parallel form's query blocks: ``ROWS`` rows, at most ``PARALLEL_MAX_BLOCKS`` blocks (each block is
# its own program region, so their number bounds the compile time).
ROWS = 128
PARALLEL_MAX_BLOCKS = 16
# The parallel form's fewest query rows per block, by platform (more than the tiles' rows where they are
# fewer): each block reads every key's 6d-wide features up to its last row again, which a TPU's
# bandwidth pays for (docs/BENCHMARKS.md, TPU v4 ahead of time).
PARALLEL_MIN_ROWS = {"tpu": 256}

dot = pallas_utils.einsum_f32  # float32 accumulation, full precision for float32 operands


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array, lam_raw: jax.Array, *,
            positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
            state: SanatanState | None = None, options: Options = Options(),
            chunk_size: int = CHUNK) -> tuple[jax.Array, SanatanState]:
  """The chunked p = 1 form of MATH §1.2 in chunks of ``chunk_size`` tokens (``min(chunk_size, T)``),
  all chunks at once: o [B, T, H, dv] in v's dtype and the final state (``_chunked_core``).

  With ``options.remat`` the backward pass recomputes the forward from the op's inputs
  (``jax.checkpoint`` around the whole form, features included), so what waits for it is q, k, v,
  omega, lam_raw, the int positions and segment ids and the state: O(B T H d). Autodiff of the form
  itself keeps, per layer until its backward pass, the features Phi(q), Phi(k) [B, T, H, F] (F = 6d)
  and their fp32 channels, the masked blocks A_n [B, N, H, C, C] and the state stacks
  S_<n [B, N, H, F, dv]. The recomputation runs the same operations, so outputs and gradients are
  those without it; it costs one more forward pass of the op in the backward pass.
  """
  core = functools.partial(_chunked_core, options=options, chunk_size=chunk_size)
  if options.remat:
    core = jax.checkpoint(core)
  return core(q, k, v, omega, lam_raw, positions, segment_ids, state)


def _chunked_core(q, k, v, omega, lam_raw, positions, segment_ids, state, options: Options,
                  chunk_size: int) -> tuple[jax.Array, SanatanState]:
  """``chunked`` without the recomputation (what autodiff differentiates).

  Per chunk n: the masked block A_n = Mask ⊙ Phi(Q_n) Phi(K_n)ᵀ and the chunk's state increment
  ΔS_n = Phi(K_n)ᵀ V_n (of its last document's tokens); the state entering chunk n is the gated
  prefix sum S_<n = Σ_{m<n} ΔS_m over the chunks since the last document start
  (``chunk_prefix_sum``). A token reads S_<n only if it is in the document of the token before its
  chunk; the incoming ``state`` belongs to each row's first document (``base.read_state``).
  """
  x = base.prepare(q, k, omega, lam_raw, positions, segment_ids, state, options)
  B, T, H, _ = q.shape
  C = min(chunk_size, T)
  N = -(-T // C)
  chunks = lambda a: jnp.pad(a, [(0, 0), (0, N * C - T)] + [(0, 0)] * (a.ndim - 2)).reshape(
      B, N, C, *a.shape[2:])
  q_BxNxCxHxF, k_BxNxCxHxF, v_BxNxCxHxV = chunks(x.phi_q), chunks(x.phi_k), chunks(v)
  mask_CxC = jnp.tril(jnp.ones((C, C), bool))[None, None, None]
  k_state_BxNxCxHxF, last_BxN, reads_BxNxC = k_BxNxCxHxF, None, None
  if segment_ids is not None:
    docs = chunk_documents(x.doc, N * C, C)  # edge-padded: padding tokens stay in the last document
    doc_BxNxC = docs.doc.reshape(B, N, C)
    mask_CxC = mask_CxC & (doc_BxNxC[:, :, None, :, None] == doc_BxNxC[:, :, None, None, :])
    writes_BxNxC = docs.writes.reshape(B, N, C).astype(bool)  # in the document leaving the chunk
    k_state_BxNxCxHxF = jnp.where(writes_BxNxC[..., None, None], k_BxNxCxHxF, 0)
    reads_BxNxC = docs.reads.reshape(B, N, C).astype(bool)
    last_BxN = doc_BxNxC[:, :, -1]  # the document of the state leaving each chunk
  s_BxNxHxCxC = jnp.where(mask_CxC, dot("bnqhf,bnkhf->bnhqk", q_BxNxCxHxF, k_BxNxCxHxF), 0.0)
  num_BxNxCxHxV = dot("bnhqk,bnkhv->bnqhv", s_BxNxHxCxC.astype(v.dtype), v_BxNxCxHxV)
  den_BxNxCxH = jnp.sum(s_BxNxHxCxC, axis=-1).transpose(0, 1, 3, 2)
  # Inter-chunk: each chunk's increments (fp32), summed into the states entering the chunks.
  dS_BxNxHxFxV = dot("bnkhf,bnkhv->bnhfv", k_state_BxNxCxHxF, v_BxNxCxHxV)
  dz_BxNxHxF = jnp.sum(k_state_BxNxCxHxF.astype(F32), axis=2)
  block = prefix_block(pallas_utils.backend())
  S_in_BxNxHxFxV = chunk_prefix_sum(dS_BxNxHxFxV, last_BxN, block)
  z_in_BxNxHxF = chunk_prefix_sum(dz_BxNxHxF, last_BxN, block)
  state_num_BxNxCxHxV = dot("bnqhf,bnhfv->bnqhv", q_BxNxCxHxF, S_in_BxNxHxFxV.astype(q_BxNxCxHxF.dtype))
  state_den_BxNxCxH = dot("bnqhf,bnhf->bnqh", q_BxNxCxHxF, z_in_BxNxHxF)
  if reads_BxNxC is not None:
    state_num_BxNxCxHxV = jnp.where(reads_BxNxC[..., None, None], state_num_BxNxCxHxV, 0.0)
    state_den_BxNxCxH = jnp.where(reads_BxNxC[..., None], state_den_BxNxCxH, 0.0)
  num_BxTxHxV = (num_BxNxCxHxV + state_num_BxNxCxHxV).reshape(B, N * C, H, -1)[:, :T]
  den_BxTxH = (den_BxNxCxH + state_den_BxNxCxH).reshape(B, N * C, H)[:, :T]
  S_BxHxFxV = _state_leaving(S_in_BxNxHxFxV, dS_BxNxHxFxV, last_BxN)
  z_BxHxF = _state_leaving(z_in_BxNxHxF, dz_BxNxHxF, last_BxN)
  if state is not None:
    state_num, state_den = base.read_state(x.phi_q, x.doc, state)
    num_BxTxHxV, den_BxTxH = num_BxTxHxV + state_num, den_BxTxH + state_den
    keep_B = x.doc[:, -1] == 0  # the last token is still in the incoming state's document
    S_BxHxFxV = S_BxHxFxV + jnp.where(keep_B[:, None, None, None], state.S, 0.0)
    z_BxHxF = z_BxHxF + jnp.where(keep_B[:, None, None], state.z, 0.0)
  o_BxTxHxV = num_BxTxHxV / (den_BxTxH[..., None] + x.c * EPS)
  return o_BxTxHxV.astype(v.dtype), SanatanState(S_BxHxFxV, z_BxHxF, base.next_position(x.positions))


def _expand(a_BxJ, ndim: int) -> jax.Array:
  """``a`` with trailing unit axes up to ``ndim`` axes."""
  return a_BxJ.reshape(a_BxJ.shape + (1,) * (ndim - a_BxJ.ndim))


def _state_leaving(y_in_BxNx, x_BxNx, last_BxN) -> jax.Array:
  """The state leaving the last chunk: what entered it (if the chunk continues that document) plus
  its own increment."""
  if last_BxN is None or x_BxNx.shape[1] == 1:
    return y_in_BxNx[:, -1] + x_BxNx[:, -1]
  keep_B = _expand(last_BxN[:, -2] == last_BxN[:, -1], x_BxNx.ndim - 1)
  return jnp.where(keep_B, y_in_BxNx[:, -1], 0.0) + x_BxNx[:, -1]


def query_blocks(T: int, rows: int, max_blocks: int = PARALLEL_MAX_BLOCKS) -> tuple[tuple[int, int], ...]:
  """(first, stop) rows of the parallel form's query blocks: ``rows`` rows, more where T needs over
  ``max_blocks`` of them."""
  rows = max(rows, -(-T // max_blocks))
  return tuple((a, min(a + rows, T)) for a in range(0, T, rows))


class _Power(NamedTuple):
  """The static configuration of ``_power_sums``."""

  p: int
  channels: int
  three_channel: str
  d: int
  blocks: tuple[tuple[int, int], ...]
  documents: bool


def parallel(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array, lam_raw: jax.Array, *,
             positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
             state: SanatanState | None = None, options: Options = Options(),
             rows: int = ROWS) -> tuple[jax.Array, SanatanState | None]:
  """``reference.parallel`` in query blocks of ``rows`` rows, at least the platform's
  ``PARALLEL_MIN_ROWS`` (see the module docstring): o [B, T, H, dv] in v's dtype and, at p = 1 with
  6 channels, the final state."""
  x = base.prepare(q, k, omega, lam_raw, positions, segment_ids, state, options)
  rows = max(rows, PARALLEL_MIN_ROWS.get(pallas_utils.backend(), 1))
  config = _Power(options.p, options.channels, options.three_channel, q.shape[-1],
                  query_blocks(q.shape[1], rows), segment_ids is not None)
  num_BxTxHxV, den_BxTxH = _power_sums(x.phi_q, x.phi_k, v, x.doc, config)
  return base.power_output(num_BxTxHxV, den_BxTxH, v, x, state, options)


def _block_scores(phi_q_BxRxHxF, phi_k_BxSxHxF, doc_BxT, queries: tuple[int, int],
                  keys: tuple[int, int], config: _Power):
  """Scores [B, H, R, S] of query rows ``queries`` = (first, stop) against key rows ``keys``, and
  the weights as a function of them (``base.power_weights`` under the causal and document mask)."""
  (q0, q1), (k0, k1) = queries, keys
  s_BxHxRxS = dot("bthf,bshf->bhts", phi_q_BxRxHxF, phi_k_BxSxHxF)
  mask_1x1xRxS = (q0 + jnp.arange(q1 - q0))[:, None] >= (k0 + jnp.arange(k1 - k0))[None, :]
  mask_1x1xRxS = mask_1x1xRxS[None, None]
  if config.documents:
    same_BxRxS = doc_BxT[:, q0:q1, None] == doc_BxT[:, None, k0:k1]
    mask_1x1xRxS = mask_1x1xRxS & same_BxRxS[:, None]

  def weights(s):
    return base.power_weights(s, mask_1x1xRxS, p=config.p, channels=config.channels,
                              three_channel=config.three_channel, d=config.d)

  return s_BxHxRxS, weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _power_sums(phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, doc_BxT, config: _Power):
  """N = Σ_j w_tj v_j [B, T, H, dv] and D = Σ_j w_tj [B, T, H] (fp32), one query block at a time
  against the keys up to its last row."""
  nums, dens = [], []
  q_blocks = [phi_q_BxTxHxF[:, first:stop] for first, stop in config.blocks]
  for n, (first, stop) in enumerate(config.blocks):
    s, weights = _block_scores(q_blocks[n], phi_k_BxTxHxF[:, :stop], doc_BxT, (first, stop), (0, stop),
                               config)
    w_BxHxRxS = weights(s)
    nums.append(dot("bhts,bshv->bthv", w_BxHxRxS.astype(v_BxTxHxV.dtype), v_BxTxHxV[:, :stop]))
    dens.append(jnp.sum(w_BxHxRxS, axis=-1).transpose(0, 2, 1))
    if n + 1 < len(q_blocks):
      q_blocks[n + 1] = _after(q_blocks[n + 1], (nums[-1], dens[-1]))
  return jnp.concatenate(nums, axis=1), jnp.concatenate(dens, axis=1)


def _after(inputs, results):
  """``inputs`` (the next block's own rows) as values available only once ``results`` are: the next
  block starts after this one ends, so one block's T-wide scratch is live at a time (XLA would
  otherwise be free to compute every block's scores first). Whole arrays are not passed through:
  each barrier's copy of them would be re-laid out again."""
  return jax.lax.optimization_barrier((inputs, results))[0]


def _power_sums_fwd(phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, doc_BxT, config: _Power):
  sums = _power_sums(phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, doc_BxT, config)
  return sums, (phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, doc_BxT)


def _power_sums_bwd(config: _Power, residuals, cotangents):
  """Two passes over the blocks, each recomputing the scores it needs: dw = dN vᵀ + dD and
  ds = dw ⊙ ∂w/∂s, then per query block dPhi(q) = ds Phi(k) (keys up to its last row), and per key
  block dv = wᵀ dN and dPhi(k) = dsᵀ Phi(q) (queries from its first row on). Each gradient row is
  written once, with no accumulation across blocks."""
  phi_q_BxTxHxF, phi_k_BxTxHxF, v_BxTxHxV, doc_BxT = residuals
  dnum_BxTxHxV = cotangents[0].astype(v_BxTxHxV.dtype)
  dden_BxHxT = cotangents[1].transpose(0, 2, 1)

  def grad_scores(queries, keys, phi_q_BxRxHxF, phi_k_BxSxHxF, v_BxSxHxV):
    """(w, ds, the block's dN) of query rows ``queries`` against key rows ``keys``."""
    q0, q1 = queries
    s, weights = _block_scores(phi_q_BxRxHxF, phi_k_BxSxHxF, doc_BxT, queries, keys, config)
    w_BxHxRxS, weights_vjp = jax.vjp(weights, s)
    dnum_BxRxHxV = dnum_BxTxHxV[:, q0:q1]
    dw_BxHxRxS = dot("bthv,bshv->bhts", dnum_BxRxHxV, v_BxSxHxV) + dden_BxHxT[:, :, q0:q1, None]
    ds_BxHxRxS = weights_vjp(dw_BxHxRxS)[0].astype(phi_q_BxTxHxF.dtype)
    return w_BxHxRxS, ds_BxHxRxS, dnum_BxRxHxV

  dq_BxTxHxF = jnp.zeros_like(phi_q_BxTxHxF)
  q_blocks = [phi_q_BxTxHxF[:, first:stop] for first, stop in config.blocks]
  for n, (first, stop) in enumerate(config.blocks):
    _, ds_BxHxRxS, _ = grad_scores((first, stop), (0, stop), q_blocks[n], phi_k_BxTxHxF[:, :stop],
                                   v_BxTxHxV[:, :stop])
    dq_BxRxHxF = dot("bhts,bshf->bthf", ds_BxHxRxS, phi_k_BxTxHxF[:, :stop])
    dq_BxTxHxF = dq_BxTxHxF.at[:, first:stop].set(dq_BxRxHxF.astype(dq_BxTxHxF.dtype))
    if n + 1 < len(q_blocks):
      q_blocks[n + 1] = _after(q_blocks[n + 1], dq_BxTxHxF)
  T = phi_q_BxTxHxF.shape[1]
  dk_BxTxHxF, dv_BxTxHxV = jnp.zeros_like(phi_k_BxTxHxF), jnp.zeros_like(v_BxTxHxV)
  kv_blocks = [(phi_k_BxTxHxF[:, first:stop], v_BxTxHxV[:, first:stop]) for first, stop in config.blocks]
  kv_blocks[0] = _after(kv_blocks[0], dq_BxTxHxF)
  for n, (first, stop) in enumerate(config.blocks):
    phi_k_BxSxHxF, v_BxSxHxV = kv_blocks[n]
    phi_q_BxRxHxF = phi_q_BxTxHxF[:, first:]  # the queries at or after the block's first row
    w_BxHxRxS, ds_BxHxRxS, dnum_BxRxHxV = grad_scores((first, T), (first, stop), phi_q_BxRxHxF,
                                                      phi_k_BxSxHxF, v_BxSxHxV)
    dv_BxSxHxV = dot("bhts,bthv->bshv", w_BxHxRxS.astype(v_BxTxHxV.dtype), dnum_BxRxHxV)
    dk_BxSxHxF = dot("bhts,bthf->bshf", ds_BxHxRxS, phi_q_BxRxHxF)
    dv_BxTxHxV = dv_BxTxHxV.at[:, first:stop].set(dv_BxSxHxV.astype(dv_BxTxHxV.dtype))
    dk_BxTxHxF = dk_BxTxHxF.at[:, first:stop].set(dk_BxSxHxF.astype(dk_BxTxHxF.dtype))
    if n + 1 < len(kv_blocks):
      kv_blocks[n + 1] = _after(kv_blocks[n + 1], (dk_BxTxHxF, dv_BxTxHxV))
  return dq_BxTxHxF, dk_BxTxHxF, dv_BxTxHxV, None


_power_sums.defvjp(_power_sums_fwd, _power_sums_bwd)


@dataclasses.dataclass(frozen=True)
class ParallelTiles:
  """``parallel``'s query blocks: ``rows`` query rows per block (on a TPU at least
  ``PARALLEL_MIN_ROWS["tpu"]``; more where T needs over ``PARALLEL_MAX_BLOCKS`` blocks)."""

  rows: int = ROWS

  def __post_init__(self):
    if not isinstance(self.rows, int) or self.rows < 1:
      raise ValueError(f"tiles: rows must be a positive number of query rows, got {self.rows!r}")


class Parallel(Backend[ParallelTiles]):
  """``parallel`` as a backend: any platform, every power and channel variant."""

  tiles_type = ParallelTiles

  def heuristic_config(self, problem: Problem) -> ParallelTiles:
    del problem
    return ParallelTiles()

  def flops_per_head(self, problem: Problem, tiles: ParallelTiles | None = None) -> float:
    return flops.quadratic(problem.feature_dim, problem.value_dim + 1, problem.length or 1)

  def __call__(self, q, k, v, omega, lam_raw, *, positions, segment_ids, state, tiles: ParallelTiles,
               options: Options):
    return parallel(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids, state=state,
                    options=options, rows=tiles.rows)


class Chunked(Backend[ChunkTiles]):
  """``chunked`` as a backend: any platform, p = 1 with 6 channels, chunks of ``ChunkTiles.chunk``."""

  tiles_type = ChunkTiles
  requirement = "p = 1 with 6 channels"

  def supports(self, problem: Problem) -> bool:
    return problem.constant_state

  def heuristic_config(self, problem: Problem) -> ChunkTiles:
    del problem
    return self.default_tiles()

  def default_tiles(self) -> ChunkTiles:
    return ChunkTiles(CHUNK)

  def flops_per_head(self, problem: Problem, tiles: ChunkTiles | None = None) -> float:
    chunk = self.config(problem, tiles).chunk
    return flops.chunked(problem.feature_dim, problem.value_dim + 1, chunk, problem.length or chunk)

  def __call__(self, q, k, v, omega, lam_raw, *, positions, segment_ids, state, tiles: ChunkTiles,
               options: Options):
    return chunked(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids, state=state,
                   options=options, chunk_size=tiles.chunk)
