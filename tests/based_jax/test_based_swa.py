"""Sliding-window attention and rotary (MATH §2.2): exact window, softmax reference, decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.sliding_window import (IMPLEMENTATIONS, rotary, sliding_window_attention,
                                      zero_window_state)
from lmcore.numerics import relative_l2

# fp32; the implementations differ only in which masked-out scores they materialise.
TOL = 1e-5
BLOCK = 8

swa = jax.jit(sliding_window_attention, static_argnames=("window", "implementation", "block_size"))


def random_qkv(seed, length, batch=2, heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
          for _ in range(3)]


def reference(q, k, v, window, segment_ids=None):
  """Masked full softmax in float64: key j visible to query i iff i-window <= j <= i, same doc."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  length = q.shape[1]
  s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  mask = np.broadcast_to((j <= i) & (j >= i - window), (q.shape[0], length, length))
  if segment_ids is not None:
    seg = np.asarray(segment_ids)
    mask = mask & (seg[:, :, None] == seg[:, None, :])
  s = np.where(mask[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhts,bshv->bthv", p / p.sum(-1, keepdims=True), v)


def test_rotary_is_the_neox_half_rotation():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
  pos = rng.integers(0, 100, size=(2, 5))
  angle = pos[..., None, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
  x1, x2 = x[..., :4], x[..., 4:]
  expected = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                             x2 * np.cos(angle) + x1 * np.sin(angle)], -1)
  np.testing.assert_allclose(rotary(jnp.asarray(x), jnp.asarray(pos)), expected, rtol=1e-5,
                             atol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
  q, k, _ = random_qkv(1, 1, batch=1, heads=1)
  at = lambda x, position: rotary(x, jnp.full((1, 1), position))
  score = lambda m, n: float((at(q, m) * at(k, n)).sum())
  assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
  assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("length,window", [(1, 5), (7, 5), (33, 5), (67, 16), (33, 0)])
def test_equals_masked_full_softmax_reference(implementation, length, window):
  q, k, v = random_qkv(length + window, length)
  o, _ = swa(q, k, v, window=window, implementation=implementation, block_size=BLOCK)
  assert relative_l2(o, reference(q, k, v, window)) < TOL


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sees_exactly_its_window(implementation):
  window, query = 5, 20
  q, k, v = random_qkv(2, 33)

  def out(k, v):
    o, _ = sliding_window_attention(q, k, v, window=window, implementation=implementation,
                                    block_size=BLOCK)
    return o[:, query].sum()

  dk, dv = jax.jit(jax.grad(out, argnums=(0, 1)))(k, v)
  per_key = np.abs(np.asarray(dk)).sum((0, 2, 3)) + np.abs(np.asarray(dv)).sum((0, 2, 3))
  # Keys 0 .. window steps back (window - 1 back included) matter; window + 1 back is exactly zero.
  assert np.all(per_key[query - window:query + 1] > 0)
  assert np.all(per_key[:query - window] == 0) and np.all(per_key[query + 1:] == 0)


def test_blocked_and_full_gradients_agree():
  q, k, v = random_qkv(3, 33)
  c = jnp.asarray(np.random.default_rng(4).normal(size=v.shape), jnp.float32)
  grad = lambda impl: jax.jit(jax.grad(lambda args: (sliding_window_attention(
      *args, window=5, implementation=impl, block_size=BLOCK)[0] * c).sum()))((q, k, v))
  for g_blocked, g_full in zip(grad("blocked"), grad("full")):
    assert relative_l2(g_blocked, g_full) < TOL


def test_decode_token_by_token_equals_full_forward_past_the_window():
  q, k, v = random_qkv(5, 33)
  expected = reference(q, k, v, window=5)
  state = zero_window_state(2, 5, 2, 8, 8)
  outputs = []
  for t in range(33):
    o, state = swa(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], window=5, state=state,
                   implementation="blocked", block_size=BLOCK)
    outputs.append(o)
  assert relative_l2(jnp.concatenate(outputs, 1), expected) < TOL
  assert np.all(np.asarray(state.length) == 33)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_prefill_then_chunks_and_tokens_equal_full_forward(implementation):
  q, k, v = random_qkv(6, 67)
  expected = reference(q, k, v, window=16)
  outputs, state, start = [], None, 0
  for size in (33, 7, 1, 7, 1, 1, 17):
    sl = slice(start, start + size)
    o, state = swa(q[:, sl], k[:, sl], v[:, sl], window=16, state=state,
                   implementation=implementation, block_size=BLOCK)
    outputs.append(o)
    start += size
  assert relative_l2(jnp.concatenate(outputs, 1), expected) < TOL


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_segment_ids_confine_attention_to_the_document_across_calls(implementation):
  q, k, v = random_qkv(7, 33)
  segment_ids = jnp.asarray([np.repeat(np.arange(4), (3, 12, 1, 17)), np.repeat([5, 6], (30, 3))])
  expected = reference(q, k, v, window=5, segment_ids=segment_ids)
  whole, _ = swa(q, k, v, window=5, segment_ids=segment_ids, implementation=implementation,
                 block_size=BLOCK)
  assert relative_l2(whole, expected) < TOL
  # Split inside documents: the state carries where the current document began.
  outputs, state, start = [], None, 0
  for size in (7, 1, 25):
    sl = slice(start, start + size)
    o, state = swa(q[:, sl], k[:, sl], v[:, sl], window=5, state=state,
                   segment_ids=segment_ids[:, sl], implementation=implementation, block_size=BLOCK)
    outputs.append(o)
    start += size
  assert relative_l2(jnp.concatenate(outputs, 1), expected) < TOL


def test_bf16_outputs_and_ring_buffer_keep_the_input_dtype():
  q, k, v = (x.astype(jnp.bfloat16) for x in random_qkv(8, 9))
  o, state = swa(q, k, v, window=4, implementation="blocked", block_size=BLOCK)
  assert o.dtype == state.k.dtype == jnp.bfloat16 and state.k.shape == (2, 5, 2, 8)


def test_unknown_implementation_is_rejected():
  q, k, v = random_qkv(9, 3)
  with pytest.raises(ValueError, match="blocked"):
    sliding_window_attention(q, k, v, window=2, implementation="flash")
