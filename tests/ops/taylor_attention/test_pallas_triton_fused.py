"""The fused-chunk Taylor kernels (the backend ``pallas_fused``) compute taylor_linear_attention's
function (MATH §2.1): the shared checks of ``test_base`` (rejecting the decay ablation), and outputs,
final state and gradients (q, k, v, initial S and z) equal the materialised parallel form for partial
chunks, a padded key dim, several value tiles and feature blocks, both state layouts, packed
documents and rows cut into spans; the kernels lower to Triton for an H200 at the BASED head shape.

Interpreted on CPU. Tolerance: relative L2 error 1e-5 at fp32 (summation order only; observed below
3e-7).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax import TaylorState, taylor_features, taylor_linear_attention
from based_jax.ops.taylor_attention.pallas_triton_fused import FusedTiles, taylor_fused_pallas
from kernel_cases import CHUNK, assert_close, document_ids, normals, run_taylor, taylor_abstract_inputs
from lmcore.ops.common import pallas_utils

from .test_base import TaylorAttentionTestBase


class TestPallasFused(TaylorAttentionTestBase):
  """The shared checks on the fused kernels (interpreted on CPU) at chunks of 16 and feature blocks of
  8 rows (d' = 4: two quadratic blocks and the linear one), so that states cross chunks and blocks."""

  implementation = "pallas_fused"
  tiles = FusedTiles(chunk=CHUNK, features=8)
  decay = False
  pieces = (33, 7, 1, 26)


def _inputs(seed, T, *, B=2, H=2, d=8, dv=5):
  return normals(np.random.default_rng(seed), (B, T, H, d), (B, T, H, d), (B, T, H, dv))


def _prefix_state(seed, feature, *, d=8):
  """A reachable state: sums of phi(k) v^T and phi(k) over a random 9-token prefix."""
  _, k, v = _inputs(seed, 9, d=d)
  phi = taylor_features(k, feature)
  return TaylorState(jnp.einsum("bthf,bthv->bhfv", phi, v), phi.sum(1))


def _run(fn, T, d, feature, segment_ids=None):
  inputs, state = _inputs(T, T, d=d), _prefix_state(100 + T, feature, d=d)
  projections = normals(np.random.default_rng(99), inputs[2].shape, *(x.shape for x in state))
  options = {} if segment_ids is None else dict(segment_ids=segment_ids)
  return run_taylor(fn, inputs, state, projections, feature=feature, **options)


_parallel = functools.partial(taylor_linear_attention, implementation="parallel")


def test_fused_equals_parallel_with_gradients():
  """Key dim padded 6 -> 8, two value tiles of 4 (dv = 5 -> 8), two quadratic blocks of 32 rows and the
  linear one, a partial chunk; row 1 packs documents starting mid-chunk, at a chunk start (16) and a
  one-token one (the shared checks cover the compact layout, one value tile and feature blocks of 8)."""
  T, d, feature, tiles, starts = 37, 6, "full", FusedTiles(chunk=CHUNK, features=32, block_v=4), (5, 16, 17)
  segment_ids = document_ids(2, T, starts)
  got = _run(functools.partial(taylor_fused_pallas, tiles=tiles), T, d, feature, segment_ids)
  want = _run(_parallel, T, d, feature, segment_ids)
  assert_close(got, want, f"T={T} d={d} {feature} {tiles} documents={starts}")


@pytest.mark.parametrize("count,parts,starts", [(4, 1, (12, 18, 36, 48)), (4, 2, (12, 18, 36, 48)),
                                                (2, 4, None)])
def test_rows_cut_into_spans_equal_the_parallel_form(count, parts, starts):
  """Each row run as ``count`` rows of 8-token chunks from the states entering its spans
  (``lmcore.ops.common.spans``; the totals and entry-gradient kernels; T = 64), through the backend.
  With four spans, row 1's documents start in span 0's last chunk (12), in span 1's first chunk (18:
  span 1 hands on only its last document, written across both chunks), in span 2's first chunk (36)
  and at span 3's first token (48: span 3 starts from zeros); with two, one document. Outputs, final
  state and gradients, the initial state's included, equal the parallel form; the totals summed over
  ``parts`` parts of a span (of 16 or 8 tokens with four spans; 8 with two)."""
  T, d, feature = 64, 4, "compact"
  segment_ids = None if starts is None else document_ids(2, T, starts)
  tiles = FusedTiles(chunk=8, features=8, spans=count, parts=parts)
  split = functools.partial(taylor_linear_attention, implementation="pallas_fused", tiles=tiles)
  got = _run(split, T, d, feature, segment_ids)
  want = _run(_parallel, T, d, feature, segment_ids)
  assert_close(got, want, f"T={T} spans={count} parts={parts} documents={starts}")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_kernels_lower_to_triton_for_an_h200_with_bfloat16_inputs():
  """Forward (walk, intra) and backward (dq walk, dk/dv walk, intra) kernels pass the Pallas Triton
  lowering for an abstract H200 at the BASED head shape (d' = 16, dv = 64), with a partial chunk and
  packed documents."""
  def loss(q, k, v, segment_ids):
    o, new = taylor_fused_pallas(q, k, v, interpret=False, segment_ids=segment_ids)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), *taylor_abstract_inputs(T=200))
  assert lowered.as_text().count("xla.gpu.triton") == 5


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("precision,stages", [("input", {2, 3}), ("float32", {2})])
def test_four_byte_operands_run_at_most_two_pipeline_stages(precision, stages):
  """Three stages of 128-token fp32 chunks overflow the H200's shared memory: the kernels on 4-byte
  operands cap the default tiling's stages, bf16 ones keep them."""
  def loss(q, k, v, segment_ids):
    return taylor_fused_pallas(q, k, v, interpret=False, precision=precision)[0].astype(jnp.float32).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2))
  text = pallas_utils.lower_for_gpu(grad, *taylor_abstract_inputs(T=512)).as_text()
  assert text.count("xla.gpu.triton") == 5
  assert {int(n) for n in re.findall(r"num_stages = (\d+) : i32", text)} == stages


