"""Gated linear attention (MATH §3, §4): the state, the argument checks and the wrapper every chunked
form runs in (``run_backend``). Imported by every backend; imports no backend.

The backend contract: ``backend(q, k, v, g_BxTxHxG, S0_BxHxKxV, *, scale, doc_BxT, tiles, options)
-> (o [B, T, H, V] fp32, S_T [B, H, K, V] fp32)``, with G = 1 (a scalar gate per head) or K (per key
channel), ``doc_BxT`` the document index of ``lmcore.ops.common.segments.document_index``, ``tiles``
the backend's tiling (``lmcore.ops.common.backend``) and ``options`` the ``Options`` it reads.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common.segments import document_index

OP = "gated_linear_attention"


@dataclasses.dataclass(frozen=True)
class Problem:
  """What decides the backend and its FLOP count: the platform, the kernel's head widths K x V (V + 1
  for a normalised form: the ones column) and the length T (None: not known)."""

  platform: str
  key_dim: int = 0
  value_dim: int = 0
  length: int | None = None

  def describe(self) -> str:
    return f"heads of {self.key_dim} x {self.value_dim} on {self.platform}"


class Options(NamedTuple):
  """The options a backend may read besides its tiling.

  precision: the GPU kernel's dot operands, "input" (the inputs' dtype), "tf32" or "float32"
    (``pallas_utils.PRECISIONS``); the TPU kernel takes "input" only, the XLA forms ignore it.
  split_state: the kernels' backward takes its state dots' fp32 operands as two parts in the inputs'
    dtype (``pallas_utils.split_dot``); False: one rounding.
  remat: ``chunked``'s backward recomputes the forward from the inputs (``xla.chunked``).
  """

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
  for name, (got, want) in expected.items():
    if tuple(got) != tuple(want):
      raise ValueError(f"{OP}: {name} has shape {tuple(got)}, expected "
                       f"{tuple(want)} (q is {tuple(q.shape)} = [B, T, H, K], v is "
                       f"{tuple(v.shape)} = [B, T, H, V])")


def check_chunk_size(chunk_size: int) -> None:
  """Raises ValueError unless ``chunk_size`` is a power of two."""
  if chunk_size < 1 or chunk_size & (chunk_size - 1):
    raise ValueError(f"{OP}: chunk_size must be a power of two, got {chunk_size}")


def run_backend(backend, q: jax.Array, k: jax.Array, v: jax.Array, log_forget: jax.Array | None,
                state: LinearAttentionState | None, *, normalize: bool, eps: float, scale: float,
                segment_ids: jax.Array | None, out_dtype=None
                ) -> tuple[jax.Array, LinearAttentionState]:
  """``gated_linear_attention`` around one backend (see the module docstring): fills in the zero
  state, no decay and one document, and with ``normalize`` appends the ones column whose output
  divides o (the state's last column is then z). Inputs as ``gated_linear_attention``'s, already
  checked; o comes in ``out_dtype`` (None: q's).
  """
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


# The kernels' arguments by name and each one's leading dimensions, for their shard_map
# (``lmcore.ops.common.shard_map.run_sharded``); outputs: o "BTH", S "BH".
KERNEL_LAYOUTS = dict(q_BxTxHxK="BTH", k_BxTxHxK="BTH", v_BxTxHxV="BTH", g_BxTxHxG="BTH",
                      S0_BxHxKxV="BH", doc_BxT="B")


def kernel_inputs(q, k, v, g, S0, doc_BxT) -> dict:
  """A backend's arrays by the kernels' argument names (``KERNEL_LAYOUTS``)."""
  return dict(zip(KERNEL_LAYOUTS, (q, k, v, g, S0, doc_BxT)))
