"""Small pieces shared by the linear-attention mixers (GLA, CyFA and the normalised baselines)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.mixers import flops
from lmcore.mixers.base import float_bytes
from lmcore.ops.gated_linear_attention import pallas_triton, resolve_implementation, xla


class HeadRMSNorm(nnx.Module):
  """y = x / sqrt(mean(x²) + eps) ⊙ w over one head's channels (the last axis), w shared by heads.

  FLA's group RMSNorm of GLA and Gated DeltaNet (a weight of size head_dim). With ``gate``, the
  result is multiplied by swish(gate) (FLA's FusedRMSNormGated). fp32 inside, input dtype out.
  """

  def __init__(self, dim: int, *, eps: float):
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x_BxTxHxd: jax.Array, gate_BxTxHxd: jax.Array | None = None) -> jax.Array:
    x = x_BxTxHxd.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight[...]
    if gate_BxTxHxd is not None:
      y = y * jax.nn.silu(gate_BxTxHxd.astype(jnp.float32))
    return y.astype(x_BxTxHxd.dtype)


def split_heads(x_BxTxF: jax.Array, n_heads: int) -> jax.Array:
  """[B, T, H * d] -> [B, T, H, d]."""
  B, T, F = x_BxTxF.shape
  return x_BxTxF.reshape(B, T, n_heads, F // n_heads)


def merge_heads(x_BxTxHxd: jax.Array) -> jax.Array:
  """[B, T, H, d] -> [B, T, H * d]."""
  B, T = x_BxTxHxd.shape[:2]
  return x_BxTxHxd.reshape(B, T, -1)


def implementation_for(configured: str, length: int) -> str:
  """One-token calls (decode) run the token-by-token ``recurrent`` scan, others the configured one.

  Both compute the same function; the chunked form would pad a single token to a whole chunk.
  """
  return "recurrent" if length == 1 else configured


def linear_state_bytes(batch_size: int, n_heads: int, key_dim: int, value_dim: int) -> int:
  """Bytes of a ``LinearAttentionState`` (S and z, fp32)."""
  return float_bytes((batch_size, n_heads, key_dim, value_dim), (batch_size, n_heads, key_dim))


def linear_attention_flops(implementation: str, chunk_size: int | None, n_heads: int, features: int,
                           values: int, seq_len: int) -> float:
  """Sequence-mixing FLOPs per token of ``gated_linear_attention`` over ``n_heads`` heads of key width
  F = ``features`` and V = ``values`` mixed columns (V + 1 for a normalised form), conventions of
  ``lmcore.mixers.flops``, "auto" resolved as on a GPU:

  * ``parallel``: per head 2 · (F + V) · (T + 1) / 2 (the causal half);
  * ``recurrent``: per head 4 · F · V;
  * ``chunked`` / ``xla`` / ``pallas``: per head 2 · C' · (F + V) + 4 · F · V with C' = min(C, T),
    C = ``chunk_size`` or the implementation's default (XLA 64, the Triton kernel 16).
  """
  name = flops.on_gpu(resolve_implementation, implementation, key_dim=features, value_dim=values)
  if name == "parallel":
    return n_heads * flops.quadratic(features, values, seq_len)
  if name == "recurrent":
    return n_heads * flops.recurrent(features, values)
  default = pallas_triton.CHUNK if name == "pallas" else xla.CHUNK
  chunk = default if chunk_size is None else chunk_size
  return n_heads * flops.chunked(features, values, chunk, seq_len)
