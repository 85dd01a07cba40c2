"""The SANATAN p = 1 Pallas kernels compute sanatan_attention's function (SPEC §1.2): outputs,
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

from lmcore.kernels import pallas_utils
from lmcore.numerics import relative_l2
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.kernels import sanatan_p1_pallas

CHUNK = 16
RTOL = 1e-5
# These tests check the math, not code generation: skip LLVM's expensive passes on a shared CPU.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_recurrent = functools.partial(sanatan_attention, implementation="recurrent")


def _inputs(seed, T, *, B=2, H=2, d=8, dv=5):
  """q, k, v, omega, lam_raw with |u| spread across both edges of the root saturation band."""
  rng = np.random.default_rng(seed)
  spread = lambda *s: rng.normal(size=s) * np.exp(rng.uniform(np.log(0.01), np.log(50.0), size=s))
  arrays = (spread(B, T, H, d), spread(B, T, H, d), rng.normal(size=(B, T, H, dv)),
            np.pi / 4 + 0.3 * rng.normal(size=(H, d)), 2.0 * rng.normal(size=(H, d)))
  return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def _prefix_state(seed, **shape):
  """A reachable state: the one a random 5-token prefix leaves (positions continue from 5)."""
  return jax.jit(_recurrent, compiler_options=_FAST_COMPILE)(*_inputs(seed, 5, **shape))[1]


def _run(fn, inputs, state, seed=99, **options):
  """Outputs, final state and gradients of a random projection of both w.r.t. every input."""
  q, k, v, omega, lam_raw = inputs
  B, T, H, d = q.shape
  F, dv = 6 * d, v.shape[-1]
  rng = np.random.default_rng(seed)
  do, dS, dz = (jnp.asarray(rng.normal(size=s), jnp.float32)
                for s in ((B, T, H, dv), (B, H, F, dv), (B, H, F)))
  position = jnp.zeros((B,), jnp.int32) if state is None else state.position
  S0, z0 = (jnp.zeros((B, H, F, dv)), jnp.zeros((B, H, F))) if state is None else state[:2]

  def loss(q, k, v, omega, lam_raw, S0, z0):
    o, new = fn(q, k, v, omega, lam_raw, state=SanatanState(S0, z0, position), **options)
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  grad = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)
  (_, (o, new)), grads = jax.jit(grad, compiler_options=_FAST_COMPILE)(*inputs, S0, z0)
  names = ("dq", "dk", "dv", "domega", "dlam_raw", "dS0", "dz0")
  return {"o": o, "S": new.S, "z": new.z, "position": new.position, **dict(zip(names, grads))}


def _reference(seed, T, with_state, d, segments=False, rotate=True):
  """The recurrent form's ``_run`` on the inputs of a case."""
  inputs, state, options = _case(seed, T, with_state, d, segments, rotate)
  return _run(_recurrent, inputs, state, **options)


@functools.cache
def _case(seed, T, with_state, d, segments=False, rotate=True):
  """(inputs, state, options) of a case (cached: the kernel and the reference share them).
  ``segments``: row 1 packs four documents (boundaries mid-chunk at 12 and 20 and at the chunk
  start 32, positions restarting); row 0 is one document continuing the state's positions."""
  inputs = _inputs(seed, T, d=d)
  state = _prefix_state(100 + seed, d=d) if with_state else None
  if not segments:
    return inputs, state, dict(rotate=rotate)
  segment_ids = np.zeros((2, T), np.int32)
  positions = np.tile(np.arange(T, dtype=np.int32), (2, 1)) + 5
  for start in (12, 20, 32):
    segment_ids[1, start:] += 1
    positions[1, start:] = np.arange(T - start)
  return inputs, state, dict(segment_ids=jnp.asarray(segment_ids),
                             positions=jnp.asarray(positions), rotate=rotate)


def _assert_same(got, want, what):
  np.testing.assert_array_equal(got["position"], want["position"])
  errors = {name: relative_l2(got[name], want[name]) for name in want if name != "position"}
  bad = {name: e for name, e in errors.items() if e > RTOL}
  assert not bad, f"{what}: relative L2 errors above {RTOL}: {bad}"


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
  _assert_same(got, _reference(T, T, with_state, d), what)


@pytest.mark.parametrize("rotate", [True, False])
def test_pallas_honours_segment_ids_explicit_positions_and_no_rotation(rotate):
  inputs, state, options = _case(7, 37, True, 8, segments=True, rotate=rotate)
  kernel = functools.partial(sanatan_p1_pallas, chunk_size=CHUNK)
  got = _run(kernel, inputs, state, **options)
  _assert_same(got, _reference(7, 37, True, 8, segments=True, rotate=rotate),
               f"segments, rotate={rotate}")


def test_pallas_two_pieces_with_state_equal_whole():
  q, k, v, omega, lam_raw = _inputs(21, 37)
  call = jax.jit(functools.partial(sanatan_p1_pallas, chunk_size=CHUNK),
                 compiler_options=_FAST_COMPILE)
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
  gradients, two state scans and gradients backward."""
  B, T, H, d, dv = 1, 40, 2, 24, 40
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  param = jax.ShapeDtypeStruct((H, d), jnp.float32)

  def loss(q, k, v, omega, lam_raw):
    o, new = sanatan_p1_pallas(q, k, v, omega, lam_raw, interpret=False)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), bf16(B, T, H, d),
                                       bf16(B, T, H, d), bf16(B, T, H, dv), param, param)
  assert lowered.as_text().count("xla.gpu.triton") == 8


def test_bad_options_raise_clear_errors():
  q, k, v, omega, lam_raw = _inputs(3, 9)
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
  q, k, v, omega, lam_raw = _inputs(7, 21)
  op = lambda implementation: jax.jit(functools.partial(sanatan_attention,
                                                        implementation=implementation),
                                      compiler_options=_FAST_COMPILE)
  o_kernel, state_kernel = op("pallas")(q, k, v, omega, lam_raw)
  o_ref, state_ref = op("recurrent")(q, k, v, omega, lam_raw)
  assert relative_l2(o_kernel, o_ref) <= RTOL and relative_l2(state_kernel.S, state_ref.S) <= RTOL
  o_auto, _ = op(None)(q, k, v, omega, lam_raw)
  assert pallas_utils.default_implementation() == "chunked" and relative_l2(o_auto, o_ref) <= RTOL
