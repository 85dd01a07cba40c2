"""Gated linear attention (MATH §3, §4): what every backend shares. Imports no backend.

Backend contract: ``backend(q, k, v, g_BxTxHxG, S0_BxHxKxV, *, scale, doc_BxT, tiles, options) ->
(o [B, T, H, V] fp32, S_T [B, H, K, V] fp32)``; G = 1 (a gate per head) or K (per key channel),
``doc_BxT`` from ``segments.document_index``. ``run_backend`` wraps one into the op's signature.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common import flops, layout
from lmcore.ops.common.backend import HeadProblem
from lmcore.ops.common.pallas_utils import pad_axis
from lmcore.ops.common.segments import document_index

OP = "gated_linear_attention"
Problem = HeadProblem


class Options(NamedTuple):
  """What a backend may read besides its tiling: ``precision``, the Triton kernels' dot operands
  (``pallas_utils.PRECISIONS``); ``split_state``, the kernels' backward state dots in two parts
  (``pallas_utils.split_dot``); ``remat``, ``xla.chunked`` recomputes its forward in the backward."""

  precision: str = "input"
  split_state: bool = True
  remat: bool = True


class LinearAttentionState(NamedTuple):
  """The recurrent state, fp32: ``S`` [B, H, K, V] and ``z`` [B, H, K] (the key sum; zeros unless
  normalised)."""

  S: jax.Array
  z: jax.Array

  @classmethod
  def zeros(cls, batch_size: int, n_heads: int, key_dim: int,
            value_dim: int) -> "LinearAttentionState":
    return cls(jnp.zeros((batch_size, n_heads, key_dim, value_dim), jnp.float32),
               jnp.zeros((batch_size, n_heads, key_dim), jnp.float32))


def check_shapes(q, k, v, log_forget, state, segment_ids) -> None:
  """Raises ValueError unless q, k [B,T,H,K], v [B,T,H,V], gate [B,T,H] or [B,T,H,K], ids [B,T]."""
  batch_size, length, n_heads, key_dim = q.shape
  gate_shapes = (tuple(q.shape[:3]), tuple(q.shape))
  if log_forget is not None and tuple(log_forget.shape) not in gate_shapes:
    raise ValueError(f"{OP}: log_forget has shape {tuple(log_forget.shape)}, "
                     f"expected {gate_shapes[0]} (per head) or {gate_shapes[1]} (per key channel)")
  expected = {"k": (k.shape, q.shape), "v": (v.shape[:3], q.shape[:3])}
  if state is not None:
    expected["state.S"] = (state.S.shape, (batch_size, n_heads, key_dim, v.shape[-1]))
    expected["state.z"] = (state.z.shape, (batch_size, n_heads, key_dim))
  if segment_ids is not None:
    expected["segment_ids"] = (segment_ids.shape, (batch_size, length))
  layout.check_shapes(OP, expected, q.shape, v.shape)


def run_backend(backend, q: jax.Array, k: jax.Array, v: jax.Array, log_forget: jax.Array | None = None,
                state: LinearAttentionState | None = None, *, normalize: bool = False, eps: float = 1e-6,
                scale: float = 1.0, segment_ids: jax.Array | None = None, out_dtype=None
                ) -> tuple[jax.Array, LinearAttentionState]:
  """``gated_linear_attention``'s function of already checked inputs, computed by ``backend(q, k, v, g,
  S0, *, scale, doc_BxT)``: zero state, no decay and one document by default; ``normalize`` appends
  the ones column whose output divides o (the state's last column is then z). o in ``out_dtype``
  (None: q's)."""
  out_dtype = q.dtype if out_dtype is None else out_dtype
  batch_size, length, n_heads, key_dim = q.shape
  value_dim = v.shape[-1]
  if state is None:
    state = LinearAttentionState.zeros(batch_size, n_heads, key_dim, value_dim)
  if log_forget is None:
    log_forget = jnp.zeros((batch_size, length, n_heads), jnp.float32)
  g_BxTxHxG = log_forget.astype(jnp.float32)
  if g_BxTxHxG.ndim == 3:
    g_BxTxHxG = g_BxTxHxG[..., None]
  doc_BxT = document_index(segment_ids, batch_size, length)
  S0 = state.S.astype(jnp.float32)
  if normalize:
    v = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
    S0 = jnp.concatenate([S0, state.z.astype(jnp.float32)[..., None]], axis=-1)
  o, S = backend(q, k, v, g_BxTxHxG, S0, scale=scale, doc_BxT=doc_BxT)
  if not normalize:
    return o.astype(out_dtype), LinearAttentionState(S, jnp.zeros_like(state.z, jnp.float32))
  o = o[..., :value_dim] / (o[..., value_dim:] + eps)
  return o.astype(out_dtype), LinearAttentionState(S[..., :value_dim], S[..., value_dim])


# The kernels' arguments by name and their leading dimensions (``shard_map.run_sharded``); outputs:
# o "BTH", S "BH".
KERNEL_LAYOUTS = dict(q_BxTxHxK="BTH", k_BxTxHxK="BTH", v_BxTxHxV="BTH", g_BxTxHxG="BTH",
                      S0_BxHxKxV="BH", doc_BxT="B")


def kernel_inputs(q, k, v, g, S0, doc_BxT) -> dict:
  """A backend's arrays by the kernels' argument names (``KERNEL_LAYOUTS``)."""
  return dict(zip(KERNEL_LAYOUTS, (q, k, v, g, S0, doc_BxT)))


def pad_inputs(q, k, v, g, S0, Tp: int, Kp: int, Vp: int):
  """The kernels' inputs padded with zeros, which leave states and outputs unchanged: q, k
  [B, Tp, H, Kp], v [B, Tp, H, Vp], g fp32 [B, Tp, H, 1 or Kp], S0 fp32 [B, H, Kp, Vp]."""
  pad = lambda x, sizes: functools.reduce(lambda y, a: pad_axis(y, a, sizes[a]), sizes, x)
  G = 1 if g.shape[-1] == 1 else Kp
  return (pad(q, {1: Tp, 3: Kp}), pad(k, {1: Tp, 3: Kp}), pad(v, {1: Tp, 3: Vp}),
          pad(g.astype(jnp.float32), {1: Tp, 3: G}), pad(S0.astype(jnp.float32), {2: Kp, 3: Vp}))


def chunked_flops(problem: Problem, chunk: int) -> float:
  """``flops.chunked`` of a chunked form at ``chunk`` tokens per chunk (T unknown: one chunk)."""
  return flops.chunked(problem.key_dim, problem.value_dim, chunk, problem.length or chunk)


def gate_grad(q, k, dq, dk, final, G: int) -> jax.Array:
  """dg, time on axis 1, from the kernels' fp32 dq, dk (q's layout) and final = sum_v S_T ⊙ dS_T.

  o depends on the cumulative log gate B only through q ⊙ exp(B), k ⊙ exp(-B) and exp(B_T) in S_T,
  so dB_t = q_t ⊙ dq_t - k_t ⊙ dk_t (+ final at t = T) and dg is the reverse cumulative sum of dB
  (summed over keys for G = 1)."""
  dB = q.astype(jnp.float32) * dq - k.astype(jnp.float32) * dk
  dB = dB.at[:, -1].add(final)
  if G == 1:
    dB = jnp.sum(dB, axis=-1, keepdims=True)
  return jnp.flip(jnp.cumsum(jnp.flip(dB, 1), axis=1), 1)
