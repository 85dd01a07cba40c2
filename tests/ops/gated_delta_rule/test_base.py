"""The shared checks of every gated delta rule implementation: it computes the MATH §4 recurrence
(a float64 loop), with and without packed documents; outputs, final state and gradients equal a
second form's for odd lengths and partial chunks and with segment resets; three pieces with the
state passed equal the whole. Each backend's test file subclasses ``GatedDeltaRuleTestBase``.

Comparisons use the relative L2 error ||a - b|| / ||b|| (FLA's testing rule) at fp32, with fresh
random inputs per case; gradients are those of ``sum(o * do) + sum(S_final * dS)`` with respect to
q, k, v, log_alpha, beta and the initial state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.ops.common.backend import ChunkTiles
from lmcore.ops.gated_delta_rule import DeltaRuleState, gated_delta_rule
from lmcore.numerics import relative_l2

B, H, K, V = 2, 2, 8, 6
ARG_NAMES = ("q", "k", "v", "log_alpha", "beta", "S0")
# fp32 with reassociated sums (chunked vs token scan): errors are ~1e-7; 1e-5 leaves headroom.
FP32_TOL = 1e-5


def gdr_inputs(seed: int, length: int, log_alpha_range=(-2.0, -0.01), beta_range=(0.05, 0.95),
               with_state: bool = True) -> dict[str, np.ndarray]:
  """q, k L2-normalised (as the layer passes them), gates in the given ranges, optional S0."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  inputs = {
      "q": unit(rng.normal(size=(B, length, H, K))),
      "k": unit(rng.normal(size=(B, length, H, K))),
      "v": rng.normal(size=(B, length, H, V)),
      "log_alpha": rng.uniform(*log_alpha_range, size=(B, length, H)),
      "beta": rng.uniform(*beta_range, size=(B, length, H)),
      "S0": rng.normal(size=(B, H, K, V)) if with_state else np.zeros((B, H, K, V)),
      "do": rng.normal(size=(B, length, H, V)),
      "dS": rng.normal(size=(B, H, K, V)),
  }
  return {name: x.astype(np.float32) for name, x in inputs.items()}


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def outputs_and_grads(inputs, segment_ids=None, *, implementation: str, chunk_size: int = 16):
  """(o, final S, grads by ARG_NAMES) of the random projection sum(o * do) + sum(S * dS)."""
  def loss(args):
    q, k, v, log_alpha, beta, S0 = args
    o, state = gated_delta_rule(q, k, v, log_alpha, beta, implementation=implementation,
                                state=DeltaRuleState(S0),
                                tiles=ChunkTiles(chunk_size) if implementation == "chunked" else None,
                                segment_ids=segment_ids)
    return jnp.sum(o * inputs["do"]) + jnp.sum(state.S * inputs["dS"]), (o, state.S)

  grads, (o, S) = jax.grad(loss, has_aux=True)(tuple(inputs[name] for name in ARG_NAMES))
  return o, S, dict(zip(ARG_NAMES, grads))



def numpy_gated_delta_rule(inputs, resets=None):
  """MATH §4 literally, in float64: S = alpha (I - beta k k^T) S + beta k v^T, o = K^-1/2 S^T q."""
  q, k, v, log_alpha, beta = (inputs[n].astype(np.float64) for n in ARG_NAMES[:5])
  S = inputs["S0"].astype(np.float64).copy()
  o = np.zeros(v.shape)
  for b in range(B):
    for t in range(q.shape[1]):
      for h in range(H):
        if resets is not None and resets[b][t]:
          S[b, h] = 0.0
        kt, alpha, beta_t = k[b, t, h][:, None], np.exp(log_alpha[b, t, h]), beta[b, t, h]
        S[b, h] = (alpha * (np.eye(K) - beta_t * kt @ kt.T) @ S[b, h]
                   + beta_t * kt @ v[b, t, h][None])
        o[b, t, h] = K**-0.5 * S[b, h].T @ q[b, t, h]
  return o, S


