"""The SANATAN p = 1 fused-chunk Pallas kernels (``pallas_fused``) compute sanatan_attention's function
(MATH §1.2): the shared checks of ``test_base``, and outputs, final state and gradients (q, k, v, omega,
lam_raw, initial S and z) equal the recurrent form for partial chunks, padded head and value dims,
several value tiles, every channel grouping, different chunks per kernel, packed documents (starts
inside chunks and at a chunk start), an incoming state, the no-rotation ablation, kept factors and rows
cut into spans; bf16 inputs lose no more than XLA "chunked" in bf16; the default and every tuning
tiling lower to Triton for an H200.

The kernels run in interpret mode on CPU, with chunks of 8 or 16 tokens so that every case walks
several chunks. Tolerance: relative L2 error 1e-5 at fp32 (the forms differ only in summation
order; observed below 5e-7 here).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import harness, kernel_check
from kernel_cases import (FAST_COMPILE, assert_close, normals, packed_documents, run_sanatan,
                          sanatan_abstract_inputs, sanatan_inputs)
from lmcore.numerics import relative_l2
from lmcore.ops.common import pallas_utils
from lmcore.ops.common.backend import ChunkTiles
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.mixer import SanatanMixer
from sanatan_jax.ops.sanatan_attention.pallas_triton_fused import (TILES, FusedTiles, KernelTiles,
                                                                   sanatan_fused_pallas)

from .test_base import SanatanAttentionTestBase

_recurrent = functools.partial(sanatan_attention, implementation="recurrent")


def _tiles(forward, dq, dkv, warps=4, stages=2, **rest):
  """FusedTiles from (chunk, block_v, channels per program) of each kernel."""
  return FusedTiles(*(KernelTiles(*t, warps, stages) for t in (forward, dq, dkv)), **rest)


class TestPallasFused(SanatanAttentionTestBase):
  """The shared checks through ``implementation="pallas_fused"`` (interpreted here): two value tiles
  of dv = 5 in the forward and dq kernels, three channel groupings, and a longer chunk in dq (so time
  is padded to its multiple); the T = 33 cases walk five chunks, their document starts inside chunks."""

  implementation = "pallas_fused"
  tiles = _tiles((8, 4, 2), (16, 4, 3), (8, 8, 1))


def _prefix_state(seed, **shape):
  """A reachable state: the one a random 5-token prefix leaves (positions continue from 5)."""
  return jax.jit(_recurrent, compiler_options=FAST_COMPILE)(*sanatan_inputs(seed, 5, **shape))[1]


def _run(fn, inputs, state, **options):
  """``run_sanatan`` with random projections drawn from seed 99."""
  B, T, H, d = inputs[0].shape
  F, dv = 6 * d, inputs[2].shape[-1]
  projections = normals(np.random.default_rng(99), (B, T, H, dv), (B, H, F, dv), (B, H, F))
  return run_sanatan(fn, inputs, state, projections, **options)


@pytest.mark.parametrize("T,d,dv,documents,rotate,tiles,remat", [
    # Partial last chunk, one channel per program in every walk (the constant channel in the first
    # program's forward and dv walks), head dim padded 6 -> 8, dv = 5 padded to one value tile of 8;
    # four documents (starts mid-chunk at 12 and 20, at a chunk start at 32) after the incoming
    # state's; the forward's factors kept for the backward.
    (37, 6, 5, True, True, _tiles((8, 8, 1), (8, 8, 1), (8, 8, 1)), False),
    # Whole chunks of 16, the no-rotation ablation, channel groups of 3, 1 and 2, two value tiles in
    # the dk and dv walks.
    (48, 8, 8, True, False, _tiles((16, 8, 3), (16, 8, 1), (16, 4, 2)), True),
])
def test_fused_kernel_equals_recurrent_with_gradients(T, d, dv, documents, rotate, tiles, remat):
  inputs = sanatan_inputs(T + d, T, d=d, dv=dv)
  state = _prefix_state(100 + T, d=d, dv=dv)
  options = dict(rotate=rotate, **(packed_documents(2, T, (12, 20, 32)) if documents else {}))
  got = _run(functools.partial(sanatan_fused_pallas, tiles=tiles, remat=remat), inputs, state, **options)
  want = _run(_recurrent, inputs, state, **options)
  assert_close(got, want, f"T={T} d={d} dv={dv} documents={documents} rotate={rotate} tiles={tiles} "
                          f"remat={remat}")


@pytest.mark.parametrize("T,count,parts,starts,block_v", [
    # Four spans of two 8-token chunks, summed in one part each; row 1's documents start in span 0's
    # last chunk (12), in span 1's first chunk (18: span 1 hands on only its last document, written
    # across both chunks, to span 2), in span 2's first chunk (36) and at span 3's first token (48:
    # span 3 starts from zeros).
    (64, 4, 1, (12, 18, 36, 48), 8),
    # The same documents, each span summed in two one-chunk parts (part 0 of span 1 is two documents),
    # two value tiles in the parts' kernels and the walks.
    (64, 4, 2, (12, 18, 36, 48), 4),
    # Row 1's one document start in span 1 (18): span 0 is one document, so what span 1's first two
    # tokens give the state entering it reaches the incoming state's gradient, and its other tokens' must not.
    (64, 4, 1, (18,), 8),
    # Two spans of three chunks, summed in three parts, after an incoming state; one document.
    (48, 2, 3, (), 8),
])
def test_rows_cut_into_spans_equal_the_recurrent_form(T, count, parts, starts, block_v):
  """Each row run as ``count`` rows from the states entering its spans (``lmcore.ops.common.spans``:
  the totals and entry-gradient kernels over ``parts`` parts per span): outputs, final state and every
  gradient, the initial state's included, equal the recurrent form."""
  inputs = sanatan_inputs(T + count, T, d=4, dv=5)
  state = _prefix_state(200 + T, d=4, dv=5)
  options = packed_documents(2, T, starts) if starts else {}
  tiles = _tiles((8, 8, 1), (8, 8, 2), (8, block_v, 1), spans=count, parts=parts)
  got = _run(functools.partial(sanatan_fused_pallas, tiles=tiles), inputs, state, **options)
  want = _run(_recurrent, inputs, state, **options)
  assert_close(got, want, f"T={T} spans={count} parts={parts} documents starting at {starts} "
                          f"block_v={block_v}")


