"""AdamW with linear warmup, cosine decay and global-norm clipping; decay only on weight matrices."""

from __future__ import annotations

import jax
import optax

from lmcore.config import TrainConfig


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
  """Linear warmup from ``warmup_init_lr`` to the peak, then cosine to ``min_lr_ratio`` · peak at ``steps``."""
  return optax.warmup_cosine_decay_schedule(
      init_value=train.warmup_init_lr, peak_value=train.learning_rate,
      warmup_steps=train.warmup_steps, decay_steps=max(train.steps, train.warmup_steps + 1),
      end_value=train.learning_rate * train.min_lr_ratio)


def weight_decay_mask(params) -> dict:
  """True for parameters named ``kernel`` (Linear and Conv weights).

  Everything else — embeddings, position tables, norm scales, biases and the mixers' own named
  parameters (SANATAN ω and λ_raw, Gated DeltaNet A_log and dt_bias, gate biases) — is not decayed.
  """
  def is_kernel(path, _):
    return getattr(path[-1], "key", None) == "kernel"
  return jax.tree_util.tree_map_with_path(is_kernel, params)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(train.grad_clip),
      optax.adamw(learning_rate_schedule(train), b1=train.b1, b2=train.b2,
                  weight_decay=train.weight_decay, mask=weight_decay_mask))
