"""The learning-rate schedule and AdamW against their closed forms (warmup, then cosine decay to a
fraction of the peak: MATH §1.4 and §2.4).

lr(t) = init + (peak - init) t / W                                         for t < W
lr(t) = floor + (peak - floor) (1 + cos(pi (t - W) / (S - W))) / 2         for W <= t <= S
lr(t) = floor                                                              after S
with floor = min_lr_ratio · peak, W = warmup_steps, S = steps, and t the number of updates already
applied (the first update uses lr(0)).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmcore.config import TrainConfig
from lmcore.train.optim import learning_rate_schedule, make_optimizer


def closed_form(train: TrainConfig, t: int) -> float:
  peak, init, W, S = train.learning_rate, train.warmup_init_lr, train.warmup_steps, train.steps
  floor = train.min_lr_ratio * peak
  if t < W:
    return init + (peak - init) * t / W
  progress = min((t - W) / (S - W), 1.0)
  return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


CONFIGS = [
    TrainConfig(steps=200, warmup_steps=20, learning_rate=1e-3, min_lr_ratio=0.1),
    TrainConfig(steps=101, warmup_steps=7, learning_rate=3e-4, min_lr_ratio=0.25, warmup_init_lr=1e-5),
    TrainConfig(steps=50, warmup_steps=10, learning_rate=2e-3, min_lr_ratio=0.0),
    TrainConfig(steps=40, warmup_steps=0, learning_rate=1e-2, min_lr_ratio=0.1),
]


@pytest.mark.parametrize("train", CONFIGS, ids=lambda t: f"S{t.steps}-W{t.warmup_steps}-r{t.min_lr_ratio}")
def test_schedule_matches_the_closed_form_at_its_landmarks(train):
  """Step 0, the end of warmup, the midpoint of the decay, the last step and after it."""
  schedule = learning_rate_schedule(train)
  W, S = train.warmup_steps, train.steps
  landmarks = {"step 0": 0, "warmup midpoint": W // 2, "end of warmup": W,
               "decay midpoint": W + (S - W) // 2, "step before last": S - 1, "last step": S,
               "after the last step": S + 10}
  for name, t in landmarks.items():
    # fp32 arithmetic: a millionth of the peak absolute (cos near pi loses relative precision).
    assert float(schedule(t)) == pytest.approx(closed_form(train, t), rel=1e-5,
                                               abs=1e-6 * train.learning_rate), f"{name} (t = {t})"
  # The named values, not only the formula: the peak after warmup, min_lr_ratio · peak at the end.
  assert float(schedule(W)) == pytest.approx(train.learning_rate, rel=1e-6)
  assert float(schedule(S)) == pytest.approx(train.min_lr_ratio * train.learning_rate, rel=1e-5,
                                             abs=1e-6 * train.learning_rate)


def test_the_optimizer_applies_the_schedule_and_decays_only_kernels():
  """Constant gradient g on a norm scale: Adam's m̂/sqrt(v̂) is exactly g/|g|, so every step moves it
  by -lr(t) (the rate the optimizer really applies, not only the schedule function). A kernel with
  zero gradient moves only by the decoupled weight decay, -lr(t) · weight_decay · p."""
  train = TrainConfig(steps=30, warmup_steps=6, learning_rate=1e-2, min_lr_ratio=0.2,
                      warmup_init_lr=1e-3, weight_decay=0.1, grad_clip=1.0)
  tx = make_optimizer(train)
  params = {"norm": {"scale": jnp.zeros((3,), jnp.float32)},
            "proj": {"kernel": jnp.ones((2, 2), jnp.float32)}}
  grads = {"norm": {"scale": jnp.full((3,), 0.5, jnp.float32)},
           "proj": {"kernel": jnp.zeros((2, 2), jnp.float32)}}

  def step(carry, _):
    params, opt_state = carry
    updates, opt_state = tx.update(grads, opt_state, params)
    return (jax.tree.map(jnp.add, params, updates), opt_state), (updates, params)

  n = train.steps + 3
  _, (updates, before) = jax.lax.scan(step, (params, tx.init(params)), None, length=n)
  rates = np.asarray([closed_form(train, t) for t in range(n)])
  scale_steps = np.asarray(updates["norm"]["scale"])
  np.testing.assert_allclose(scale_steps, -rates[:, None] * np.ones((1, 3)), rtol=1e-5)
  kernel_steps = np.asarray(updates["proj"]["kernel"])
  expected = -rates[:, None, None] * train.weight_decay * np.asarray(before["proj"]["kernel"])
  np.testing.assert_allclose(kernel_steps, expected, rtol=1e-5)


# ------------------------------------------------------------------------------ which parameters decay

# The decay rule (docs/DECISIONS.md, Training; MATH §1.4 and §2.4): the weight matrices of linear layers
# and of the short convolutions (parameters named `kernel`) decay; embeddings, the position table, the
# tied or untied head's bias, norm scales and biases, and the mixers' own parameters (SANATAN's omega and
# lam_raw, GDN's A_log and dt_bias, BaseConv's long filter conv_kernel) do not. An untied head is a
# linear layer and decays. Each family below lists exactly its decayed paths.
MLP = ("mlp/w_down/kernel", "mlp/w_gate/kernel", "mlp/w_up/kernel")
QKVO = ("mixer/wq/kernel", "mixer/wk/kernel", "mixer/wv/kernel", "mixer/wo/kernel")


def _block(i: int, *names: str) -> set[str]:
  return {f"blocks/{i}/{name}" for name in (*names, *MLP)}


FAMILIES = {
    "sanatan_positions_tied": (
        "sanatan*1", {"sanatan": {"n_heads": 2, "head_dim": 8, "p": 2}}, dict(max_positions=16),
        _block(0, *QKVO)),
    "based": (
        "base_conv*3;taylor@1;swa@2",
        {"taylor": {"n_heads": 2, "feature_dim": 4}, "swa": {"n_heads": 2, "window": 4}, "base_conv": {}}, {},
        _block(0, "mixer/in_proj/kernel", "mixer/out_proj/kernel")
        | _block(1, "mixer/proj_q/kernel", "mixer/proj_k/kernel", "mixer/proj_v/kernel",
                 "mixer/out_proj/kernel")
        | _block(2, "mixer/Wqkv/kernel", "mixer/out_proj/kernel")),
    "softmax_layernorm_untied": (
        "softmax*1", {"softmax": {"n_heads": 2}}, dict(norm="layernorm", tie_embeddings=False),
        _block(0, *QKVO) | {"head/kernel"}),
    "gla": (
        "gla*1", {"gla": {"n_heads": 2}}, {},
        _block(0, *QKVO, "mixer/wg/kernel", "mixer/gate_down/kernel", "mixer/gate_up/kernel")),
    "cyfa_gdn_untied": (
        "cyfa*1,gdn*1",
        {"cyfa": {"n_heads": 2, "head_dim": 8, "v_head_dim": 8}, "gdn": {"n_heads": 2, "head_dim": 8}},
        dict(tie_embeddings=False),
        _block(0, *QKVO, "mixer/wg/kernel", "mixer/w_forget/kernel", "mixer/w_strength/kernel",
               "mixer/w_write/kernel")
        | _block(1, *(f"mixer/{n}_proj/kernel" for n in "qkvabgo"), "mixer/q_conv/kernel",
                 "mixer/k_conv/kernel", "mixer/v_conv/kernel")
        | {"head/kernel"}),
    "linear_baselines": (
        "linear_transformer*1,performer*1,cosformer*1",
        {k: {"n_heads": 2, "head_dim": 8} for k in ("linear_transformer", "performer", "cosformer")}, {},
        _block(0, *QKVO) | _block(1, *QKVO) | _block(2, *QKVO)),
}
# Never decayed, in whichever family has them.
NEVER_DECAYED = ("embed/embedding", "pos_embed/embedding", "final_norm/scale", "final_norm/bias", "omega",
                 "lam_raw", "A_log", "dt_bias", "conv_kernel", "norm/scale", "norm/weight", "/bias")


def _paths(tree) -> dict[str, object]:
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("family", FAMILIES)
def test_exactly_the_weight_matrices_of_each_family_are_decayed(family):
  """The decay mask over a real (abstract) model of each family is the table's set of paths."""
  from flax import nnx

  from lmcore import config as cfg_lib
  from lmcore.model import LanguageModel
  from lmcore.train.optim import weight_decay_mask

  pattern, mixers, fields, decayed = FAMILIES[family]
  n_layers = 1 + max(int(path.split("/")[1]) for path in decayed if path.startswith("blocks/"))
  config = cfg_lib.model_config(dict(vocab_size=64, d_model=16, n_layers=n_layers, pattern=pattern,
                                     mlp_hidden=32, dtype="float32", mixers=mixers, **fields))
  abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.split(abstract, nnx.Param, ...)[1])
  mask = _paths(weight_decay_mask(params))
  assert set(mask) == set(_paths(params))
  assert {path for path, on in mask.items() if on} == decayed
  for path, on in mask.items():
    if any(name in path for name in NEVER_DECAYED):
      assert not on, path