def test_bf16_inputs_are_no_less_accurate_than_the_xla_chunked_form_in_bf16():
  """bf16 q, k, v (bf16 features and dots, fp32 states and sums; the channel groups' parts in bf16):
  the largest relative error of the output and the gradients against the fp32 recurrent form on the
  same inputs (``kernel_check``'s comparison) is at most XLA "chunked"'s own in bf16 (observed 7.2e-3
  against 1.2e-2, both in the lam_raw gradient, at these 45 tokens, where the bf16 rounding floor
  alone is 1.9e-3)."""
  inputs = sanatan_inputs(21, 45, d=16, dv=16)
  bf16 = tuple(x.astype(jnp.bfloat16) for x in inputs[:3]) + inputs[3:]
  upcast = tuple(x.astype(jnp.float32) for x in bf16)
  first = lambda fn: lambda *a: fn(*a)[0]
  o_ref, grads_ref = kernel_check.output_and_grads(first(_recurrent), upcast, "highest")

  def worst(fn):
    o, grads = kernel_check.output_and_grads(first(fn), bf16)
    assert o.dtype == jnp.bfloat16
    return max(relative_l2(np.asarray(a, np.float32), b)
               for a, b in zip((o, *grads), (o_ref, *grads_ref)))

  chunked = functools.partial(sanatan_attention, implementation="chunked", tiles=ChunkTiles(16))
  tiles = _tiles((16, 16, 1), (16, 16, 1), (16, 16, 1))
  assert worst(functools.partial(sanatan_fused_pallas, tiles=tiles)) <= worst(chunked)


# Triton calls of one forward and backward: the forward, dq, dk and dv walks; the factor kernel for
# q and k in the forward and again in the backward (recomputed); the factors' VJP kernel for q and k.
KERNEL_CALLS = 10


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("documents,precision,T,count", [(True, "input", 200, 1), (False, "tf32", 200, 1),
                                                         (True, "input", 256, 2)])
def test_kernels_lower_to_triton_for_an_h200(documents, precision, T, count):
  """The walks and the factor kernels pass the Pallas Triton lowering (power-of-two tiles, the 4-D
  grid, traced chunk loops, document masks) for an abstract H200 with bf16 inputs, padded head and
  value dims and a partial chunk, at the default tilings of bf16 and of fp32 operands (through the
  op, its heuristic); cut into two spans, the totals and entry-gradient kernels too."""
  tiles = FusedTiles(spans=count) if count > 1 else None

  def loss(q, k, v, omega, lam_raw, segment_ids):
    o, new = sanatan_attention(q, k, v, omega, lam_raw, implementation="pallas_fused", tiles=tiles,
                               kernel_precision=precision, segment_ids=segment_ids if documents else None)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
                                       *sanatan_abstract_inputs(T=T))
  assert lowered.as_text().count("xla.gpu.triton") == KERNEL_CALLS + 2 * (count > 1)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_every_tuning_tiling_lowers_at_the_benchmark_shape():
  """Each ``harness.FUSED_TUNING`` tiling (the first is the bf16 default) lowers forward and
  backward for an H200 at T = 2048, 12 heads of 64, bf16."""
  args = sanatan_abstract_inputs(B=1, T=2048, H=12, d=64, dv=64)[:5]
  _, cases, flops = harness.fused_tuning_cases(1, 64, jnp.float32)
  assert len(cases) == len(harness.FUSED_TUNING) == len(flops)
  assert harness.FUSED_TUNING[0] == TILES[2]
  assert next(iter(cases)) == "pallas_fused (fwd 64x64 c1 4w 3s, dq 64x64 c1 4w 3s, dkv 64x64 c1 4w 3s)"
  for tiles in harness.FUSED_TUNING:

    def loss(*a, tiles=tiles):
      o, _ = sanatan_fused_pallas(*a, tiles=tiles, interpret=False)
      return o.astype(jnp.float32).sum()

    lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert lowered.as_text().count("xla.gpu.triton") == KERNEL_CALLS, tiles


