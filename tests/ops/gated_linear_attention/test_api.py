"""The op's switch: the registry maps names to backends, "auto"/None resolve per platform (the Triton
kernels on GPUs for heads they were measured to win at, XLA "chunked" elsewhere), unknown names list
the ones that run, bad shapes and tiles raise clear errors."""

import jax.numpy as jnp
import pytest

from lmcore.ops.common.backend import ChunkTiles
from lmcore.ops.gated_linear_attention import (REGISTRY, LinearAttentionState, Problem,
                                               gated_linear_attention, problem)
from lmcore.ops.gated_linear_attention import pallas_mosaic_tpu, pallas_triton, reference, xla
from .test_base import gla_inputs


@pytest.mark.parametrize("platform,expected", [("cpu", "chunked"), ("tpu", "chunked"),
                                               ("gpu", "pallas_triton")])
def test_registry_names_its_backends_and_auto_resolves_per_platform(platform, expected):
  problem = Problem(platform, 64, 64, 2048)
  assert REGISTRY.resolve_name(None, problem) == REGISTRY.resolve_name("auto", problem) == expected
  kinds = {"recurrent": reference.Recurrent, "parallel": reference.Parallel, "chunked": xla.Chunked,
           "pallas_triton": pallas_triton.PallasTriton, "pallas_tpu": pallas_mosaic_tpu.PallasMosaicTpu}
  assert {name: type(b) for name, b in REGISTRY.backends.items()} == kinds


@pytest.mark.parametrize("key_dim,value_dim,expected", [
    (64, 64, "pallas_triton"), (96, 192, "pallas_triton"), (128, 256, "pallas_triton"),
    (128, 257, "chunked"), (128, 512, "chunked"), (256, 64, "chunked")])
def test_auto_keeps_heads_wider_than_measured_on_xla_on_gpu(key_dim, value_dim, expected):
  """The kernel beat XLA at every head up to 128 x 256 and lost at 128 x 512; naming it still runs it."""
  problem = Problem("gpu", key_dim, value_dim, 2048)
  assert REGISTRY.resolve_name("auto", problem) == expected
  assert REGISTRY.resolve_name("pallas_triton", problem) == "pallas_triton"


def test_a_backend_named_off_its_platform_lists_the_ones_that_run():
  with pytest.raises(ValueError, match=r"'pallas_tpu' does not run heads of 8 x 5 on gpu \(it needs a tpu or "
                                       r"cpu platform\); use one of recurrent, parallel, chunked, "
                                       r"pallas_triton, auto"):
    REGISTRY.resolve("pallas_tpu", Problem("gpu", 8, 5))
  with pytest.raises(ValueError, match="'pallas_triton' does not run heads of 8 x 5 on tpu"):
    REGISTRY.resolve("pallas_triton", Problem("tpu", 8, 5))


def test_unknown_implementation_names_list_the_ones_that_run():
  q, k, v, _, _ = gla_inputs(51, 9, None, False)
  for name in ("cuda_magic", "reference", "xla", "pallas"):
    with pytest.raises(ValueError, match="for heads of 8 x 5 on cpu use one of recurrent, parallel, chunked, "
                                         "pallas_triton, pallas_tpu, auto"):
      gated_linear_attention(q, k, v, implementation=name)


def test_auto_counts_the_normaliser_column():
  """A normalised form's kernel is V + 1 wide: at V = MAX_VALUE "auto" takes XLA on a GPU."""
  q = jnp.zeros((1, 8, 1, 4))
  v = jnp.zeros((1, 8, 1, pallas_triton.MAX_VALUE))
  assert REGISTRY.resolve_name("auto", problem(q, v, normalize=False, platform="gpu")) == "pallas_triton"
  assert REGISTRY.resolve_name("auto", problem(q, v, normalize=True, platform="gpu")) == "chunked"


def test_invalid_shapes_and_tiles_raise_clear_errors():
  q, k, v, _, _ = gla_inputs(61, 9, None, False)
  with pytest.raises(ValueError, match=r"log_forget has shape \(2, 9, 3\)"):
    gated_linear_attention(q, k, v, jnp.zeros((2, 9, 3)))
  with pytest.raises(ValueError, match="power of two"):
    gated_linear_attention(q, k, v, tiles=ChunkTiles(24))
  with pytest.raises(ValueError, match="power of two"):
    pallas_triton.TritonTiles(chunk=24)
  with pytest.raises(ValueError, match="TritonTiles has no field 'warps'; valid: block_v, chunk, num_stages"):
    REGISTRY.tiles("pallas_triton", {"warps": 4}, "GLA tiles")
  with pytest.raises(ValueError, match="tiles belong to one backend, but the implementation is 'auto'"):
    REGISTRY.tiles("auto", {"chunk": 32}, "GLA tiles")
  with pytest.raises(ValueError, match="state.S"):
    gated_linear_attention(q, k, v, state=LinearAttentionState.zeros(2, 2, 8, 4))
