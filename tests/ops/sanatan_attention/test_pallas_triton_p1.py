"""The SANATAN p = 1 Pallas kernels compute sanatan_attention's function (MATH §1.2): outputs,
final state and gradients (q, k, v, omega, lam_raw, initial S and z) equal the recurrent form, for
partial chunks, padded head dims, value tiles, packed documents and the no-rotation ablation.

The kernels run in interpret mode on CPU. Tolerance: relative L2 error 1e-5 at fp32 (kernel and
reference differ only in summation order; observed about 1e-6 here and on the H200 compiled
kernels).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CHUNK, FAST_COMPILE, RTOL, assert_close, normals, packed_documents,
                          run_sanatan, sanatan_abstract_inputs, sanatan_inputs)
from lmcore.ops.common import pallas_utils
from lmcore.numerics import relative_l2
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.ops.sanatan_attention.pallas_triton_p1 import sanatan_p1_pallas

from .test_base import SanatanAttentionTestBase

_recurrent = functools.partial(sanatan_attention, implementation="recurrent")


class TestPallasTriton(SanatanAttentionTestBase):
  """The shared checks through ``implementation="pallas"`` (interpreted here): the p = 1 kernels of
  this file, and at a power the blocked kernels (test_pallas_triton_blocked.py)."""

  implementation = "pallas"
  future_power = (2, 4, "clean")
  packed_power = 4


def _prefix_state(seed, **shape):
  """A reachable state: the one a random 5-token prefix leaves (positions continue from 5)."""
  return jax.jit(_recurrent, compiler_options=FAST_COMPILE)(*sanatan_inputs(seed, 5, **shape))[1]


def _run(fn, inputs, state, **options):
  """``run_sanatan`` with random projections drawn from seed 99."""
  B, T, H, d = inputs[0].shape
  F, dv = 6 * d, inputs[2].shape[-1]
  projections = normals(np.random.default_rng(99), (B, T, H, dv), (B, H, F, dv), (B, H, F))
  return run_sanatan(fn, inputs, state, projections, **options)


def _reference(seed, T, with_state, d, segments=False, rotate=True):
  """The recurrent form's ``_run`` on the inputs of a case."""
  inputs, state, options = _case(seed, T, with_state, d, segments, rotate)
  return _run(_recurrent, inputs, state, **options)


@functools.cache
def _case(seed, T, with_state, d, segments=False, rotate=True):
  """(inputs, state, options) of a case (cached: the kernel and the reference share them).
  ``segments``: row 1 packs four documents (boundaries mid-chunk at 12 and 20 and at the chunk
  start 32, positions restarting); row 0 is one document continuing the state's positions."""
  inputs = sanatan_inputs(seed, T, d=d)
  state = _prefix_state(100 + seed, d=d) if with_state else None
  if not segments:
    return inputs, state, dict(rotate=rotate)
  return inputs, state, dict(packed_documents(2, T, (12, 20, 32)), rotate=rotate)


@pytest.mark.parametrize("T,with_state,d,tuning", [
    (16, False, 8, {}),
    (37, True, 6, {"block_v": 4}),  # head dim padded 6 -> 8; dv = 5 padded to two value tiles
    (64, True, 8, {"scan": "xla"}),  # phase 2 by XLA's associative scan
])
def test_pallas_equals_recurrent_with_gradients_for_partial_chunks(T, with_state, d, tuning):
  inputs, state, options = _case(T, T, with_state, d)
  kernel = functools.partial(sanatan_p1_pallas, chunk_size=CHUNK, **tuning)
  got = _run(kernel, inputs, state, **options)
  what = f"T={T} state={with_state} d={d} {tuning}"
  assert_close(got, _reference(T, T, with_state, d), what)


@pytest.mark.parametrize("rotate", [True, False])
def test_pallas_honours_segment_ids_explicit_positions_and_no_rotation(rotate):
  inputs, state, options = _case(7, 37, True, 8, segments=True, rotate=rotate)
  kernel = functools.partial(sanatan_p1_pallas, chunk_size=CHUNK)
  got = _run(kernel, inputs, state, **options)
  assert_close(got, _reference(7, 37, True, 8, segments=True, rotate=rotate),
               f"segments, rotate={rotate}")


def test_pallas_two_pieces_with_state_equal_whole():
  q, k, v, omega, lam_raw = sanatan_inputs(21, 37)
  call = jax.jit(functools.partial(sanatan_p1_pallas, chunk_size=CHUNK),
                 compiler_options=FAST_COMPILE)
  o, whole = call(q, k, v, omega, lam_raw)
  first, second = slice(0, 21), slice(21, None)  # both pieces end in a partial chunk
  o1, mid = call(q[:, first], k[:, first], v[:, first], omega, lam_raw)
  o2, end = call(q[:, second], k[:, second], v[:, second], omega, lam_raw, state=mid)
  assert relative_l2(jnp.concatenate([o1, o2], axis=1), o) < RTOL
  assert relative_l2(end.S, whole.S) < RTOL and relative_l2(end.z, whole.z) < RTOL
  np.testing.assert_array_equal(end.position, whole.position)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_kernels_lower_to_triton_for_an_h200_with_bfloat16_inputs():
  """Forward and backward kernels pass the Pallas Triton lowering (power-of-two blocks, supported
  primitives, the in-kernel feature map and its VJP, the 4-D grid) for an abstract H200, with
  padded dims and the default chunk: writes, the state scan and outputs forward; writes, read
  gradients, two state scans, dq and dk/dv backward."""
  def loss(q, k, v, omega, lam_raw):
    o, new = sanatan_p1_pallas(q, k, v, omega, lam_raw, interpret=False)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
                                       *sanatan_abstract_inputs(T=40)[:5])
  assert lowered.as_text().count("xla.gpu.triton") == 9


def test_bad_options_raise_clear_errors():
  q, k, v, omega, lam_raw = sanatan_inputs(3, 9)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    sanatan_p1_pallas(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    sanatan_p1_pallas(q, k, v, omega, lam_raw, chunk_size=24)
  wrong = SanatanState(jnp.zeros((2, 2, 48, 4)), jnp.zeros((2, 2, 48)), jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"state.S has shape"):
    sanatan_p1_pallas(q, k, v, omega, lam_raw, state=wrong)


def test_op_and_mixer_dispatch_to_the_kernel():
  """``implementation="pallas"`` in the op (and so in the mixer config) runs the kernel; ``None``
  (like "auto") picks the measured fastest for the backend, XLA chunked on this CPU host."""
  q, k, v, omega, lam_raw = sanatan_inputs(7, 21)
  op = lambda implementation: jax.jit(functools.partial(sanatan_attention,
                                                        implementation=implementation),
                                      compiler_options=FAST_COMPILE)
  o_kernel, state_kernel = op("pallas")(q, k, v, omega, lam_raw)
  o_ref, state_ref = op("recurrent")(q, k, v, omega, lam_raw)
  assert relative_l2(o_kernel, o_ref) <= RTOL and relative_l2(state_kernel.S, state_ref.S) <= RTOL
  o_auto, _ = op(None)(q, k, v, omega, lam_raw)
  assert pallas_utils.default_implementation() == "chunked" and relative_l2(o_auto, o_ref) <= RTOL
