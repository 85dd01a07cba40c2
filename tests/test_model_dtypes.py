"""The backbone in bf16, as it trains: bf16 activations into and out of every mixer and MLP, an fp32
residual stream, fp32 logits.

Tests elsewhere build fp32 models, where a residual added in bf16 and one added in fp32 are the same
thing. Here the model computes in bfloat16 and every block's output is checked against
``h + mixer(norm(h)).astype(float32)``, then ``+ mlp(norm(h)).astype(float32)``, computed from the
block's own submodules: rounding the stream to bf16 moves it by about 1e-3 relative, far above the
1e-6 allowed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.model import LanguageModel
from lmcore.numerics import relative_l2

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 12)), jnp.int32)
# A mixer with a growing cache and one with a fixed fp32 state.
PATTERN, MIXERS = "softmax*1,gla*1", {"softmax": {"n_heads": 2}, "gla": {"n_heads": 2}}


def model_config(dtype: str, mlp: str = "swiglu"):
  return cfg_lib.model_config(dict(vocab_size=97, d_model=32, n_layers=2, pattern=PATTERN,
                                   mlp=mlp, mlp_hidden=48, dtype=dtype, mixers=MIXERS))


@pytest.fixture(scope="module")
def bf16_model():
  return LanguageModel(model_config("bfloat16"), rngs=nnx.Rngs(0))


def reference_block(block, h_BxTxD, positions_BxT):
  """Block's contract: fp32 residual, bf16 mixer and MLP in and out (also checked here)."""
  x = block.mixer_norm(h_BxTxD).astype(jnp.bfloat16)
  y, _ = block.mixer(x, state=None, positions_BxT=positions_BxT, segment_ids_BxT=None)
  assert y.dtype == jnp.bfloat16, f"{type(block.mixer).__name__} returned {y.dtype} for bf16 input"
  h_BxTxD = h_BxTxD + y.astype(jnp.float32)
  if block.mlp is not None:
    y = block.mlp(block.mlp_norm(h_BxTxD).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    h_BxTxD = h_BxTxD + y.astype(jnp.float32)
  return h_BxTxD


@nnx.jit
def block_outputs(model):
  """Per block: (its output, ``reference_block`` of its input); then hidden states, their final-norm
  reference and the logits (one compiled program instead of op-by-op dispatch)."""
  positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
  h = model._embed(TOKENS, positions)
  pairs = []
  for block in model.blocks:
    want = reference_block(block, h, positions)
    h, _ = block(h, None, positions, None)
    pairs.append((h, want))
  hidden, _ = model.hidden_states(TOKENS)
  return pairs, (hidden, model.final_norm(h)), model(TOKENS)[0]


def test_every_block_adds_its_bf16_outputs_to_an_fp32_residual_stream(bf16_model):
  pairs, (hidden, want_hidden), logits = block_outputs(bf16_model)
  for i, (h, want) in enumerate(pairs):
    assert h.dtype == jnp.float32, f"block {i} returned a {h.dtype} residual stream"
    error = relative_l2(h, want)
    assert error < 1e-6, f"block {i}: residual stream differs from the fp32 sum by {error:.2e}"
  assert hidden.dtype == jnp.float32 and relative_l2(hidden, want_hidden) < 1e-6
  assert logits.dtype == jnp.float32


def test_bf16_model_is_close_to_its_fp32_twin_but_really_computes_in_bf16(bf16_model):
  """Same parameters (same seed; parameters are fp32 whatever the compute dtype): logits within bf16
  rounding of the fp32 model's, and not equal to them (the activations really are bf16)."""
  fp32_model = LanguageModel(model_config("float32"), rngs=nnx.Rngs(0))
  params_a = jax.tree.leaves(nnx.state(bf16_model, nnx.Param))
  params_b = jax.tree.leaves(nnx.state(fp32_model, nnx.Param))
  assert all(a.dtype == jnp.float32 and np.array_equal(a, b) for a, b in zip(params_a, params_b))
  logits = nnx.jit(lambda model: model(TOKENS)[0])
  error = relative_l2(logits(bf16_model), logits(fp32_model))
  assert 1e-5 < error < 3e-2, error


def test_decode_state_of_a_bf16_model_is_fp32_where_it_accumulates():
  """Recurrent state is accumulated in fp32 even when activations are bf16 (the GLA layer's S)."""
  model = LanguageModel(model_config("bfloat16"), rngs=nnx.Rngs(0))
  state = nnx.jit(lambda model: model(TOKENS, state=model.init_state(2, 16))[1])(model)
  gla_state = state["layers"][1]
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(gla_state)
             if jnp.issubdtype(leaf.dtype, jnp.floating))
