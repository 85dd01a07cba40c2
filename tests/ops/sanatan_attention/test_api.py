"""The op's switch: the registry maps names to backends, "auto"/None resolve per platform, power,
channel variant and head width (the Triton kernels on GPUs for the heads they were measured to win at,
XLA "chunked" or "parallel" elsewhere), a name that is unknown or does not run the problem lists the
ones that do, and tiles become the named backend's typed tiling."""

import jax.numpy as jnp
import pytest

from lmcore.ops.common.backend import ChunkTiles
from sanatan_jax import sanatan_attention
from sanatan_jax.ops.sanatan_attention import REGISTRY, Problem, check_variant, problem
from sanatan_jax.ops.sanatan_attention import (pallas_mosaic_tpu_p1, pallas_triton_flash, pallas_triton_fused,
                                               reference, xla)

from .test_base import inputs, prefix_state


def test_registry_names_its_backends():
  kinds = {"parallel": xla.Parallel, "chunked": xla.Chunked, "recurrent": reference.Recurrent,
           "pallas_fused": pallas_triton_fused.PallasFused, "pallas_flash": pallas_triton_flash.PallasFlash,
           "pallas_tpu": pallas_mosaic_tpu_p1.PallasTpu}
  assert {name: type(b) for name, b in REGISTRY.backends.items()} == kinds


@pytest.mark.parametrize("platform,p,channels,expected", [
    ("gpu", 1, 6, "pallas_fused"), ("gpu", 2, 6, "pallas_flash"), ("gpu", 1, 4, "pallas_flash"),
    ("gpu", 4, 3, "pallas_flash"), ("tpu", 1, 6, "chunked"), ("tpu", 2, 6, "parallel"),
    ("tpu", 1, 3, "parallel"), ("cpu", 1, 6, "chunked"), ("cpu", 2, 4, "parallel")])
def test_auto_resolves_per_platform_and_variant(platform, p, channels, expected):
  problem = Problem(platform, p, channels, 64, 64, 2048)
  assert REGISTRY.resolve_name(None, problem) == REGISTRY.resolve_name("auto", problem) == expected


@pytest.mark.parametrize("p,head_dim,value_dim,expected", [
    (1, 64, 64, "pallas_fused"), (1, 128, 512, "pallas_fused"), (1, 128, 513, "chunked"),
    (1, 256, 64, "chunked"), (2, 64, 64, "pallas_flash"), (2, 64, 128, "parallel"),
    (2, 128, 64, "parallel")])
def test_auto_keeps_heads_wider_than_measured_on_xla_on_gpu(p, head_dim, value_dim, expected):
  """The kernels won up to their ``MAX_HEAD_DIM`` x ``MAX_VALUE_DIM``; naming them still runs them."""
  problem = Problem("gpu", p, 6, head_dim, value_dim, 2048)
  assert REGISTRY.resolve_name("auto", problem) == expected
  kernel = "pallas_fused" if p == 1 else "pallas_flash"
  assert REGISTRY.resolve_name(kernel, problem) == kernel


def test_the_tpu_kernels_are_named_only():
  problem = Problem("tpu", 1, 6, 64, 64, 2048)
  assert "pallas_tpu" not in REGISTRY.auto["tpu"]
  assert REGISTRY.resolve_name("pallas_tpu", problem) == "pallas_tpu"


def test_the_problem_of_a_call_takes_the_kernels_operand_dtype():
  q, v = jnp.zeros((1, 8, 2, 4), jnp.bfloat16), jnp.zeros((1, 8, 2, 3), jnp.bfloat16)
  assert problem(q, v, p=2, platform="gpu") == Problem("gpu", 2, 6, 4, 3, 8, "bfloat16")
  assert problem(q, v, kernel_precision="tf32", platform="gpu").dtype == "float32"
  # The heuristic tiling follows the operand width: fp32 operands take the fp32 tilings.
  for name, module in (("pallas_fused", pallas_triton_fused), ("pallas_flash", pallas_triton_flash)):
    backend = REGISTRY.backends[name]
    assert backend.heuristic_config(problem(q, v, platform="gpu")) == module.TILES[2]
    fp32 = problem(q, v, kernel_precision="float32", platform="gpu")
    assert backend.heuristic_config(fp32) == module.TILES[4]


def test_unknown_or_unsupported_names_list_the_ones_that_run():
  q, k, v, omega, lam_raw = inputs(51, 9)
  for name in ("flash", "pallas", "blocked", "chunked_scan"):
    with pytest.raises(ValueError, match=r"unknown implementation '\w+'; for p=1 with 6 channels, heads of "
                                         r"4 x 5 on cpu use one of parallel, chunked, recurrent, "
                                         r"pallas_fused, pallas_tpu, auto"):
      sanatan_attention(q, k, v, omega, lam_raw, implementation=name)
  for name in ("chunked", "recurrent", "pallas_fused", "pallas_tpu"):
    with pytest.raises(ValueError, match=rf"'{name}' does not run p=2 with 6 channels, heads of 4 x 5 on "
                                         r"cpu \(it needs p = 1 with 6 channels on .*\); use one of "
                                         r"parallel, pallas_flash, auto"):
      sanatan_attention(q, k, v, omega, lam_raw, p=2, implementation=name)
  with pytest.raises(ValueError, match=r"'pallas_tpu' does not run .* on gpu \(it needs p = 1 with 6 "
                                       r"channels on tpu or cpu\)"):
    REGISTRY.resolve("pallas_tpu", Problem("gpu", 1, 6, 4, 5))
  with pytest.raises(ValueError, match=r"'pallas_fused' does not run .* on tpu"):
    REGISTRY.resolve("pallas_fused", Problem("tpu", 1, 6, 4, 5))