def assert_close(got, want, tol=FP32_TOL):
  o, S, grads = got
  o_ref, S_ref, grads_ref = want
  assert relative_l2(o, o_ref) < tol, f"output rel err {relative_l2(o, o_ref):.2e}"
  assert relative_l2(S, S_ref) < tol, f"final state rel err {relative_l2(S, S_ref):.2e}"
  for name in ARG_NAMES:
    assert np.all(np.isfinite(grads[name])), f"d{name} is not finite"
    err = relative_l2(grads[name], grads_ref[name])
    assert err < tol, f"d{name} rel err {err:.2e}"


# Boundaries at 5 (inside a chunk of 16), 16 (on a chunk edge), 17 and 25 (id 0 again: a new
# document). The segment tests use this layout so that they share the compiled reference.
SEGMENT_IDS = np.array([[0] * 5 + [1] * 11 + [2] + [3] * 8 + [0] * 8, [5] * 24 + [6] * 9], np.int32)


class GatedDeltaRuleTestBase:
  """Subclasses set ``implementation`` and the form it is compared with."""

  implementation: str
  reference_implementation = "recurrent"

  @pytest.mark.parametrize("with_state", [False, True])
  def test_matches_numpy_loop_of_math_formula(self, with_state):
    inputs = gdr_inputs(seed=1 + with_state, length=7, with_state=with_state)
    o_np, S_np = numpy_gated_delta_rule(inputs)
    o, S, _ = outputs_and_grads(inputs, implementation=self.implementation)
    assert relative_l2(o, o_np) < FP32_TOL and relative_l2(S, S_np) < FP32_TOL

  def test_resets_state_where_segment_ids_change_like_numpy_loop(self):
    inputs = gdr_inputs(seed=3, length=33)
    resets = [[t > 0 and ids[t] != ids[t - 1] for t in range(33)] for ids in SEGMENT_IDS]
    o_np, S_np = numpy_gated_delta_rule(inputs, resets)
    o, S, _ = outputs_and_grads(inputs, SEGMENT_IDS, implementation=self.implementation)
    assert relative_l2(o, o_np) < FP32_TOL and relative_l2(S, S_np) < FP32_TOL

  @pytest.mark.parametrize("with_state", [False, True])
  @pytest.mark.parametrize("length,chunk_size", [(1, 16), (7, 16), (33, 16), (67, 16), (67, 64)])
  def test_matches_reference_with_gradients_for_odd_lengths_and_partial_chunks(
      self, length, chunk_size, with_state):
    seed = 10 * length + chunk_size + with_state
    inputs = gdr_inputs(seed, length=length, with_state=with_state)
    assert_close(outputs_and_grads(inputs, implementation=self.implementation,
                                   chunk_size=chunk_size),
                 outputs_and_grads(inputs, implementation=self.reference_implementation,
                                   chunk_size=chunk_size))

  def test_matches_reference_with_segment_resets_inside_and_on_chunk_edges(self):
    inputs = gdr_inputs(seed=4, length=33)
    assert_close(outputs_and_grads(inputs, SEGMENT_IDS, implementation=self.implementation),
                 outputs_and_grads(inputs, SEGMENT_IDS, implementation=self.reference_implementation))

  def test_three_pieces_with_state_passed_equal_the_whole_sequence(self):
    inputs = gdr_inputs(seed=5, length=67)
    o_whole, S_whole, _ = outputs_and_grads(inputs, implementation=self.implementation)
    per_token = ("q", "k", "v", "log_alpha", "beta", "do")
    S, outputs = inputs["S0"], []
    for cut in (slice(0, 33), slice(33, 66), slice(66, 67)):  # lengths already compiled above
      piece = {name: x[:, cut] if name in per_token else x for name, x in inputs.items()}
      o, S, _ = outputs_and_grads({**piece, "S0": S}, implementation=self.implementation)
      outputs.append(o)
    assert relative_l2(jnp.concatenate(outputs, axis=1), o_whole) < FP32_TOL
    assert relative_l2(S, S_whole) < FP32_TOL
