"""What every Taylor linear attention backend shares (MATH §2.1): the problem a backend is chosen for,
the state, argument checks and the pieces of the parallel form that the blocked kernels reuse.

Per head, with ``A_tj = phi(q_t)·phi(k_j) = 1 + s + s²/2`` and ``s = q_t·k_j / sqrt(d')``::

    y_t = dt_t · sum_{j<=t} gamma^(t-j) A_tj v_j / (sum_{j<=t} A_tj + eps)

The recurrent state is ``S = sum_j gamma^(T-1-j) phi(k_j) v_j^T`` [F, dv] and ``z = sum_j phi(k_j)``
[F], both fp32; a state passed in is the prefix of the same sequence (write-then-read: token t sees
itself). Documents are numbered by ``lmcore.ops.common.segments.document_index``; an incoming state
continues document 0 of each row.

The backend contract: ``backend(q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles,
options) -> (o [B, T, H, dv], TaylorState)``, with ``state`` None for zeros, ``decay`` [H] / ``dt``
[B, T, H] or None (the decay ablation), ``tiles`` the backend's tiling (``lmcore.ops.common.backend``)
and ``options`` the ``Options`` it reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from based_jax.taylor import Feature, feature_width, taylor_features, taylor_kernel

OP = "taylor_linear_attention"


@dataclasses.dataclass(frozen=True)
class Problem:
  """What decides the backend and its FLOP count: the platform, the key dim d' and value dim dv of a
  head, the length T (None: not known), whether ``segment_ids`` (packed documents) or the decay
  ablation (``decay`` or ``dt``) are given, and the state's feature layout."""

  platform: str
  key_dim: int = 0
  value_dim: int = 0
  length: int | None = None
  segments: bool = False
  decay: bool = False
  feature: Feature = "compact"

  def describe(self) -> str:
    options = [name for name, given in (("segment_ids", self.segments), ("the decay ablation", self.decay))
               if given]
    length = "" if self.length is None else f" of {self.length} tokens"
    given = f" with {' and '.join(options)}" if options else ""
    return f"heads of {self.key_dim} x {self.value_dim}{length}{given} on {self.platform}"


class Options(NamedTuple):
  """The options a backend may read besides its tiling. precision: the Triton kernels' dot operands,
  "input" (the inputs' dtype), "tf32" or "float32" (``pallas_utils.PRECISIONS``); the TPU kernels
  take "input" only, the XLA forms ignore it."""

  precision: str = "input"


class TaylorState(NamedTuple):
  """Recurrent state of Taylor linear attention (fp32)."""

  S: jax.Array  # [B, H, F, dv]: sum_j gamma^(age) phi(k_j) v_j^T
  z: jax.Array  # [B, H, F]: sum_j phi(k_j), undecayed


# The kernels' arguments by name and each one's leading dimensions, for their shard_map
# (``lmcore.ops.common.shard_map.run_sharded``), and those of their outputs (o, state).
KERNEL_LAYOUTS = dict(q="BTH", k="BTH", v="BTH", state="BH", segment_ids="B")
KERNEL_OUT_LAYOUTS = ("BTH", TaylorState(S="BH", z="BH"))


def zero_state(batch_size: int, n_heads: int, key_dim: int, value_dim: int,
               feature: Feature = "compact") -> TaylorState:
  """The start-of-sequence state."""
  f = feature_width(key_dim, feature)
  return TaylorState(S=jnp.zeros((batch_size, n_heads, f, value_dim), jnp.float32),
                     z=jnp.zeros((batch_size, n_heads, f), jnp.float32))


def default_decay_rates(n_heads: int) -> jax.Array:
  """The decay ablation's rates ``gamma_h = 1 - 2^(-3-h)``, h = 0..H-1 (MATH §2.1), fp32 [H]."""
  return 1.0 - 2.0 ** (-3.0 - jnp.arange(n_heads, dtype=jnp.float32))


