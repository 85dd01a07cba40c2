"""SANATAN attention (MATH §1.1 step 6, §1.2): every backend computes the same function.

``SanatanAttentionTestBase`` holds the checks every backend passes; each backend's test file subclasses
it with its ``implementation``, the small ``tiles`` it runs the checks at (so that T = 33 crosses
several chunks or blocks) and the ``variant`` (p, channels, three_channel) it computes: outputs, final
states and gradients equal the reference's for odd lengths, with a state and packed documents; two
pieces equal the whole; no output depends on a later token or on another document. The reference is
``reference.parallel``, the plain materialised form differentiated by autodiff, named "reference" here
(``attention``); every other name goes through ``sanatan_attention``.

Errors are relative L2 ``||a - b|| / ||b||`` at fp32. Outputs and states agree to 1e-5 (the forms
differ only in summation order); gradients to 1e-4 (they pass through the saturating tanh roots
and the power, which amplify the fp32 differences of summation order).

Compile time dominates on CPU (the Pallas kernels run interpreted), so the checks reuse programs: the
T = 7 and T = 33 stateless programs of the odd-length check serve the causality, two-piece and
packed-document checks too, and the reference's runs are computed once per case (``_reference``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.numerics import relative_l2
from sanatan_jax import SanatanState, features, sanatan_attention
from sanatan_jax.ops.sanatan_attention import reference
from sanatan_jax.ops.sanatan_attention.base import Options, factor_channel, sanatan_features

OUT_TOL, GRAD_TOL = 1e-5, 1e-4
P1 = (1, 6, "clean")
# The tests check the math, not code generation: skipping LLVM's expensive passes halves the
# compile time of these small programs on a shared CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
  with jax.numpy_rank_promotion("raise"):
    yield


def jit(fn, **kw):
  """``jax.jit`` with the fast-compile options."""
  return jax.jit(fn, compiler_options=FAST_COMPILE, **kw)


def attention(q, k, v, omega, lam_raw, *, implementation, variant=P1, tiles=None, **kw):
  """``sanatan_attention`` at ``variant`` = (p, channels, three_channel), or for implementation
  "reference" ``reference.parallel`` itself."""
  p, channels, three_channel = variant
  if implementation != "reference":
    return sanatan_attention(q, k, v, omega, lam_raw, implementation=implementation, p=p, channels=channels,
                             three_channel=three_channel, tiles=tiles, **kw)
  rotate = kw.pop("rotate", True)
  options = Options(p=p, channels=channels, three_channel=three_channel, rotate=rotate)
  return reference.parallel(q, k, v, omega, lam_raw, options=options, **kw)


attend = jit(attention, static_argnames=("implementation", "variant", "tiles", "rotate"))


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
  return attend(*inputs(seed, T), implementation="reference")[1]


def assert_states_close(a: SanatanState, b: SanatanState):
  assert relative_l2(a.S, b.S) <= OUT_TOL and relative_l2(a.z, b.z) <= OUT_TOL
  np.testing.assert_array_equal(a.position, b.position)


def outputs_and_grads(x, do, **kw):
  """o and the gradients of <o, do> w.r.t. q, k, v, omega, lam_raw, from one compiled program."""

  def run(*args):
    o, vjp = jax.vjp(lambda *a: attention(*a, **kw)[0], *args)
    return o, vjp(do)

  return jit(run)(*x)


# Row 0 keeps the incoming state for 20 tokens; row 1 resets it twice, once inside a chunk.
GRAD_SEGMENTS = ((0,) * 20 + (1,) * 13, (0,) * 5 + (1,) * 20 + (2,) * 8)


def _grads_with_state(implementation, tiles, variant, x, state, segment_ids, seed=5):
  """Outputs, final state and the gradients of <o, do> (+ <S, dS> + <z, dz> with a state) w.r.t.
  q, k, v, omega, lam_raw (and S0, z0)."""
  rng = np.random.default_rng(seed)
  do = jnp.asarray(rng.normal(size=x[2].shape), jnp.float32)
  if state is None:
    o, grads = outputs_and_grads(x, do, implementation=implementation, variant=variant, tiles=tiles,
                                 segment_ids=segment_ids)
    return (o, None), grads
  dS, dz = (jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in (state.S, state.z))

  def loss(q, k, v, omega, lam_raw, S0, z0):
    o, new = attention(q, k, v, omega, lam_raw, implementation=implementation, variant=variant, tiles=tiles,
                       state=SanatanState(S0, z0, state.position), segment_ids=segment_ids)
    return jnp.sum(o * do) + jnp.sum(new.S * dS) + jnp.sum(new.z * dz), (o, new)

  (_, (o, new)), grads = jit(jax.value_and_grad(loss, tuple(range(7)), has_aux=True))(*x, state.S, state.z)
  return (o, new), grads


@functools.cache
def _reference_grads(variant, with_state):
  """``_grads_with_state`` of the reference on the gradient check's case, computed once."""
  state = prefix_state(4) if with_state else None
  return _grads_with_state("reference", None, variant, inputs(3, 33), state, jnp.asarray(GRAD_SEGMENTS))


DOCS = (7, 33)  # packed rows of two documents whose lengths reuse the odd-length programs


def packed(seed):
  """40-token rows packing documents of 7 and 33 tokens, positions restarted per document."""
  segment_ids = jnp.asarray([[4] * DOCS[0] + [9] * DOCS[1]] * 2)
  positions = jnp.asarray([list(range(DOCS[0])) + list(range(DOCS[1]))] * 2)
  return inputs(seed, sum(DOCS)), segment_ids, positions


