"""The XLA backends (xla.py) pass the shared checks of ``SanatanAttentionTestBase``; ``parallel``
equals the reference for every power and channel variant without a T x T array in its gradients,
``chunked`` takes bf16 inputs and recomputes its forward in the backward pass."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.numerics import relative_l2
from lmcore.ops.common import pallas_utils
from lmcore.ops.common.backend import ChunkTiles
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.ops.sanatan_attention.xla import ParallelTiles

from .test_base import (GRAD_TOL, OUT_TOL, SanatanAttentionTestBase, attention, inputs, jit,
                        outputs_and_grads, prefix_state)

class TestParallel(SanatanAttentionTestBase):
  """Query blocks of 16 rows: T = 33 runs three blocks, the last of one row."""

  implementation = "parallel"
  tiles = ParallelTiles(16)

  @pytest.mark.parametrize("p,channels,three_channel", [(2, 6, "clean"), (4, 4, "clean"), (2, 3, "legacy"),
                                                        (2, 3, "clean")])
  def test_parallel_equals_the_reference_with_gradients_for_every_variant(self, p, channels, three_channel):
    """Outputs and the gradients of its custom VJP against autodiff of ``reference.parallel``, with
    packed documents (one starting inside a query block)."""
    x = inputs(3 * p + channels, 33)
    segment_ids = jnp.asarray([[0] * 20 + [1] * 13, [0] * 5 + [1] * 28])
    do = jnp.asarray(np.random.default_rng(p).normal(size=x[2].shape), jnp.float32)
    kw = dict(variant=(p, channels, three_channel), segment_ids=segment_ids)
    o_ref, g_ref = outputs_and_grads(x, do, implementation="reference", **kw)
    o, g = outputs_and_grads(x, do, implementation="parallel", tiles=self.tiles, **kw)
    assert relative_l2(o, o_ref) <= OUT_TOL
    for name, a, b in zip(("q", "k", "v", "omega", "lam_raw"), g, g_ref):
      assert relative_l2(a, b) <= GRAD_TOL, name

  @pytest.mark.xla_optimized
  def test_parallel_gradient_holds_no_t_by_t_array(self):
    """At T = 4096 (16 blocks of 256 rows) the compiled gradient's scratch is some blocks of scores,
    O(T · T / 16) each (both backward passes' blocks, T · T / 16 at most), less than one T x T array,
    where autodiff of the materialised form keeps several."""
    T = 4096
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32)
              for s in ((1, T, 1, 4), (1, T, 1, 4), (1, T, 1, 4), (1, 4), (1, 4))]
    loss = lambda *a: jnp.sum(sanatan_attention(*a, p=2, implementation="parallel",
                                                tiles=ParallelTiles(256))[0])
    compiled = jit(jax.grad(loss, tuple(range(5)))).lower(*shapes).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 4 * T * T

  def test_parallel_query_blocks_take_the_platforms_fewest_rows(self):
    """Blocks of 128 rows at T = 1024: 8 query blocks here, 4 of ``PARALLEL_MIN_ROWS["tpu"]`` = 256
    rows on a TPU (two dots per block in the forward: scores, then weights by values)."""
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32)
              for s in ((1, 1024, 1, 4), (1, 1024, 1, 4), (1, 1024, 1, 4), (1, 4), (1, 4))]

    def dots():  # a new function each time: traces are cached per function
      fn = lambda *a: sanatan_attention(*a, p=2, implementation="parallel", tiles=ParallelTiles(128))[0]
      return str(jax.make_jaxpr(fn)(*shapes)).count("dot_general")

    here = dots()
    with pallas_utils.assume_backend("tpu"):
      assert here - dots() == 2 * (8 - 4)


class TestChunked(SanatanAttentionTestBase):
  """Every chunk at once, the entering states as a cumulative sum over chunks; chunks of 16."""

  implementation = "chunked"
  tiles = ChunkTiles(16)

  def test_bfloat16_inputs_give_bfloat16_outputs_and_float32_state(self):
    x = inputs(16, 33)
    o32 = self.attend(*x)[0]
    bf16 = [a.astype(jnp.bfloat16) for a in x[:3]]
    o16, state16 = self.attend(*bf16, *x[3:])
    assert o16.dtype == jnp.bfloat16 and state16.S.dtype == jnp.float32
    # bf16 rounds q, k, v and the features by up to 2^-9 relative.
    assert relative_l2(o16.astype(jnp.float32), o32) <= 3e-2

  def test_recomputing_backward_equals_keeping_the_forward(self):
    """``chunked_remat`` changes only what the backward pass keeps: outputs and gradients are those
    of plain autodiff of the same form (same operations; fp32 summation order at most)."""
    x = inputs(21, 33)
    do = jnp.asarray(np.random.default_rng(21).normal(size=x[2].shape), jnp.float32)
    (o, g), (o_ref, g_ref) = (outputs_and_grads(x, do, implementation="chunked", tiles=self.tiles,
                                                chunked_remat=remat) for remat in (True, False))
    assert relative_l2(o, o_ref) <= 1e-6
    for name, a, b in zip(("q", "k", "v", "omega", "lam_raw"), g, g_ref):
      assert relative_l2(a, b) <= 1e-6, name

  def test_many_chunks_equal_parallel_with_state_and_segments(self):
    """Chunks of 2 tokens: 17 chunks, more than one block of ``chunk_prefix_sum`` (two levels and a
    padded last block), with a reset inside a chunk, one on a chunk boundary and an incoming state."""
    x = inputs(22, 33)
    state = prefix_state(23)
    segment_ids = jnp.asarray([[0] * 20 + [1] * 13, [0] * 5 + [1] * 20 + [2] * 8])

    def run(implementation, q, k, v, omega, lam_raw, S0, z0):
      o, new = attention(q, k, v, omega, lam_raw, implementation=implementation,
                         tiles=ChunkTiles(2) if implementation == "chunked" else None,
                         state=SanatanState(S0, z0, state.position), segment_ids=segment_ids)
      return o, new.S, new.z

    rng = np.random.default_rng(24)
    cotangents = tuple(jnp.asarray(rng.normal(size=a.shape), jnp.float32)
                       for a in (x[2], state.S, state.z))

    def outputs_and_vjp(implementation):
      out, vjp = jax.vjp(functools.partial(run, implementation), *x, state.S, state.z)
      return out, vjp(cotangents)

    got, want = (jit(outputs_and_vjp, static_argnums=0)(impl) for impl in ("chunked", "reference"))
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
      assert relative_l2(a, b) <= OUT_TOL
    for name, a, b in zip(("q", "k", "v", "omega", "lam_raw", "S0", "z0"), got[1], want[1]):
      assert relative_l2(a, b) <= GRAD_TOL, name


def _kept_for_backward(fn, *args) -> list[jax.ShapeDtypeStruct]:
  """The arrays ``jax.vjp`` keeps for the backward pass of ``fn`` (the leaves of its VJP function),
  traced only."""
  return jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args))


def _bytes(arrays) -> int:
  return sum(a.size * a.dtype.itemsize for a in arrays)


def test_chunked_backward_keeps_the_inputs_not_features_blocks_or_state_stacks():
  """With ``chunked_remat`` (the default) the backward pass recomputes everything from the inputs, so
  what waits for it is at most twice the inputs' bytes and no chunk-stacked (5-d) array. Without it,
  autodiff keeps the 6d-wide features, the [B, N, H, C, C] blocks and the [B, N, H, F, dv] state
  stacks: 19 times the inputs here, which these bounds catch."""
  x = (*inputs(3, 40), jnp.ones((2, 2, 24, 5)), jnp.ones((2, 2, 24)))  # 3 chunks of 16, one partial
  segment_ids = jnp.asarray([[0] * 21 + [1] * 19, [0] * 40])

  def kept(remat):
    def o_and_state(q, k, v, omega, lam_raw, S, z):
      return sanatan_attention(q, k, v, omega, lam_raw, implementation="chunked", tiles=ChunkTiles(16),
                               state=SanatanState(S, z, jnp.full((2,), 3, jnp.int32)),
                               segment_ids=segment_ids, chunked_remat=remat)
    return _kept_for_backward(o_and_state, *x)

  input_bytes = _bytes((*x, segment_ids))
  with_remat, without = kept(True), kept(False)
  assert _bytes(with_remat) <= 2 * input_bytes
  assert max(a.ndim for a in with_remat) <= 4
  assert _bytes(without) > 4 * input_bytes and max(a.ndim for a in without) >= 5


def test_the_op_and_the_mixer_run_one_default_chunk():
  """Without tiles, ``chunked`` runs chunks of ``xla.CHUNK`` tokens whether called as the function, through
  the op's registry or from the SANATAN mixer (whose FLOP count is the form's at that chunk)."""
  from flax import nnx

  from sanatan_jax import SanatanMixer
  from sanatan_jax.ops.sanatan_attention import REGISTRY, Problem, xla

  problem = Problem("cpu", 1, 6, 64, 64, 2048, "bfloat16")
  assert REGISTRY.resolve("chunked", problem).config(problem, None) == ChunkTiles(xla.CHUNK)
  assert REGISTRY.tiles("chunked", {}, "tiles") == ChunkTiles(xla.CHUNK)  # a mapping without the chunk
  assert inspect.signature(xla.chunked).parameters["chunk_size"].default == xla.CHUNK

  def flops(tiles):
    config = SanatanMixer.Config(n_heads=12, head_dim=64, implementation="chunked", tiles=tiles)
    return nnx.eval_shape(lambda: SanatanMixer(config, d_model=768, rngs=nnx.Rngs(0))).flops_per_token(2048)

  assert flops(None) == flops({"chunk": xla.CHUNK}) == flops({}) != flops({"chunk": xla.CHUNK // 2})
