"""Backbone tests: shapes, causality by gradients, decode == full forward, config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore import config as cfg_lib
from lmcore import remat
from lmcore.model import LanguageModel, abstract_param_count, count_params


def tiny_model_config(pattern="softmax*2", n_layers=2, **model_fields):
  values = dict(vocab_size=97, d_model=32, n_layers=n_layers, pattern=pattern, mlp_hidden=48,
                dtype="float32", **model_fields)
  return cfg_lib.model_config({**values, "mixers": {"softmax": {"n_heads": 4}}})


def make_model(config, seed=0):
  return LanguageModel(config, rngs=nnx.Rngs(seed))


def test_forward_shapes_and_dtypes():
  model = make_model(tiny_model_config())
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (3, 11)), jnp.int32)
  logits, state = model(tokens)
  assert logits.shape == (3, 11, 97) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(logits)))
  np.testing.assert_array_equal(np.asarray(state["position"]), [11, 11, 11])


def test_future_tokens_get_zero_gradient():
  """Causality (nanodo's test): d logits_t / d position-embedding row s is exactly 0 for s > t."""
  model = make_model(tiny_model_config(max_positions=9))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (1, 9)), jnp.int32)
  t = 4

  def logit_at_t(params):
    return nnx.merge(graphdef, params, rest)(tokens)[0][0, t].sum()

  grad_PxD = np.asarray(jax.grad(logit_at_t)(params)["pos_embed"]["embedding"][...])
  assert np.abs(grad_PxD[t + 1:]).max() == 0.0
  assert np.abs(grad_PxD[:t + 1]).min(axis=1).max() > 0.0


def test_remat_gives_the_same_loss_and_gradients_with_one_checkpoint_per_block():
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 16)), jnp.int32)

  def loss_and_grads(remat):
    graphdef, params, rest = nnx.split(make_model(tiny_model_config(remat=remat)), nnx.Param, ...)
    loss = lambda params: nnx.merge(graphdef, params, rest)(tokens)[0].astype(jnp.float32).std()
    primitives = [e.primitive.name for e in jax.make_jaxpr(loss)(params).jaxpr.eqns]
    return jax.value_and_grad(loss)(params), primitives

  (plain, plain_grads), plain_primitives = loss_and_grads(False)
  (remat, remat_grads), remat_primitives = loss_and_grads(True)
  np.testing.assert_allclose(remat, plain, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert remat_primitives.count("remat2") == 2 and "remat2" not in plain_primitives  # jax.checkpoint, per block


def tiny_based_config(**model_fields):
  """BASED's three layer kinds, fp32; the Taylor chunks (8) and SWA blocks (8) end in partial ones at
  T = 21."""
  mixers = {"taylor": {"n_heads": 2, "feature_dim": 4, "implementation": "chunked", "tiles": {"chunk": 8}},
            "swa": {"n_heads": 2, "window": 5, "block_size": 8}, "base_conv": {}}
  return cfg_lib.model_config(dict(vocab_size=97, d_model=32, n_layers=3, pattern="base_conv*3;taylor@1;swa@2",
                                   mlp_hidden=48, dtype="float32", mixers=mixers, **model_fields))


def _based_loss(config, tokens):
  graphdef, params, rest = nnx.split(make_model(config, seed=6), nnx.Param, ...)
  return lambda params: nnx.merge(graphdef, params, rest)(tokens)[0].std(), params


def test_every_remat_policy_gives_the_same_loss_and_gradients_on_a_tiny_based_model():
  """Recomputing in the backward changes what is stored, not what is computed: loss and every
  gradient as without remat, to fp32 rounding (the recomputed forward reruns the same ops)."""
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, 97, (2, 21)), jnp.int32)
  plain_loss, params = _based_loss(tiny_based_config(), tokens)
  plain, plain_grads = jax.jit(jax.value_and_grad(plain_loss))(params)
  # "dots" (BASED's) on every layer, then the others per layer ("none" is the plain path itself).
  for policy in ["dots", "full;dots_except_mlp@1,2"]:
    loss, _ = _based_loss(tiny_based_config(remat=True, remat_policy=policy), tokens)
    got, got_grads = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(got, plain, rtol=1e-6, err_msg=policy)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(plain_grads)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=policy)


def _kept_for_backward(loss, params) -> list[jax.ShapeDtypeStruct]:
  """The arrays ``jax.vjp`` keeps for the backward pass (the leaves of its VJP function), traced only."""
  return jax.tree.leaves(jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params))


def test_each_remat_policy_keeps_what_it_says():
  """Under "dots" a BASED block keeps its input and its projections' outputs ([B, T, width]: at most
  3 dims), a fraction of what plain autodiff keeps (which includes the sliding window's [B, N, H, C, S]
  scores, the Taylor chunks' stacks and the convolution's fp32 copies); "dots_except_mlp" keeps less
  (not the MLP's gate and up), "full" the block inputs alone, "none" what plain autodiff keeps."""
  tokens = jnp.asarray(np.random.default_rng(8).integers(0, 97, (2, 32)), jnp.int32)
  kept = {}
  for name, fields in {"plain": {}, **{p: dict(remat=True, remat_policy=p) for p in remat.POLICIES}}.items():
    kept[name] = _kept_for_backward(*_based_loss(tiny_based_config(**fields), tokens))
  size = {name: sum(a.size * a.dtype.itemsize for a in arrays) for name, arrays in kept.items()}
  assert max(a.ndim for a in kept["dots"]) <= 3 < max(a.ndim for a in kept["plain"])
  assert size["full"] < size["dots_except_mlp"] < size["dots"] < 0.5 * size["plain"]
  assert size["none"] == size["plain"]


