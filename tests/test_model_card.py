"""The model card's analytic FLOPs per token (lmcore/model_card.py, lmcore/mixers/flops.py).

Every expected number is a hand count from the sizes of the config (written out as arithmetic on
literals), never a call to the functions under test: per layer the dense kernels (2 · in · out),
the sequence mixing of the configured implementation per head and token, and for the model the
SwiGLU MLP (2 · 3 · D · hidden per layer) and the unembedding (2 · D · vocab).
"""

import dataclasses
import importlib

import pytest
from flax import nnx

from based_jax.mixers import BaseConv, SlidingWindowAttention, TaylorLinearAttention, ZoologyBaseConv
from based_jax.ops.taylor_attention import xla as taylor_xla
from based_jax.ops.taylor_attention.pallas_triton_fused import FusedTiles
from lmcore import config as cfg_lib
from lmcore import model_card
from lmcore.mixers import (CosFormer, CyFA, GatedDeltaNet, GLA, LinearTransformer, Performer,
                           SoftmaxAttention)
from lmcore.mixers.base import InitSpec
from lmcore.model import with_mixer_overrides
from sanatan_jax.mixer import SanatanMixer


def preset(module: str, name: str) -> cfg_lib.ExperimentConfig:
  return cfg_lib.experiment_config(importlib.import_module(f"configs.{module}").get_config(name))


def mixer(cls, d_model: int = 64, **fields):
  """An abstract mixer (no arrays allocated)."""
  return nnx.eval_shape(lambda: cls(cls.Config(**fields), d_model=d_model, init=InitSpec(),
                                    rngs=nnx.Rngs(0)))


# The SANATAN 184M backbone (configs/sanatan.py): D 768, 12 layers, SwiGLU 2048, vocab 126,349, T 2048;
# 12 heads of d = dv = 64, so F = 6 · 64 = 384 features and 64 + 1 = 65 mixed columns.
SANATAN_PROJECTIONS = 4 * 2 * 768 * 768  # Wq, Wk, Wv, Wo: 4,718,592
SANATAN_MLP = 2 * 3 * 768 * 2048  # 9,437,184
SANATAN_UNEMBEDDING = 2 * 768 * 126_349  # 194,072,064


def test_sanatan_184m_p1_matches_the_hand_count():
  """p = 1, "auto" counted as on a GPU: the fused-chunk kernel, chunks of its 64 tokens."""
  mixing = 12 * (2 * 64 * (384 + 65) + 4 * 384 * 65)  # 12 · 157,312 = 1,887,744
  forward = 12 * (SANATAN_PROJECTIONS + mixing + SANATAN_MLP) + SANATAN_UNEMBEDDING
  config = preset("sanatan", "184m_p1_scratch")
  card = model_card.card(config.model, config.data.seq_len)
  assert forward == 386_594_304
  assert card["flops_per_token_forward"] == pytest.approx(forward, rel=1e-12)
  assert card["flops_per_token_train"] == pytest.approx(3 * forward, rel=1e-12)
  parts = card["flops_per_token_forward_parts"]
  assert parts["mixers"] == pytest.approx(12 * (SANATAN_PROJECTIONS + mixing), rel=1e-12)
  assert parts["mlp"] == 12 * SANATAN_MLP and parts["unembedding"] == SANATAN_UNEMBEDDING
  assert card["params"] == 183_581_184  # the card's other numbers are unchanged
  assert card["state_bytes_per_sequence"] == 12 * 12 * (384 * 64 + 384) * 4


def test_sanatan_184m_p2_counts_the_causal_half():
  """p = 2 trains with the materialised "parallel" form: (F + dv + 1) · (T + 1) per head."""
  mixing = 12 * (384 + 65) * 2049  # 11,040,012
  forward = 12 * (SANATAN_PROJECTIONS + mixing + SANATAN_MLP) + SANATAN_UNEMBEDDING
  config = preset("sanatan", "184m_p2")
  assert model_card.card(config.model, 2048)["flops_per_token_forward"] == pytest.approx(
      forward, rel=1e-12)
  assert forward == 496_421_520


def test_the_chunked_form_is_counted_per_chunk_not_once():
  """SANATAN's XLA "chunked" counts every chunk: the per-token count of a chunked form does not fall
  as T grows (a chunk counted once would halve it at every doubling)."""
  base = preset("sanatan", "184m_p1_scratch").model
  scan = with_mixer_overrides(base, implementation="chunked")
  mixing = 12 * (2 * 128 * (384 + 65) + 4 * 384 * 65)  # C = 128: 12 · 214,784 = 2,577,408
  per_layer = SANATAN_PROJECTIONS + mixing  # 7,296,000
  for T in (1024, 2048, 4096):
    parts = model_card.flops_per_token(scan, T)
    assert parts["mixers"] == pytest.approx(12 * per_layer, rel=1e-12)
  # About 4.7e6 of projections and 2.6e6 of mixing per layer and token at T = 2048.
  assert 7.0e6 < per_layer < 7.5e6


