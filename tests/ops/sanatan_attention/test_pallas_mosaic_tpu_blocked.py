"""The Mosaic TPU blocked SANATAN kernels (pallas_mosaic_tpu_blocked.py) compute sanatan_attention's
function (MATH §1.1 step 6): outputs and gradients (q, k, v, omega, lam_raw) equal the materialised
``parallel`` form for every channel variant and several powers, partial blocks, query blocks longer
and shorter than key blocks, packed documents with restarting positions and the no-rotation
ablation; forward and backward pass the Pallas TPU (Mosaic) lowering, and on a TPU
``implementation="pallas"`` picks them.

The kernels run interpreted on CPU: ``interpret=True`` is Pallas' generic interpreter (a scan over
the grid in order, scratch NaN-filled); one case runs the TPU simulator (``pltpu.InterpretParams``:
VMEM and HBM simulated, uninitialised buffers NaN, out-of-bounds reads raise). Tolerance: relative
L2 error 1e-5 at fp32 (the forms differ only in summation order; observed below 5e-7).
"""

import functools

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


@pytest.mark.parametrize("p,channels,three_channel,T,d,blocks,documents,rotate", [
    (2, 6, "clean", 37, 8, (16, 8), True, True),  # partial last block; BQ > BK; two documents
    (3, 4, "clean", 29, 4, (8, 16), False, True),  # BK > BQ; total scores clipped at 0 (below)
    (1, 3, "legacy", 23, 8, (8, 8), True, False),  # p = 1 runs too; no rotation
])
def test_tpu_kernels_equal_parallel_with_gradients(p, channels, three_channel, T, d, blocks,
                                                   documents, rotate):
  inputs = sanatan_inputs(10 * p + channels + T, T, d=d)
  options = dict(p=p, channels=channels, three_channel=three_channel, rotate=rotate)
  if documents:
    options.update(packed_documents(2, T, (12,)))  # the boundary sits inside a block
  _assert_same_as_parallel(inputs, f"p={p} {channels}ch {three_channel} T={T} blocks={blocks}",
                           block_q=blocks[0], block_k=blocks[1], **options)


def test_four_channel_inputs_above_reach_the_clip():
  """The 4-channel case above has negative total scores (clipped to 0 before the power), so it
  tests the clip and its gradient."""
  T = 29
  assert clipped_scores(10 * 3 + 4 + T, T) >= 10


def test_tpu_simulator_runs_the_kernels_like_the_parallel_form():
  """The TPU simulator: two query blocks of 16 and four key blocks of 8 (two of them after the
  first query block: skipped, their copies clamped), two documents."""
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
  """On a TPU, implementation='pallas' picks these kernels, and the forward, dq and dk/dv kernels
  pass the Pallas TPU lowering ((8, 128) block shapes, supported primitives, the in-kernel feature
  map and its VJP) for an abstract TPU. Mosaic's layout passes and compilation run in libtpu and
  are not checked here."""
  grad = _grad("pallas", p=p, channels=channels, three_channel=three_channel)
  lowered = pallas_utils.lower_for_tpu(grad, *sanatan_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 3


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
