"""Small pieces shared by the linear-attention mixers (GLA, CyFA and the normalised baselines)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.mixers.base import float_bytes
from lmcore.ops.common import pallas_utils
from lmcore.ops.gated_linear_attention import REGISTRY, Problem


class HeadRMSNorm(nnx.Module):
  """y = x / sqrt(mean(x²) + eps) ⊙ w over a head's channels, w shared by heads (FLA's group RMSNorm);
  with ``gate``, times swish(gate) (FusedRMSNormGated). fp32 inside, input dtype out."""

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
  """One-token calls (decode) run ``recurrent`` (a chunked form would pad the token to a chunk)."""
  return "recurrent" if length == 1 else configured


def linear_state_bytes(batch_size: int, n_heads: int, key_dim: int, value_dim: int) -> int:
  """Bytes of a ``LinearAttentionState`` (S and z, fp32)."""
  return float_bytes((batch_size, n_heads, key_dim, value_dim), (batch_size, n_heads, key_dim))


def linear_attention_flops(implementation: str, tiles, n_heads: int, features: int, values: int,
                           seq_len: int) -> float:
  """Sequence-mixing FLOPs per token of ``gated_linear_attention`` over ``n_heads`` heads of F x V
  (V + 1 normalised): the resolved backend's ``flops_per_head`` on its counting platform."""
  problem = Problem(REGISTRY.counting_platform(implementation), features, values, seq_len)
  return n_heads * REGISTRY.resolve(implementation, problem).flops_per_head(problem, tiles)


def check_linear_attention(config, name: str) -> None:
  """Checks a linear-attention mixer config's ``implementation`` and ``kernel_precision`` and makes its
  ``tiles`` the named backend's typed tiling (``Registry.tiles``); ``config`` is a frozen dataclass."""
  REGISTRY.check_name(config.implementation)
  pallas_utils.check_precision(config.kernel_precision, f"{name} kernel_precision")
  object.__setattr__(config, "tiles", REGISTRY.tiles(config.implementation, config.tiles, f"{name} tiles"))


def decode_tiles(tiles, length: int):
  """The tiles of a call: none for a one-token call, which runs ``recurrent`` (``implementation_for``)."""
  return None if length == 1 else tiles
