"""The shared checks of every gated linear attention implementation: outputs, states and gradients
equal a second form's, for scalar and per-channel gates, normalised or not, odd lengths and partial
chunks; packed documents equal each document run alone; two pieces with the state passed equal the
whole. Each backend's test file subclasses ``GatedLinearAttentionTestBase``.

Tolerances: relative L2 error (FLA's rule), 1e-5 at fp32: the forms differ in summation order only.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import gated_inputs, normal
from lmcore.numerics import relative_l2
from lmcore.ops.gated_linear_attention import REGISTRY, LinearAttentionState, gated_linear_attention

CHUNK = 16
RTOL = 1e-5


def gla_inputs(seed, T, gate, normalize, *, B=2, H=2, K=8, V=5, decay=(0.01, 2.0), with_state=True):
  """q, k, v, log_forget, state; positive q, k when normalised (as feature maps produce)."""
  rng = np.random.default_rng(seed)
  q, k, v, log_forget = gated_inputs(rng, T, gate, normalize, B=B, H=H, K=K, V=V, decay=decay)
  state = None
  if with_state:
    z = jnp.asarray(rng.uniform(0.5, 2.0, size=(B, H, K)) if normalize else np.zeros((B, H, K)),
                    jnp.float32)
    state = LinearAttentionState(normal(rng, B, H, K, V), z)
  return q, k, v, log_forget, state


def outputs_and_grads(op, q, k, v, log_forget, state, normalize, seed=99, compiler_options=None):
  """Outputs, final state and gradients w.r.t. q, k, v, log_forget and the initial state of a
  random projection of outputs and final state; ``op`` has ``gated_linear_attention``'s signature."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  rng = np.random.default_rng(seed)
  shapes = ((B, T, H, V), (B, H, K, V), (B, H, K))
  do, dS, dz = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes)
  if state is None:
    state = LinearAttentionState.zeros(B, H, K, V)
  has_gate = log_forget is not None
  gate = log_forget if has_gate else jnp.zeros((B, T, H))

  def loss(q, k, v, log_forget, state):
    o, new = op(q, k, v, log_forget if has_gate else None, state=state, normalize=normalize)
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True),
                 compiler_options=compiler_options)
  (_, (o, new)), grads = grad(q, k, v, gate, state)
  return o, new, grads


def assert_same(got, want, what: str, rtol=RTOL, gate_rtol=RTOL):
  o, new, grads = got
  o_ref, new_ref, grads_ref = want
  errors = {"o": relative_l2(o, o_ref), "S": relative_l2(new.S, new_ref.S),
            "z": relative_l2(new.z, new_ref.z)}
  for name, g, g_ref in zip(("dq", "dk", "dv", "dlog_forget"), grads[:4], grads_ref[:4]):
    errors[name] = relative_l2(g, g_ref)
  errors["dS0"] = relative_l2(grads[4].S, grads_ref[4].S)
  errors["dz0"] = relative_l2(grads[4].z, grads_ref[4].z)
  bad = {n: e for n, e in errors.items() if e > (gate_rtol if n == "dlog_forget" else rtol)}
  assert not bad, f"{what}: relative L2 errors above tolerance: {bad}"


def numpy_recurrence(q, k, v, log_forget, state, normalize, eps=1e-6, scale=1.0):
  """Direct transcription of the MATH §3 recurrence with an explicit key sum z (float64)."""
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


@functools.cache
def _reference_run(implementation, T, gate, normalize, with_state):
  """``outputs_and_grads`` of ``implementation`` on ``gla_inputs(T, T, ...)``, computed once."""
  inputs = gla_inputs(T, T, gate, normalize, with_state=with_state)
  op = functools.partial(gated_linear_attention, implementation=implementation)
  return outputs_and_grads(op, *inputs, normalize)


class GatedLinearAttentionTestBase:
  """Subclasses set ``implementation`` (and override ``op`` for a backend's own entry point, which
  takes ``chunk_size``)."""

  implementation: str
  reference_implementation = "recurrent"  # the form every case is compared with
  compiler_options = None

  def op(self, chunk_size: int = CHUNK, **options):
    """The function under test, with ``gated_linear_attention``'s signature, at chunks of ``chunk_size``
    (backends with tiles)."""
    tiled = REGISTRY.backends[self.implementation].tiles_type is not None
    tiles = REGISTRY.tiles(self.implementation, {"chunk": chunk_size}, "test") if tiled else None
    return functools.partial(gated_linear_attention, implementation=self.implementation, tiles=tiles,
                             **options)

  @pytest.mark.parametrize("T,gate,normalize,with_state", [
      (1, "channel", False, True),
      (33, "head", False, False),
      (67, "channel", True, True),
  ])
  def test_matches_reference_with_gradients_for_odd_lengths_and_partial_chunks(
      self, T, gate, normalize, with_state):
    inputs = gla_inputs(T, T, gate, normalize, with_state=with_state)
    got = outputs_and_grads(self.op(chunk_size=CHUNK), *inputs, normalize,
                            compiler_options=self.compiler_options)
    want = _reference_run(self.reference_implementation, T, gate, normalize, with_state)
    assert_same(got, want, f"{self.implementation} T={T} gate={gate}")

  def test_segment_ids_reset_the_state_at_document_boundaries(self):
    """Packed rows equal each document run on its own (the first one continuing the given state)."""
    q, k, v, log_forget, state = gla_inputs(31, 37, "channel", True, B=1)
    bounds = [0, 5, 16, 17, 30, 37]  # mid-chunk, at a chunk start, a one-token document, last chunk
    segment_ids = jnp.asarray(np.repeat(np.arange(5), np.diff(bounds))[None], jnp.int32)
    call = jax.jit(self.op(chunk_size=CHUNK, normalize=True), compiler_options=self.compiler_options)
    o, new = call(q, k, v, log_forget, state=state, segment_ids=segment_ids)
    pieces, piece_state = [], state
    for start, stop in zip(bounds[:-1], bounds[1:]):
      if start > 0:
        piece_state = LinearAttentionState.zeros(*state.S.shape)
      doc = slice(start, stop)
      o_doc, S_doc, z_doc = numpy_recurrence(q[:, doc], k[:, doc], v[:, doc], log_forget[:, doc],
                                             piece_state, normalize=True)
      pieces.append(o_doc)
      piece_state = LinearAttentionState(S_doc, z_doc)
    assert relative_l2(o, np.concatenate(pieces, axis=1)) < RTOL
    assert relative_l2(new.S, piece_state.S) < RTOL and relative_l2(new.z, piece_state.z) < RTOL

  @pytest.mark.parametrize("T,cut", [(40, 20), (37, 21)])  # both pieces end in a partial chunk
  def test_two_pieces_with_state_equal_whole(self, T, cut):
    q, k, v, log_forget, state = gla_inputs(21, T, "channel", True)
    call = jax.jit(self.op(chunk_size=CHUNK, normalize=True), compiler_options=self.compiler_options)
    o, whole = call(q, k, v, log_forget, state=state)
    first, second = slice(0, cut), slice(cut, None)
    o1, mid = call(q[:, first], k[:, first], v[:, first], log_forget[:, first], state=state)
    o2, end = call(q[:, second], k[:, second], v[:, second], log_forget[:, second], state=mid)
    assert relative_l2(jnp.concatenate([o1, o2], axis=1), o) < RTOL
    assert relative_l2(end.S, whole.S) < RTOL and relative_l2(end.z, whole.z) < RTOL
