"""The Mosaic TPU gated linear attention kernels (pallas_tpu.py) compute the op's function: outputs,
final state and gradients (q, k, v, log forget gate, initial S and z) equal the token-by-token
reference for scalar, per-key-channel and no gates, normalised or not, partial chunks, several value
tiles and packed documents; forward and backward pass the Pallas TPU (Mosaic) lowering.

The kernels run interpreted on CPU: ``interpret=True`` is Pallas' generic interpreter (a scan over
the grid in order, scratch NaN-filled); one case runs the TPU simulator (``pltpu.InterpretParams``).
Tolerance: relative L2 error 1e-5 at fp32 (the forms differ only in summation order; observed
below 5e-7).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from lmcore.kernels import LinearAttentionState, gated_linear_attention, pallas_utils
from lmcore.kernels.gated_linear_attention import pallas_tpu
from lmcore.numerics import relative_l2

CHUNK = 16
RTOL = 1e-5
# These tests check the math, not code generation: skip LLVM's expensive passes on a shared CPU.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _inputs(seed, T, gate, normalize, *, with_state, B=2, H=2, K=8, V=5):
  """(q, k, v, log_forget, state), segment ids (row 1: a second document from T // 3, mid-chunk)
  and random projections of o, S, z.

  Log gates in [-0.3, -0.01]: weak enough that what a chunk hands on still matters chunks later.
  """
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, k, v = arr(B, T, H, K), arr(B, T, H, K), arr(B, T, H, V)
  if normalize:
    q, k = jnp.exp(0.5 * q), jnp.exp(0.5 * k)
  gate_shape = {"head": (B, T, H), "channel": (B, T, H, K)}.get(gate)
  log_forget = None
  if gate is not None:
    log_forget = jnp.asarray(-rng.uniform(0.01, 0.3, gate_shape), jnp.float32)
  z = jnp.asarray(rng.uniform(0.5, 2.0, (B, H, K)) if normalize else np.zeros((B, H, K)), jnp.float32)
  state = LinearAttentionState(arr(B, H, K, V), z) if with_state else None
  segment_ids = np.zeros((B, T), np.int32)
  segment_ids[1, T // 3:] = 1
  projections = (arr(B, T, H, V), arr(B, H, K, V), arr(B, H, K))
  return (q, k, v, log_forget, state), jnp.asarray(segment_ids), projections


def _run(fn, inputs, projections, **options):
  """Outputs, final state and gradients of a random projection of both w.r.t. every input."""
  q, k, v, log_forget, state = inputs
  B, T, H, K = q.shape
  state = state or LinearAttentionState.zeros(B, H, K, v.shape[-1])
  gate = jnp.zeros((B, T, H)) if log_forget is None else log_forget

  def loss(q, k, v, gate, state):
    o, new = fn(q, k, v, None if log_forget is None else gate, state=state, chunk_size=CHUNK,
                **options)
    do, dS, dz = projections
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
  (_, (o, new)), grads = jax.jit(grad, compiler_options=_FAST_COMPILE)(q, k, v, gate, state)
  return {"o": o, "S": new.S, "z": new.z, "dq": grads[0], "dk": grads[1], "dv": grads[2],
          "dlog_forget": grads[3], "dS0": grads[4].S, "dz0": grads[4].z}


def _assert_same_as_reference(seed, T, gate, normalize, with_state, scale=1.0, **tuning):
  inputs, segment_ids, projections = _inputs(seed, T, gate, normalize, with_state=with_state)
  options = dict(normalize=normalize, segment_ids=segment_ids, scale=scale)
  got = _run(functools.partial(pallas_tpu.gated_linear_attention_tpu, **tuning), inputs,
             projections, **options)
  want = _run(functools.partial(gated_linear_attention, implementation="reference"), inputs,
              projections, **options)
  errors = {name: relative_l2(got[name], want[name]) for name in want}
  bad = {name: e for name, e in errors.items() if e > RTOL}
  assert not bad, f"T={T} gate={gate} normalize={normalize} {tuning}: errors above {RTOL}: {bad}"


@pytest.mark.parametrize("T,gate,normalize,with_state,scale,tuning", [
    (37, "head", False, True, 1.0, {}),  # CyFA's forget="head"
    (37, "channel", False, True, 8**-0.5, {"sub_chunk": 8}),  # GLA; keys before the sub-chunk
    (40, "channel", True, False, 1.0, {"block_v": 4}),  # V = 5 + ones column -> two value tiles
])
def test_tpu_kernels_equal_reference_with_gradients_for_partial_chunks_and_documents(
    T, gate, normalize, with_state, scale, tuning):
  _assert_same_as_reference(T, T, gate, normalize, with_state, scale, interpret=True, **tuning)


def test_tpu_simulator_runs_the_kernels_like_the_reference():
  """TPU interpret mode: VMEM scratch and HBM simulated, uninitialised buffers NaN, reads out of
  bounds raise. No gate, normalised, two chunks."""
  _assert_same_as_reference(20, 20, None, True, True, interpret=pltpu.InterpretParams())


def _abstract_inputs(gate_shape, B=1, T=200, H=2, K=24, V=40):
  """bf16 q, k, v with head dims that need padding, a partial chunk, fp32 gate, segment ids."""
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  gate = jax.ShapeDtypeStruct((B, T, H) if gate_shape == "head" else (B, T, H, K), jnp.float32)
  return (bf16(B, T, H, K), bf16(B, T, H, K), bf16(B, T, H, V), gate,
          jax.ShapeDtypeStruct((B, T), jnp.int32))


def _loss(implementation, **options):
  def loss(q, k, v, log_forget, segment_ids):
    o, new = gated_linear_attention(q, k, v, log_forget, implementation=implementation,
                                    segment_ids=segment_ids, **options)
    return o.astype(jnp.float32).sum() + new.S.sum()
  return loss


@pytest.mark.parametrize("gate_shape", ["head", "channel"])
def test_pallas_implementation_lowers_to_mosaic_for_a_tpu_with_bfloat16_inputs(gate_shape):
  """On a TPU, implementation='pallas' picks these kernels, and the forward, dq and dk/dv kernels
  pass the Pallas TPU lowering ((8, 128) block shapes, supported primitives) for an abstract TPU.
  Mosaic's layout passes and compilation run in libtpu and are not checked here."""
  grad = jax.grad(_loss("pallas", chunk_size=64), argnums=(0, 1, 2, 3))
  lowered = pallas_utils.lower_for_tpu(grad, *_abstract_inputs(gate_shape))
  assert lowered.as_text().count("tpu_custom_call") == 3


def test_default_implementation_on_tpu_is_still_xla():
  lowered = pallas_utils.lower_for_tpu(_loss(None), *_abstract_inputs("head"))
  assert lowered.as_text().count("tpu_custom_call") == 0


def test_compiling_off_tpu_and_bad_block_sizes_raise_clear_errors():
  (q, k, v, log_forget, _), _, _ = _inputs(3, 9, "head", False, with_state=False)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    pallas_tpu.gated_linear_attention_tpu(q, k, v, log_forget, interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    pallas_tpu.gated_linear_attention_tpu(q, k, v, log_forget, chunk_size=24, interpret=True)
  compiled = functools.partial(pallas_tpu.gated_linear_attention_tpu, interpret=False, block_v=64)
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_utils.lower_for_tpu(compiled, q, k, v, log_forget)
