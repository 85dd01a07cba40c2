"""The blocked SANATAN Pallas kernels compute sanatan_attention's function (MATH §1.1 step 6) for
every power and channel variant: outputs and gradients (q, k, v, omega, lam_raw) equal the
materialised ``parallel`` form, for partial blocks, query blocks longer and shorter than key blocks,
padded head and value dims, packed documents, explicit positions and the no-rotation ablation.

The kernels run in interpret mode on CPU. Tolerance: relative L2 error 1e-5 at fp32 (the forms
differ only in summation order; observed below 1e-6 here).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (FAST_COMPILE, assert_close, clipped_scores, packed_documents,
                          run_blocked, sanatan_abstract_inputs, sanatan_inputs)
from lmcore.ops.common import pallas_utils
from sanatan_jax import sanatan_attention
from sanatan_jax.ops.sanatan_attention.pallas_triton_blocked import sanatan_blocked_pallas


def _parallel(*args, **options):
  return sanatan_attention(*args, implementation="parallel", **options)[0]


@pytest.mark.parametrize("p,channels,three_channel,T,d,blocks", [
    (2, 6, "clean", 37, 8, (16, 8)),  # partial last block; query blocks longer than key blocks
    (4, 6, "clean", 16, 8, (8, 16)),  # key blocks longer than query blocks
    (2, 4, "clean", 29, 4, (8, 8)),  # d = 4: some total scores are negative and clipped at 0
    (1, 4, "clean", 21, 6, (8, 8)),  # head dim padded 6 -> 8
    (3, 3, "legacy", 23, 8, (8, 16)),  # any positive integer power
    (2, 3, "clean", 23, 8, (16, 8)),
])
def test_blocked_kernel_equals_parallel_with_gradients(p, channels, three_channel, T, d, blocks):
  inputs = sanatan_inputs(10 * p + channels + T, T, d=d)
  options = dict(p=p, channels=channels, three_channel=three_channel)
  block_q, block_k = blocks
  got = run_blocked(functools.partial(sanatan_blocked_pallas, block_q=block_q, block_k=block_k),
                    inputs, **options)
  want = run_blocked(_parallel, inputs, **options)
  assert_close(got, want, f"p={p} {channels}ch {three_channel} T={T} d={d} blocks={blocks}")


def test_four_channel_inputs_above_reach_the_clip():
  """The d = 4 inputs of the 4-channel p = 2 case have negative total scores (clipped to 0 before
  the power), so that case tests the clip and its gradient."""
  T = 29
  assert clipped_scores(10 * 2 + 4 + T, T) >= 10


def test_blocked_kernel_honours_segment_ids_explicit_positions_and_no_rotation():
  """Row 1 packs two documents (boundary mid-block, positions restarting); row 0 is one document."""
  T = 37
  inputs = sanatan_inputs(7, T)
  for rotate in (True, False):
    options = dict(p=2, **packed_documents(2, T, (12,)), rotate=rotate)
    got = run_blocked(functools.partial(sanatan_blocked_pallas, block_q=8, block_k=8), inputs,
                      **options)
    want = run_blocked(_parallel, inputs, **options)
    assert_close(got, want, f"segments, rotate={rotate}")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("p,channels,three_channel", [(2, 6, "clean"), (4, 4, "clean"),
                                                      (1, 3, "legacy")])
def test_kernels_lower_to_triton_for_an_h200_with_bfloat16_inputs(p, channels, three_channel):
  """Forward, dq and dk/dv kernels pass the Pallas Triton lowering (power-of-two blocks, traced
  loop bounds, the in-kernel feature map and its VJP) for an abstract H200, with padded dims."""
  def loss(q, k, v, omega, lam_raw):
    o = sanatan_blocked_pallas(q, k, v, omega, lam_raw, p=p, channels=channels,
                               three_channel=three_channel, interpret=False)
    return o.astype(jnp.float32).sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
                                       *sanatan_abstract_inputs(T=40)[:5])
  assert lowered.as_text().count("xla.gpu.triton") == 3  # forward, dq, dk/dv


def test_op_dispatches_every_variant_but_p1_six_channels_to_the_blocked_kernel():
  """``implementation="pallas"`` runs the blocked kernel, without a state, wherever the p = 1
  kernel does not apply (p = 1 with 6 channels: test_pallas_triton_p1.py)."""
  inputs = sanatan_inputs(5, 13)
  for options in (dict(p=2), dict(p=1, channels=4)):
    op = functools.partial(sanatan_attention, implementation="pallas", **options)
    o, state = jax.jit(op, compiler_options=FAST_COMPILE)(*inputs)
    kernel = functools.partial(sanatan_blocked_pallas, **options)
    assert state is None
    np.testing.assert_array_equal(o, jax.jit(kernel, compiler_options=FAST_COMPILE)(*inputs))


def test_bad_options_raise_clear_errors():
  q, k, v, omega, lam_raw = sanatan_inputs(3, 9)
  with pytest.raises(NotImplementedError, match="implementation='blocked'"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="block_k must be a power of two"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, block_k=24)
  with pytest.raises(ValueError, match="p must be a positive integer"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, p=0)
  with pytest.raises(ValueError, match="channels must be one of"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, channels=5)
  state = sanatan_attention(q, k, v, omega, lam_raw, implementation="recurrent")[1]
  with pytest.raises(ValueError, match="no constant-size state"):
    sanatan_attention(q, k, v, omega, lam_raw, p=2, implementation="pallas", state=state)