class SanatanAttentionTestBase:
  """The checks every backend passes at its ``variant`` (see the module docstring); a backend with
  the constant-size state (p = 1, 6 channels) also carries and returns states."""

  implementation: str
  tiles = None  # the backend's tiling for the checks; None: its heuristic
  variant = P1

  @property
  def stateful(self) -> bool:
    return self.variant[:2] == (1, 6)

  def attend(self, *args, **kw):
    return attend(*args, implementation=self.implementation, variant=self.variant, tiles=self.tiles, **kw)

  def _skip_if_reference(self):
    if self.implementation == "reference":
      pytest.skip("reference.parallel is the reference")

  @pytest.mark.parametrize("T,with_state", [(1, True), (7, False), (33, False)])
  def test_outputs_and_state_equal_the_reference_for_odd_lengths(self, T, with_state):
    self._skip_if_reference()
    x = inputs(T, T)
    state = prefix_state(100 + T) if with_state and self.stateful else None
    o_ref, state_ref = attend(*x, implementation="reference", variant=self.variant, state=state)
    o, new_state = self.attend(*x, state=state)
    assert relative_l2(o, o_ref) <= OUT_TOL
    if self.stateful:
      assert_states_close(new_state, state_ref)
    else:
      assert new_state is None

  def test_gradients_equal_the_reference_with_state_and_documents(self):
    self._skip_if_reference()
    x = inputs(3, 33)
    state = prefix_state(4) if self.stateful else None
    (o, new), g = _grads_with_state(self.implementation, self.tiles, self.variant, x, state,
                                    jnp.asarray(GRAD_SEGMENTS))
    (o_ref, new_ref), g_ref = _reference_grads(self.variant, self.stateful)
    assert relative_l2(o, o_ref) <= OUT_TOL
    if self.stateful:
      assert_states_close(new, new_ref)
    for name, a, b in zip(("q", "k", "v", "omega", "lam_raw", "S0", "z0"), g, g_ref):
      assert relative_l2(a, b) <= GRAD_TOL, name

  def test_two_pieces_with_state_equal_whole(self):
    if not self.stateful:
      pytest.skip("no constant-size state to pass")
    q, k, v, omega, lam_raw = inputs(8, 33)
    run = functools.partial(self.attend, omega=omega, lam_raw=lam_raw)
    o_whole, state_whole = run(q, k, v)
    o_head, state_head = run(q[:, :7], k[:, :7], v[:, :7])
    # Default positions continue from state_head.position.
    o_tail, state_tail = run(q[:, 7:], k[:, 7:], v[:, 7:], state=state_head)
    assert relative_l2(jnp.concatenate([o_head, o_tail], axis=1), o_whole) <= OUT_TOL
    assert_states_close(state_tail, state_whole)

  def test_outputs_do_not_depend_on_future_tokens(self):
    q, k, v, omega, lam_raw = inputs(10, 33)
    q2, k2, v2, _, _ = inputs(11, 33)
    cut = 19  # tokens >= cut are replaced; outputs before cut must not move at all.
    swap = lambda a, b: jnp.concatenate([a[:, :cut], b[:, cut:]], axis=1)
    o = self.attend(q, k, v, omega, lam_raw)[0]
    o2 = self.attend(swap(q, q2), swap(k, k2), swap(v, v2), omega, lam_raw)[0]
    np.testing.assert_array_equal(o[:, :cut], o2[:, :cut])
    assert not np.allclose(o[:, cut:], o2[:, cut:])

  def test_packed_documents_equal_separate_documents(self):
    (q, k, v, omega, lam_raw), segment_ids, positions = packed(12)
    o, state = self.attend(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids)
    for doc in (slice(0, DOCS[0]), slice(DOCS[0], None)):
      o_doc, state_doc = self.attend(q[:, doc], k[:, doc], v[:, doc], omega, lam_raw)
      assert relative_l2(o[:, doc], o_doc) <= OUT_TOL
    if self.stateful:
      assert_states_close(state, state_doc)

  def test_changing_one_document_leaves_the_next_unchanged(self):
    (q, k, v, omega, lam_raw), segment_ids, positions = packed(13)
    q2, k2, v2, _, _ = inputs(14, sum(DOCS))
    first = (segment_ids == 4)[:, :, None, None]
    kw = dict(positions=positions, segment_ids=segment_ids)
    o = self.attend(q, k, v, omega, lam_raw, **kw)[0]
    o2 = self.attend(jnp.where(first, q2, q), jnp.where(first, k2, k), jnp.where(first, v2, v), omega,
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


def test_the_kernels_channels_from_factors_are_the_feature_map():
  """``factor_channel`` (the kernels' one statement of Phi's channels) gives ``features.feature_map``'s
  six channels, for a static channel and for a traced or per-lane one, and ``one`` replaces the
  constant channel."""
  rng = np.random.default_rng(0)
  theta, r = (jnp.asarray(rng.uniform(-3, 3, (5, 4)), jnp.float32) for _ in range(2))
  cos, sin = jnp.cos(theta), jnp.sin(theta)
  phi = features.feature_map(theta, r, 6).reshape(5, 4, 6)
  for c in range(6):
    np.testing.assert_allclose(factor_channel(c, cos, sin, r), phi[..., c], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(factor_channel)(jnp.int32(c), cos, sin, r), phi[..., c], rtol=1e-6,
                               atol=1e-6)
  lanes = jnp.asarray([1, 4, 2, 5])  # one channel per last-axis position
  np.testing.assert_allclose(factor_channel(lanes, cos, sin, r),
                             jnp.take_along_axis(phi, lanes[None, :, None], axis=-1)[..., 0], rtol=1e-6)
  np.testing.assert_array_equal(factor_channel(0, cos, sin, r, one=0.0), 0.0)
