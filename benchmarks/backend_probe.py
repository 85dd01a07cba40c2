"""One op, two Pallas GPU lowerings: the intra-chunk block of causal linear attention.

Per (batch·head b, chunk n) with chunk C, query/key width K and value width V::

    o_n = mask_causal(q_n k_nᵀ) v_n,   q_n, k_n: [C, K], v_n: [C, V], mask: keep j <= i

in bf16 with fp32 accumulation: the scores are rounded to bf16 before the second matmul (a tensor-core
operand) and the output to bf16. Inputs are [BH, T, K] ([BH, T, V] for v) with T a multiple of C.

Three forms of the same math, to choose a Pallas GPU backend by measurement (``scripts/bench_backends.py``):
  * ``intra_chunk_triton``: ``pl.pallas_call`` with BlockSpecs, lowered by Pallas-Triton (as our kernels);
  * ``intra_chunk_mosaic``: ``plgpu.kernel`` (Mosaic GPU, Hopper): TMA copies of q, k, v into swizzled
    SMEM, two ``plgpu.wgmma`` (scores, then mixing) into fp32 register accumulators, a TMA store of o;
  * ``intra_chunk_xla``: the same per-chunk einsums in XLA; ``intra_chunk_reference`` is its fp32 form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lmcore.ops.common import pallas_utils as pu

CHUNK = 64
_F32 = jnp.float32


def _check(q, k, v, chunk):
  BH, T, K = q.shape
  if k.shape != q.shape or v.shape[:2] != (BH, T) or T % chunk:
    raise ValueError(f"need q, k [BH, T, K], v [BH, T, V], T % {chunk} == 0; got {q.shape}, "
                     f"{k.shape}, {v.shape}")


def _chunks(x_BHxTxD, chunk):
  BH, T, D = x_BHxTxD.shape
  return x_BHxTxD.reshape(BH, T // chunk, chunk, D)


def _causal(C):
  return jnp.tril(jnp.ones((C, C), bool))


def intra_chunk_xla(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk: int = CHUNK):
  """XLA form with the kernels' rounding: fp32 scores rounded to the input dtype, fp32 mixing, output in
  the input dtype. [BH, T, V]."""
  _check(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk)
  q, k, v = (_chunks(x, chunk) for x in (q_BHxTxK, k_BHxTxK, v_BHxTxV))
  s_BHxNxCxC = jnp.einsum("bnik,bnjk->bnij", q, k, preferred_element_type=_F32)
  p_BHxNxCxC = jnp.where(_causal(chunk), s_BHxNxCxC, 0.0).astype(v.dtype)
  o_BHxNxCxV = jnp.einsum("bnij,bnjv->bniv", p_BHxNxCxC, v, preferred_element_type=_F32)
  return o_BHxNxCxV.reshape(v_BHxTxV.shape).astype(v_BHxTxV.dtype)


def intra_chunk_reference(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk: int = CHUNK):
  """fp32 throughout (inputs upcast, HIGHEST precision, no rounding of scores): [BH, T, V] fp32."""
  _check(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk)
  q, k, v = (_chunks(x.astype(_F32), chunk) for x in (q_BHxTxK, k_BHxTxK, v_BHxTxV))
  hi = jax.lax.Precision.HIGHEST
  s_BHxNxCxC = jnp.einsum("bnik,bnjk->bnij", q, k, precision=hi)
  o_BHxNxCxV = jnp.einsum("bnij,bnjv->bniv", jnp.where(_causal(chunk), s_BHxNxCxC, 0.0), v, precision=hi)
  return o_BHxNxCxV.reshape(v_BHxTxV.shape)


def _triton_kernel(q_ref, k_ref, v_ref, o_ref):
  """One (b, n) program: refs are the chunk's [C, K], [C, K], [C, V] and [C, V] blocks."""
  s_CxC = pu.dot(q_ref[...], k_ref[...], trans_b=True)
  C = s_CxC.shape[0]
  i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
  p_CxC = jnp.where(i >= j, s_CxC, 0.0).astype(v_ref.dtype)
  o_ref[...] = pu.dot(p_CxC, v_ref[...]).astype(o_ref.dtype)


