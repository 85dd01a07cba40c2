"""The op's switch and public surface (api.py, base.py): the registry maps names to backends; "auto" /
None resolve per platform, length, packed documents, decay ablation and head widths (the Triton kernels
on GPUs where they were measured fastest, XLA elsewhere and past them); unknown or unsupported names
list the ones that run; tiles from a config mapping become the backend's typed tiling, and tiles with
"auto" are rejected; on this CPU host "auto" gives exactly the outputs of the XLA form it resolves to.
Also the decay ablation's default rates and the zero state's feature width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.ops.taylor_attention import (REGISTRY, Problem, default_decay_rates, problem,
                                            taylor_linear_attention, zero_state)
from based_jax.ops.taylor_attention import (pallas_mosaic_tpu, pallas_triton_blocked, pallas_triton_fused,
                                            reference, xla)
from lmcore.ops.common.backend import ChunkTiles


def test_default_decay_rates_follow_one_minus_two_to_minus_three_minus_h():
  np.testing.assert_allclose(default_decay_rates(16)[:3], [0.875, 0.9375, 0.96875])
  np.testing.assert_allclose(default_decay_rates(16)[-1], 1 - 2.0**-18, rtol=0, atol=1e-7)


def test_zero_state_has_feature_width():
  state = zero_state(3, 2, 16, 64)
  assert state.S.shape == (3, 2, 153, 64) and state.z.shape == (3, 2, 153)


def test_registry_names_its_backends():
  kinds = {"parallel": reference.Parallel, "recurrent": reference.Recurrent, "chunked": xla.Chunked,
           "pallas_blocked": pallas_triton_blocked.PallasBlocked,
           "pallas_fused": pallas_triton_fused.PallasFused, "pallas_tpu": pallas_mosaic_tpu.PallasTpu}
  assert {name: type(b) for name, b in REGISTRY.backends.items()} == kinds


def _auto(platform, length=2048, key_dim=16, value_dim=64, **options):
  """What "auto" and None resolve to (they agree); any name resolves to itself where it runs."""
  p = Problem(platform, key_dim, value_dim, length, **options)
  name = REGISTRY.resolve_name("auto", p)
  assert REGISTRY.resolve_name(None, p) == name and REGISTRY.resolve_name("recurrent", p) == "recurrent"
  return name


@pytest.mark.parametrize("platform,length,decay,segments,expected", [
    ("gpu", 2048, False, False, "pallas_blocked"), ("gpu", 2048, False, True, "pallas_blocked"),
    ("gpu", 4096, False, False, "pallas_blocked"), ("gpu", 8191, False, True, "pallas_blocked"),
    ("gpu", 8192, False, False, "pallas_fused"), ("gpu", 8192, False, True, "pallas_fused"),
    ("gpu", None, False, False, "pallas_fused"),  # an unknown length counts as long
    ("gpu", 2048, True, False, "chunked"), ("gpu", 2048, True, True, "chunked"),
    ("cpu", 2048, False, False, "chunked"), ("cpu", 2048, False, True, "chunked"),
    ("tpu", 2048, False, False, "chunked"), ("tpu", 2048, True, True, "chunked"),
])
def test_auto_resolves_per_platform_length_documents_and_decay(platform, length, decay, segments, expected):
  """On GPUs the blocked kernels below ``BLOCKED_BELOW`` tokens and the fused-chunk ones from it, both
  with documents; the decay ablation, which no kernel takes, goes to XLA "chunked", with documents too.
  TPUs and CPUs run XLA "chunked" (the Mosaic kernels are untimed)."""
  assert pallas_triton_blocked.BLOCKED_BELOW == 8192
  assert _auto(platform, length, decay=decay, segments=segments) == expected


@pytest.mark.parametrize("key_dim,value_dim,expected", [
    (16, 64, "pallas_blocked"), (8, 32, "pallas_blocked"), (16, 112, "pallas_blocked"),
    (16, 256, "pallas_blocked"), (32, 128, "pallas_blocked"), (64, 128, "pallas_blocked"),
    (16, 512, "pallas_fused"), (32, 512, "pallas_fused"), (64, 512, "chunked"), (16, 1024, "chunked"),
    (128, 64, "chunked")])
def test_auto_keeps_heads_wider_than_measured_on_xla_on_gpu_at_short_lengths(key_dim, value_dim, expected):
  """At T = 2048 the blocked kernels for d' up to 64 and dv up to their ``MAX_VALUE_DIM``; past it the
  fused-chunk kernels where their key dim allows (d' <= 32) and dv is at most 512; XLA beyond."""
  assert _auto("gpu", 2048, key_dim, value_dim) == expected
  assert _auto("gpu", 2048, key_dim, value_dim, segments=True) == expected


@pytest.mark.parametrize("key_dim,value_dim,expected", [
    (16, 64, "pallas_fused"), (16, 112, "pallas_fused"), (16, 512, "pallas_fused"),
    (32, 128, "pallas_blocked"), (64, 64, "pallas_blocked"), (64, 512, "chunked"), (256, 64, "chunked")])
def test_auto_on_long_sequences_on_gpu(key_dim, value_dim, expected):
  """From T = 8192 the fused-chunk kernels at d' <= ``BLOCKED_ABOVE_KEY_DIM``; wider keys keep the
  blocked kernels, past their value width XLA."""
  for length in (8192, 32768):
    assert _auto("gpu", length, key_dim, value_dim) == expected
    assert _auto("gpu", length, key_dim, value_dim, segments=True) == expected


def test_problem_of_a_call_reads_the_arrays():
  q, v = jnp.zeros((2, 9, 3, 16)), jnp.zeros((2, 9, 3, 112))
  assert problem(q, v, segments=True, platform="gpu") == Problem("gpu", 16, 112, 9, segments=True)
  assert REGISTRY.resolve_name("auto", problem(q, v, platform="gpu")) == "pallas_blocked"


def test_unknown_and_unsupported_names_list_the_ones_that_run():
  x = jnp.ones((1, 3, 1, 2))
  for name in ("reference", "xla", "pallas", "pallas_triton"):
    with pytest.raises(ValueError, match=f"unknown implementation '{name}'; for heads of 2 x 2 of 3 "
                                         "tokens on cpu use one of parallel, recurrent, chunked, "
                                         "pallas_blocked, pallas_fused, pallas_tpu, auto"):
      taylor_linear_attention(x, x, x, implementation=name)
  with pytest.raises(ValueError, match=r"'pallas_tpu' does not run heads of 16 x 64 on gpu \(it needs no "
                                       r"decay ablation on tpu or cpu\); use one of parallel, recurrent, "
                                       r"chunked, pallas_blocked, pallas_fused, auto"):
    REGISTRY.resolve("pallas_tpu", Problem("gpu", 16, 64))
  with pytest.raises(ValueError, match="'pallas_blocked' does not run heads of 16 x 64 on tpu"):
    REGISTRY.resolve("pallas_blocked", Problem("tpu", 16, 64))
  with pytest.raises(ValueError, match="unknown implementation 'pallas'; valid: parallel, recurrent"):
    REGISTRY.check_name("pallas")


def test_tiles_from_a_mapping_become_the_backends_typed_tiling():
  assert REGISTRY.tiles("chunked", {"chunk": 32}, "Taylor tiles") == ChunkTiles(32)
  assert (REGISTRY.tiles("pallas_blocked", {"block_q": 32, "num_stages": 2}, "Taylor tiles")
          == pallas_triton_blocked.BlockedTiles(block_q=32, num_stages=2))
  assert (REGISTRY.tiles("pallas_fused", {"chunk": 64, "intra": [4, 2]}, "Taylor tiles")
          == pallas_triton_fused.FusedTiles(chunk=64, intra=(4, 2)))
  assert REGISTRY.tiles("pallas_tpu", {"chunk": 128}, "Taylor tiles") == pallas_mosaic_tpu.MosaicTiles(128)
  assert REGISTRY.tiles("parallel", None, "Taylor tiles") is None
  with pytest.raises(ValueError, match="Taylor tiles: tiles belong to one backend, but the implementation "
                                       "is 'auto'"):
    REGISTRY.tiles("auto", {"chunk": 32}, "Taylor tiles")
  with pytest.raises(ValueError, match="Taylor tiles: BlockedTiles has no field 'chunk'; valid: block_k, "
                                       "block_q, num_stages, num_warps"):
    REGISTRY.tiles("pallas_blocked", {"chunk": 32}, "Taylor tiles")
  with pytest.raises(ValueError, match="implementation 'recurrent' has no tiles"):
    REGISTRY.tiles("recurrent", {"chunk": 32}, "Taylor tiles")


def test_bad_shapes_and_tiles_raise_clear_errors():
  x = jnp.ones((1, 3, 2, 4))
  with pytest.raises(ValueError, match=r"decay must be per-head rates of shape \(2,\)"):
    taylor_linear_attention(x, x, x, decay=jnp.ones((3,)))
  with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\] = \(1, 3\)"):
    taylor_linear_attention(x, x, x, segment_ids=jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="do not fit Chunked, which takes a ChunkTiles"):
    taylor_linear_attention(x, x, x, implementation="chunked", tiles=pallas_mosaic_tpu.MosaicTiles())
  with pytest.raises(ValueError, match="unknown precision 'fp16'"):
    taylor_linear_attention(x, x, x, kernel_precision="fp16")


@pytest.mark.parametrize("segmented", [False, True])
def test_auto_on_cpu_is_the_chunked_form_with_and_without_documents(segmented):
  B, T, H, d = 2, 11, 2, 4
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, w)), jnp.float32) for w in (d, d, 3))
  segment_ids = jnp.asarray([[0] * 5 + [1] * 6, [0] * 11]) if segmented else None
  run = lambda name: jax.jit(lambda q, k, v: taylor_linear_attention(
      q, k, v, implementation=name, segment_ids=segment_ids))(q, k, v)
  jax.tree.map(np.testing.assert_array_equal, run("auto"), run("chunked"))
