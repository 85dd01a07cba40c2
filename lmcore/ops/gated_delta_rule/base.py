"""Gated delta rule (MATH §4, Gated DeltaNet): the state and the checks every form shares.

Backend contract: ``backend(q, k, v, log_alpha_BxTxH, beta_BxTxH, S0_BxHxKxV, *, scale,
segment_ids_BxT, tiles) -> (o [B, T, H, V] fp32, S_T [B, H, K, V] fp32)``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common import layout
from lmcore.ops.common.backend import HeadProblem

OP = "gated_delta_rule"
Problem = HeadProblem


class DeltaRuleState(NamedTuple):
  """The recurrent state: ``S`` [B, H, K, V], float32 (``o_t = scale * S_t^T q_t``)."""

  S: jax.Array

  @classmethod
  def zeros(cls, batch_size: int, n_heads: int, key_dim: int, value_dim: int) -> "DeltaRuleState":
    return cls(jnp.zeros((batch_size, n_heads, key_dim, value_dim), jnp.float32))


def check_shapes(q, k, v, log_alpha, beta, state, segment_ids) -> None:
  """ValueError unless q, k [B,T,H,K], v [B,T,H,V], gates [B,T,H], S [B,H,K,V], ids [B,T]."""
  batch_size, length, n_heads, key_dim = q.shape
  expected = {"k": (k.shape, q.shape), "v": (v.shape[:3], q.shape[:3]),
              "log_alpha": (log_alpha.shape, q.shape[:3]), "beta": (beta.shape, q.shape[:3])}
  if state is not None:
    expected["state.S"] = (state.S.shape, (batch_size, n_heads, key_dim, v.shape[-1]))
  if segment_ids is not None:
    expected["segment_ids"] = (segment_ids.shape, (batch_size, length))
  layout.check_shapes(OP, expected, q.shape, v.shape)
