"""The Mosaic TPU flash SANATAN kernels (pallas_mosaic_tpu_blocked.py) compute sanatan_attention's
function (MATH §1.1 step 6): outputs and gradients (q, k, v, omega, lam_raw) equal the materialised
``parallel`` form for every channel variant and several powers, partial blocks, odd and even block
counts (the folded causal grid), query blocks longer and shorter than key blocks, packed documents
with restarting positions (document block skipping in both kernel orders) and the no-rotation
ablation. Their cost estimates count only the causally visible block pairs and each token's features
once per pass; forward and backward pass the Pallas TPU (Mosaic) lowering and, with libtpu, compile
for a TPU v4; on a TPU ``implementation="pallas"`` picks them.

The kernels run interpreted on CPU: ``interpret=True`` is Pallas' generic interpreter (a scan over
the grid in order, scratch NaN-filled); one case runs the TPU simulator (``pltpu.InterpretParams``:
VMEM and HBM simulated, uninitialised buffers NaN, out-of-bounds reads raise). Tolerance: relative
L2 error 1e-5 at fp32 (the forms differ only in summation order; observed below 5e-7).
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_cases import (assert_close, clipped_scores, packed_documents, run_blocked,
                          sanatan_abstract_inputs, sanatan_inputs)
from lmcore.ops.common import pallas_utils
from sanatan_jax import sanatan_attention
from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_blocked as pallas_blocked_tpu


def _assert_same_as_parallel(inputs, what, interpret=True, block_q=8, block_k=8, **options):
  kernel = functools.partial(pallas_blocked_tpu.sanatan_blocked_tpu, interpret=interpret,
                             block_q=block_q, block_k=block_k)
  got = run_blocked(kernel, inputs, **options)
  want = run_blocked(lambda *a, **o: sanatan_attention(*a, implementation="parallel", **o)[0],
                     inputs, **options)
  assert_close(got, want, what)


@pytest.mark.parametrize("p,channels,three_channel,T,d,blocks,starts,rotate", [
    # Partial last block; BQ > BK; 3 query blocks (odd: the middle row of the folded grid idles);
    # the document starting at 12 skips key block 0 for query blocks 1, 2 and vice versa.
    (2, 6, "clean", 37, 8, (16, 8), (12,), True),
    (3, 4, "clean", 29, 4, (8, 16), (), True),  # BK > BQ; total scores clipped at 0 (below)
    (1, 3, "legacy", 23, 8, (8, 8), (12,), False),  # p = 1 runs too; no rotation
    # Four documents over eight blocks: whole runs of block pairs skipped.
    (2, 6, "clean", 64, 4, (8, 8), (9, 30, 41), True),
])
def test_tpu_kernels_equal_parallel_with_gradients(p, channels, three_channel, T, d, blocks,
                                                   starts, rotate):
  inputs = sanatan_inputs(10 * p + channels + T, T, d=d)
  options = dict(p=p, channels=channels, three_channel=three_channel, rotate=rotate)
  if starts:
    options.update(packed_documents(2, T, starts))
  _assert_same_as_parallel(inputs, f"p={p} {channels}ch {three_channel} T={T} blocks={blocks}",
                           block_q=blocks[0], block_k=blocks[1], **options)


def test_four_channel_inputs_above_reach_the_clip():
  """The 4-channel case above has negative total scores (clipped to 0 before the power), so it
  tests the clip and its gradient."""
  T = 29
  assert clipped_scores(10 * 3 + 4 + T, T) >= 10


def test_tpu_simulator_runs_the_kernels_like_the_parallel_form():
  """The TPU simulator: two query blocks of 16 and four key blocks of 8 (the folded grids run only
  the 6 causally visible pairs), two documents (key block 0 skipped for query block 1, and the
  other way round, their copies clamped)."""
  T = 20
  _assert_same_as_parallel(sanatan_inputs(4, T, B=2, H=1), "TPU simulator",
                           interpret=pltpu.InterpretParams(), block_q=16, block_k=8, p=2,
                           **packed_documents(2, T, (9,)))


def _grad(implementation, **options):
  def loss(q, k, v, omega, lam_raw, segment_ids):
    o, _ = sanatan_attention(q, k, v, omega, lam_raw, segment_ids=segment_ids,
                             implementation=implementation, **options)
    return o.astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


@pytest.mark.parametrize("p,channels,three_channel", [(2, 6, "clean"), (4, 4, "clean"),
                                                      (1, 3, "legacy")])
def test_pallas_implementation_lowers_to_mosaic_for_a_tpu_with_bfloat16_inputs(
    p, channels, three_channel):
  """On a TPU, implementation='pallas' picks these kernels, and the feature kernel (Phi(k) in the
  forward, Phi(q) and Phi(k) in the backward), the forward, dq and dk/dv kernels pass the Pallas TPU
  lowering ((8, 128) block shapes, supported primitives, the in-kernel feature map and its VJP) for
  an abstract TPU (libtpu's compile: below)."""
  grad = _grad("pallas", p=p, channels=channels, three_channel=three_channel)
  lowered = pallas_utils.lower_for_tpu(grad, *sanatan_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 6


def _kernel(q, k, v, omega, lam_raw, segment_ids=None, **options):
  o = pallas_blocked_tpu.sanatan_blocked_tpu(q, k, v, omega, lam_raw, segment_ids=segment_ids,
                                             interpret=False, **options)
  return o.astype(jnp.float32).sum()


def test_cost_estimates_count_visible_block_pairs_and_features_once_per_pass():
  """T = 1000 in blocks of 256: 4 query and 4 key blocks, 10 causally visible pairs of 256 x 256
  (not 16), of which the 4 diagonal ones skip their wholly masked 128 x 128 quarter: 9 pairs' worth
  of [query, key] entries. Per entry, 2 FLOPs per lane of each dot: the forward's score (F = 5d = 320
  packed features) and value (dv = 64) dots, dq's score, dw and d Phi(q) dots, dk/dv's score, dw,
  dv and d Phi(k) dots; per token, the 0/1 matmul spreading u over the F lanes (2·d·F FLOPs) once
  per feature pass, and once more for a VJP (the forward: Phi(q); dq and dk/dv: Phi of their outer
  side, then its VJP; the feature kernel: Phi of one side)."""
  BH, Tp, d, F, V, pairs = 2, 1024, 64, 320, 64, 9
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  param = jax.ShapeDtypeStruct((2, d), jnp.float32)
  grad = jax.grad(functools.partial(_kernel, block_q=256, block_k=256), argnums=(0, 1, 2, 3, 4))
  text = pallas_utils.lower_for_tpu(grad, bf16(1, 1000, 2, d), bf16(1, 1000, 2, d),
                                    bf16(1, 1000, 2, V), param, param).as_text()
  flops = sorted(int(x) for x in re.findall(r"cost_estimate.{0,80}?flops\\22:(\d+)", text))
  pair = lambda per_entry: pairs * 256 * 256 * per_entry
  spread = 2 * Tp * d * F
  want = [spread] * 3 + [pair(2 * (F + V)) + spread, pair(2 * (2 * F + V)) + 3 * spread,
                         pair(2 * (2 * F + 2 * V)) + 3 * spread]
  assert flops == sorted(BH * x for x in want)


def test_default_blocks_shrink_with_the_head_to_fit_vmem():
  block = pallas_blocked_tpu.default_block
  assert block(64, 64, 6, jnp.bfloat16) == block(128, 512, 6, jnp.bfloat16) == 512
  assert block(128, 512, 6, jnp.float32) == block(256, 256, 6, jnp.bfloat16) == 256
  assert block(512, 512, 6, jnp.bfloat16) == 128


def test_kernels_compile_for_a_tpu_v4_with_libtpu():
  """libtpu compiles the forward and backward kernels for a TPU v4 (Mosaic's layout passes and
  VMEM allocation, stricter than interpreting or lowering): bf16, d = dv = 64 (F = 320 packed
  lanes), three blocks of 128 (an odd count: the folded grid's idle half row) and documents."""
  pytest.importorskip("libtpu", reason="compiling for a TPU needs libtpu: pip install -e '.[tpu]'")
  # libtpu takes a machine-wide lock when it loads; other JAX processes would make it fail.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.sharding import NamedSharding, PartitionSpec

  from lmcore.tpu_slices import tpu_devices

  mesh = jax.sharding.Mesh(tpu_devices("v4-8")[:1], ("x",))
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                   sharding=NamedSharding(mesh, PartitionSpec()))
  B, T, H, d = 1, 384, 2, 64
  args = [spec((B, T, H, d), jnp.bfloat16)] * 3 + [spec((H, d), jnp.float32)] * 2
  grad = jax.grad(functools.partial(_kernel, block_q=128, block_k=128), argnums=(0, 1, 2, 3, 4))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = jax.jit(grad).lower(*args, spec((B, T), jnp.int32))
  assert lowered.compile().as_text().count("tpu_custom_call") >= 6


def test_default_implementation_on_tpu_is_still_xla():
  lowered = pallas_utils.lower_for_tpu(_grad(None, p=2), *sanatan_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 0


def test_compiling_off_tpu_and_bad_options_raise_clear_errors():
  q, k, v, omega, lam_raw = sanatan_inputs(3, 9)
  kernel = pallas_blocked_tpu.sanatan_blocked_tpu
  with pytest.raises(NotImplementedError, match="implementation='blocked'"):
    kernel(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    kernel(q, k, v, omega, lam_raw, block_q=24, interpret=True)
  with pytest.raises(ValueError, match="p must be a positive integer"):
    kernel(q, k, v, omega, lam_raw, p=0, interpret=True)
  with pytest.raises(ValueError, match="channels must be one of"):
    kernel(q, k, v, omega, lam_raw, channels=5, interpret=True)