def check_shapes(q, k, v, decay, dt, segment_ids) -> None:
  """Raises ValueError unless q, k are [B, T, H, d'], v [B, T, H, dv], decay [H], dt [B, T, H] and
  segment_ids [B, T]."""
  if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
    raise ValueError(f"{OP}: q, k must be [B, T, H, d'] and v [B, T, H, dv]; "
                     f"got {q.shape}, {k.shape}, {v.shape}")
  if decay is not None and decay.shape != q.shape[2:3]:
    raise ValueError(f"{OP}: decay must be per-head rates of shape {q.shape[2:3]}, got {decay.shape}")
  if dt is not None and dt.shape != q.shape[:3]:
    raise ValueError(f"{OP}: dt must have shape [B, T, H] = {q.shape[:3]}, got {dt.shape}")
  if segment_ids is not None and segment_ids.shape != q.shape[:2]:
    raise ValueError(f"{OP}: segment_ids must have shape [B, T] = {q.shape[:2]}, got {segment_ids.shape}")


def as_state(state: TaylorState | None, q: jax.Array, v: jax.Array,
             feature: Feature) -> TaylorState:
  """``state`` in fp32, or the zero state for q's batch, heads and key dim and v's value dim."""
  if state is None:
    return zero_state(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], feature)
  return TaylorState(*(x.astype(jnp.float32) for x in state))


def decay_inputs(q: jax.Array, decay: jax.Array | None,
                 dt: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """``log gamma`` [H] (zeros without decay) and ``dt`` [B, T, H] (ones without), fp32."""
  batch, length, heads, _ = q.shape
  log_gamma_H = (jnp.zeros((heads,), jnp.float32) if decay is None
                 else jnp.log(decay.astype(jnp.float32)))
  dt_BxTxH = jnp.ones((batch, length, heads), jnp.float32) if dt is None else dt.astype(jnp.float32)
  return log_gamma_H, dt_BxTxH


def mm(spec: str, *operands: jax.Array) -> jax.Array:
  """einsum accumulated in fp32 at full precision."""
  return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def scores(q_BxTxHxK: jax.Array, k_BxSxHxK: jax.Array) -> jax.Array:
  """A_ts = 1 + s + s²/2 straight from q·k (no feature map), fp32 [B, H, T, S]."""
  s_BxHxTxS = mm("bthk,bshk->bhts", q_BxTxHxK, k_BxSxHxK) / math.sqrt(q_BxTxHxK.shape[-1])
  return taylor_kernel(s_BxHxTxS)


def state_reads(q: jax.Array, state: TaylorState, doc_BxT: jax.Array, feature: Feature):
  """Which tokens read an incoming state (document 0's: [B, T, 1] float) and what they read,
  phi(q)·S [B, T, H, dv] and phi(q)·z [B, T, H] (fp32, undecayed)."""
  phi_q_BxTxHxF = taylor_features(q, feature)
  return ((doc_BxT == 0)[..., None].astype(jnp.float32),
          (mm("bthf,bhfv->bthv", phi_q_BxTxHxF, state.S),
           mm("bthf,bhf->bth", phi_q_BxTxHxF, state.z)))


def parallel_final_state(k: jax.Array, v: jax.Array, state: TaylorState, log_gamma_H: jax.Array,
                         doc_BxT: jax.Array, *, feature: Feature) -> TaylorState:
  """The state after the last token: only the last document's keys, plus the old state if the row
  is one document."""
  length = k.shape[1]
  in_last_BxT = (doc_BxT == doc_BxT[:, -1:]).astype(jnp.float32)
  age_T = length - 1 - jnp.arange(length)
  weight_BxTxH = in_last_BxT[..., None] * jnp.exp(age_T[:, None] * log_gamma_H)
  phi_k_BxTxHxF = taylor_features(k, feature).astype(jnp.float32)
  keep_B = (doc_BxT[:, -1] == 0).astype(jnp.float32)
  S = (keep_B[:, None, None, None] * jnp.exp(length * log_gamma_H)[:, None, None] * state.S
       + mm("bthf,bthv->bhfv", phi_k_BxTxHxF * weight_BxTxH[..., None], v))
  z = keep_B[:, None, None] * state.z + mm("bthf,bt->bhf", phi_k_BxTxHxF, in_last_BxT)
  return TaylorState(S, z)
