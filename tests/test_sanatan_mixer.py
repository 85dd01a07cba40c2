"""SanatanMixer (MATH §1.1 data flow, §1.2 state and memory, §1.4 size) and gate stats (§1.3)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore.mixers.base import InitSpec, dense, scaled_linear
from lmcore.numerics import relative_l2
from lmcore.ops.common.backend import ChunkTiles
from sanatan_jax import SanatanMixer, sanatan_attention
from sanatan_jax import features
from sanatan_jax.gate_stats import gate_statistics, sample_positions
from sanatan_jax.mixer import kv_cache_bytes
from sanatan_jax.ops.sanatan_attention.xla import ParallelTiles

D, T = 16, 11
OUT_TOL = 1e-5
# The tests check the math, not code generation (see tests/ops/sanatan_attention/test_base.py).
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# Larger than the 0.02 default, so that |q|, |k| straddle the root saturation band.
_INIT = InitSpec(std=0.5, out_std=0.3)


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
  with jax.numpy_rank_promotion("raise"):
    yield


_TILES = {"parallel": {"rows": 4}, "chunked": {"chunk": 4}}


def _mixer(seed=0, **config):
  implementation = config.get("implementation", "parallel")
  cfg = SanatanMixer.Config(**{"n_heads": 2, "head_dim": 4, "v_head_dim": 3,
                               "tiles": _TILES.get(implementation), **config})
  return SanatanMixer(cfg, d_model=D, init=_INIT, rngs=nnx.Rngs(seed))


def _x(seed, length=T, batch=2):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, length, D)), jnp.float32)


def _apply(mixer):
  """The mixer as a jitted pure function: (x, state) -> (y, new_state)."""
  graphdef, params = nnx.split(mixer)

  def apply(params, x_BxTxD, state):
    return nnx.merge(graphdef, params)(x_BxTxD, state=state)

  apply = jax.jit(apply, compiler_options=_FAST_COMPILE)
  return lambda x_BxTxD, state=None: apply(params, x_BxTxD, state)


def test_decode_token_by_token_after_parallel_prefill_equals_full_forward():
  mixer = _mixer()
  run = _apply(mixer)
  x = _x(1)
  y_full, state_full = run(x)
  prefill = 4
  y_prefill, state = run(x[:, :prefill], mixer.init_state(2))
  ys = [y_prefill]
  for t in range(prefill, T):  # T = 1 calls use decode_implementation = "recurrent"
    y_t, state = run(x[:, t:t + 1], state)
    ys.append(y_t)
  assert relative_l2(jnp.concatenate(ys, axis=1), y_full) <= OUT_TOL
  assert relative_l2(state.S, state_full.S) <= OUT_TOL and relative_l2(state.z, state_full.z) <= OUT_TOL
  np.testing.assert_array_equal(state.position, [T, T])


def test_parallel_chunked_recurrent_mixers_agree():
  x = _x(2)
  y_ref, state_ref = _apply(_mixer(implementation="parallel"))(x)
  for implementation in ("chunked", "recurrent"):
    y, state = _apply(_mixer(implementation=implementation))(x)
    assert relative_l2(y, y_ref) <= OUT_TOL, implementation
    assert relative_l2(state.S, state_ref.S) <= OUT_TOL, implementation


def test_mixer_follows_spec_data_flow():
  """y = Wo(SANATAN(x Wq / sqrt(d), x Wk / sqrt(d), x Wv)), no biases, omega = pi/4 (MATH §1.1)."""
  mixer = _mixer(p=2, implementation="parallel")
  np.testing.assert_array_equal(mixer.omega[...], np.float32(math.pi / 4))
  assert all(layer.bias is None for layer in (mixer.wq, mixer.wk, mixer.wv, mixer.wo))

  @jax.jit
  def by_hand(x, wq, wk, wv, wo, omega, lam_raw):
    split = lambda w, width: (x @ w).reshape(2, T, 2, width)
    q, k, v = split(wq, 4) / 2.0, split(wk, 4) / 2.0, split(wv, 3)
    o, _ = sanatan_attention(q, k, v, omega, lam_raw, p=2)
    return o.reshape(2, T, 6) @ wo

  x = _x(3)
  y, state = _apply(mixer)(x)
  assert state is None
  weights = [layer.kernel[...] for layer in (mixer.wq, mixer.wk, mixer.wv, mixer.wo)]
  assert relative_l2(y, by_hand(x, *weights, mixer.omega[...], mixer.lam_raw[...])) <= OUT_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scaled_linear_is_the_scaled_layer_bit_for_bit_at_power_of_two_scales(dtype):
  """x (s W) + s b == (x W + b) s for s = 2^-3, values and gradients (the mixer's 1 / sqrt(64));
  any other s agrees to rounding."""
  layer = nnx.Linear(D, 8, use_bias=True, dtype=dtype, param_dtype=jnp.float32,
                     bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
  x = _x(4).astype(dtype)

  graphdef, params = nnx.split(layer)

  def loss(params, fn, scale):
    return jnp.sum(jnp.sin(fn(nnx.merge(graphdef, params), x, scale).astype(jnp.float32)))

  plain = lambda layer, x, scale: layer(x) * scale
  by_grad = lambda fn, scale: jax.value_and_grad(loss)(params, fn, scale)
  got, want = jax.tree.leaves(by_grad(scaled_linear, 0.125)), jax.tree.leaves(by_grad(plain, 0.125))
  assert len(got) == 3  # the loss, the kernel's and the bias's gradients
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  # Another scale rounds s W to the compute dtype first: within that dtype's rounding (bf16: 2^-8).
  tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
  assert relative_l2(scaled_linear(layer, x, 0.3), layer(x) * 0.3) <= tol
  assert scaled_linear(dense(D, 8, std=1.0, rngs=nnx.Rngs(1), dtype=dtype), x, 0.5).dtype == dtype


@pytest.mark.parametrize("config,frozen", [({"learn_omega": False}, "omega"),
                                           ({"rotate": False}, "lam_raw")])
def test_ablations_keep_the_parameter_but_give_it_no_gradient(config, frozen):
  mixer = _mixer(**config)
  graphdef, params = nnx.split(mixer, nnx.Param)
  x = _x(4)
  loss = lambda params: jnp.sum(nnx.merge(graphdef, params)(x)[0] ** 2)
  grads = jax.jit(jax.grad(loss), compiler_options=_FAST_COMPILE)(params)
  np.testing.assert_array_equal(grads[frozen][...], 0.0)
  other = {"omega": "lam_raw", "lam_raw": "omega"}[frozen]
  assert float(jnp.abs(grads[other][...]).max()) > 0


def test_p2_mixer_rejects_decode_state_with_a_clear_message():
  mixer = _mixer(p=2)
  with pytest.raises(ValueError, match="no constant-size state"):
    mixer.init_state(2)
  with pytest.raises(ValueError, match="no constant-size state"):
    mixer.state_bytes(2)
  state = _mixer(p=1).init_state(2)
  with pytest.raises(ValueError, match="no constant-size state"):
    mixer(_x(5, length=1), state=state)


def test_config_rejects_unknown_or_unsupported_options():
  with pytest.raises(ValueError, match="SANATAN: implementation 'chunked' needs p = 1 with 6 channels, got "
                                       "p=2 with 6 channels; use one of parallel, pallas_flash, auto"):
    SanatanMixer.Config(p=2, implementation="chunked")
  for field in ("implementation", "decode_implementation"):
    with pytest.raises(ValueError, match="unknown implementation 'pallas'; valid: parallel, chunked"):
      SanatanMixer.Config(**{field: "pallas"})
  with pytest.raises(ValueError, match="channels must be one of"):
    SanatanMixer.Config(channels=5)
  with pytest.raises(ValueError, match="unknown precision 'fp16'"):
    SanatanMixer.Config(kernel_precision="fp16")


def test_config_tiles_become_the_named_backends_typed_tiling():
  """A mapping of fields (a config file or --config override) becomes the backend's frozen tiling; tiles
  with "auto", for a backend without tiles or with a field the tiling lacks are refused at once."""
  assert SanatanMixer.Config(implementation="chunked", tiles={"chunk": 64}).tiles == ChunkTiles(64)
  assert SanatanMixer.Config(implementation="parallel", tiles={"rows": 256}).tiles == ParallelTiles(256)
  assert SanatanMixer.Config(implementation="auto").tiles is None
  with pytest.raises(ValueError, match="SANATAN tiles: tiles belong to one backend, but the implementation "
                                       "is 'auto'"):
    SanatanMixer.Config(implementation="auto", tiles={"chunk": 64})
  with pytest.raises(ValueError, match="SANATAN tiles: implementation 'recurrent' has no tiles"):
    SanatanMixer.Config(implementation="recurrent", tiles={"chunk": 64})
  with pytest.raises(ValueError, match="SANATAN tiles: ChunkTiles has no field 'chunk_size'; valid: chunk"):
    SanatanMixer.Config(implementation="chunked", tiles={"chunk_size": 64})


def test_flops_count_the_backend_auto_runs_on_a_gpu():
  """p = 1 "auto" counts the fused-chunk kernels at their chunk (64), p = 2 the causal half; the
  chunked form its tiles' chunk; a one-token-per-step form 4 · F · (dv + 1) per head."""
  T, H, d = 256, 2, 4
  F, V = 6 * d, d + 1
  dense = 2 * D * 3 * H * d + 2 * H * d * D

  def flops(**config):
    return SanatanMixer(SanatanMixer.Config(n_heads=H, head_dim=d, **config), d_model=D,
                        rngs=nnx.Rngs(0)).flops_per_token(T)

  chunked = lambda C: dense + H * (2 * C * (F + V) + 4 * F * V)
  assert flops(implementation="auto") == flops(implementation="pallas_fused") == chunked(64)
  assert flops(implementation="chunked") == chunked(128)
  assert flops(implementation="chunked", tiles={"chunk": 16}) == chunked(16)
  assert flops(implementation="recurrent") == dense + H * 4 * F * V
  assert flops(p=2, implementation="auto") == flops(p=2) == dense + H * (F + V) * (T + 1)


def _abstract_184m_mixer():
  """One layer of the 184M model (MATH §1.4), shapes only."""
  cfg = SanatanMixer.Config(n_heads=12, head_dim=64)
  return nnx.eval_shape(lambda: SanatanMixer(cfg, d_model=768, rngs=nnx.Rngs(0)))


def test_184m_mixer_has_spec_parameter_count():
  params = nnx.state(_abstract_184m_mixer(), nnx.Param)
  attention = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert attention == 4 * 768**2 + 2 * 12 * 64 == 2_360_832
  # With the 2048 SwiGLU and two RMSNorms this is MATH §1.4's 7,080,960 per block.
  assert attention + 3 * 768 * 2048 + 2 * 768 == 7_080_960


def test_state_bytes_reproduce_spec_memory_accounting():
  """12 layers x 12 heads x (6*64^2 + 6*64) fp32 = 14,376,960 bytes = a 195-token KV cache."""
  total = 12 * _abstract_184m_mixer().state_bytes(1)
  assert total == 14_376_960 == kv_cache_bytes(195, n_layers=12, d_model=768)
  state = _mixer().init_state(3)
  assert _mixer().state_bytes(3) == state.S.nbytes + state.z.nbytes


def test_roots_are_soft_roots_of_pre_rotation_projection_angles():
  mixer = _mixer()
  mixer.omega[...] = mixer.omega[...] + 0.2
  x = _x(6)
  r_q, r_k = mixer.roots(x)
  for r, w in ((r_q, mixer.wq), (r_k, mixer.wk)):
    u = (x @ w.kernel[...]).reshape(2, T, 2, 4) / 2.0
    expected = features.soft_roots(features.angles(u), mixer.omega[...])
    assert relative_l2(r, expected) <= OUT_TOL


def _brute_force_gate_stats(rq, rk, positions):
  """The MATH §1.3 definitions as loops over sequences, sampled queries and causal keys."""
  mismatched, gates, entries = 0, [], 0
  for b, t_P in enumerate(positions):
    for t in t_P:
      for j in range(t + 1):
        mis = np.sign(rq[b, t]) != np.sign(rk[b, j])
        mismatched += mis.sum()
        gates.extend((1 + rq[b, t] * rk[b, j])[mis])
        entries += mis.size
  return mismatched / entries, np.mean(gates) if gates else np.nan, mismatched


def _roots(seed, shape=(2, 9, 2, 3)):
  rng = np.random.default_rng(seed)
  r = np.tanh(4 * rng.normal(size=(2,) + shape))
  r[0, 0, 3, 1, 2] = r[1, 1, 4, 0, 0] = 0.0  # exact zeros: sign 0 mismatches both signs
  return r[0], r[1]


@pytest.mark.parametrize("num_positions", [100, 4])
def test_gate_statistics_match_brute_force_over_causal_same_head_pairs(num_positions):
  rq, rk = _roots(7)
  stats = gate_statistics(rq, rk, num_positions=num_positions, seed=3)
  positions = sample_positions(2, 9, num_positions, seed=3)
  fraction, gate_mean, mismatched = _brute_force_gate_stats(rq, rk, positions)
  np.testing.assert_allclose(stats["mismatch_fraction"], fraction, rtol=1e-12)
  np.testing.assert_allclose(stats["mismatch_gate_mean"], gate_mean, rtol=1e-12)
  assert stats["num_mismatched"] == mismatched
  assert stats["num_pairs"] == sum(int((t + 1).sum()) for t in positions)
  assert stats["frac_saturated_q"] == np.mean(np.abs(rq) > 0.99)
  assert stats["frac_saturated_k"] == np.mean(np.abs(rk) > 0.99)


def test_gate_statistics_sampling_is_deterministic_per_seed_and_nan_safe():
  rq, rk = _roots(8)
  assert gate_statistics(rq, rk, num_positions=4, seed=1) == gate_statistics(
      rq, rk, num_positions=4, seed=1)
  same = np.abs(rq) + 0.5
  stats = gate_statistics(same, same)
  assert stats["mismatch_fraction"] == 0.0 and np.isnan(stats["mismatch_gate_mean"])
  assert stats["num_pairs"] == 2 * 9 * 10 // 2


def test_gate_statistics_of_mixer_roots():
  r_q, r_k = _mixer().roots(_x(9))
  stats = gate_statistics(r_q, r_k, num_positions=5)
  assert 0.0 < stats["mismatch_fraction"] < 1.0
  assert 0.0 <= stats["mismatch_gate_mean"] <= 1.0  # a mismatched gate 1 + rq rk is below 1
