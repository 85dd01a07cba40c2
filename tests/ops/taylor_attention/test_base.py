"""The shared checks of every Taylor linear attention backend (MATH §2.1): outputs equal a float64
transcription of the formula; outputs, final state and gradients equal a second form's for odd
lengths, partial chunks, with and without a prefix state and the decay ablation; full and compact
features give the same function; pieces with the state threaded equal the whole sequence; packed
documents equal each document run alone. Backends without the decay ablation (the kernels) must reject
it instead, naming the backends that take it. Each backend's test file subclasses
``TaylorAttentionTestBase``.

Tolerance: relative L2 error 1e-5 at fp32; the forms differ only in summation order.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.ops.taylor_attention import (TaylorState, default_decay_rates, taylor_linear_attention,
                                            zero_state)
from based_jax.taylor import taylor_features
from kernel_cases import FAST_COMPILE
from lmcore.numerics import relative_l2

TOL = 1e-5
CHUNK = 16

# One jitted entry point, so that cases of equal shapes share a compilation ("no state" and "no
# decay" are a zero state and unit rates for the XLA forms for the same reason;
# test_xla.py::test_defaults_equal_zero_state_and_unit_rates proves that equivalence). The cases
# check the math, not code generation: LLVM's expensive passes are skipped.
attend = jax.jit(taylor_linear_attention, static_argnames=("implementation", "feature", "tiles", "eps"),
                 compiler_options=FAST_COMPILE)
features = jax.jit(taylor_features, static_argnames="feature")


@functools.cache
def outputs_and_grads(implementation, tiles):
  """``f(x, cotangents)``: outputs, final state and gradients (q, k, v, initial state, dt and the decay
  rates if given) of a random projection, by one jitted function per backend (cases of equal shapes
  share it)."""
  def loss(diff_args, cotangents):
    q, k, v, state, dt, decay = diff_args
    o, new = taylor_linear_attention(q, k, v, implementation=implementation, tiles=tiles, state=state,
                                     decay=decay, dt=dt)
    return sum((y * c).sum() for y, c in zip((o, *new), cotangents)), (o, new)

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST_COMPILE)

  def run(x, cotangents):
    (_, (o, new)), grads = grad((x["q"], x["k"], x["v"], x["state"], x["dt"], x["decay"]), cotangents)
    return o, new, grads
  return run


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


def numpy_reference(q, k, v, dt, gamma, eps):
  """Direct transcription of y_t = dt_t sum_j gamma^(t-j) A_tj v_j / (sum_j A_tj + eps), j <= t."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  dt = np.ones(q.shape[:3]) if dt is None else np.asarray(dt, np.float64)
  gamma = np.ones(q.shape[2]) if gamma is None else np.asarray(gamma, np.float64)
  s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
  t = np.arange(q.shape[1])
  lag = t[:, None] - t[None, :]
  A = np.where(lag >= 0, 1 + s + s**2 / 2, 0.0)
  decay = np.where(lag >= 0, gamma[:, None, None] ** np.maximum(lag, 0), 0.0)
  num = np.einsum("bhts,bshv->bthv", A * decay, v) * dt[..., None]
  return num / (A.sum(-1).transpose(0, 2, 1)[..., None] + eps)


