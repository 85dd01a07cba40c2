"""BASED mixers (MATH §2.1–§2.4): parameter layouts, decode == forward, implementations agree, the
Taylor mixer's config (implementation names, tiles) and FLOP counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from based_jax import BaseConv, SlidingWindowAttention, TaylorLinearAttention, ZoologyBaseConv
from based_jax.ops.taylor_attention import REGISTRY, Problem
from based_jax.ops.taylor_attention.pallas_triton_blocked import BlockedTiles
from lmcore.ops.common.backend import ChunkTiles
from lmcore.registry import mixer_class
from lmcore.mixers.base import InitSpec
from lmcore.numerics import relative_l2

TOL = 1e-5  # fp32
D = 16
SMALL = {
    "taylor": (TaylorLinearAttention, dict(n_heads=2, feature_dim=4, tiles={"chunk": 4})),
    "taylor_decay": (TaylorLinearAttention,
                     dict(n_heads=2, feature_dim=4, tiles={"chunk": 4}, decay=True)),
    "swa": (SlidingWindowAttention, dict(n_heads=2, window=3, block_size=4)),
    "base_conv": (BaseConv, {}),
    "base_conv_zoology": (ZoologyBaseConv, {}),
}


def build(name, seed=0, dtype=jnp.float32, **overrides):
  cls, cfg = SMALL[name]
  return cls(cls.Config(**{**cfg, **overrides}), d_model=D, dtype=dtype, rngs=nnx.Rngs(seed))


@nnx.jit
def call(mixer, x, state):
  return mixer(x, state)


def param_count(cls, d_model, **cfg):
  mixer = nnx.eval_shape(lambda: cls(cls.Config(**cfg), d_model=d_model, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(mixer, nnx.Param)))


@pytest.mark.parametrize("d_model,layers,taylor,swa,mlp_hidden,expected", [
    (1024, 27, (1, 6, 11, 16, 21), (2, 7, 12, 17, 22), 2048, 362_620_928),
    (1792, 36, (1, 6, 11, 16, 21, 27, 33), (2, 7, 12, 17, 22, 28, 34), 3584, 1_349_453_056),
])
def test_model_parameter_count_matches_the_released_models(d_model, layers, taylor, swa,
                                                            mlp_hidden, expected):
  counts = {"taylor": param_count(TaylorLinearAttention, d_model),
            "swa": param_count(SlidingWindowAttention, d_model),
            "base_conv": param_count(BaseConv, d_model)}
  kinds = ["taylor" if i in taylor else "swa" if i in swa else "base_conv" for i in range(layers)]
  blocks = layers * (3 * d_model * mlp_hidden + 2 * d_model)  # SwiGLU + two RMSNorms
  total = sum(counts[k] for k in kinds) + blocks + 50264 * d_model + d_model
  assert total == expected


def test_per_layer_parameter_counts_follow_the_reference_formulas():
  d = 1024
  assert param_count(TaylorLinearAttention, d) == 2 * 256 * d + 2 * d * d
  assert param_count(TaylorLinearAttention, d, decay=True) == 2 * 256 * d + 2 * d * d + 16 * d + 16
  assert param_count(SlidingWindowAttention, d) == 4 * d * d
  assert param_count(BaseConv, d) == 6 * d * d + 11 * d
  assert param_count(ZoologyBaseConv, d) == d * d + d + 3 * d + d


def test_registry_names_resolve_to_these_classes():
  assert mixer_class("taylor") is TaylorLinearAttention
  assert mixer_class("swa") is SlidingWindowAttention
  assert mixer_class("base_conv") is BaseConv
  assert mixer_class("base_conv_zoology") is ZoologyBaseConv


@pytest.mark.parametrize("name", list(SMALL))
def test_decode_token_by_token_equals_full_forward(name):
  mixer = build(name)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 11, D)), jnp.float32)
  expected, _ = call(mixer, x, None)
  state, outputs = mixer.init_state(2, 11), []
  for t in range(11):
    y, state = call(mixer, x[:, t:t + 1], state)
    outputs.append(y)
  assert relative_l2(jnp.concatenate(outputs, 1), expected) < TOL


@pytest.mark.parametrize("name", list(SMALL))
def test_prefill_then_decode_equals_full_forward(name):
  mixer = build(name)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 11, D)), jnp.float32)
  expected, _ = call(mixer, x, None)
  prefill, state = call(mixer, x[:, :7], None)
  outputs = [prefill]
  for t in range(7, 11):
    y, state = call(mixer, x[:, t:t + 1], state)
    outputs.append(y)
  assert relative_l2(jnp.concatenate(outputs, 1), expected) < TOL


@pytest.mark.parametrize("decay", [False, True])
def test_taylor_mixer_chunked_parallel_recurrent_agree(decay):
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 11, D)), jnp.float32)
  out = {impl: call(build("taylor", implementation=impl, decay=decay,
                          tiles={"chunk": 4} if impl == "chunked" else None), x, None)
         for impl in ("chunked", "parallel", "recurrent")}
  for impl in ("chunked", "parallel"):
    assert relative_l2(out[impl][0], out["recurrent"][0]) < TOL
    assert relative_l2(out[impl][1].S, out["recurrent"][1].S) < TOL


def test_taylor_mixer_runs_a_kernel_at_tiles_from_a_mapping_like_parallel():
  """``implementation="pallas_blocked"`` with tiles given as a config file's mapping reaches the
  kernels (interpreted here) at that typed tiling; the default implementation stays "chunked"."""
  assert TaylorLinearAttention.Config().implementation == "chunked"
  kernel = build("taylor", implementation="pallas_blocked", tiles={"block_q": 16, "block_k": 32})
  assert kernel.config.tiles == BlockedTiles(16, 32)
  x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 21, D)), jnp.float32)
  y_kernel, state_kernel = call(kernel, x, None)
  y_ref, state_ref = call(build("taylor", implementation="parallel", tiles=None), x, None)
  assert relative_l2(y_kernel, y_ref) < TOL and relative_l2(state_kernel.S, state_ref.S) < TOL


def test_taylor_mixer_built_with_auto_runs_its_xla_form_on_cpu():
  x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 9, D)), jnp.float32)
  y_auto, _ = call(build("taylor", implementation="auto", tiles=None), x, None)
  y_xla, _ = call(build("taylor", implementation="chunked", tiles=None), x, None)
  np.testing.assert_array_equal(y_auto, y_xla)


def test_taylor_config_checks_names_and_types_its_tiles():
  assert TaylorLinearAttention.Config(tiles={"chunk": 32}).tiles == ChunkTiles(32)
  assert TaylorLinearAttention.Config(implementation="auto").tiles is None
  with pytest.raises(ValueError, match="Taylor tiles: tiles belong to one backend, but the implementation is "
                                       "'auto'"):
    TaylorLinearAttention.Config(implementation="auto", tiles={"chunk": 32})
  with pytest.raises(ValueError, match="Taylor tiles: ChunkTiles has no field 'chunk_size'; valid: chunk"):
    TaylorLinearAttention.Config(tiles={"chunk_size": 32})
  with pytest.raises(ValueError, match="unknown implementation 'pallas'; valid: parallel, recurrent, "
                                       "chunked, pallas_blocked, pallas_fused, pallas_tpu or 'auto'"):
    TaylorLinearAttention.Config(implementation="pallas")
  with pytest.raises(ValueError, match="unknown precision 'fp16'"):
    TaylorLinearAttention.Config(kernel_precision="fp16")


def _abstract_taylor(d_model: int, **fields):
  return nnx.eval_shape(lambda: TaylorLinearAttention(TaylorLinearAttention.Config(**fields),
                                                      d_model=d_model, rngs=nnx.Rngs(0)))


def test_taylor_flops_are_the_backends_count_and_auto_counts_as_on_a_gpu():
  """Projections plus H times the backend's ``flops_per_head`` (d', dv = D / H, the decay and feature
  layout in the problem); "auto" as it resolves on a GPU: BASED 360M's and 1.3B's heads at T = 2048
  count the blocked kernels, at 8192 the fused-chunk ones, with the decay ablation XLA chunked."""
  d_model, T = 1024, 2048
  dense = 2 * 1024 * (2 * 16 * 16 + 1024) + 2 * 1024 * 1024
  chunked = lambda chunk, F: 2 * chunk * (16 + 65) + 4 * F * 65  # scores at d' = 16, dv + 1 = 65 columns
  per_head = {  # the full layout: F = 273; the TPU kernels' rows are compact (153), their chunks >= 128
      ("chunked", ChunkTiles(32)): chunked(32, 273), ("pallas_fused", None): chunked(128, 273),
      ("pallas_tpu", None): chunked(128, 153), ("recurrent", None): 4 * 273 * 65,
      ("pallas_blocked", None): (16 + 65) * (T + 1)}
  for (name, tiles), count in per_head.items():
    mixer = _abstract_taylor(d_model, implementation=name, tiles=tiles, feature="full")
    assert mixer.flops_per_token(T) == dense + 16 * count, name
    problem = Problem("gpu", 16, 64, T, feature="full")
    assert REGISTRY.backends[name].flops_per_head(problem, tiles) == count, name
  assert _abstract_taylor(d_model, tiles={"chunk": 32}).flops_per_token(T) == dense + 16 * chunked(32, 153)

  def flops(d_model, implementation, T=T, **fields):
    return _abstract_taylor(d_model, implementation=implementation, **fields).flops_per_token(T)

  for d in (1024, 1792):
    assert flops(d, "auto") == flops(d, "pallas_blocked") == flops(d, "parallel")
    assert flops(d, "auto", 8192) == flops(d, "pallas_fused", 8192)
  assert flops(1024, "auto", decay=True) == flops(1024, "chunked", decay=True)
  assert flops(1024, "auto", decay=True) != flops(1024, "chunked")  # dt_proj


@pytest.mark.parametrize("name", list(SMALL))
def test_state_bytes_match_the_initial_state(name):
  mixer = build(name)
  leaves = jax.tree.leaves(mixer.init_state(3, 100))
  counters = 2 * 3 * 4 if name == "swa" else 0  # SWA's int32 length/start are not counted
  assert mixer.state_bytes(3, 100) == sum(x.nbytes for x in leaves) - counters


def test_state_bytes_of_the_360m_layers():
  abstract = lambda cls: nnx.eval_shape(lambda: cls(cls.Config(), d_model=1024, rngs=nnx.Rngs(0)))
  taylor, swa, conv = map(abstract, (TaylorLinearAttention, SlidingWindowAttention, BaseConv))
  assert taylor.state_bytes(1) == 16 * (153 * 64 + 153) * 4
  assert swa.state_bytes(1) == 65 * 2 * 1024 * 4
  assert conv.state_bytes(1) == 2 * 2048 * 4


@pytest.mark.parametrize("name", list(SMALL))
def test_bf16_compute_keeps_fp32_params_and_bf16_outputs(name):
  mixer = build(name, dtype=jnp.bfloat16)
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 5, D)), jnp.bfloat16)
  y, _ = call(mixer, x, None)
  assert y.dtype == jnp.bfloat16
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(mixer, nnx.Param)))


def test_output_projections_use_the_output_init_scale():
  mixer = TaylorLinearAttention(TaylorLinearAttention.Config(), d_model=256,
                                init=InitSpec(std=0.02, out_std=0.002), rngs=nnx.Rngs(0))
  assert np.std(mixer.proj_q.kernel[...]) == pytest.approx(0.02, rel=0.05)
  assert np.std(mixer.out_proj.kernel[...]) == pytest.approx(0.002, rel=0.05)
