"""The gated delta rule op (MATH §4, Gated DeltaNet) with an ``implementation=`` switch.

Per head, with the fp32 state S_t in R^{K x V}:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,

alpha_t = exp(log_alpha_t) in (0, 1], beta_t in (0, 1), scale = K^-1/2 unless given. The caller
L2-normalises q and k (FLA does the same in-kernel with ``use_qk_l2norm_in_kernel``).

Implementations (all compute the same function; tests/ops/gated_delta_rule proves it):
  * ``recurrent``: ``lax.scan`` over tokens in fp32 (reference.py);
  * ``chunked`` / ``xla``: the WY / UT transform per chunk, ``lax.scan`` over chunks (xla.py);
  * ``auto`` (or None): ``chunked`` on every backend (``resolve_implementation``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from lmcore.ops.common import implementations
from lmcore.ops.gated_delta_rule import reference
from lmcore.ops.gated_delta_rule import xla
from lmcore.ops.gated_delta_rule.base import CHUNK, OP, DeltaRuleState, check_shapes

Implementation = Literal["recurrent", "chunked", "xla"]

# Each backend has base.py's contract; the chunked one also takes ``chunk_size``.
IMPLEMENTATIONS: dict[str, Callable] = {
    "recurrent": reference.recurrent,
    "chunked": xla.chunked,
    "xla": xla.chunked,
}


def resolve_implementation(implementation: str | None, **problem) -> str:
  """"auto" and None: "chunked" (the fastest here, on every backend); a name of
  ``IMPLEMENTATIONS`` as is; anything else a ValueError. ``problem`` is not read."""
  del problem
  return implementations.resolve(OP, implementation, IMPLEMENTATIONS, lambda: "chunked")


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, log_alpha: jax.Array,
                     beta: jax.Array, *,
                     implementation: Implementation | Literal["auto"] | None = "chunked",
                     state: DeltaRuleState | None = None, chunk_size: int = CHUNK,
                     scale: float | None = None,
                     segment_ids: jax.Array | None = None) -> tuple[jax.Array, DeltaRuleState]:
  """Gated delta rule over a sequence; returns (o [B, T, H, V] in q's dtype, final DeltaRuleState).

  Args:
    q, k: [B, T, H, K], L2-normalised by the caller.
    v: [B, T, H, V].
    log_alpha: [B, T, H], log of the decay, <= 0 (accumulated in fp32).
    beta: [B, T, H], the write strength in (0, 1).
    implementation: a name of ``IMPLEMENTATIONS``; "auto" or None picks ``chunked``
      (``resolve_implementation``).
    state: the state before the first token; None means zeros (start of a sequence).
    chunk_size: tokens per chunk of the chunked form (``min(chunk_size, T)`` is used).
    scale: read-out scale, default K^-1/2.
    segment_ids: optional int [B, T]; where the id changes between consecutive tokens the state is
      reset to zero (packed documents, MATH §6.4). The incoming ``state`` belongs to the first
      token's segment.
  """
  check_shapes(q, k, v, log_alpha, beta, state, segment_ids)
  implementation = resolve_implementation(implementation)
  batch_size, _, n_heads, key_dim = q.shape
  if state is None:
    state = DeltaRuleState.zeros(batch_size, n_heads, key_dim, v.shape[-1])
  scale = key_dim**-0.5 if scale is None else scale
  options = {"chunk_size": chunk_size} if implementation != "recurrent" else {}
  o, S = IMPLEMENTATIONS[implementation](q, k, v, log_alpha, beta, state.S.astype(jnp.float32),
                                         scale=scale, segment_ids_BxT=segment_ids, **options)
  return o.astype(q.dtype), DeltaRuleState(S)