def test_a_state_at_a_power_is_the_error_that_explains():
  """A state passed with p >= 2 or the ablation channels fails on the state (a p >= 2 decode call),
  not on the implementation; without one such a call runs and returns no state."""
  q, k, v, omega, lam_raw = inputs(17, 7)
  state = prefix_state(18)
  for options in (dict(p=2), dict(channels=4), dict(p=2, implementation="recurrent")):
    with pytest.raises(ValueError, match="no constant-size state"):
      sanatan_attention(q, k, v, omega, lam_raw, state=state, **options)
  assert sanatan_attention(q, k, v, omega, lam_raw, p=2, implementation="auto")[1] is None


def test_variants_a_named_backend_never_runs_fail_at_config_time():
  check_variant("chunked", 1, 6, "SANATAN")
  check_variant("auto", 2, 4, "SANATAN")
  with pytest.raises(ValueError, match=r"SANATAN: implementation 'chunked' needs p = 1 with 6 channels, got "
                                       r"p=2 with 6 channels; use one of parallel, pallas_flash, auto"):
    check_variant("chunked", 2, 6, "SANATAN")
  with pytest.raises(ValueError, match=r"'pallas_flash' needs p >= 2 or 4 or 3 channels .*; use one of "
                                       r"parallel, chunked, recurrent, pallas_fused, pallas_tpu, auto"):
    check_variant("pallas_flash", 1, 6, "SANATAN")


def test_tiles_become_the_named_backends_typed_tiling():
  fused = REGISTRY.tiles("pallas_fused", {"forward": {"chunk": 32, "num_stages": 2}, "spans": 4}, "t")
  assert fused == pallas_triton_fused.FusedTiles(
      forward=pallas_triton_fused.KernelTiles(chunk=32, num_stages=2), spans=4)
  assert REGISTRY.tiles("chunked", {"chunk": 64}, "t") == ChunkTiles(64)
  assert REGISTRY.tiles("parallel", {"rows": 256}, "t") == xla.ParallelTiles(256)
  flash = REGISTRY.tiles("pallas_flash", {"dq": {"block": 64, "loop": 32}}, "t")
  assert flash.dq == pallas_triton_flash.BlockTiles(64, 32)
  assert flash.forward == pallas_triton_flash.FlashTiles().forward
  tpu = REGISTRY.tiles("pallas_tpu", {"block_v": 256}, "t")
  assert tpu == pallas_mosaic_tpu_p1.MosaicTiles(block_v=256)
  assert REGISTRY.tiles("recurrent", None, "t") is None


def test_bad_tiles_raise_clear_errors():
  with pytest.raises(ValueError, match="SANATAN tiles: tiles belong to one backend, but the implementation is "
                                       "'auto'"):
    REGISTRY.tiles("auto", {"chunk": 64}, "SANATAN tiles")
  with pytest.raises(ValueError, match="'recurrent' has no tiles; backends with tiles: parallel, chunked, "
                                       "pallas_fused, pallas_flash, pallas_tpu"):
    REGISTRY.tiles("recurrent", {"chunk": 64}, "SANATAN tiles")
  with pytest.raises(ValueError, match="SANATAN tiles.forward: KernelTiles has no field 'warps'"):
    REGISTRY.tiles("pallas_fused", {"forward": {"warps": 4}}, "SANATAN tiles")
  with pytest.raises(ValueError, match="chunk must be a power of two, got 24"):
    REGISTRY.tiles("pallas_fused", {"dq": {"chunk": 24}}, "SANATAN tiles")
  with pytest.raises(ValueError, match="channels per program must divide 6"):
    pallas_triton_fused.KernelTiles(channels=4)
  with pytest.raises(ValueError, match="spans must be a power of two, got 3"):
    pallas_triton_fused.FusedTiles(spans=3)
  with pytest.raises(ValueError, match="loop must be a power of two, got 24"):
    pallas_triton_flash.BlockTiles(16, 24)
  with pytest.raises(ValueError, match="rows must be a positive number of query rows"):
    xla.ParallelTiles(0)
  q, k, v, omega, lam_raw = inputs(52, 9)
  with pytest.raises(ValueError, match=r"tiles ChunkTiles\(chunk=16\) do not fit Parallel, which takes a "
                                       r"ParallelTiles"):
    sanatan_attention(q, k, v, omega, lam_raw, implementation="parallel", tiles=ChunkTiles(16))