def test_softmax_presets_match_the_hand_count():
  tiny = preset("baselines", "softmax_tiny")  # D 128, 4 layers, SwiGLU 384, vocab 8192, T 128
  layer = 4 * 2 * 128 * 128 + 4 * (32 + 32) * 129 + 2 * 3 * 128 * 384  # 4 heads of 32
  forward = 4 * layer + 2 * 128 * 8192
  assert forward == 3_933_184
  assert model_card.card(tiny.model, 128)["flops_per_token_forward"] == pytest.approx(forward)

  from benchmarks import train_step
  big = cfg_lib.experiment_config(train_step.PRESETS["softmax_184m"]())  # SANATAN's backbone
  layer = SANATAN_PROJECTIONS + 12 * (64 + 64) * 2049 + SANATAN_MLP
  forward = 12 * layer + SANATAN_UNEMBEDDING
  assert forward == 401_708_544
  assert model_card.card(big.model, 2048)["flops_per_token_forward"] == pytest.approx(forward)
  # Transformer++ at that width (RoPE, no table): the same count, the rotations as uncounted as the
  # table's lookup; the card's parameters lack the table (2,048 × 768).
  card = model_card.card(preset("baselines", "transformer_pp_184m").model, 2048)
  assert card["flops_per_token_forward"] == pytest.approx(forward)
  assert card["params"] == 181_989_888 == 97_036_032 + 12 * (SANATAN_PROJECTIONS // 2 + SANATAN_MLP // 2 + 2 * 768) + 768


def test_based_360m_matches_the_hand_count():
  """D 1024, 27 layers: Taylor at 5, SWA (window 64) at 5, BaseConv at 17; SwiGLU 2048; vocab 50,264."""
  # Taylor, 16 heads of d' = 16, dv = 64: "auto" at T = 2048 < 8192 is the blocked kernel,
  # scores from the raw q · k (width 16) and 64 + 1 mixed columns over the causal half.
  taylor = 2 * 2 * 1024 * 256 + 2 * 2 * 1024 * 1024 + 16 * (16 + 65) * 2049
  # SWA, 16 heads of 64: token t sees min(t + 1, 65) keys, on average 131,040 / 2048 = 63.984375.
  swa = 2 * 1024 * 3072 + 2 * 1024 * 1024 + 16 * 2 * 128 * 63.984375
  base_conv = 2 * 1024 * 4096 + 2 * 2048 * 1024 + 2 * 3 * 2048
  mixers = 5 * taylor + 5 * swa + 17 * base_conv
  forward = mixers + 27 * 2 * 3 * 1024 * 2048 + 2 * 1024 * 50_264
  assert forward == 739_543_056
  config = preset("based", "360m")
  card = model_card.card(config.model, config.data.seq_len)
  assert card["flops_per_token_forward"] == pytest.approx(forward, rel=1e-12)
  assert card["flops_per_token_forward_parts"]["mixers"] == pytest.approx(mixers, rel=1e-12)


# Each mixer alone at D = 64 and T = 256, two implementations (or two settings) each.
T = 256


def test_softmax_counts_the_causal_half_for_every_implementation():
  expected = 4 * 2 * 64 * 64 + 4 * (16 + 16) * 257  # 4 heads of 16
  for implementation in ("xla", "cudnn"):
    m = mixer(SoftmaxAttention, n_heads=4, implementation=implementation)
    assert m.flops_per_token(T) == expected


def test_gla():
  # expand_k 0.5, expand_v 1 at D = 64, 4 heads: d_k = 8, d_v = 16; gate rank 16.
  dense = 2 * 64 * (32 + 32 + 64 + 64 + 16) + 2 * 16 * 32 + 2 * 64 * 64
  chunked = 4 * (2 * 64 * (8 + 16) + 4 * 8 * 16)  # XLA chunk 64
  pallas = 4 * (2 * 16 * (8 + 16) + 4 * 8 * 16)  # the Triton kernel's chunk 16 ("auto" on a GPU)
  recurrent = 4 * 4 * 8 * 16
  assert mixer(GLA, implementation="chunked").flops_per_token(T) == dense + chunked
  assert mixer(GLA, implementation="auto").flops_per_token(T) == dense + pallas
  assert mixer(GLA, implementation="recurrent").flops_per_token(T) == dense + recurrent
  assert mixer(GLA, implementation="chunked", tiles={"chunk": 32}).flops_per_token(T) == dense + 4 * (
      2 * 32 * (8 + 16) + 4 * 8 * 16)
  # The TPU kernels counted on a TPU, at their compiled chunk of at least 128 tokens (min(C, T)).
  assert mixer(GLA, implementation="pallas_tpu").flops_per_token(T) == dense + 4 * (
      2 * min(128, T) * (8 + 16) + 4 * 8 * 16)


def test_cyfa():
  # 2 heads, d_k = d_v = 16; q, k, v, output gate, o; forget per channel (2 · 16), write, strength.
  dense = 4 * 2 * 64 * 32 + 2 * 32 * 64 + 2 * 64 * (32 + 2 + 2)
  fields = dict(n_heads=2, head_dim=16, v_head_dim=16, forget="channel")
  chunked = 2 * (2 * 64 * 32 + 4 * 16 * 16)
  parallel = 2 * (16 + 16) * (T + 1)
  assert mixer(CyFA, implementation="chunked", **fields).flops_per_token(T) == dense + chunked
  assert mixer(CyFA, implementation="parallel", **fields).flops_per_token(T) == dense + parallel


def test_gated_deltanet():
  # 4 heads, K = 16, V = 32, conv 4: q, k (64 -> 64), v, g (64 -> 128), b, a (64 -> 4), o (128 -> 64).
  dense = 2 * 2 * 64 * 64 + 2 * 2 * 64 * 128 + 2 * 2 * 64 * 4 + 2 * 128 * 64
  convs = 2 * 4 * (64 + 64 + 128)
  fields = dict(n_heads=4, head_dim=16, v_head_dim=32)
  wy = 4 * (64 * (5 * 16 + 3 * 32) + 6 * 16 * 32)  # C' = 64: C'(5K + 3V) + 6KV per head
  recurrent = 4 * 6 * 16 * 32
  assert mixer(GatedDeltaNet, implementation="chunked", **fields).flops_per_token(T) == (
      dense + convs + wy)
  assert mixer(GatedDeltaNet, implementation="recurrent", **fields).flops_per_token(T) == (
      dense + convs + recurrent)
  # The chunk is min(chunk, T).
  assert mixer(GatedDeltaNet, implementation="chunked", **fields).flops_per_token(16) == (
      dense + convs + 4 * (16 * (5 * 16 + 3 * 32) + 6 * 16 * 32))


def test_normalised_linear_baselines():
  """4 heads of d = 16, V = 16 + 1 (the normaliser); F = d, m = 32 random features, 2d."""
  dense = 4 * 2 * 64 * 64
  fields = dict(n_heads=4, head_dim=16)
  chunk = lambda F: 4 * (2 * 64 * (F + 17) + 4 * F * 17)
  assert mixer(LinearTransformer, implementation="chunked", **fields).flops_per_token(T) == (
      dense + chunk(16))
  assert mixer(LinearTransformer, implementation="recurrent", **fields).flops_per_token(T) == (
      dense + 4 * 4 * 16 * 17)
  features = 4 * 2 * 2 * 16 * 32  # φ(q), φ(k): x W^T with W [m, d], per head
  assert mixer(Performer, implementation="chunked", n_features=32, **fields).flops_per_token(T) == (
      dense + features + chunk(32))
  assert mixer(Performer, implementation="parallel", n_features=32, **fields).flops_per_token(T) == (
      dense + features + 4 * (32 + 17) * (T + 1))
  assert mixer(CosFormer, implementation="chunked", **fields).flops_per_token(T) == dense + chunk(32)
  assert mixer(CosFormer, implementation="auto", **fields).flops_per_token(T) == dense + 4 * (
      2 * 16 * (32 + 17) + 4 * 32 * 17)  # the Triton kernel's chunk 16


def test_sanatan_mixer():
  # 4 heads of d = dv = 16: projections 4 · 2 · 64 · 64; 6 channels F = 96, 4 channels F = 64.
  dense = 4 * 2 * 64 * 64
  chunked = lambda C, F=96: 4 * (2 * C * (F + 17) + 4 * F * 17)
  cases = [
      (dict(p=1, implementation="chunked"), chunked(128)),
      (dict(p=1, implementation="chunked", tiles={"chunk": 16}), chunked(16)),
      (dict(p=1, implementation="auto"), chunked(64)),  # the fused-chunk kernels' chunk (GPU)
      (dict(p=1, implementation="pallas_fused", tiles={"forward": {"chunk": 32}}), chunked(32)),
      (dict(p=1, implementation="pallas_tpu"), chunked(128)),  # the Mosaic kernels' chunk
      (dict(p=1, implementation="recurrent"), 4 * 4 * 96 * 17),
      (dict(p=2, implementation="parallel"), 4 * (96 + 17) * (T + 1)),
      (dict(p=2, implementation="auto"), 4 * (96 + 17) * (T + 1)),  # the flash kernels on a GPU
      (dict(p=2, channels=4, implementation="pallas_flash"), 4 * (64 + 17) * (T + 1)),
  ]
  for fields, mixing in cases:
    assert mixer(SanatanMixer, **fields).flops_per_token(T) == dense + mixing, fields


def test_taylor():
  # 4 heads of d' = 8, dv = 16: proj_q, proj_k 64 -> 32; proj_v, out_proj 64 -> 64.
  dense = 2 * 2 * 64 * 32 + 2 * 2 * 64 * 64
  compact, full = 1 + 8 + 36, 1 + 8 + 64
  fields = dict(n_heads=4, feature_dim=8)
  chunk = taylor_xla.CHUNK  # the XLA form's default chunk
  assert mixer(TaylorLinearAttention, implementation="chunked", **fields).flops_per_token(T) == (
      dense + 4 * (2 * chunk * (8 + 17) + 4 * compact * 17))
  assert mixer(TaylorLinearAttention, implementation="chunked", tiles={"chunk": 32},
               **fields).flops_per_token(T) == dense + 4 * (2 * 32 * (8 + 17) + 4 * compact * 17)
  assert mixer(TaylorLinearAttention, implementation="recurrent", feature="full",
               **fields).flops_per_token(T) == dense + 4 * 4 * full * 17
  auto = mixer(TaylorLinearAttention, implementation="auto", **fields)
  assert auto.flops_per_token(T) == dense + 4 * (8 + 17) * (T + 1)  # blocked kernels below 8192
  fused_chunk = FusedTiles().chunk  # the fused-chunk kernels from 8192, at their default tiles
  assert auto.flops_per_token(8192) == dense + 4 * (2 * fused_chunk * (8 + 17) + 4 * full * 17)
  decay = mixer(TaylorLinearAttention, implementation="auto", decay=True, **fields)
  assert decay.flops_per_token(T) == dense + 2 * 64 * 4 + 4 * (2 * chunk * (8 + 17)
                                                               + 4 * compact * 17)  # XLA chunked


def test_sliding_window():
  # 4 heads of 16, window 8: token t sees min(t + 1, 9) keys, (45 + (T - 9) · 9) / T on average.
  dense = 2 * 64 * 192 + 2 * 64 * 64
  blocked = mixer(SlidingWindowAttention, n_heads=4, window=8, implementation="blocked")
  assert blocked.flops_per_token(T) == pytest.approx(dense + 4 * 2 * 32 * (45 + 247 * 9) / T)
  assert blocked.flops_per_token(4) == pytest.approx(dense + 4 * 2 * 32 * 10 / 4)  # T < window
  full = mixer(SlidingWindowAttention, n_heads=4, window=8, implementation="full")
  assert full.flops_per_token(T) == dense + 4 * (16 + 16) * (T + 1)


def test_convolutions():
  assert mixer(BaseConv, kernel_size=3).flops_per_token(T) == (
      2 * 64 * 256 + 2 * 128 * 64 + 2 * 3 * 128)
  assert mixer(ZoologyBaseConv, kernel_size=4).flops_per_token(T) == 2 * 64 * 64 + 2 * 4 * 64


def test_auto_counts_as_its_gpu_form_on_any_host():
  """The CPU running this test resolves GLA's "auto" to XLA chunked; the card counts the GPU kernels."""
  model = preset("baselines", "gla_tiny").model
  with_impl = lambda name: with_mixer_overrides(model, implementation=name)
  auto = model_card.card(with_impl("auto"), 64)
  kernel = model_card.card(with_impl("pallas_triton"), 64)
  chunked = model_card.card(with_impl("chunked"), 64)
  assert auto["flops_per_token_train"] == kernel["flops_per_token_train"]
  assert auto["flops_per_token_train"] != chunked["flops_per_token_train"]  # chunk 16 vs 64
  assert auto["state_bytes_per_sequence"] == chunked["state_bytes_per_sequence"] > 0


def test_models_without_an_mlp_count_none():
  model = dataclasses.replace(preset("baselines", "softmax_tiny").model, mlp="none")
  parts = model_card.flops_per_token(model, 128)
  assert parts["mlp"] == 0 and parts["forward"] == parts["mixers"] + 2 * 128 * 8192


def test_a_sequence_length_below_one_is_refused():
  with pytest.raises(ValueError, match="seq_len=0"):
    model_card.flops_per_token(preset("baselines", "softmax_tiny").model, 0)
