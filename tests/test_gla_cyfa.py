"""GLA and CyFA mixers: FLA's GLA parameter layout, the CyFA gates and recurrence, and that chunked,
recurrent and token-by-token decoding compute the same function.

Tolerances: relative L2 error 1e-5 at fp32 (the implementations differ only in summation order).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore.mixers.base import InitSpec
from lmcore.mixers.cyfa import CyFA
from lmcore.mixers.gla import GLA
from lmcore.numerics import relative_l2

RTOL = 1e-5
D = 16
INIT = InitSpec(std=0.3, out_std=0.3)  # large enough that gates and keys vary across tokens


@nnx.jit
def _call(mixer, x_BxTxD, state):
  return mixer(x_BxTxD, state=state)


_gates = nnx.jit(lambda mixer, x_BxTxD: mixer.gates(x_BxTxD))
_monitors = nnx.jit(lambda mixer, x_BxTxD: mixer.monitors(x_BxTxD))


def _x(seed, B=2, T=37, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).normal(size=(B, T, D)), jnp.float32)


def _assert_chunked_equals_recurrent_and_decode_equals_full(cls, config, seed):
  """Same parameters (same seed) under both implementations; decode threads the state per token."""
  chunked = cls(config, d_model=D, init=INIT, rngs=nnx.Rngs(seed))
  recurrent = cls(dataclasses.replace(config, implementation="recurrent", tiles=None), d_model=D, init=INIT,
                  rngs=nnx.Rngs(seed))
  x = _x(seed)
  y, state = _call(chunked, x, None)
  y_ref, state_ref = _call(recurrent, x, None)
  assert relative_l2(y, y_ref) < RTOL and relative_l2(state.S, state_ref.S) < RTOL
  decode_state, ys = chunked.init_state(x.shape[0]), []
  for t in range(x.shape[1]):
    y_t, decode_state = _call(chunked, x[:, t:t + 1], decode_state)
    ys.append(y_t)
  assert relative_l2(jnp.concatenate(ys, axis=1), y) < RTOL and relative_l2(decode_state.S, state.S) < RTOL


def _param_count(module_factory) -> int:
  return sum(p.size for p in jax.tree.leaves(nnx.state(nnx.eval_shape(module_factory), nnx.Param)))


@pytest.mark.parametrize("n_heads,total", [(4, 182_217_984), (12, 182_216_448)])
def test_gla_182m_param_count_matches_fla_layout(n_heads, total):
  """GLA at D = 768, 12 layers, SwiGLU 2048, 2 RMSNorms per block, final norm, tied vocab 126,349.

  Per layer, FLA's GatedLinearAttention holds q, k (768 x 384), v, g, o (768 x 768), the gate
  768 x 16 + 16 x 384 + bias 384 and the group-norm weight of size head_v_dim = 768 / n_heads.
  FLA's default 4 heads give 182,217,984 (279,254,016 untied). MATH §4's 182,216,448
  (279,252,480 untied) is exactly 128 fewer per layer: a norm weight of 64 = head_v_dim at 12 heads.
  """
  mixer = _param_count(lambda: GLA(GLA.Config(n_heads=n_heads), d_model=768, init=InitSpec(),
                                   rngs=nnx.Rngs(0)))
  assert mixer == 2 * 768 * 384 + 3 * 768 * 768 + 768 * 16 + 16 * 384 + 384 + 768 // n_heads
  embeddings, block = 126_349 * 768, mixer + 3 * 768 * 2048 + 2 * 768
  assert 12 * block + embeddings + 768 == total
  assert 12 * block + 2 * embeddings + 768 == total + 97_036_032


def test_gla_log_forget_is_logsigmoid_of_the_low_rank_gate_over_16():
  gla = GLA(GLA.Config(n_heads=2), d_model=D, init=INIT, rngs=nnx.Rngs(0))
  x = _x(1)
  logits = x @ gla.gate_down.kernel[...] @ gla.gate_up.kernel[...] + gla.gate_up.bias[...]
  want = jax.nn.log_sigmoid(logits).reshape(2, 37, 2, 4) / 16
  assert relative_l2(gla.log_forget(x), want) < RTOL
  assert float(jnp.max(gla.log_forget(x))) <= 0.0


def test_gla_chunked_equals_recurrent_and_decode_equals_full_forward():
  config = GLA.Config(n_heads=2, tiles={"chunk": 16})
  _assert_chunked_equals_recurrent_and_decode_equals_full(GLA, config, 2)


def test_gla_state_matches_declared_bytes():
  gla = GLA(GLA.Config(n_heads=2), d_model=D, init=INIT, rngs=nnx.Rngs(0))
  state = gla.init_state(3)
  assert state.S.shape == (3, 2, 4, 8)
  assert gla.state_bytes(3) == sum(a.nbytes for a in jax.tree.leaves(state))


def _cyfa(seed=0, n_heads=2, **fields):
  config = CyFA.Config(n_heads=n_heads, head_dim=4, v_head_dim=3, **fields)
  return CyFA(config, d_model=D, init=INIT, rngs=nnx.Rngs(seed))


def test_cyfa_gate_biases_start_in_the_non_saturated_middle():
  gates = _gates(_cyfa(n_heads=4), jnp.zeros((1, 1, D)))
  np.testing.assert_allclose(jnp.exp(gates.log_forget)[0, 0], jax.nn.sigmoid(jnp.arange(1.0, 5.0)),
                             rtol=1e-6)
  np.testing.assert_allclose(gates.write, 0.5, rtol=1e-6)
  np.testing.assert_allclose(gates.strength, 1.0, rtol=1e-6)


@pytest.mark.parametrize("forget", ["head", "channel"])
def test_cyfa_gates_lie_in_the_unit_interval(forget):
  gates = _gates(_cyfa(forget=forget), _x(3, scale=2.0))
  forget_gate = np.exp(np.asarray(gates.log_forget))
  expected_rank = 4 if forget == "channel" else 3
  assert gates.log_forget.ndim == expected_rank
  for name, g in (("forget", forget_gate), ("write", np.asarray(gates.write))):
    assert ((g > 0) & (g < 1)).all(), f"{name} gate leaves (0, 1): [{g.min()}, {g.max()}]"
  assert (np.asarray(gates.strength) > 0).all()


def test_cyfa_state_follows_the_spec_recurrence():
  """S_t = f_t ⊙ S_{t-1} + min(w_t, w_max) i_t k̂_t v_tᵀ, k̂ = k / max(||k||, k_floor) (float64)."""
  cyfa = _cyfa(4, forget="channel", k_floor=1.5, w_max=1.2)  # the floor and the clip both bite
  x = _x(4)
  _, state = _call(cyfa, x, None)
  gates = _gates(cyfa, x)
  split = lambda a, d: np.asarray(a, np.float64).reshape(2, 37, 2, d)
  k, v = split(cyfa.wk(x), 4), split(cyfa.wv(x), 3)
  norms = np.linalg.norm(k, axis=-1, keepdims=True)
  assert (norms < 1.5).any() and (np.asarray(gates.strength) > 1.2).any()
  k_hat = k / np.maximum(norms, 1.5)
  write = np.minimum(np.asarray(gates.strength, np.float64), 1.2) * np.asarray(gates.write)
  forget = np.exp(np.asarray(gates.log_forget, np.float64))
  S = np.zeros((2, 2, 4, 3))
  for t in range(37):
    k_written = write[:, t, :, None] * k_hat[:, t]
    S = forget[:, t, :, :, None] * S + k_written[..., :, None] * v[:, t, :, None, :]
  assert relative_l2(state.S, S) < RTOL


def test_cyfa_state_stays_finite_and_bounded_over_8192_tokens():
  """With |k̂| <= 1 and writes <= w_max, ||S_t|| <= w_max max||v|| / (1 - max f) for every t."""
  cyfa = _cyfa(5, implementation="recurrent")
  x = _x(5, B=1, T=8192, scale=2.0)
  _, state = _call(cyfa, x, None)
  S = np.asarray(state.S)
  assert np.isfinite(S).all()
  gates = _gates(cyfa, x)
  max_forget = float(jnp.max(jnp.exp(gates.log_forget)))
  max_v = float(jnp.max(jnp.linalg.norm(cyfa.wv(x).reshape(1, 8192, 2, 3), axis=-1)))
  assert np.linalg.norm(S, axis=(-2, -1)).max() <= cyfa.config.w_max * max_v / (1 - max_forget)


@pytest.mark.parametrize("fields", [dict(forget="head"), dict(forget="channel", output_gate=False)])
def test_cyfa_chunked_equals_recurrent_and_decode_equals_full_forward(fields):
  config = CyFA.Config(n_heads=2, head_dim=4, v_head_dim=3, tiles={"chunk": 16}, **fields)
  _assert_chunked_equals_recurrent_and_decode_equals_full(CyFA, config, 6)


def test_cyfa_monitors_report_state_norm_gate_and_strength_statistics():
  cyfa = _cyfa(7, w_max=1.0)  # w starts around 1, so some but not all writes are clipped
  x = _x(7)
  monitors = _monitors(cyfa, x)
  assert set(monitors) == {"state_norm", "forget_mean", "forget_std", "write_gate_mean",
                           "write_gate_std", "write_strength_mean", "write_strength_std",
                           "write_strength_max", "write_strength_clipped_frac"}
  assert all(m.shape == () and np.isfinite(m) for m in monitors.values())
  _, state = _call(cyfa, x, None)
  gates = _gates(cyfa, x)
  strength, forget = np.asarray(gates.strength), np.exp(np.asarray(gates.log_forget))
  want = {"state_norm": np.mean(np.linalg.norm(np.asarray(state.S), axis=(-2, -1))),
          "forget_mean": forget.mean(), "forget_std": forget.std(),
          "write_gate_mean": np.mean(gates.write), "write_gate_std": np.std(gates.write),
          "write_strength_mean": strength.mean(), "write_strength_std": strength.std(),
          "write_strength_max": strength.max(),
          "write_strength_clipped_frac": np.mean(strength > 1.0)}
  assert 0 < want["write_strength_clipped_frac"] < 1
  for name, value in want.items():
    assert math.isclose(float(monitors[name]), float(value), rel_tol=1e-5), name


def _flops(cls, d_model: int, implementation: str, **fields) -> float:
  abstract = nnx.eval_shape(lambda: cls(cls.Config(implementation=implementation, **fields), d_model=d_model,
                                        init=INIT, rngs=nnx.Rngs(0)))
  return abstract.flops_per_token(2048)


def test_flop_counts_follow_the_backend_auto_takes_on_a_gpu_by_head_shape():
  """The model card counts "auto" as it resolves on a GPU: two heads at 768 (192 x 384) are wider than
  the Triton kernels' range and count XLA chunked (C = 64); four (96 x 192) count the kernels (C = 16)."""
  assert _flops(GLA, 768, "auto", n_heads=2) == _flops(GLA, 768, "chunked", n_heads=2)
  assert _flops(GLA, 768, "auto") == _flops(GLA, 768, "pallas_triton")
  assert _flops(GLA, 768, "auto") < _flops(GLA, 768, "chunked")
  assert _flops(CyFA, 512, "auto", head_dim=128, v_head_dim=128) == _flops(
      CyFA, 512, "pallas_triton", head_dim=128, v_head_dim=128)


@pytest.mark.parametrize("cls,fields", [(GLA, dict(n_heads=2)), (CyFA, dict(n_heads=2, head_dim=4, v_head_dim=4))])
def test_auto_runs_chunked_on_cpu_and_the_triton_kernels_agree_with_it(cls, fields):
  """"auto" on this CPU host is exactly XLA "chunked"; what it runs on a GPU, the Triton kernels
  (interpreted here), gives the same outputs within fp32 summation order."""
  x = _x(8, T=9)
  y = {name: _call(cls(cls.Config(implementation=name, **fields), d_model=D, init=INIT, rngs=nnx.Rngs(0)),
                   x, None)[0] for name in ("auto", "chunked", "pallas_triton")}
  np.testing.assert_array_equal(y["auto"], y["chunked"])
  assert relative_l2(y["pallas_triton"], y["chunked"]) <= RTOL
