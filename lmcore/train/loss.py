"""The training loss: next-token cross-entropy in nats, token mean, computed in fp32 (MATH §6.3)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx


def split_batch(batch: dict[str, Any], use_segments: bool):
  """[b, T+1] windows -> inputs, targets, positions, segment ids (the latter two None unless packed)."""
  tokens = batch["tokens"]
  inputs_BxT, targets_BxT = tokens[:, :-1], tokens[:, 1:]
  if not use_segments:
    return inputs_BxT, targets_BxT, None, None
  return inputs_BxT, targets_BxT, batch["positions"][:, :-1], batch["segment_ids"][:, :-1]


def forward(graphdef, params, rest, inputs_BxT, positions_BxT=None, segment_ids_BxT=None):
  model = nnx.merge(graphdef, params, rest)
  logits_BxTxV, _ = model(inputs_BxT, positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT)
  return logits_BxTxV


def token_nll(logits_BxTxV, targets_BxT):
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV.astype(jnp.float32), targets_BxT)


def loss_fn(graphdef, params, rest, batch, use_segments: bool):
  """Token-mean cross-entropy of one batch of [b, T+1] windows."""
  inputs, targets, positions, segments = split_batch(batch, use_segments)
  logits_BxTxV = forward(graphdef, params, rest, inputs, positions, segments)
  return token_nll(logits_BxTxV, targets).mean()