def test_a_bad_remat_policy_is_one_line_naming_the_valid_ones():
  """An unknown policy name, or a per-layer pattern whose counts miss model.n_layers (6 in tiny)."""
  from configs import based

  cd = based.get_config("tiny")
  cd.model.remat_policy = "dot"
  with pytest.raises(cfg_lib.ConfigError) as error:
    cfg_lib.experiment_config(cd)
  assert str(error.value) == ("model.remat_policy='dot': unknown policy 'dot'; valid: 'none', 'full', 'dots', "
                              "'dots_except_mlp' (one for every layer, or per layer as model.pattern).")
  cd.model.remat_policy = "dots*5;full@1"
  with pytest.raises(cfg_lib.ConfigError, match=r"^model.remat_policy 'dots\*5;full@1' gives 5 layers but "):
    cfg_lib.experiment_config(cd)


def test_changing_future_tokens_leaves_past_logits_unchanged():
  model = make_model(tiny_model_config())
  tokens = np.random.default_rng(3).integers(0, 97, (2, 12))
  changed = tokens.copy()
  changed[:, 7:] = (changed[:, 7:] + 1) % 97
  a, _ = model(jnp.asarray(tokens, jnp.int32))
  b, _ = model(jnp.asarray(changed, jnp.int32))
  np.testing.assert_array_equal(np.asarray(a[:, :7]), np.asarray(b[:, :7]))
  assert np.abs(np.asarray(a[:, 7:] - b[:, 7:])).max() > 0


@nnx.jit
def _step(model, tokens, state):
  """One call of the model on ``tokens`` from ``state``, compiled once per length (prefill, then T = 1)."""
  return model(tokens, state=state)


def _decode_logits(model, tokens, prefill, max_len):
  state = model.init_state(tokens.shape[0], max_len)
  logits, state = _step(model, tokens[:, :prefill], state)
  steps = [logits]
  for i in range(prefill, tokens.shape[1]):
    logits, state = _step(model, tokens[:, i:i + 1], state)
    steps.append(logits)
  return np.concatenate(steps, axis=1)


def test_decode_token_by_token_equals_full_forward():
  model = make_model(tiny_model_config(max_positions=32))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 10)), jnp.int32)
  full, _ = model(tokens)
  decoded = _decode_logits(model, tokens, prefill=3, max_len=16)
  np.testing.assert_allclose(decoded, np.asarray(full), atol=1e-4, rtol=1e-4)


def test_untied_head_and_layernorm_and_no_mlp():
  config = tiny_model_config(tie_embeddings=False, norm="layernorm", mlp="none")
  model = make_model(config)
  logits, _ = model(jnp.zeros((1, 5), jnp.int32))
  assert logits.shape == (1, 5, 97)
  assert count_params(model) == abstract_param_count(config)


def test_pattern_parsing():
  assert cfg_lib.parse_pattern("a*2,b*1", 3) == ("a", "a", "b")
  assert cfg_lib.parse_pattern("c*5;t@1,3;s@2", 5) == ("c", "t", "s", "t", "c")
  assert cfg_lib.parse_pattern("x", 3) == ("x",) * 3
  with pytest.raises(cfg_lib.ConfigError, match="n_layers"):
    cfg_lib.parse_pattern("a*2", 3)


def test_unknown_keys_name_the_key_and_the_valid_ones():
  with pytest.raises(cfg_lib.ConfigError, match=r"model\.mixers\.softmax\.n_head'.*Did you mean"):
    cfg_lib.model_config({"pattern": "softmax*2", "mixers": {"softmax": {"n_head": 4}}})
  with pytest.raises(cfg_lib.ConfigError, match="Valid keys under 'train'"):
    cfg_lib.experiment_config({"train": {"stepz": 3}})
  with pytest.raises(ValueError, match="unknown mixer kind 'sanatn'"):
    cfg_lib.model_config({"pattern": "sanatn*2"})


def test_with_mixer_overrides_changes_only_matching_fields():
  from lmcore.model import with_mixer_overrides
  config = tiny_model_config()
  changed = with_mixer_overrides(config, rope=False, not_a_field=3)
  assert changed.mixers["softmax"].rope is False
  assert dataclasses.replace(changed.mixers["softmax"], rope=True) == config.mixers["softmax"]


@pytest.mark.parametrize("pattern,n_layers,mixers", [
    ("base_conv*4;taylor@1;swa@2", 4, {"taylor": {"n_heads": 2, "feature_dim": 8},
                                       "swa": {"n_heads": 2, "window": 3}, "base_conv": {}}),
    ("sanatan*2", 2, {"sanatan": {"n_heads": 2, "head_dim": 8, "p": 1}}),
    ("cyfa*1,gdn*1", 2, {"cyfa": {"n_heads": 2, "head_dim": 8, "v_head_dim": 8},
                         "gdn": {"n_heads": 2, "head_dim": 8}}),
])
def test_whole_model_decode_equals_full_forward(pattern, n_layers, mixers):
  """BASED with all three layer types, SANATAN p = 1 and a CyFA/GDN hybrid: a prefill then one token
  at a time gives the full forward's logits (max |Δlogit| ≤ 1e-4 in fp32), past the SWA window."""
  config = cfg_lib.model_config(dict(vocab_size=97, d_model=32, n_layers=n_layers, pattern=pattern,
                                     mlp_hidden=48, dtype="float32", mixers=mixers))
  model = make_model(config, seed=4)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 97, (2, 11)), jnp.int32)
  full, _ = model(tokens)
  decoded = _decode_logits(model, tokens, prefill=4, max_len=11)
  assert np.abs(decoded - np.asarray(full)).max() <= 1e-4
