"""The Mosaic TPU SANATAN p = 1 kernels (pallas_p1_tpu.py) compute sanatan_attention's function
(SPEC §1.2): outputs, final state and gradients (q, k, v, omega, lam_raw, initial S and z) equal
the recurrent form for partial chunks, padded head dims, several value tiles, packed documents with
restarting positions, with and without an initial state and rotation; forward and backward pass
the Pallas TPU (Mosaic) lowering, and the op picks them on a TPU.

The kernels run in Pallas' generic interpreter on CPU (``interpret=True``: a scan over the grid in
order, scratch NaN-filled). Tolerance: relative L2 error 1e-5 at fp32 (the forms differ only in
summation order; observed about 2e-7).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.kernels import pallas_utils
from lmcore.numerics import relative_l2
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.kernels import pallas_p1_tpu

CHUNK = 16
RTOL = 1e-5
# These tests check the math, not code generation: skip LLVM's expensive passes on a shared CPU.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _inputs(seed, T, *, with_state, B=2, H=2, d=8, dv=5):
  """(q, k, v, omega, lam_raw), a state (or None), segment ids and positions, and random
  projections of o, S, z. |u| spreads across both edges of the root saturation band; row 1 packs
  a second document from token 12 (mid-chunk), whose positions restart at 0."""
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  spread = lambda *s: arr(*s) * np.exp(rng.uniform(np.log(0.01), np.log(50.0), size=s))
  inputs = (spread(B, T, H, d), spread(B, T, H, d), arr(B, T, H, dv),
            np.pi / 4 + 0.3 * arr(H, d), 2.0 * arr(H, d))
  F = 6 * d
  state = None
  if with_state:
    # Reachable magnitudes: S ~ sum Phi(k) v over a few tokens, z of it positive.
    state = SanatanState(3.0 * arr(B, H, F, dv), jnp.asarray(rng.uniform(1, 5, (B, H, F)),
                                                              jnp.float32),
                         jnp.full((B,), 5, jnp.int32))
  segment_ids = np.zeros((B, T), np.int32)
  segment_ids[1, 12:] = 1
  positions = np.tile(np.arange(T, dtype=np.int32), (B, 1)) + (5 if with_state else 0)
  positions[1, 12:] = np.arange(T - 12)
  documents = dict(segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions))
  projections = (arr(B, T, H, dv), arr(B, H, F, dv), arr(B, H, F))
  return inputs, state, documents, projections


def _run(fn, inputs, state, projections, **options):
  """Outputs, final state and gradients of a random projection of both w.r.t. every input."""
  q, k, v, omega, lam_raw = inputs
  B, T, H, d = q.shape
  F, dv = 6 * d, v.shape[-1]
  position = jnp.zeros((B,), jnp.int32) if state is None else state.position
  S0, z0 = (jnp.zeros((B, H, F, dv)), jnp.zeros((B, H, F))) if state is None else state[:2]

  def loss(q, k, v, omega, lam_raw, S0, z0):
    o, new = fn(q, k, v, omega, lam_raw, state=SanatanState(S0, z0, position), **options)
    do, dS, dz = projections
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  grad = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)
  (_, (o, new)), grads = jax.jit(grad, compiler_options=_FAST_COMPILE)(*inputs, S0, z0)
  names = ("dq", "dk", "dv", "domega", "dlam_raw", "dS0", "dz0")
  return {"o": o, "S": new.S, "z": new.z, "position": new.position, **dict(zip(names, grads))}


@pytest.mark.parametrize("T,with_state,d,documents,rotate,tuning", [
    # Head dim 6 (lanes 2d = 12 of 128); dv = 5 plus the normaliser column in two value tiles.
    (37, True, 6, True, True, {"block_v": 4}),
    (37, False, 8, False, False, {}),  # the "no lambda" ablation, no state, one value tile
])
def test_tpu_kernels_equal_recurrent_with_gradients_for_partial_chunks_and_documents(
    T, with_state, d, documents, rotate, tuning):
  inputs, state, docs, projections = _inputs(T, T, with_state=with_state, d=d)
  options = dict(rotate=rotate, **(docs if documents else {}))
  kernel = functools.partial(pallas_p1_tpu.sanatan_p1_tpu, chunk_size=CHUNK, interpret=True,
                             **tuning)
  got = _run(kernel, inputs, state, projections, **options)
  want = _run(functools.partial(sanatan_attention, implementation="recurrent"), inputs, state,
              projections, **options)
  np.testing.assert_array_equal(got["position"], want["position"])
  errors = {name: relative_l2(got[name], want[name]) for name in want if name != "position"}
  bad = {name: e for name, e in errors.items() if e > RTOL}
  what = f"T={T} state={with_state} d={d} documents={documents} rotate={rotate} {tuning}"
  assert not bad, f"{what}: relative L2 errors above {RTOL}: {bad}"


def _abstract_inputs(B=1, T=200, H=2, d=24, dv=40):
  """bf16 q, k, v with head dims that need padding and a partial chunk; fp32 omega, lam_raw;
  segment ids."""
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  param = jax.ShapeDtypeStruct((H, d), jnp.float32)
  return (bf16(B, T, H, d), bf16(B, T, H, d), bf16(B, T, H, dv), param, param,
          jax.ShapeDtypeStruct((B, T), jnp.int32))


def _loss(implementation):
  def loss(q, k, v, omega, lam_raw, segment_ids):
    o, new = sanatan_attention(q, k, v, omega, lam_raw, implementation=implementation,
                               segment_ids=segment_ids)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()
  return loss


def test_pallas_implementation_lowers_to_mosaic_for_a_tpu_with_bfloat16_inputs():
  """On a TPU, implementation='pallas' picks these kernels, and the forward, dq and dk/dv kernels
  (with the in-kernel feature map and its VJP) pass the Pallas TPU lowering ((8, 128) block
  shapes, supported primitives) for an abstract TPU. Mosaic's layout passes and compilation run
  in libtpu and are not checked here."""
  grad = jax.grad(_loss("pallas"), argnums=(0, 1, 2, 3, 4))
  lowered = pallas_utils.lower_for_tpu(grad, *_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 3


def test_default_implementation_on_tpu_is_still_xla():
  lowered = pallas_utils.lower_for_tpu(_loss(None), *_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 0


def test_compiling_off_tpu_bad_block_sizes_and_state_shapes_raise_clear_errors():
  (q, k, v, omega, lam_raw), _, _, _ = _inputs(3, 9, with_state=False)
  kernel = pallas_p1_tpu.sanatan_p1_tpu
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    kernel(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    kernel(q, k, v, omega, lam_raw, chunk_size=24, interpret=True)
  wrong = SanatanState(jnp.zeros((2, 2, 40, 5)), jnp.zeros((2, 2, 40)), jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="state.S has shape"):
    kernel(q, k, v, omega, lam_raw, state=wrong, interpret=True)
  compiled = functools.partial(kernel, interpret=False, block_v=64)
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_utils.lower_for_tpu(compiled, q, k, v, omega, lam_raw)
