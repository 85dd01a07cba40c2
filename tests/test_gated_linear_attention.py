"""The gated linear attention op: every implementation computes the same function (outputs, states,
gradients), for scalar and per-channel gates, normalised or not, odd lengths and partial chunks.

Tolerances: relative L2 error (FLA's rule), 1e-5 at fp32: the forms differ in summation order only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import gated_inputs, normal
from lmcore.ops.gated_linear_attention import LinearAttentionState
from lmcore.ops.gated_linear_attention import gated_linear_attention
from lmcore.ops.gated_linear_attention import api
from lmcore.ops.gated_linear_attention import reference
from lmcore.ops.gated_linear_attention import xla
from lmcore.numerics import relative_l2

CHUNK = 16
RTOL = 1e-5
_op = jax.jit(gated_linear_attention,
              static_argnames=("implementation", "chunk_size", "normalize", "eps", "scale"))


def _inputs(seed, T, gate, normalize, *, B=2, H=2, K=8, V=5, decay=(0.01, 2.0), with_state=True):
  """q, k, v, log_forget, state; positive q, k when normalised (as feature maps produce)."""
  rng = np.random.default_rng(seed)
  q, k, v, log_forget = gated_inputs(rng, T, gate, normalize, B=B, H=H, K=K, V=V, decay=decay)
  state = None
  if with_state:
    z = jnp.asarray(rng.uniform(0.5, 2.0, size=(B, H, K)) if normalize else np.zeros((B, H, K)),
                    jnp.float32)
    state = LinearAttentionState(normal(rng, B, H, K, V), z)
  return q, k, v, log_forget, state


@functools.lru_cache(maxsize=None)
def _loss_and_grad(implementation: str, normalize: bool, has_gate: bool):
  """jit(value_and_grad) of a random projection of outputs and final state."""

  def loss(q, k, v, log_forget, state, do, dS, dz):
    o, new = gated_linear_attention(q, k, v, log_forget if has_gate else None, state=state,
                                    implementation=implementation, chunk_size=CHUNK,
                                    normalize=normalize)
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def _run(implementation, q, k, v, log_forget, state, normalize, seed=99):
  """Outputs, final state and gradients w.r.t. q, k, v, log_forget and the initial state."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  rng = np.random.default_rng(seed)
  shapes = ((B, T, H, V), (B, H, K, V), (B, H, K))
  do, dS, dz = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes)
  if state is None:
    state = LinearAttentionState.zeros(B, H, K, V)
  gate = jnp.zeros((B, T, H)) if log_forget is None else log_forget
  (_, (o, new)), grads = _loss_and_grad(implementation, normalize, log_forget is not None)(
      q, k, v, gate, state, do, dS, dz)
  return o, new, grads


def _assert_same(got, want, what: str, rtol=RTOL, gate_rtol=RTOL):
  o, new, grads = got
  o_ref, new_ref, grads_ref = want
  errors = {"o": relative_l2(o, o_ref), "S": relative_l2(new.S, new_ref.S), "z": relative_l2(new.z, new_ref.z)}
  for name, g, g_ref in zip(("dq", "dk", "dv", "dlog_forget"), grads[:4], grads_ref[:4]):
    errors[name] = relative_l2(g, g_ref)
  errors["dS0"], errors["dz0"] = relative_l2(grads[4].S, grads_ref[4].S), relative_l2(grads[4].z, grads_ref[4].z)
  bad = {n: e for n, e in errors.items() if e > (gate_rtol if n == "dlog_forget" else rtol)}
  assert not bad, f"{what}: relative L2 errors above tolerance: {bad}"


