"""Gated DeltaNet mixer (MATH §4) and its short convolution: decode = full forward, chunked =
recurrent form, packed documents stay apart, FLA's gate initialisation and the state accounting.

Comparisons use the relative L2 error ||a - b|| / ||b|` at fp32 (errors ~1e-7; tolerance 1e-5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore.registry import mixer_class
from lmcore.mixers.gated_deltanet import NO_WEIGHT_DECAY, GatedDeltaNet
from lmcore.mixers.short_conv import ShortConv
from lmcore.numerics import relative_l2

B, T, D = 2, 11, 32
# V = 2 K (FLA's expand_v) so that a K/V mix-up cannot pass; chunk 4 leaves a partial last chunk.
CONFIG = GatedDeltaNet.Config(n_heads=2, head_dim=8, expand_v=2.0, tiles={"chunk": 4})
FP32_TOL = 1e-5


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
  """fp32 projections at full precision: on GPU the default (TF32) would differ between T = 1 and
  T = 11 calls by ~1e-4 and hide what these tests compare."""
  with jax.default_matmul_precision("highest"):
    yield


def _mixer(implementation: str = "chunked", dtype=jnp.float32, seed: int = 0) -> GatedDeltaNet:
  tiles = CONFIG.tiles if implementation == "chunked" else None
  config = GatedDeltaNet.Config(**{**CONFIG.__dict__, "implementation": implementation, "tiles": tiles})
  return GatedDeltaNet(config, d_model=D, dtype=dtype, rngs=nnx.Rngs(seed))


def _x(seed: int, length: int = T) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=(B, length, D)), jnp.float32)


@nnx.jit
def _call(mixer, x_BxTxD, state=None, segment_ids_BxT=None):
  return mixer(x_BxTxD, state, segment_ids_BxT=segment_ids_BxT)


def _assert_states_close(got, want):
  names = ("conv_q", "conv_k", "conv_v", "S")
  for name, a, b in zip(names, (*got[:3], got.delta.S), (*want[:3], want.delta.S)):
    assert relative_l2(a, b) < FP32_TOL, f"state {name} rel err {relative_l2(a, b):.2e}"


def test_registry_resolves_gdn_to_gated_deltanet():
  assert mixer_class("gdn") is GatedDeltaNet


@pytest.mark.parametrize("prefill", [0, 5])
def test_decode_token_by_token_equals_full_forward(prefill):
  mixer, x = _mixer(), _x(seed=1 + prefill)
  y_full, state_full = _call(mixer, x)
  state = mixer.init_state(B)
  ys = []
  if prefill:
    y, state = _call(mixer, x[:, :prefill], state)
    ys.append(y)
  for t in range(prefill, T):
    y, state = _call(mixer, x[:, t:t + 1], state)
    ys.append(y)
  assert relative_l2(jnp.concatenate(ys, axis=1), y_full) < FP32_TOL
  _assert_states_close(state, state_full)


def test_chunked_mixer_equals_recurrent_mixer_for_outputs_states_and_gradients():
  x, dy = _x(seed=3), _x(seed=4)

  @nnx.jit
  def outputs_and_grads(mixer, x_BxTxD):
    def loss(mixer, x_BxTxD):
      y, state = mixer(x_BxTxD)
      return jnp.sum(y * dy), (y, state)
    (_, (y, state)), (d_params, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        mixer, x_BxTxD)
    return y, state, d_params, dx

  y_c, state_c, d_params_c, dx_c = outputs_and_grads(_mixer("chunked"), x)
  y_r, state_r, d_params_r, dx_r = outputs_and_grads(_mixer("recurrent"), x)
  assert relative_l2(y_c, y_r) < FP32_TOL and relative_l2(dx_c, dx_r) < FP32_TOL
  _assert_states_close(state_c, state_r)
  for (path, g_c), (_, g_r) in zip(nnx.to_flat_state(d_params_c), nnx.to_flat_state(d_params_r)):
    assert relative_l2(g_c[...], g_r[...]) < FP32_TOL, f"d{'.'.join(map(str, path))}"


def test_segment_ids_keep_packed_documents_apart():
  mixer, x = _mixer(), _x(seed=5)
  # The boundary at 6 falls inside the second chunk of 4; both documents of a row restart from zero.
  segment_ids = jnp.asarray([[0] * 6 + [1] * 5, [4] * 6 + [9] * 5], jnp.int32)
  y_packed, _ = _call(mixer, x, segment_ids_BxT=segment_ids)
  y_first, _ = _call(mixer, x[:, :6])
  y_second, _ = _call(mixer, x[:, 6:])
  assert relative_l2(y_packed, jnp.concatenate([y_first, y_second], axis=1)) < FP32_TOL


def test_output_at_t_depends_only_on_tokens_up_to_t():
  mixer, x = _mixer(), _x(seed=6)
  t = 6
  grad_x = nnx.jit(nnx.grad(lambda x, mixer: jnp.sum(mixer(x)[0][:, t])))(x, mixer)
  assert np.all(np.asarray(grad_x[:, t + 1:]) == 0.0)
  assert np.all(np.abs(np.asarray(grad_x[:, :t + 1])).sum(-1) > 0.0)


def test_bf16_compute_returns_bf16_output_and_fp32_state_close_to_fp32():
  x = _x(seed=7)
  y32, state32 = _call(_mixer(dtype=jnp.float32), x)
  y16, state16 = _call(_mixer(dtype=jnp.bfloat16), x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state16))
  # bf16 projections (~4e-3 relative per rounding) through conv, norm and recurrence.
  assert relative_l2(y16, y32) < 3e-2 and relative_l2(state16.delta.S, state32.delta.S) < 3e-2


def test_gate_parameters_follow_fla_init_and_are_named_for_the_weight_decay_mask():
  mixer = GatedDeltaNet(GatedDeltaNet.Config(n_heads=64), d_model=D, rngs=nnx.Rngs(8))
  A = np.exp(np.asarray(mixer.A_log[...]))
  dt = np.asarray(jax.nn.softplus(mixer.dt_bias[...]))
  assert A.min() > 0.0 and A.max() <= 16.0 and A.max() > 8.0
  assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
  no_decay = [path for path, _ in nnx.to_flat_state(nnx.state(mixer, nnx.Param))
              if path[-1] in NO_WEIGHT_DECAY]
  assert sorted(no_decay) == [("A_log",), ("dt_bias",)]


def test_state_bytes_counts_recurrent_state_and_conv_windows():
  mixer = _mixer()
  state = mixer.init_state(3)
  H, K, V, W = CONFIG.n_heads, CONFIG.head_dim, CONFIG.value_dim, CONFIG.conv_size
  assert mixer.state_bytes(3) == sum(leaf.nbytes for leaf in jax.tree.leaves(state))
  assert mixer.state_bytes(3) == 3 * 4 * (H * K * V + (W - 1) * (2 * H * K + H * V))
  default = GatedDeltaNet(GatedDeltaNet.Config(), d_model=D, rngs=nnx.Rngs(0))
  assert default.state_bytes(1) == 4096 + 2304  # the numbers in the state_bytes docstring


def test_invalid_config_raises_with_the_valid_choices():
  with pytest.raises(ValueError, match="valid: recurrent, chunked or 'auto'"):
    GatedDeltaNet(GatedDeltaNet.Config(implementation="pallas"), d_model=D, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="ChunkTiles has no field 'chunk_size'; valid: chunk"):
    GatedDeltaNet.Config(tiles={"chunk_size": 8})
  with pytest.raises(ValueError, match="'recurrent' has no tiles"):
    GatedDeltaNet.Config(implementation="recurrent", tiles={"chunk": 8})
  with pytest.raises(ValueError, match="not an integer"):
    GatedDeltaNet(GatedDeltaNet.Config(head_dim=5, expand_v=1.5), d_model=D, rngs=nnx.Rngs(0))


def _numpy_short_conv(x_BxTxF, kernel_WxF, segment_ids_BxT=None):
  """y_t = silu(sum_i w_i x_{t-W+1+i}), zeros before the start and outside the token's segment."""
  width = kernel_WxF.shape[0]
  y = np.zeros(x_BxTxF.shape)
  for b in range(x_BxTxF.shape[0]):
    for t in range(x_BxTxF.shape[1]):
      for i in range(width):
        s = t - width + 1 + i
        if s >= 0 and (segment_ids_BxT is None or segment_ids_BxT[b, s] == segment_ids_BxT[b, t]):
          y[b, t] += kernel_WxF[i] * x_BxTxF[b, s]
  return y / (1.0 + np.exp(-y))


