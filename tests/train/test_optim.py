"""The learning-rate schedule and AdamW against their closed forms (warmup, then cosine decay to a
fraction of the peak: MATH §1.4 and §2.4).

lr(t) = init + (peak - init) t / W                                         for t < W
lr(t) = floor + (peak - floor) (1 + cos(pi (t - W) / (S - W))) / 2         for W <= t <= S
lr(t) = floor                                                              after S
with floor = min_lr_ratio · peak, W = warmup_steps, S = steps, and t the number of updates already
applied (the first update uses lr(0)).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
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