def test_bad_options_raise_clear_errors():
  q, k, v = _inputs(3, 9)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    taylor_fused_pallas(q, k, v, interpret=False)
  with pytest.raises(ValueError, match="features must be a power of two, got 48"):
    FusedTiles(features=48)
  with pytest.raises(ValueError, match="dq must be \\(warps, stages\\)"):
    FusedTiles(dq=(8, 3, 1))
  with pytest.raises(ValueError, match="spans=2: expected a power of two"):
    taylor_fused_pallas(q, k, v, tiles=FusedTiles(chunk=8, spans=2))
  with pytest.raises(ValueError, match="tiles.parts=3 does not cut spans of 8 tokens"):
    taylor_fused_pallas(jnp.zeros((1, 16, 1, 4)), jnp.zeros((1, 16, 1, 4)), jnp.zeros((1, 16, 1, 4)),
                        tiles=FusedTiles(chunk=8, spans=2, parts=3))
  wide = jnp.zeros((1, 16, 1, 64))
  with pytest.raises(ValueError, match="use implementation='pallas_blocked' or 'chunked'"):
    pallas_utils.lower_for_gpu(lambda q: taylor_fused_pallas(q, q, q, interpret=False)[0], wide)
  with pytest.raises(ValueError, match=r"'pallas_fused' does not run heads of 64 x 64 .*key dims up to 32"):
    taylor_linear_attention(wide, wide, wide, implementation="pallas_fused")


def test_tiles_from_a_config_mapping_are_hashable():
  """A config file's lists become the (warps, stages) pairs a jitted call keys on."""
  tiles = FusedTiles(**{"chunk": 64, "forward": [4, 3]})
  assert tiles.forward == (4, 3) and hash(tiles) == hash(FusedTiles(chunk=64, forward=(4, 3)))
