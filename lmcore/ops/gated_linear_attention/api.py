"""The gated linear attention op (SPEC §3, §4) with an ``implementation=`` switch.

Per head, with the fp32 state S_t in R^{K x V} and f_t = exp(log_forget_t) (a scalar per head, a
vector over the key channels, or 1 when ``log_forget`` is None)::

    S_t = diag(f_t) S_{t-1} + k_t v_tᵀ,     o_t = scale * S_tᵀ q_t     (write, then read)

With ``normalize=True`` (Linear Transformer / Performer / cosFormer) the key sum decays the same
way and divides the read-out; the scale multiplies the scores, so it cancels up to eps (as in FLA)::

    z_t = f_t ⊙ z_{t-1} + k_t,              o_t = scale * S_tᵀ q_t / (scale * q_t · z_t + eps)

This is computed by appending a ones column to v: the last column of the augmented state is z and
the last output column is the normaliser, so every implementation covers both forms unchanged.

Implementations (all compute the same function; tests/test_gated_linear_attention.py proves it):
  * ``reference`` / ``recurrent``: ``lax.scan`` over tokens in fp32 (reference.py); the decode path;
  * ``chunked`` / ``xla``: chunks of ``chunk_size`` tokens, ``lax.scan`` over chunks (xla.py);
  * ``parallel``: the materialised T x T form (reference.py), for tests;
  * ``pallas``: the Triton-Pallas kernel (pallas.py; interpret mode off GPU), on TPU the Mosaic
    kernel (pallas_tpu.py);
  * ``auto`` (or None): ``pallas`` on GPU, ``chunked`` elsewhere (``resolve_implementation``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common import pallas_utils
from lmcore.ops.gated_linear_attention import pallas_triton as pallas
from lmcore.ops.gated_linear_attention import pallas_mosaic_tpu as pallas_tpu
from lmcore.ops.gated_linear_attention import reference
from lmcore.ops.gated_linear_attention import xla


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


IMPLEMENTATIONS = ("reference", "recurrent", "chunked", "xla", "parallel", "pallas", "auto")


def _check_shapes(q, k, v, log_forget, state, segment_ids) -> None:
  """Raises ValueError unless q, k [B,T,H,K], v [B,T,H,V], gate [B,T,H] or [B,T,H,K], ids [B,T]."""
  batch_size, length, n_heads, key_dim = q.shape
  gate_shapes = (tuple(q.shape[:3]), tuple(q.shape))
  if log_forget is not None and tuple(log_forget.shape) not in gate_shapes:
    raise ValueError(f"gated_linear_attention: log_forget has shape {tuple(log_forget.shape)}, "
                     f"expected {gate_shapes[0]} (per head) or {gate_shapes[1]} (per key channel)")
  expected = {"k": (k.shape, q.shape), "v": (v.shape[:3], q.shape[:3])}
  if state is not None:
    expected["state.S"] = (state.S.shape, (batch_size, n_heads, key_dim, v.shape[-1]))
    expected["state.z"] = (state.z.shape, (batch_size, n_heads, key_dim))
  if segment_ids is not None:
    expected["segment_ids"] = (segment_ids.shape, (batch_size, length))
  for name, (got, want) in expected.items():
    if tuple(got) != tuple(want):
      raise ValueError(f"gated_linear_attention: {name} has shape {tuple(got)}, expected "
                       f"{tuple(want)} (q is {tuple(q.shape)} = [B, T, H, K], v is "
                       f"{tuple(v.shape)} = [B, T, H, V])")


def resolve_implementation(implementation: str | None) -> str:
  """``auto`` and None: ``pallas_utils.default_implementation()`` ("pallas" on GPU, else
  "chunked"); other names pass through."""
  if implementation in (None, "auto"):
    return pallas_utils.default_implementation()
  return implementation


def _backend(implementation: str | None, chunk_size: int | None, kernel_precision: str = "input"):
  """The implementation function; unknown names list the valid ones. A None chunk_size leaves each
  chunked implementation its own default."""
  implementation = resolve_implementation(implementation)
  chunk = {} if chunk_size is None else {"chunk_size": chunk_size}
  pallas_utils.check_precision(kernel_precision, "gated_linear_attention")
  if implementation == "pallas":
    kernels = pallas_tpu if pallas_utils.backend() == "tpu" else pallas
    options = pallas_utils.kernel_options(kernel_precision, "gated_linear_attention")
    return functools.partial(kernels.chunked, **chunk, **options)
  if implementation in ("reference", "recurrent"):
    return reference.recurrent
  if implementation == "parallel":
    return reference.parallel
  if implementation in ("chunked", "xla"):
    if chunk_size is not None and (chunk_size < 1 or chunk_size & (chunk_size - 1)):
      raise ValueError(f"gated_linear_attention: chunk_size must be a power of two, got "
                       f"{chunk_size}")
    return functools.partial(xla.chunked, **chunk)
  raise ValueError(f"gated_linear_attention: unknown implementation {implementation!r}; "
                   f"valid: {', '.join(IMPLEMENTATIONS)} (None means 'auto')")


def document_index(segment_ids_BxT: jax.Array) -> jax.Array:
  """0 at the first token of each row, +1 wherever the segment id changes (int32 [B, T])."""
  changes_BxT = segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]
  starts_BxT = jnp.concatenate([jnp.zeros_like(changes_BxT[:, :1]), changes_BxT], axis=1)
  return jnp.cumsum(starts_BxT.astype(jnp.int32), axis=1)


def gated_linear_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           log_forget: jax.Array | None = None, *,
                           implementation: str | None = "chunked",
                           state: LinearAttentionState | None = None,
                           chunk_size: int | None = None,
                           normalize: bool = False, eps: float = 1e-6, scale: float = 1.0,
                           segment_ids: jax.Array | None = None, kernel_precision: str = "input"
                           ) -> tuple[jax.Array, LinearAttentionState]:
  """Gated (optionally normalised) linear attention; returns (o [B, T, H, V] in q's dtype, state).

  Args:
    q, k: [B, T, H, K] (any feature map already applied by the caller).
    v: [B, T, H, V].
    log_forget: [B, T, H] (scalar per head) or [B, T, H, K] (per key channel) log forget gate,
      values <= 0 (not checked; the chunked form relies on it), accumulated in fp32; None: no decay.
    implementation: one of ``IMPLEMENTATIONS``; "auto" or None picks the measured fastest for the
      backend (``resolve_implementation``: "pallas" on GPU, "chunked" elsewhere).
    state: the state before the first token; None means zeros (start of a sequence).
    chunk_size: tokens per chunk of the chunked forms, a power of two; None: the implementation's
      measured best (``xla.CHUNK`` = 64, ``pallas.CHUNK`` = 16; the TPU kernel's own).
    normalize: divide by the decayed key sum (see the module docstring); the state then carries z.
    eps: added to the normaliser.
    scale: multiplies the scores q · k.
    segment_ids: optional int [B, T]; where the id changes between consecutive tokens the state is
      reset and no token sees another segment (packed documents, SPEC §6.4). The incoming
      ``state`` belongs to the first token's segment.
    kernel_precision: the Pallas GPU kernel's dot operands, "input" (the inputs' dtype), "tf32" or
      "float32" (fp32 throughout, and o in fp32; ``pallas_utils.PRECISIONS``). Other
      implementations ignore it.
  """
  _check_shapes(q, k, v, log_forget, state, segment_ids)
  implementation = resolve_implementation(implementation)
  precision = kernel_precision if implementation == "pallas" else "input"
  return run_backend(_backend(implementation, chunk_size, kernel_precision), q, k, v, log_forget,
                     state, normalize=normalize, eps=eps, scale=scale, segment_ids=segment_ids,
                     out_dtype=pallas_utils.output_dtype(q.dtype, precision))


def run_backend(backend, q: jax.Array, k: jax.Array, v: jax.Array, log_forget: jax.Array | None,
                state: LinearAttentionState | None, *, normalize: bool, eps: float, scale: float,
                segment_ids: jax.Array | None, out_dtype=None
                ) -> tuple[jax.Array, LinearAttentionState]:
  """``gated_linear_attention`` around one chunked form, ``backend(q, k, v, g_BxTxHxG, S0_BxHxKxV,
  scale=, doc_BxT=) -> (o fp32, S_T fp32)`` (XLA's or a kernel's): fills in the zero state, no
  decay and one document, and with ``normalize`` appends the ones column whose output divides o
  (the state's last column is then z). Inputs as ``gated_linear_attention``'s, already checked;
  o comes in ``out_dtype`` (None: q's).
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
  doc_BxT = (jnp.zeros((batch_size, length), jnp.int32) if segment_ids is None
             else document_index(segment_ids))
  S0 = state.S.astype(jnp.float32)
  if normalize:
    v = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
    S0 = jnp.concatenate([S0, state.z.astype(jnp.float32)[..., None]], axis=-1)
  o, S = backend(q, k, v, g_BxTxHxG, S0, scale=scale, doc_BxT=doc_BxT)
  if not normalize:
    return o.astype(out_dtype), LinearAttentionState(S, jnp.zeros_like(state.z, jnp.float32))
  o = o[..., :value_dim] / (o[..., value_dim:] + eps)
  return o.astype(out_dtype), LinearAttentionState(S[..., :value_dim], S[..., value_dim])
