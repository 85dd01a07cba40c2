"""Short causal convolutions and the BaseConv gates (MATH §2.3): reference, decode, documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.base_conv import causal_depthwise_conv, silu_gated_conv, zoology_gated_conv
from lmcore.numerics import relative_l2

TOL = 1e-6  # fp32; three-tap sums.

conv = jax.jit(causal_depthwise_conv)
lm_gate = jax.jit(silu_gated_conv)
zoology_gate = jax.jit(zoology_gated_conv)


def normal(rng, *shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def torch_style_conv(u, w, bias):
  """PyTorch Conv1d(groups=C, padding=K-1) truncated to the first T outputs, in numpy."""
  u, w = np.asarray(u, np.float64), np.asarray(w, np.float64)
  taps, length = w.shape[0], u.shape[1]
  padded = np.pad(u, [(0, 0), (taps - 1, 0), (0, 0)])
  return sum(padded[:, i:i + length] * w[i] for i in range(taps)) + np.asarray(bias)


@pytest.mark.parametrize("taps", [1, 3, 4])
def test_conv_equals_padded_depthwise_conv1d(taps):
  rng = np.random.default_rng(taps)
  u, w, b = normal(rng, 2, 11, 6), normal(rng, taps, 6), normal(rng, 6)
  y, state = conv(u, w, b)
  assert relative_l2(y, torch_style_conv(u, w, b)) < TOL
  np.testing.assert_array_equal(state, u[:, 11 - (taps - 1):])


def test_bf16_inputs_give_the_fp32_conv_of_their_values_rounded_once():
  """The window stays in the inputs' dtype and each tap is widened where it is multiplied: output and
  state are those of the same values in fp32 (output rounded once to bf16), with a bf16 or fp32 state."""
  rng = np.random.default_rng(12)
  u, w, state = normal(rng, 2, 9, 5).astype(jnp.bfloat16), normal(rng, 3, 5), normal(rng, 2, 2, 5)
  state = state.astype(jnp.bfloat16)
  for dtype in (jnp.bfloat16, jnp.float32):
    got, got_state = conv(u.astype(dtype), w, state=state)
    want, want_state = conv(u.astype(dtype).astype(jnp.float32), w, state=state.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(dtype), np.float32))
    np.testing.assert_array_equal(np.asarray(got_state, np.float32), np.asarray(want_state, np.float32))


def test_the_recomputed_gate_keeps_only_its_inputs_and_gives_the_same_gradients():
  """``remat=True``: autodiff keeps u1, u2 and the taps (and the output, for the square in the loss);
  the fp32 taps, the convolution's output and SiLU's are recomputed. The gradients are those of
  ``remat=False`` (the same ops run again, to fp32 rounding: XLA may fuse the recomputation otherwise)."""
  rng = np.random.default_rng(13)
  u1, u2, w = normal(rng, 2, 10, 6), normal(rng, 2, 10, 6), normal(rng, 3, 6)

  def loss(remat):
    return lambda u1, u2, w: (silu_gated_conv(u1, u2, w, remat=remat)[0] ** 2).sum()

  def kept(remat):
    vjp = jax.eval_shape(lambda *a: jax.vjp(loss(remat), *a)[1], u1, u2, w)
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(vjp))

  inputs_and_output = sum(a.size * a.dtype.itemsize for a in (u1, u2, w, u2))
  assert kept(True) <= inputs_and_output < kept(False)
  grads = [jax.jit(jax.grad(loss(remat), argnums=(0, 1, 2)))(u1, u2, w) for remat in (True, False)]
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("gate", ["lm", "zoology"])
def test_decode_token_by_token_equals_full_forward(gate):
  rng = np.random.default_rng(1)
  u, u2, w, b = normal(rng, 2, 9, 6), normal(rng, 2, 9, 6), normal(rng, 3, 6), normal(rng, 6)
  run = ((lambda sl, st: lm_gate(u[:, sl], u2[:, sl], w, state=st)) if gate == "lm" else
         (lambda sl, st: zoology_gate(u[:, sl], u2[:, sl], w, b, state=st)))
  expected, expected_state = run(slice(None), None)
  outputs, state = [], jnp.zeros((2, 2, 6))
  for t in range(9):
    o, state = run(slice(t, t + 1), state)
    outputs.append(o)
  assert relative_l2(jnp.concatenate(outputs, 1), expected) < TOL
  np.testing.assert_array_equal(state, expected_state)


def test_lm_gate_is_silu_of_conv_times_u2():
  rng = np.random.default_rng(2)
  u1, u2, w = normal(rng, 2, 7, 4), normal(rng, 2, 7, 4), normal(rng, 3, 4)
  c = torch_style_conv(u1, w, 0.0)
  y, _ = lm_gate(u1, u2, w)
  assert relative_l2(y, c / (1 + np.exp(-c)) * np.asarray(u2)) < TOL


def test_zoology_gate_is_conv_times_projection_plus_input():
  rng = np.random.default_rng(3)
  u, p, w, b = normal(rng, 2, 7, 4), normal(rng, 2, 7, 4), normal(rng, 3, 4), normal(rng, 4)
  y, _ = zoology_gate(u, p, w, b)
  assert relative_l2(y, torch_style_conv(u, w, b) * np.asarray(p) + np.asarray(u)) < TOL


def test_segment_ids_cut_the_taps_at_document_starts():
  rng = np.random.default_rng(4)
  u, w, b = normal(rng, 2, 12, 5), normal(rng, 3, 5), normal(rng, 5)
  prefix = normal(rng, 2, 2, 5)
  segment_ids = jnp.asarray([np.repeat([0, 1, 2], (4, 1, 7)), np.zeros(12, int)])
  y, state = conv(u, w, b, state=prefix, segment_ids=segment_ids)
  # Row 0: document 0 continues the prefix, documents 1 and 2 start from zeros.
  first, _ = conv(u[:, :4], w, b, state=prefix)
  second, _ = conv(u[:, 4:5], w, b)
  third, third_state = conv(u[:, 5:], w, b)
  whole, whole_state = conv(u, w, b, state=prefix)
  assert relative_l2(y[0], jnp.concatenate([first, second, third], 1)[0]) < TOL
  np.testing.assert_array_equal(state[0], third_state[0])
  assert relative_l2(y[1], whole[1]) < TOL
  np.testing.assert_array_equal(state[1], whole_state[1])


def test_state_of_a_document_shorter_than_the_window_holds_zeros_before_it():
  rng = np.random.default_rng(5)
  u, w = normal(rng, 1, 6, 3), normal(rng, 3, 3)
  _, state = conv(u, w, segment_ids=jnp.asarray([[0, 0, 0, 0, 0, 1]]))
  np.testing.assert_array_equal(state[0, 0], 0.0)
  np.testing.assert_array_equal(state[0, 1], u[0, 5])
