"""SANATAN attention (MATH §1.1 step 6, §1.2): every implementation computes the same function.

``SanatanAttentionTestBase`` holds the checks every implementation passes; each backend's test file
subclasses it with its ``implementation`` (test_reference.py, test_xla.py, test_pallas_*.py). The
reference is ``reference.parallel``, the plain materialised form differentiated by autodiff, named
"reference" here (``attention``); every other name goes through ``sanatan_attention``.

Errors are relative L2 ``||a - b|| / ||b||`` at fp32. Outputs and states agree to 1e-5 (the forms
differ only in summation order); gradients to 1e-4 (they pass through the saturating tanh roots
and the power, which amplify the fp32 differences of summation order).

Compile time dominates on CPU, so tests reuse shapes: the T = 7 and T = 33 stateless programs of
the odd-length test serve the causality, two-piece and packed-document tests too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.numerics import relative_l2
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.ops.sanatan_attention import reference
from sanatan_jax.ops.sanatan_attention.base import Options, sanatan_features

OUT_TOL, GRAD_TOL = 1e-5, 1e-4
CHUNK = BLOCK = 16
# The tests check the math, not code generation: skipping LLVM's expensive passes halves the
# compile time of these small programs on a shared CPU.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_STATIC = ("p", "channels", "three_channel", "implementation", "chunk_size", "block_size", "rotate")


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
  with jax.numpy_rank_promotion("raise"):
    yield


def jit(fn, **kw):
  """``jax.jit`` with the fast-compile options."""
  return jax.jit(fn, compiler_options=_FAST_COMPILE, **kw)


def options(implementation="reference", p=1, channels=6, three_channel="clean", **kw):
  """Every static option spelled out with the test tile sizes, so equal calls share a program."""
  return dict(implementation=implementation, p=p, channels=channels, three_channel=three_channel,
              chunk_size=CHUNK, block_size=BLOCK, **kw)


def attention(q, k, v, omega, lam_raw, *, implementation, p, channels, three_channel, chunk_size,
              block_size, rotate=True, **kw):
  """``sanatan_attention``, or for implementation "reference" ``reference.parallel`` itself."""
  if implementation != "reference":
    return sanatan_attention(q, k, v, omega, lam_raw, implementation=implementation, p=p, channels=channels,
                             three_channel=three_channel, chunk_size=chunk_size, block_size=block_size,
                             rotate=rotate, **kw)
  return reference.parallel(q, k, v, omega, lam_raw, options=Options(
      p=p, channels=channels, three_channel=three_channel, rotate=rotate, chunk_size=chunk_size,
      block_size=block_size), **kw)


_attend_jit = jit(attention, static_argnames=_STATIC)


def attend(*args, **kw):
  """``sanatan_attention`` jitted, with ``options(**kw)``."""
  return _attend_jit(*args, **options(**kw))


def inputs(seed, T, B=2, H=2, d=4, dv=5):
  """q, k, v, omega, lam_raw with |u| spread across both edges of the saturation band."""
  rng = np.random.default_rng(seed)

  def spread(*shape):
    return rng.normal(size=shape) * np.exp(rng.uniform(np.log(0.01), np.log(50.0), size=shape))

  arrays = (spread(B, T, H, d), spread(B, T, H, d), rng.normal(size=(B, T, H, dv)),
            np.pi / 4 + 0.3 * rng.normal(size=(H, d)), 2.0 * rng.normal(size=(H, d)))
  return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def prefix_state(seed, T=5):
  """A reachable state: the one a random 5-token prefix leaves."""
  return attend(*inputs(seed, T))[1]


def assert_states_close(a: SanatanState, b: SanatanState):
  assert relative_l2(a.S, b.S) <= OUT_TOL and relative_l2(a.z, b.z) <= OUT_TOL
  np.testing.assert_array_equal(a.position, b.position)


def outputs_and_grads(inputs, do, **kw):
  """o and the gradients of <o, do> w.r.t. q, k, v, omega, lam_raw, from one compiled program."""

  def run(*args):
    o, vjp = jax.vjp(lambda *a: attention(*a, **options(**kw))[0], *args)
    return o, vjp(do)

  return jit(run)(*inputs)


def _p1_grads(implementation, inputs, state, segment_ids, seed):
  """Gradients of <o, do> + <S, dS> + <z, dz> w.r.t. q, k, v, omega, lam_raw, S0, z0."""
  rng = np.random.default_rng(seed)
  do, dS, dz = (jnp.asarray(rng.normal(size=x.shape), jnp.float32)
                for x in (inputs[2], state.S, state.z))

  def loss(q, k, v, omega, lam_raw, S0, z0):
    o, new = attention(q, k, v, omega, lam_raw, **options(
        state=SanatanState(S0, z0, state.position), segment_ids=segment_ids,
        implementation=implementation))
    return jnp.sum(o * do) + jnp.sum(new.S * dS) + jnp.sum(new.z * dz)

  return jit(jax.grad(loss, tuple(range(7))))(*inputs, state.S, state.z)


_DOCS = (7, 33)  # packed rows of two documents whose lengths reuse the odd-length programs


def _packed(seed):
  """40-token rows packing documents of 7 and 33 tokens, positions restarted per document."""
  segment_ids = jnp.asarray([[4] * _DOCS[0] + [9] * _DOCS[1]] * 2)
  positions = jnp.asarray([list(range(_DOCS[0])) + list(range(_DOCS[1]))] * 2)
  return inputs(seed, sum(_DOCS)), segment_ids, positions


class SanatanAttentionTestBase:
  """The checks every implementation passes: p = 1 outputs, states and gradients equal the
  reference's (``reference.parallel``) for odd lengths, with a state and packed documents; two pieces
  equal the whole; no output depends on a later token or on another document. Forms that run
  p >= 2 (``powers``) also pass the causality and packed-document checks at a power."""

  implementation: str
  # The (p, channels, three_channel) of the causality check at a power, and the p of the
  # packed-document check at a power; None for the p = 1 six-channel forms.
  future_power: tuple[int, int, str] | None = None
  packed_power: int | None = None
  # The implementation whose tests already cover this form's p = 1 six-channel path because the
  # form runs that implementation's code there; None when the form has its own.
  p1_tested_by: str | None = None

  def _skip_if_reference(self):
    if self.implementation == "reference":
      pytest.skip("reference.parallel is the reference")

  def _skip_if_p1_tested_elsewhere(self):
    if self.p1_tested_by is not None:
      pytest.skip(f"p = 1 with 6 channels runs the {self.p1_tested_by!r} code, tested there")

  @pytest.mark.parametrize("T,with_state", [(1, True), (7, False), (33, False)])
  def test_p1_equals_parallel_for_odd_lengths(self, T, with_state):
    self._skip_if_reference()
    self._skip_if_p1_tested_elsewhere()
    q, k, v, omega, lam_raw = inputs(T, T)
    state = prefix_state(100 + T) if with_state else None
    o_ref, state_ref = attend(q, k, v, omega, lam_raw, state=state)
    o, new_state = attend(q, k, v, omega, lam_raw, state=state, implementation=self.implementation)
    assert relative_l2(o, o_ref) <= OUT_TOL
    assert_states_close(new_state, state_ref)

  def test_p1_gradients_equal_parallel_with_state_and_segments(self):
    self._skip_if_reference()
    self._skip_if_p1_tested_elsewhere()
    x = inputs(3, 33)
    state = prefix_state(4)
    # Row 0 keeps the incoming state for 20 tokens; row 1 resets it twice, once inside a chunk.
    segment_ids = jnp.asarray([[0] * 20 + [1] * 13, [0] * 5 + [1] * 20 + [2] * 8])
    g_ref = _p1_grads("reference", x, state, segment_ids, 5)
    g = _p1_grads(self.implementation, x, state, segment_ids, 5)
    for name, a, b in zip(("q", "k", "v", "omega", "lam_raw", "S0", "z0"), g, g_ref):
      assert relative_l2(a, b) <= GRAD_TOL, name

  def test_two_pieces_with_state_equal_whole(self):
    self._skip_if_p1_tested_elsewhere()
    q, k, v, omega, lam_raw = inputs(8, 33)
    run = functools.partial(attend, omega=omega, lam_raw=lam_raw,
                            implementation=self.implementation)
    o_whole, state_whole = run(q, k, v)
    o_head, state_head = run(q[:, :7], k[:, :7], v[:, :7])
    # Default positions continue from state_head.position.
    o_tail, state_tail = run(q[:, 7:], k[:, 7:], v[:, 7:], state=state_head)
    assert relative_l2(jnp.concatenate([o_head, o_tail], axis=1), o_whole) <= OUT_TOL
    assert_states_close(state_tail, state_whole)

  def _assert_causal(self, p, channels, three_channel):
    q, k, v, omega, lam_raw = inputs(10, 33)
    q2, k2, v2, _, _ = inputs(11, 33)
    cut = 19  # tokens >= cut are replaced; outputs before cut must not move at all.
    kw = dict(p=p, channels=channels, three_channel=three_channel,
              implementation=self.implementation)
    swap = lambda a, b: jnp.concatenate([a[:, :cut], b[:, cut:]], axis=1)
    o = attend(q, k, v, omega, lam_raw, **kw)[0]
    o2 = attend(swap(q, q2), swap(k, k2), swap(v, v2), omega, lam_raw, **kw)[0]
    np.testing.assert_array_equal(o[:, :cut], o2[:, :cut])
    assert not np.allclose(o[:, cut:], o2[:, cut:])

  def test_outputs_do_not_depend_on_future_tokens(self):
    self._skip_if_p1_tested_elsewhere()
    self._assert_causal(1, 6, "clean")

  def test_outputs_at_a_power_do_not_depend_on_future_tokens(self):
    if self.future_power is None:
      pytest.skip("p = 1 six-channel form")
    self._assert_causal(*self.future_power)

  def _assert_packed_equal_separate(self, p):
    (q, k, v, omega, lam_raw), segment_ids, positions = _packed(12)
    kw = dict(p=p, implementation=self.implementation)
    o, state = attend(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids, **kw)
    for doc in (slice(0, _DOCS[0]), slice(_DOCS[0], None)):
      o_doc, state_doc = attend(q[:, doc], k[:, doc], v[:, doc], omega, lam_raw, **kw)
      assert relative_l2(o[:, doc], o_doc) <= OUT_TOL
    if p == 1:
      assert_states_close(state, state_doc)

  def test_packed_documents_equal_separate_documents(self):
    self._skip_if_p1_tested_elsewhere()
    self._assert_packed_equal_separate(1)

  def test_packed_documents_at_a_power_equal_separate_documents(self):
    if self.packed_power is None:
      pytest.skip("p = 1 six-channel form")
    self._assert_packed_equal_separate(self.packed_power)

  def test_changing_one_segment_leaves_the_next_segment_unchanged(self):
    (q, k, v, omega, lam_raw), segment_ids, positions = _packed(13)
    q2, k2, v2, _, _ = inputs(14, sum(_DOCS))
    first = (segment_ids == 4)[:, :, None, None]
    kw = dict(positions=positions, segment_ids=segment_ids, implementation=self.implementation,
              p=1 if self.p1_tested_by is None else self.packed_power)
    o = attend(q, k, v, omega, lam_raw, **kw)[0]
    o2 = attend(jnp.where(first, q2, q), jnp.where(first, k2, k), jnp.where(first, v2, v), omega,
                lam_raw, **kw)[0]
    np.testing.assert_array_equal(jnp.where(first, 0, o), jnp.where(first, 0, o2))


def test_six_channel_scores_are_nonnegative_and_at_most_4d():
  q, k, _, omega, lam_raw = inputs(9, 67, d=8)
  positions = jnp.broadcast_to(jnp.arange(67), (2, 67))

  def scores(*args):
    phi_q, phi_k = sanatan_features(*args)
    return jnp.einsum("bthf,bshf->bhts", phi_q, phi_k, precision=jax.lax.Precision.HIGHEST)

  s = jit(scores)(q, k, omega, lam_raw, positions)
  assert float(s.min()) >= -1e-4 and float(s.max()) <= 4 * 8 + 1e-4


def test_state_and_recurrent_forms_reject_p_above_one_and_ablation_channels():
  q, k, v, omega, lam_raw = inputs(17, 7)
  state = prefix_state(18)
  with pytest.raises(ValueError, match="no constant-size state"):
    sanatan_attention(q, k, v, omega, lam_raw, p=2, state=state)
  with pytest.raises(ValueError, match="no constant-size state"):
    sanatan_attention(q, k, v, omega, lam_raw, channels=4, state=state)
  for implementation in ("chunked", "recurrent"):
    with pytest.raises(ValueError, match="use 'parallel' or 'blocked'"):
      sanatan_attention(q, k, v, omega, lam_raw, p=2, implementation=implementation)
    with pytest.raises(ValueError, match="use 'parallel' or 'blocked'"):
      sanatan_attention(q, k, v, omega, lam_raw, channels=3, implementation=implementation)
  with pytest.raises(ValueError, match="unknown implementation"):
    sanatan_attention(q, k, v, omega, lam_raw, implementation="flash")
  shapes = jax.eval_shape(functools.partial(sanatan_attention, p=2), q, k, v, omega, lam_raw)
  assert shapes[1] is None