def test_short_conv_matches_numpy_and_two_pieces_equal_the_whole():
  conv = ShortConv(5, 4, activation=jax.nn.silu, rngs=nnx.Rngs(9))
  x = np.random.default_rng(10).normal(size=(B, 7, 5)).astype(np.float32)
  y, window = conv(jnp.asarray(x))
  assert relative_l2(y, _numpy_short_conv(x, np.asarray(conv.kernel[...]))) < FP32_TOL
  np.testing.assert_array_equal(window, x[:, -3:])
  y_head, window_head = conv(jnp.asarray(x[:, :2]))  # shorter than the window
  y_tail, window_tail = conv(jnp.asarray(x[:, 2:]), window_head)
  assert relative_l2(jnp.concatenate([y_head, y_tail], axis=1), y) < FP32_TOL
  np.testing.assert_array_equal(window_tail, window)


def test_short_conv_does_not_read_across_segment_boundaries():
  conv = ShortConv(5, 4, activation=jax.nn.silu, rngs=nnx.Rngs(11))
  x = np.random.default_rng(12).normal(size=(B, 9, 5)).astype(np.float32)
  segment_ids = np.array([[0, 0, 1, 1, 1, 1, 1, 2, 2], [3] * 9], dtype=np.int32)
  y, _ = conv(jnp.asarray(x), segment_ids_BxT=jnp.asarray(segment_ids))
  assert relative_l2(y, _numpy_short_conv(x, np.asarray(conv.kernel[...]), segment_ids)) < FP32_TOL
