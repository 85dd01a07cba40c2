"""Taylor feature maps and Taylor linear attention (SPEC §2.1): all implementations agree."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.ops.taylor_attention.api import (IMPLEMENTATIONS, TaylorState, default_decay_rates,
                                        taylor_linear_attention, zero_state)
from based_jax.taylor import feature_width, taylor_features
from lmcore.numerics import relative_l2

# fp32 throughout; differences come only from summation order (chunked vs token-wise vs T x T).
TOL = 1e-5
CHUNK = 16

# One jitted entry point for the whole file, so that cases of equal shapes share a compilation
# ("no state" and "no decay" are passed as a zero state and unit rates for the same reason;
# test_defaults_equal_zero_state_and_unit_rates proves that equivalence).
attend = jax.jit(taylor_linear_attention,
                 static_argnames=("implementation", "feature", "chunk_size", "eps"))
features = jax.jit(taylor_features, static_argnames="feature")


def grads_close(grads, ref_grads):
  # At T = 1 the output is v exactly, so dq = dk = 0 and both sides hold ~1e-8 rounding noise:
  # judge gradients relative to max(||ref||, 0.1).
  return all(relative_l2(g, r, floor=0.1) < TOL
             for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))


def random_inputs(seed, batch=2, length=33, heads=2, key_dim=4, value_dim=5):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return dict(q=normal(batch, length, heads, key_dim), k=normal(batch, length, heads, key_dim),
              v=normal(batch, length, heads, value_dim), dt=normal(batch, length, heads),
              rng=rng)


def random_state(rng, batch, heads, key_dim, value_dim, feature):
  """A state that a real prefix could have produced: sums of phi(k) v^T and of phi(k)."""
  k = jnp.asarray(rng.normal(size=(batch, 9, heads, key_dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, 9, heads, value_dim)), jnp.float32)
  phi = features(k, feature)
  return TaylorState(S=jnp.einsum("bthf,bthv->bhfv", phi, v), z=phi.sum(1))


@pytest.mark.parametrize("feature,width", [("full", 273), ("compact", 153)])
def test_feature_dot_product_is_second_order_taylor_of_exp(feature, width):
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 50, 16)).astype(np.float32)
  phi_q, phi_k = features(jnp.asarray(q), feature), features(jnp.asarray(k), feature)
  s = (q * k).sum(-1) / 4.0
  assert phi_q.shape == (50, width) == (50, feature_width(16, feature))
  np.testing.assert_allclose((phi_q * phi_k).sum(-1), 1 + s + s**2 / 2, rtol=1e-5)


def test_full_feature_is_the_released_layout():
  x = np.random.default_rng(1).normal(size=(3, 16)).astype(np.float32)
  expected = np.concatenate([np.ones((3, 1)), x / 2.0,
                             np.einsum("zm,zn->zmn", x, x).reshape(3, 256) / (np.sqrt(2) * 4)], -1)
  np.testing.assert_allclose(features(jnp.asarray(x), "full"), expected, rtol=1e-6)


def test_unknown_feature_form_is_rejected():
  with pytest.raises(ValueError, match="compact"):
    taylor_features(jnp.ones((2, 4)), "half")


def test_default_decay_rates_follow_one_minus_two_to_minus_three_minus_h():
  np.testing.assert_allclose(default_decay_rates(16)[:3], [0.875, 0.9375, 0.96875])
  np.testing.assert_allclose(default_decay_rates(16)[-1], 1 - 2.0**-18, rtol=0, atol=1e-7)


def numpy_reference(q, k, v, dt, gamma, eps):
  """Direct transcription of y_t = dt_t sum_j gamma^(t-j) A_tj v_j / (sum_j A_tj + eps), j <= t."""
  q, k, v, dt = (np.asarray(x, np.float64) for x in (q, k, v, dt))
  s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
  t = np.arange(q.shape[1])
  lag = t[:, None] - t[None, :]
  A = np.where(lag >= 0, 1 + s + s**2 / 2, 0.0)
  decay = np.where(lag >= 0, gamma[:, None, None] ** np.maximum(lag, 0), 0.0)
  num = np.einsum("bhts,bshv->bthv", A * decay, v) * dt[..., None]
  return num / (A.sum(-1).transpose(0, 2, 1)[..., None] + eps)


def case(seed, length, with_state, with_decay, feature="compact"):
  """Inputs of one case; "without" state / decay are a zero state and unit rates with dt = 1."""
  x = random_inputs(seed, length=length)
  x["state"] = (random_state(x["rng"], 2, 2, 4, 5, feature) if with_state
                else zero_state(2, 2, 4, 5, feature))
  x["decay"] = default_decay_rates(2) if with_decay else jnp.ones((2,), jnp.float32)
  if not with_decay:
    x["dt"] = jnp.ones_like(x["dt"])
  return x


def run_forward(x, implementation, sl=slice(None), state=None, segment_ids=None):
  """One jitted call on a case (a slice of it, another state, segment ids)."""
  return attend(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], implementation=implementation,
                chunk_size=CHUNK, state=x["state"] if state is None else state,
                decay=x["decay"], dt=x["dt"][:, sl], segment_ids=segment_ids)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("with_decay", [False, True])
def test_every_implementation_equals_numpy_transcription(implementation, with_decay):
  x = case(seed=10 + with_decay, length=33, with_state=False, with_decay=with_decay)
  o, _ = run_forward(x, implementation)
  expected = numpy_reference(x["q"], x["k"], x["v"], x["dt"], np.asarray(x["decay"]), 1e-12)
  assert relative_l2(o, expected) < TOL


def test_defaults_equal_zero_state_and_unit_rates():
  x = case(seed=11, length=7, with_state=False, with_decay=False)
  o, state = attend(x["q"], x["k"], x["v"], implementation="chunked", chunk_size=CHUNK)
  o_explicit, state_explicit = run_forward(x, "chunked")
  np.testing.assert_allclose(o, o_explicit, rtol=1e-6)
  np.testing.assert_allclose(state.S, state_explicit.S, rtol=1e-6)


@functools.partial(jax.jit, static_argnames=("implementation", "feature"))
def outputs_and_grads(q, k, v, state, decay, dt, cotangents, *, implementation, feature):
  """Outputs, final state, and gradients (q, k, v, initial state, dt) of a random projection."""
  def loss(diff_args):
    q, k, v, state, dt = diff_args
    o, new = taylor_linear_attention(q, k, v, implementation=implementation, state=state,
                                     feature=feature, chunk_size=CHUNK, decay=decay, dt=dt)
    return sum((x * c).sum() for x, c in zip((o, *new), cotangents)), (o, new)

  (_, (o, new)), grads = jax.value_and_grad(loss, has_aux=True)((q, k, v, state, dt))
  return o, new, grads


def run_all_implementations(x, feature, seed):
  rng = np.random.default_rng(seed)
  shapes = [x["v"].shape, x["state"].S.shape, x["state"].z.shape]
  cotangents = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
  return {impl: outputs_and_grads(x["q"], x["k"], x["v"], x["state"], x["decay"], x["dt"],
                                  cotangents, implementation=impl, feature=feature)
          for impl in IMPLEMENTATIONS}


@pytest.mark.parametrize("length", [1, 7, 33, 67])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_decay", [False, True])
def test_chunked_recurrent_parallel_agree_in_outputs_and_state(length, with_state, with_decay):
  x = case(100 * length + 10 * with_state + with_decay, length, with_state, with_decay)
  ref_o, ref_state = run_forward(x, "recurrent")
  for impl in ("parallel", "chunked"):
    o, new = run_forward(x, impl)
    assert relative_l2(o, ref_o) < TOL, impl
    assert relative_l2(new.S, ref_state.S) < TOL and relative_l2(new.z, ref_state.z) < TOL, impl


# Gradients at one multi-chunk length with a partial last chunk (gradient programs are the slow
# compilations; the forward test above covers the other lengths).
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_decay", [False, True])
def test_chunked_recurrent_parallel_agree_in_gradients(with_state, with_decay):
  x = case(10 * with_state + with_decay, 33, with_state, with_decay)
  results = run_all_implementations(x, "compact", seed=3)
  for impl in ("parallel", "chunked"):
    assert grads_close(results[impl], results["recurrent"]), impl


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_full_and_compact_features_give_the_same_outputs(implementation):
  x = case(8, 33, with_state=False, with_decay=True)
  # The same prefix expressed in either feature form.
  prefix = {f: random_state(np.random.default_rng(0), 2, 2, 4, 5, f) for f in ("full", "compact")}
  o_full, state_full = attend(x["q"], x["k"], x["v"], state=prefix["full"], feature="full",
                              implementation=implementation, chunk_size=CHUNK, decay=x["decay"],
                              dt=x["dt"], segment_ids=None)
  o_compact, state_compact = run_forward(x, implementation, state=prefix["compact"])
  assert state_full.S.shape == (2, 2, 21, 5) and state_compact.S.shape == (2, 2, 15, 5)
  assert relative_l2(o_full, o_compact) < TOL


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("with_decay", [False, True])
def test_pieces_with_state_threaded_equal_the_whole_sequence(implementation, with_decay):
  x = case(20 + with_decay, 67, with_state=True, with_decay=with_decay)
  whole_o, whole_state = run_forward(x, implementation)
  outputs, state, start = [], x["state"], 0
  for size in (33, 7, 7, 7, 7, 1, 1, 1, 1, 1, 1):
    o, state = run_forward(x, implementation, slice(start, start + size), state)
    outputs.append(o)
    start += size
  assert start == 67
  assert relative_l2(jnp.concatenate(outputs, 1), whole_o) < TOL
  assert relative_l2(state.S, whole_state.S) < TOL and relative_l2(state.z, whole_state.z) < TOL


@pytest.mark.parametrize("implementation", ["parallel", "recurrent"])
def test_segment_ids_isolate_documents_and_reset_the_state(implementation):
  x = case(30, 33, with_state=True, with_decay=True)
  doc_lengths = (1, 7, 7, 7, 7, 1, 1, 1, 1)
  segment_ids = jnp.asarray([np.repeat(np.arange(9), doc_lengths), np.full(33, 9)])
  o, new = run_forward(x, implementation, segment_ids=segment_ids)
  # Row 0: the first document continues the state, later ones start fresh; row 1: one document.
  alone, state, start = [], x["state"], 0
  for size in doc_lengths:
    o_doc, last_state = run_forward(x, "recurrent", slice(start, start + size), state)
    alone.append(o_doc)
    state, start = zero_state(2, 2, 4, 5), start + size
  whole_o, whole_state = run_forward(x, "recurrent")
  assert relative_l2(o[0], jnp.concatenate(alone, 1)[0]) < TOL
  assert relative_l2(new.S[0], last_state.S[0]) < TOL and relative_l2(new.z[0], last_state.z[0]) < TOL
  assert relative_l2(o[1], whole_o[1]) < TOL and relative_l2(new.S[1], whole_state.S[1]) < TOL


def test_chunked_rejects_segment_ids_naming_the_alternatives():
  x = random_inputs(seed=31, length=5)
  with pytest.raises(NotImplementedError, match="parallel"):
    taylor_linear_attention(x["q"], x["k"], x["v"], implementation="chunked",
                            segment_ids=jnp.zeros((2, 5), jnp.int32))


def test_bf16_inputs_give_bf16_outputs_and_fp32_state():
  x = case(40, 7, with_state=True, with_decay=True)
  bf16 = {**x, **{n: x[n].astype(jnp.bfloat16) for n in "qkv"}}
  o, state = run_forward(bf16, "chunked")
  ref, _ = run_forward(x, "chunked")
  assert o.dtype == jnp.bfloat16 and state.S.dtype == state.z.dtype == jnp.float32
  assert relative_l2(o, ref) < 3e-2  # bf16 inputs: ~3 significant digits.


def test_zero_state_has_feature_width():
  state = zero_state(3, 2, 16, 64)
  assert state.S.shape == (3, 2, 153, 64) and state.z.shape == (3, 2, 153)