# ------------------------------------------------------------------------------ AdamW by hand

# A toy tree with a leaf of every decay class; omega dominates the first gradient's norm, so clipping
# computed over the kernels only (or leaf by leaf) gives another update.
TOY = {"embed": {"embedding": (4, 3)}, "blocks": {"0": {"mixer": {"wq": {"kernel": (3, 3)}, "omega": (2,)},
                                                      "mlp_norm": {"scale": (3,)}}},
       "head": {"kernel": (3, 4), "bias": (4,)}}
GRAD_SCALES = (30.0, 0.2, 4.0)  # clipped, not clipped, clipped


def toy_tree(seed: int, scale: float = 1.0, omega_scale: float = 1.0):
  rng = np.random.default_rng(seed)
  tree = jax.tree.map(lambda shape: jnp.asarray(scale * rng.normal(size=shape), jnp.float32), TOY,
                      is_leaf=lambda x: isinstance(x, tuple))
  tree["blocks"]["0"]["mixer"]["omega"] = tree["blocks"]["0"]["mixer"]["omega"] * omega_scale
  return tree


def hand_written_adamw(train: TrainConfig, params, grads_per_step, clip_norm_of=None):
  """AdamW as MATH §1.4 states it, in float64 numpy: g <- g · min(1, c / ||g||) with ||g|| the norm of
  every leaf, m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g², p <- p - lr(t) (m̂ / (sqrt(v̂) + 1e-8)
  + wd · p · [leaf named kernel]). ``clip_norm_of``: another norm (to show the test tells them apart)."""
  flat = {k: np.asarray(v, np.float64) for k, v in _paths(params).items()}
  m = {k: np.zeros_like(v) for k, v in flat.items()}
  v2 = {k: np.zeros_like(v) for k, v in flat.items()}
  for t, grads in enumerate(grads_per_step):
    g = {k: np.asarray(v, np.float64) for k, v in _paths(grads).items()}
    norm = (clip_norm_of or (lambda g: np.sqrt(sum((x ** 2).sum() for x in g.values()))))(g)
    factor = min(1.0, train.grad_clip / norm)
    for k in flat:
      gk = g[k] * factor
      m[k] = train.b1 * m[k] + (1 - train.b1) * gk
      v2[k] = train.b2 * v2[k] + (1 - train.b2) * gk ** 2
      m_hat, v_hat = m[k] / (1 - train.b1 ** (t + 1)), v2[k] / (1 - train.b2 ** (t + 1))
      decay = train.weight_decay * flat[k] if k.endswith("/kernel") else 0.0
      flat[k] = flat[k] - closed_form(train, t) * (m_hat / (np.sqrt(v_hat) + 1e-8) + decay)
  return flat