def test_tiles_reach_the_kernels_through_the_op_and_the_mixer():
  """One program for all six channels with value tiles of 2 in the forward gives the recurrent form's
  output and state through the op; the mixer's ``tiles`` mapping becomes that typed tiling."""
  inputs = sanatan_inputs(3, 20, d=4, dv=4)
  tiles = FusedTiles(forward=KernelTiles(8, 2, 6, 4, 2))
  got = jax.jit(functools.partial(sanatan_attention, implementation="pallas_fused", tiles=tiles),
                compiler_options=FAST_COMPILE)(*inputs)
  want = _recurrent(*inputs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert relative_l2(np.asarray(a), np.asarray(b)) < 1e-5
  config = SanatanMixer.Config(implementation="pallas_fused",
                               tiles={"forward": {"chunk": 8, "block_v": 2, "channels": 6, "num_stages": 2}})
  assert config.tiles == tiles


def test_bad_options_raise_clear_errors():
  q, k, v, omega, lam_raw = sanatan_inputs(3, 9)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    sanatan_fused_pallas(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="spans=4: expected a power of two that cuts T = 9"):
    sanatan_fused_pallas(q, k, v, omega, lam_raw, tiles=FusedTiles(spans=4))
  with pytest.raises(ValueError, match="parts=3 does not cut spans of 32 tokens into whole chunks of 8"):
    sanatan_fused_pallas(*sanatan_inputs(3, 64), tiles=_tiles((8, 8, 1), (8, 8, 1), (8, 8, 1), spans=2,
                                                               parts=3))
  wrong = SanatanState(jnp.zeros((2, 2, 48, 4)), jnp.zeros((2, 2, 48)), jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"state.S has shape"):
    sanatan_fused_pallas(q, k, v, omega, lam_raw, state=wrong)


def test_the_mixer_counts_the_kernel_at_its_own_chunk():
  """FLOPs per token of "pallas_fused": the chunked form at the kernels' forward chunk (64 for bf16
  operands, 32 at kernel_precision "float32"), also for "auto" (counted as on a GPU)."""

  def flops(**fields):
    config = SanatanMixer.Config(n_heads=2, head_dim=8, **fields)
    return SanatanMixer(config, d_model=16, rngs=nnx.Rngs(0)).flops_per_token(256)

  chunked = lambda chunk: flops(implementation="chunked", tiles={"chunk": chunk})
  assert flops(implementation="pallas_fused") == flops(implementation="auto") == chunked(64)
  assert flops(implementation="pallas_fused", kernel_precision="float32") == chunked(32)
  assert flops(implementation="pallas_fused", tiles={"forward": {"chunk": 16}}) == chunked(16)


@pytest.mark.xla_optimized
def test_the_backward_keeps_no_factors_unless_asked():
  """The kernels' backward recomputes the factors of Phi behind ``base.after_cotangent``: XLA cannot
  merge the recomputation with the forward's, so the compiled step (3 layers, compiled, not run) keeps
  fewer temporaries than with ``chunked_remat=False``, which keeps the forward's factors for the
  backward. (Merged, every layer's factors would wait for the backward either way.)"""
  B, T, H, d, L = 1, 128, 2, 16, 3  # 128 tokens: the kept factors outweigh the interpreter's buffers
  x = jax.random.normal(jax.random.key(0), (B, T, H, d), jnp.bfloat16)
  W = jax.random.normal(jax.random.key(1), (L, d, d)) * 0.1
  omega, lam_raw = jnp.full((H, d), 0.7), jnp.zeros((H, d))

  def loss(W, x, remat):
    for layer in range(L):
      q = (x @ W[layer].astype(x.dtype)) * 0.25
      x = x + sanatan_attention(q, q, x, omega, lam_raw, implementation="pallas_fused",
                                chunked_remat=remat)[0]
    return jnp.sum(x.astype(jnp.float32))

  def temporaries(remat):
    compiled = jax.jit(jax.grad(functools.partial(loss, remat=remat))).lower(W, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temporaries(True) < temporaries(False)