def _numpy_recurrence(q, k, v, log_forget, state, normalize, eps=1e-6, scale=1.0):
  """Direct transcription of the SPEC recurrence with an explicit key sum z (float64)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, K = q.shape
  f = np.ones((B, T, H, K)) if log_forget is None else np.exp(np.asarray(log_forget, np.float64))
  f = f if f.ndim == 4 else np.repeat(f[..., None], K, axis=-1)
  S, z = np.array(state.S, np.float64), np.array(state.z, np.float64)
  o = np.zeros(v.shape)
  for t in range(T):
    S = f[:, t, :, :, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
    z = f[:, t] * z + k[:, t]
    o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    if normalize:
      o[:, t] /= scale * np.einsum("bhk,bhk->bh", q[:, t], z)[..., None] + eps
  return o, S, z


@pytest.mark.parametrize("gate,normalize", [("channel", False), ("head", True), (None, True)])
def test_reference_matches_numpy_transcription(gate, normalize):
  q, k, v, log_forget, state = _inputs(0, 7, gate, normalize)
  o, new = _op(q, k, v, log_forget, state=state, implementation="reference", normalize=normalize,
               scale=0.7)
  o_np, S_np, z_np = _numpy_recurrence(q, k, v, log_forget, state, normalize, scale=0.7)
  assert relative_l2(o, o_np) < RTOL and relative_l2(new.S, S_np) < RTOL
  if normalize:
    assert relative_l2(new.z, z_np) < RTOL
  else:
    assert not np.any(np.asarray(new.z))


@pytest.mark.parametrize("T,gate,normalize,with_state,implementations", [
    (1, "channel", False, True, ("chunked",)),
    (33, "head", False, False, ("chunked", "parallel")),
    (67, "channel", True, True, ("chunked", "parallel")),
])
def test_chunked_and_parallel_equal_reference_for_odd_lengths_with_gradients(
    T, gate, normalize, with_state, implementations):
  inputs = _inputs(T, T, gate, normalize, with_state=with_state)
  want = _run("reference", *inputs, normalize)
  for implementation in implementations:
    got = _run(implementation, *inputs, normalize)
    _assert_same(got, want, f"{implementation} T={T} gate={gate}")


@pytest.mark.parametrize("gate,decay,gate_rtol", [
    ("channel", (5.0, 20.0), 1e-3), ("head", (5.0, 20.0), 1e-3), ("channel", (1e-4, 2e-3), RTOL)])
def test_chunked_is_stable_and_exact_under_strong_and_weak_decay(gate, decay, gate_rtol):
  """Strong decay: within a chunk of 16 the log-decay sums reach about -200, where exp(+200) of a
  factored form would overflow fp32; the masked form stays finite and exact. The gradient w.r.t. the
  gate gets 1e-3: it is built from differences of fp32 cumulative sums of that magnitude, whose
  absolute error ≈ 200 · 2^-24 ≈ 1e-5 (the token-by-token scan never forms them)."""
  inputs = _inputs(11, 33, gate, False, decay=decay)
  got, want = _run("chunked", *inputs, False), _run("reference", *inputs, False)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
  _assert_same(got, want, f"decay {decay}", gate_rtol=gate_rtol)


def test_chunked_two_pieces_with_state_equal_whole():
  q, k, v, log_forget, state = _inputs(21, 40, "channel", True)
  call = functools.partial(_op, chunk_size=CHUNK, normalize=True)
  o, whole = call(q, k, v, log_forget, state=state)
  first, second = slice(0, 20), slice(20, None)  # both pieces end in a partial chunk
  o1, mid = call(q[:, first], k[:, first], v[:, first], log_forget[:, first], state=state)
  o2, end = call(q[:, second], k[:, second], v[:, second], log_forget[:, second], state=mid)
  assert relative_l2(jnp.concatenate([o1, o2], axis=1), o) < RTOL
  assert relative_l2(end.S, whole.S) < RTOL and relative_l2(end.z, whole.z) < RTOL


@pytest.mark.parametrize("implementation", ["reference", "parallel", "chunked"])
def test_segment_ids_reset_the_state_at_document_boundaries(implementation):
  """Packed rows equal each document run on its own (the first one continuing the given state)."""
  q, k, v, log_forget, state = _inputs(31, 37, "channel", True, B=1)
  bounds = [0, 5, 16, 17, 30, 37]  # mid-chunk, at a chunk start, a one-token document, last chunk
  segment_ids = jnp.asarray(np.repeat(np.arange(5), np.diff(bounds))[None], jnp.int32)
  o, new = _op(q, k, v, log_forget, state=state, implementation=implementation, chunk_size=CHUNK,
               normalize=True, segment_ids=segment_ids)
  pieces, piece_state = [], state
  for start, stop in zip(bounds[:-1], bounds[1:]):
    if start > 0:
      piece_state = LinearAttentionState.zeros(*state.S.shape)
    doc = slice(start, stop)
    o_doc, S_doc, z_doc = _numpy_recurrence(q[:, doc], k[:, doc], v[:, doc], log_forget[:, doc],
                                            piece_state, normalize=True)
    pieces.append(o_doc)
    piece_state = LinearAttentionState(S_doc, z_doc)
  assert relative_l2(o, np.concatenate(pieces, axis=1)) < RTOL
  assert relative_l2(new.S, piece_state.S) < RTOL and relative_l2(new.z, piece_state.z) < RTOL


def test_bfloat16_inputs_give_bfloat16_outputs_close_to_fp32_and_fp32_state():
  q, k, v, log_forget, state = _inputs(41, 33, "channel", True)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  o, new = _op(bf16(q), bf16(k), bf16(v), log_forget, state=state, chunk_size=CHUNK,
               normalize=True)
  o_ref, _ = _op(q, k, v, log_forget, state=state, implementation="reference", normalize=True)
  assert o.dtype == jnp.bfloat16 and new.S.dtype == jnp.float32 and new.z.dtype == jnp.float32
  assert relative_l2(o, o_ref) < 2e-2  # bf16 has an 8-bit mantissa (relative rounding 4e-3)


def test_none_implementation_means_chunked_and_unknown_names_list_valid_ones():
  assert api._backend(None, CHUNK).func is api._backend("chunked", CHUNK).func is xla.chunked
  assert api._backend("recurrent", CHUNK) is api._backend("reference", CHUNK) is reference.recurrent
  q, k, v, _, _ = _inputs(51, 9, None, False)
  with pytest.raises(ValueError, match="valid: reference, recurrent, chunked, xla, parallel"):
    gated_linear_attention(q, k, v, implementation="cuda_magic")


def test_invalid_shapes_and_chunk_sizes_raise_clear_errors():
  q, k, v, _, _ = _inputs(61, 9, None, False)
  with pytest.raises(ValueError, match=r"log_forget has shape \(2, 9, 3\)"):
    _op(q, k, v, jnp.zeros((2, 9, 3)))
  with pytest.raises(ValueError, match="power of two"):
    _op(q, k, v, chunk_size=24)
  with pytest.raises(ValueError, match="state.S"):
    _op(q, k, v, state=LinearAttentionState.zeros(2, 2, 8, 4))
