"""The gated delta rule op (SPEC §4, Gated DeltaNet) with an ``implementation=`` switch.

Per head, with the fp32 state S_t in R^{K x V}:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,

alpha_t = exp(log_alpha_t) in (0, 1], beta_t in (0, 1), scale = K^-1/2 unless given. The caller
L2-normalises q and k (FLA does the same in-kernel with ``use_qk_l2norm_in_kernel``).

Implementations (all compute the same function; tests/test_gated_delta_rule.py proves it):
  * ``reference`` / ``recurrent``: ``lax.scan`` over tokens in fp32 (reference.py);
  * ``chunked`` / ``xla``: the WY / UT transform per chunk, ``lax.scan`` over chunks (xla.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.gated_delta_rule import reference

from lmcore.ops.gated_delta_rule import xla


class DeltaRuleState(NamedTuple):
  """The recurrent state: ``S`` [B, H, K, V], float32 (``o_t = scale * S_t^T q_t``)."""

  S: jax.Array

  @classmethod
  def zeros(cls, batch_size: int, n_heads: int, key_dim: int, value_dim: int) -> "DeltaRuleState":
    return cls(jnp.zeros((batch_size, n_heads, key_dim, value_dim), jnp.float32))


IMPLEMENTATIONS = ("reference", "recurrent", "chunked", "xla")


def _check_shapes(q, k, v, log_alpha, beta, state, segment_ids) -> None:
  """ValueError unless q, k [B,T,H,K], v [B,T,H,V], gates [B,T,H], S [B,H,K,V], ids [B,T]."""
  batch_size, length, n_heads, key_dim = q.shape
  expected = {"k": (k.shape, q.shape), "v": (v.shape[:3], q.shape[:3]),
              "log_alpha": (log_alpha.shape, q.shape[:3]), "beta": (beta.shape, q.shape[:3])}
  if state is not None:
    expected["state.S"] = (state.S.shape, (batch_size, n_heads, key_dim, v.shape[-1]))
  if segment_ids is not None:
    expected["segment_ids"] = (segment_ids.shape, (batch_size, length))
  for name, (got, want) in expected.items():
    if tuple(got) != tuple(want):
      raise ValueError(f"gated_delta_rule: {name} has shape {tuple(got)}, expected {tuple(want)} "
                       f"(q {tuple(q.shape)} is [B, T, H, K], v {tuple(v.shape)} is [B, T, H, V])")


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, log_alpha: jax.Array,
                     beta: jax.Array, *, implementation: str | None = "chunked",
                     state: DeltaRuleState | None = None, chunk_size: int = 64,
                     scale: float | None = None,
                     segment_ids: jax.Array | None = None) -> tuple[jax.Array, DeltaRuleState]:
  """Gated delta rule over a sequence; returns (o [B, T, H, V] in q's dtype, final DeltaRuleState).

  Args:
    q, k: [B, T, H, K], L2-normalised by the caller.
    v: [B, T, H, V].
    log_alpha: [B, T, H], log of the decay, <= 0 (accumulated in fp32).
    beta: [B, T, H], the write strength in (0, 1).
    implementation: one of ``IMPLEMENTATIONS``; None picks ``chunked`` (the XLA fallback of
      ARCHITECTURE.md, and the fastest here).
    state: the state before the first token; None means zeros (start of a sequence).
    chunk_size: tokens per chunk of the chunked form (``min(chunk_size, T)`` is used).
    scale: read-out scale, default K^-1/2.
    segment_ids: optional int [B, T]; where the id changes between consecutive tokens the state is
      reset to zero (packed documents, SPEC §6.4). The incoming ``state`` belongs to the first
      token's segment.
  """
  _check_shapes(q, k, v, log_alpha, beta, state, segment_ids)
  batch_size, _, n_heads, key_dim = q.shape
  if state is None:
    state = DeltaRuleState.zeros(batch_size, n_heads, key_dim, v.shape[-1])
  scale = key_dim**-0.5 if scale is None else scale
  S0_BxHxKxV = state.S.astype(jnp.float32)
  if implementation in ("reference", "recurrent"):
    o, S = reference.gated_delta_rule_recurrent(q, k, v, log_alpha, beta, S0_BxHxKxV, scale,
                                                segment_ids)
  elif implementation in (None, "chunked", "xla"):
    if chunk_size < 1:
      raise ValueError(f"gated_delta_rule: chunk_size must be >= 1, got {chunk_size}")
    o, S = xla.gated_delta_rule_chunked(q, k, v, log_alpha, beta, S0_BxHxKxV, scale, chunk_size,
                                        segment_ids)
  else:
    raise ValueError(f"gated_delta_rule: unknown implementation {implementation!r}; "
                     f"valid: {', '.join(IMPLEMENTATIONS)} (None means 'chunked')")
  return o.astype(q.dtype), DeltaRuleState(S)