def intra_chunk_triton(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk: int = CHUNK, *, interpret: bool = False,
                       num_warps: int = 4, num_stages: int = 1):
  """Pallas-Triton kernel over the grid (BH, T / C), one chunk per program: [BH, T, V]."""
  _check(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk)
  BH, T, K = q_BHxTxK.shape
  V = v_BHxTxV.shape[-1]
  spec = lambda width: pl.BlockSpec((None, chunk, width), lambda b, n: (b, n, 0))
  return pl.pallas_call(
      _triton_kernel, grid=(BH, T // chunk), in_specs=[spec(K), spec(K), spec(V)], out_specs=spec(V),
      out_shape=jax.ShapeDtypeStruct(v_BHxTxV.shape, v_BHxTxV.dtype), interpret=interpret,
      compiler_params=pu.compiler_params(interpret, num_warps, num_stages))(q_BHxTxK, k_BHxTxK, v_BHxTxV)


def _smem(rows: int, cols: int, dtype):
  """An SMEM buffer [rows, cols] tiled and swizzled as wgmma operands and TMA copies want them."""
  bits = jnp.finfo(dtype).bits
  swizzle = plgpu.find_swizzle(cols * bits, "a chunk row")
  tile_cols = 8 * swizzle // bits  # one swizzle span (swizzle bytes) of columns
  return plgpu.SMEM((rows, cols), dtype,
                    transforms=(plgpu.TilingTransform((8, tile_cols)), plgpu.SwizzleTransform(swizzle)))


def _mosaic_body(q_gmem, k_gmem, v_gmem, o_gmem, q_smem, k_smem, v_smem, o_smem, p_smem, loaded):
  """One (b, n) block, one warpgroup: TMA q, k, v [C, ·] into SMEM (one barrier each), S = q kᵀ and
  O = mask(S) v by wgmma, O out by TMA. The masked bf16 scores P feed the second wgmma from SMEM
  (``p_smem``, written and committed) or, when ``p_smem`` is None, straight from registers."""
  C = q_smem.shape[0]
  rows = (jax.lax.axis_index("bh"), pl.ds(jax.lax.axis_index("chunk") * C, C))
  operands = ((q_gmem, q_smem), (k_gmem, k_smem), (v_gmem, v_smem))
  for i, (src, dst) in enumerate(operands):
    plgpu.copy_gmem_to_smem(src.at[rows], dst, loaded.at[i])
  for i in range(len(operands)):
    plgpu.barrier_wait(loaded.at[i])

  def scores(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
    return acc_ref[...]

  s_CxC = pl.run_scoped(scores, plgpu.ACC((C, C), _F32))
  i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=plgpu.Layout.WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=plgpu.Layout.WGMMA)
  p_CxC = jnp.where(i >= j, s_CxC, 0.0).astype(v_smem.dtype)
  if p_smem is not None:
    p_smem[...] = p_CxC
    plgpu.commit_smem()
    p_CxC = p_smem

  def mix(acc_ref):
    plgpu.wgmma(acc_ref, p_CxC, v_smem)
    return acc_ref[...]

  o_CxV = pl.run_scoped(mix, plgpu.ACC((C, o_smem.shape[1]), _F32))
  o_smem[...] = o_CxV.astype(o_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows])
  plgpu.wait_smem_to_gmem(0)


def intra_chunk_mosaic(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk: int = CHUNK, *, scores_in_smem: bool = True,
                       interpret: bool = False):
  """Mosaic GPU kernel over the grid (BH, T / C), one warpgroup per chunk: [BH, T, V].

  C must be a multiple of 64 (a warpgroup's wgmma has 64-row tiles); K = V = 64 bf16 columns fill
  one 128-byte swizzle span (narrower rows get smaller swizzles). ``scores_in_smem`` passes the masked
  scores to the second wgmma through SMEM (False: as a register operand, which Pallas' GPU interpreter
  does not support). ``interpret`` runs that interpreter (``plgpu.InterpretGPUParams``) on the host.
  """
  _check(q_BHxTxK, k_BHxTxK, v_BHxTxV, chunk)
  BH, T, K = q_BHxTxK.shape
  V, dt = v_BHxTxV.shape[-1], v_BHxTxV.dtype
  p_smem = _smem(chunk, chunk, dt) if scores_in_smem else None
  return plgpu.kernel(
      _mosaic_body, out_type=jax.ShapeDtypeStruct(v_BHxTxV.shape, dt),
      scratch_types=(_smem(chunk, K, q_BHxTxK.dtype), _smem(chunk, K, k_BHxTxK.dtype), _smem(chunk, V, dt),
                     _smem(chunk, V, dt), p_smem, plgpu.Barrier(num_barriers=3)),
      grid=(BH, T // chunk), grid_names=("bh", "chunk"),
      interpret=plgpu.InterpretGPUParams() if interpret else None)(q_BHxTxK, k_BHxTxK, v_BHxTxV)
