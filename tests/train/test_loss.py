"""The fused head + cross-entropy equals the materialised form (loss and gradients) and needs far less
memory; "auto" and bad names resolve as documented."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lmcore.config import model_config
from lmcore.model import LanguageModel
from lmcore import loss as loss_lib


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _materialized_sum(h_BxTxD, w_DxV, targets_BxT, weights_BxT):
  logits = jnp.einsum("btd,dv->btv", h_BxTxD, w_DxV)
  return (optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxT) * weights_BxT).sum()


@pytest.mark.parametrize("B,T,D,V,block_tokens", [(2, 37, 24, 101, 16), (3, 5, 8, 67, 0)])
def test_fused_equals_materialized_loss_and_grads_fp32(B, T, D, V, block_tokens):
  """Odd T, odd V (the vocabulary is never split), with weights; three blocks of 13 steps (two padded
  steps) or the default single block: loss and both gradients within 1e-6 relative in fp32."""
  keys = jax.random.split(jax.random.key(B * T + V), 4)
  h = jax.random.normal(keys[0], (B, T, D))
  w = jax.random.normal(keys[1], (D, V)) / np.sqrt(D) * 3
  targets = jax.random.randint(keys[2], (B, T), 0, V)
  weights = jax.random.uniform(keys[3], (B, T))
  fused = lambda h, w: loss_lib.fused_cross_entropy(h, w, targets, weights, compute_dtype=jnp.float32,
                                                    block_tokens=block_tokens)
  want, (dh_want, dw_want) = jax.value_and_grad(_materialized_sum, argnums=(0, 1))(h, w, targets, weights)
  got, (dh, dw) = jax.value_and_grad(fused, argnums=(0, 1))(h, w)
  assert _rel(got, want) <= 1e-6 and _rel(jax.jit(fused)(h, w), want) <= 1e-6
  assert _rel(dh, dh_want) <= 1e-6 and _rel(dw, dw_want) <= 1e-6
  # A scaled loss scales the gradients (the backward multiplies the stored ones by the cotangent).
  dh3 = jax.grad(lambda h: 3.0 * fused(h, w))(h)
  assert _rel(dh3, 3 * dh_want) <= 1e-6


def test_block_length_prefers_divisors_and_pads_the_rest():
  assert loss_lib.block_length(2048, 32, 126_349) == 32  # 2^27 / (32 V) = 33 -> the divisor 32
  assert loss_lib.block_length(37, 2, 101, block_tokens=32) == 13  # 3 balanced blocks, 2 padded steps
  assert loss_lib.block_length(10, 1, 8, block_tokens=1000) == 10


def _tiny_model(tie: bool):
  config = model_config(dict(vocab_size=97, d_model=16, n_layers=2, pattern="softmax*2", mlp_hidden=32,
                             tie_embeddings=tie, dtype="float32", mixers={"softmax": {"n_heads": 2}}))
  return config, nnx.split(LanguageModel(config, rngs=nnx.Rngs(0)), nnx.Param, ...)


@pytest.mark.parametrize("tie", [True, False])
def test_training_loss_is_the_same_through_the_fused_and_materialized_heads(tie):
  """The training loss of a whole model (tied and untied head, T odd): value and every parameter's
  gradient within 1e-6 relative (fp32)."""
  config, (graphdef, params, rest) = _tiny_model(tie)
  tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, config.vocab_size)  # T = 11
  batch = {"tokens": tokens}
  results = {}
  for impl in ("fused", "materialized"):
    loss = lambda p: loss_lib.loss_fn(graphdef, p, rest, batch, False, impl, block_tokens=6)
    results[impl] = jax.value_and_grad(loss)(nnx.to_pure_dict(params))
  (loss_f, grads_f), (loss_m, grads_m) = results["fused"], results["materialized"]
  assert _rel(loss_f, loss_m) <= 1e-6
  flat_m = dict(jax.tree_util.tree_flatten_with_path(grads_m)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(grads_f)[0]:
    assert _rel(g, flat_m[path]) <= 1e-6, jax.tree_util.keystr(path)
  head = "head" if not tie else "embed"
  assert any(head in jax.tree_util.keystr(p) for p in flat_m)


def test_bf16_fused_loss_is_close_to_the_materialized_bf16_loss():
  """bf16 operands, fp32 accumulation in both: the same loss to fp32 rounding of the sum order."""
  config, (graphdef, params, rest) = _tiny_model(True)
  config = dataclasses.replace(config, dtype="bfloat16")
  graphdef = nnx.split(nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
  batch = {"tokens": jax.random.randint(jax.random.key(2), (2, 17), 0, config.vocab_size)}
  params = nnx.to_pure_dict(params)
  fused = loss_lib.loss_fn(graphdef, params, rest, batch, False, "fused", block_tokens=8)
  materialized = loss_lib.loss_fn(graphdef, params, rest, batch, False, "materialized")
  assert abs(float(fused) - float(materialized)) < 1e-5 * float(materialized)


@pytest.mark.xla_optimized
def test_fused_loss_compiles_to_a_fraction_of_the_materialized_memory():
  """Loss and gradients for 8 × 512 tokens at V = 16,384 (fp32 logits: 256 MiB, and again as their
  gradient): XLA's temp buffers of the fused form (a block of logits, dW and its fp32 accumulator) are
  under a tenth of the materialised form's."""
  B, T, D, V = 8, 512, 128, 16_384
  h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
  w = jax.ShapeDtypeStruct((D, V), jnp.float32)
  targets = jax.ShapeDtypeStruct((B, T), jnp.int32)

  def temp_bytes(fn):
    grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    return grad.lower(h, w, targets).compile().memory_analysis().temp_size_in_bytes

  fused = temp_bytes(lambda h, w, t: loss_lib.fused_cross_entropy(h, w, t, compute_dtype=jnp.bfloat16,
                                                                  block_tokens=256))
  materialized = temp_bytes(lambda h, w, t: optax.softmax_cross_entropy_with_integer_labels(
      jnp.einsum("btd,dv->btv", h.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32), t).sum())
  assert materialized >= B * T * V * 4  # at least the fp32 logits
  assert fused < materialized / 10, (fused, materialized)


def test_auto_resolves_per_backend_and_bad_names_fail_with_the_valid_ones():
  assert loss_lib.resolve_loss_impl("auto", "gpu") == loss_lib.AUTO_LOSS_IMPL["gpu"]
  assert loss_lib.resolve_loss_impl("materialized") == "materialized"
  with pytest.raises(ValueError, match="train.loss_impl='fast'; valid: 'auto', 'fused', 'materialized'"):
    loss_lib.resolve_loss_impl("fast")