class TaylorAttentionTestBase:
  """Subclasses set ``implementation`` and, for a tiled backend, ``tiles`` (chunks or blocks of
  ``CHUNK`` tokens, so that the cases cross them)."""

  implementation: str
  tiles = None
  reference_implementation = "recurrent"  # the form outputs, states and gradients are compared with
  decay = True  # takes the decay ablation (decay, dt)
  pieces = (33, 7, 7, 7, 7, 1, 1, 1, 1, 1, 1)  # call lengths of the threaded-state check (sum 67)

  def op(self, q, k, v, **options):
    """The backend under test, with ``taylor_linear_attention``'s arguments."""
    return attend(q, k, v, implementation=self.implementation, tiles=self.tiles, **options)

  def case(self, seed, length, with_state, with_decay, feature="compact"):
    """Inputs of one case. Without state: a zero state. Without decay: unit rates and dt = 1 where
    the backend takes the decay ablation, None where it does not."""
    x = random_inputs(seed, length=length)
    x["state"] = (random_state(x["rng"], 2, 2, 4, 5, feature) if with_state
                  else zero_state(2, 2, 4, 5, feature))
    if with_decay:
      x["decay"] = default_decay_rates(2)
    elif self.decay:
      x["decay"], x["dt"] = jnp.ones((2,), jnp.float32), jnp.ones_like(x["dt"])
    else:
      x["decay"], x["dt"] = None, None
    return x

  def run_forward(self, x, implementation=None, sl=slice(None), state=None, segment_ids=None,
                  feature="compact"):
    """One jitted call on a case (a slice of it, another state, segment ids); ``implementation``
    None is the one under test."""
    options = dict(state=x["state"] if state is None else state, decay=x["decay"],
                   dt=None if x["dt"] is None else x["dt"][:, sl], segment_ids=segment_ids, feature=feature)
    q, k, v = x["q"][:, sl], x["k"][:, sl], x["v"][:, sl]
    if implementation is None:
      return self.op(q, k, v, **options)
    return attend(q, k, v, implementation=implementation, **options)

  def assert_rejects_decay(self, x):
    """The backend refuses the decay ablation and names the backends that take it."""
    with pytest.raises(ValueError, match=rf"'{self.implementation}' does not run .* with the decay "
                                         r"ablation on cpu .*; use one of parallel, recurrent, chunked, "
                                         r"auto"):
      taylor_linear_attention(x["q"], x["k"], x["v"], implementation=self.implementation,
                              decay=x["decay"], dt=x["dt"])

  @pytest.mark.parametrize("with_decay", [False, True])
  def test_equals_numpy_transcription(self, with_decay):
    x = self.case(seed=10 + with_decay, length=33, with_state=False, with_decay=with_decay)
    if with_decay and not self.decay:
      return self.assert_rejects_decay(x)
    o, _ = self.run_forward(x)
    expected = numpy_reference(x["q"], x["k"], x["v"], x["dt"], x["decay"], 1e-12)
    assert relative_l2(o, expected) < TOL

  @pytest.mark.parametrize("length", [1, 7, 33, 67])
  @pytest.mark.parametrize("with_decay", [False, True])
  def test_matches_reference_in_outputs_and_state_for_odd_lengths(self, length, with_decay):
    """With and without a prefix state (one compilation: no state is the zero state)."""
    for with_state in (False, True):
      x = self.case(100 * length + 10 * with_state + with_decay, length, with_state, with_decay)
      if with_decay and not self.decay:
        return self.assert_rejects_decay(x)
      ref_o, ref_state = self.run_forward(x, self.reference_implementation)
      o, new = self.run_forward(x)
      assert relative_l2(o, ref_o) < TOL, f"state={with_state}"
      assert relative_l2(new.S, ref_state.S) < TOL and relative_l2(new.z, ref_state.z) < TOL

  # Gradients at one multi-chunk length with a partial last chunk (gradient programs are the slow
  # compilations; the forward check above covers the other lengths).
  @pytest.mark.parametrize("with_decay", [False, True])
  def test_matches_reference_in_gradients(self, with_decay):
    """With and without a prefix state (one compilation)."""
    for with_state in (False, True):
      x = self.case(10 * with_state + with_decay, 33, with_state, with_decay)
      if with_decay and not self.decay:
        return self.assert_rejects_decay(x)
      rng = np.random.default_rng(3)
      shapes = [x["v"].shape, x["state"].S.shape, x["state"].z.shape]
      cotangents = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
      got = outputs_and_grads(self.implementation, self.tiles)(x, cotangents)
      want = outputs_and_grads(self.reference_implementation, None)(x, cotangents)
      assert grads_close(got, want), f"state={with_state}"

  def test_full_and_compact_features_give_the_same_outputs(self):
    x = self.case(8, 33, with_state=False, with_decay=self.decay)
    # The same prefix expressed in either feature form.
    prefix = {f: random_state(np.random.default_rng(0), 2, 2, 4, 5, f) for f in ("full", "compact")}
    o_full, state_full = self.run_forward(x, state=prefix["full"], feature="full")
    o_compact, state_compact = self.run_forward(x, state=prefix["compact"])
    assert state_full.S.shape == (2, 2, 21, 5) and state_compact.S.shape == (2, 2, 15, 5)
    assert relative_l2(o_full, o_compact) < TOL

  @pytest.mark.parametrize("with_decay", [False, True])
  def test_pieces_with_state_threaded_equal_the_whole_sequence(self, with_decay):
    x = self.case(20 + with_decay, 67, with_state=True, with_decay=with_decay)
    if with_decay and not self.decay:
      return self.assert_rejects_decay(x)
    whole_o, whole_state = self.run_forward(x)
    outputs, state, start = [], x["state"], 0
    for size in self.pieces:
      o, state = self.run_forward(x, sl=slice(start, start + size), state=state)
      outputs.append(o)
      start += size
    assert start == 67
    assert relative_l2(jnp.concatenate(outputs, 1), whole_o) < TOL
    assert relative_l2(state.S, whole_state.S) < TOL and relative_l2(state.z, whole_state.z) < TOL

  def test_segment_ids_isolate_documents_and_reset_the_state(self):
    """Row 0 packs nine documents (the first continues the state, later ones start fresh; a
    boundary at a chunk start, one-token documents); row 1 is one document."""
    x = self.case(30, 33, with_state=True, with_decay=self.decay)
    doc_lengths = (1, 7, 7, 7, 7, 1, 1, 1, 1)
    segment_ids = jnp.asarray([np.repeat(np.arange(9), doc_lengths), np.full(33, 9)])
    o, new = self.run_forward(x, segment_ids=segment_ids)
    alone, state, start = [], x["state"], 0
    for size in doc_lengths:
      o_doc, last_state = self.run_forward(x, "recurrent", slice(start, start + size), state)
      alone.append(o_doc)
      state, start = zero_state(2, 2, 4, 5), start + size
    whole_o, whole_state = self.run_forward(x, "recurrent")
    assert relative_l2(o[0], jnp.concatenate(alone, 1)[0]) < TOL
    assert relative_l2(new.S[0], last_state.S[0]) < TOL
    assert relative_l2(new.z[0], last_state.z[0]) < TOL
    assert relative_l2(o[1], whole_o[1]) < TOL and relative_l2(new.S[1], whole_state.S[1]) < TOL
