"""The gated delta rule op (MATH §4, Gated DeltaNet) with an ``implementation=`` switch.

Per head, with the fp32 state S_t in R^{K x V}:

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,

alpha_t = exp(log_alpha_t) in (0, 1], beta_t in (0, 1), scale = K^-1/2 unless given. The caller
L2-normalises q and k (FLA does the same in-kernel with ``use_qk_l2norm_in_kernel``).

Backends (``REGISTRY``; tests/ops/gated_delta_rule proves they agree): ``recurrent`` (reference.py;
the decode path) and ``chunked`` (xla.py, the WY / UT transform), which "auto" takes everywhere.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from lmcore.ops.common import pallas_utils
from lmcore.ops.common.backend import ChunkTiles, Registry
from lmcore.ops.gated_delta_rule import reference
from lmcore.ops.gated_delta_rule import xla
from lmcore.ops.gated_delta_rule.base import OP, DeltaRuleState, Problem, check_shapes

Implementation = Literal["recurrent", "chunked", "auto"]

REGISTRY = Registry(OP, {"recurrent": reference.Recurrent(), "chunked": xla.Chunked()},
                    auto={"gpu": ("chunked",), "tpu": ("chunked",), "cpu": ("chunked",)})


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, log_alpha: jax.Array,
                     beta: jax.Array, *, implementation: Implementation | None = "chunked",
                     state: DeltaRuleState | None = None, tiles: ChunkTiles | None = None,
                     scale: float | None = None,
                     segment_ids: jax.Array | None = None) -> tuple[jax.Array, DeltaRuleState]:
  """Gated delta rule; returns (o [B, T, H, V] in q's dtype, final DeltaRuleState).

  q, k [B, T, H, K] L2-normalised; v [B, T, H, V]; log_alpha <= 0 and beta in (0, 1), [B, T, H].
  ``state`` None: zeros. ``tiles`` None: the backend's heuristic. ``segment_ids`` [B, T]: the state
  resets where the id changes (MATH §6.4); the incoming state belongs to the first token's segment.
  """
  check_shapes(q, k, v, log_alpha, beta, state, segment_ids)
  batch_size, length, n_heads, key_dim = q.shape
  problem = Problem(pallas_utils.backend(), key_dim, v.shape[-1], length)
  backend = REGISTRY.resolve(implementation, problem)
  if state is None:
    state = DeltaRuleState.zeros(batch_size, n_heads, key_dim, v.shape[-1])
  scale = key_dim**-0.5 if scale is None else scale
  o, S = backend(q, k, v, log_alpha, beta, state.S.astype(jnp.float32), scale=scale,
                 segment_ids_BxT=segment_ids, tiles=backend.config(problem, tiles))
  return o.astype(q.dtype), DeltaRuleState(S)