@functools.cache
def _compiled_steps(train: TrainConfig):
  tx = make_optimizer(train)

  @jax.jit
  def steps(params, grads_per_step):
    opt_state = tx.init(params)
    for grads in grads_per_step:
      updates, opt_state = tx.update(grads, opt_state, params)
      params = jax.tree.map(jnp.add, params, updates)
    return params

  return steps


def optimizer_steps(train: TrainConfig, params, grads_per_step):
  """The parameters after ``make_optimizer(train)`` applied the gradients one step after another."""
  params = _compiled_steps(train)(params, grads_per_step)
  return {k: np.asarray(v, np.float64) for k, v in _paths(params).items()}


TOY_TRAIN = TrainConfig(steps=10, warmup_steps=2, learning_rate=1e-2, warmup_init_lr=2e-3, min_lr_ratio=0.1,
                        weight_decay=0.3, grad_clip=1.0)


def test_three_adamw_steps_equal_the_hand_written_update():
  """make_optimizer over three steps (warmup and decay of the rate, clipped and unclipped gradients,
  masked decay) equals the float64 transcription to fp32 rounding (relative 1e-5 per leaf)."""
  params = toy_tree(0)
  grads = [toy_tree(1 + i, scale) for i, scale in enumerate(GRAD_SCALES)]
  got, want = optimizer_steps(TOY_TRAIN, params, grads), hand_written_adamw(TOY_TRAIN, params, grads)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_clipping_uses_the_global_norm_of_every_gradient_leaf():
  """The first gradient is clipped by c / optax.tree.norm(full tree) (the global norm), its omega leaf
  holding most of the norm; the next (unclipped) steps mix it into Adam's moments, so the parameters
  after them depend on the clip factor. The same reference with the norm of the kernels only is far off."""

  params = toy_tree(0)
  grads = [toy_tree(1, 3.0, omega_scale=40.0), toy_tree(2, 0.05), toy_tree(3, 0.05)]
  assert float(optax.tree.norm(grads[0])) > 10 * TOY_TRAIN.grad_clip
  assert float(optax.tree.norm(grads[1])) < TOY_TRAIN.grad_clip
  np.testing.assert_allclose(
      float(optax.tree.norm(grads[0])),
      np.sqrt(sum(float((np.asarray(x, np.float64) ** 2).sum()) for x in jax.tree.leaves(grads[0]))),
      rtol=1e-6)
  got = optimizer_steps(TOY_TRAIN, params, grads)
  want = hand_written_adamw(TOY_TRAIN, params, grads)
  kernels_only = hand_written_adamw(TOY_TRAIN, params, grads, clip_norm_of=lambda g: np.sqrt(
      sum((x ** 2).sum() for k, x in g.items() if k.endswith("kernel"))))
  name = "blocks/0/mlp_norm/scale"
  np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
  assert np.abs(kernels_only[name] - want[name]).max() > 100 * np.abs(got[name] - want[name]).max() + 1e-6
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
