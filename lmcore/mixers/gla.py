"""GLA — Gated Linear Attention (MATH §4), parameter for parameter FLA's GatedLinearAttention layer.

Per head, with d_k = expand_k·D / H and d_v = expand_v·D / H (no biases except b_up)::

    q, k = x W_q, x W_k    (D -> expand_k·D)        v, g = x W_v, x W_g    (D -> expand_v·D)
    log α_t = logsigmoid(x W_down W_up + b_up) / gate_logit_normalizer    (per key channel)
    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,    o_t = d_k^-1/2 S_tᵀ q_t
    y = W_o [RMSNorm(o_t) ⊙ swish(g_t)]    (RMSNorm over d_v, its weight shared by the heads)

FLA initialises every Linear N(0, 0.02) with zero bias; here the output projection uses
``init.out_std``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.mixers import flops
from lmcore.mixers.base import InitSpec, dense
from lmcore.ops.gated_linear_attention import LinearAttentionState, gated_linear_attention
from lmcore.mixers.common import (HeadRMSNorm, check_linear_attention, decode_tiles, implementation_for,
                                  linear_attention_flops, linear_state_bytes, merge_heads, split_heads)


class GLA(nnx.Module):
  """Gated Linear Attention mixer; state ``LinearAttentionState`` (S [B, H, d_k, d_v], z unused)."""

  @dataclasses.dataclass(frozen=True)
  class Config:
    n_heads: int = 4
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_low_rank: int = 16
    gate_logit_normalizer: float = 16.0
    implementation: str = "chunked"
    tiles: Any = None  # the named backend's tiling, e.g. {"chunk": 32}; None: its heuristic
    kernel_precision: str = "input"  # "pallas_triton" only: "tf32"/"float32" run the kernels in fp32
    # The kernels' backward state dots in two bf16 parts; False: one rounding, faster
    # (docs/BENCHMARKS.md, Gated linear attention: split state dots).
    kernel_split_state: bool = True
    # XLA "chunked" only: the backward recomputes the op's forward (far less memory); under model.remat
    # the block is recomputed anyway, and False saves a third forward.
    chunked_remat: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self):
      check_linear_attention(self, "GLA")

  def __init__(self, config: Config, *, d_model: int, init: InitSpec, dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.config = config
    key_dim, value_dim = int(d_model * config.expand_k), int(d_model * config.expand_v)
    if key_dim % config.n_heads or value_dim % config.n_heads:
      raise ValueError(f"GLA: key dim {key_dim} and value dim {value_dim} must be divisible by "
                       f"n_heads={config.n_heads}")
    self.head_k_dim, self.head_v_dim = key_dim // config.n_heads, value_dim // config.n_heads
    linear = functools.partial(dense, std=init.std, dtype=dtype, rngs=rngs)
    self.wq, self.wk = linear(d_model, key_dim), linear(d_model, key_dim)
    self.wv, self.wg = linear(d_model, value_dim), linear(d_model, value_dim)
    self.gate_down = linear(d_model, config.gate_low_rank)
    self.gate_up = linear(config.gate_low_rank, key_dim, use_bias=True)
    self.norm = HeadRMSNorm(self.head_v_dim, eps=config.norm_eps)
    self.wo = dense(value_dim, d_model, std=init.out_std, dtype=dtype, rngs=rngs)

  def init_state(self, batch_size: int, max_len: int | None = None) -> LinearAttentionState:
    H = self.config.n_heads
    return LinearAttentionState.zeros(batch_size, H, self.head_k_dim, self.head_v_dim)

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    return linear_state_bytes(batch_size, self.config.n_heads, self.head_k_dim, self.head_v_dim)

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: the dense kernels plus the op per head at F = d_k, V = d_v."""
    c = self.config
    return flops.dense(self) + linear_attention_flops(
        c.implementation, c.tiles, c.n_heads, self.head_k_dim, self.head_v_dim, seq_len)

  def log_forget(self, x_BxTxD: jax.Array) -> jax.Array:
    """log α [B, T, H, d_k], fp32: logsigmoid of the low-rank gate over the normaliser."""
    logits = self.gate_up(self.gate_down(x_BxTxD)).astype(jnp.float32)
    log_alpha = jax.nn.log_sigmoid(logits) / self.config.gate_logit_normalizer
    return split_heads(log_alpha, self.config.n_heads)

  def __call__(self, x_BxTxD, state: LinearAttentionState | None = None, positions_BxT=None,
               segment_ids_BxT=None):
    H, T = self.config.n_heads, x_BxTxD.shape[1]
    q, k, v, g = (split_heads(w(x_BxTxD), H) for w in (self.wq, self.wk, self.wv, self.wg))
    o_BxTxHxV, new_state = gated_linear_attention(
        q, k, v, self.log_forget(x_BxTxD), state=state, scale=self.head_k_dim**-0.5,
        implementation=implementation_for(self.config.implementation, T),
        tiles=decode_tiles(self.config.tiles, T), segment_ids=segment_ids_BxT,
        kernel_precision=self.config.kernel_precision, kernel_split_state=self.config.kernel_split_state,
        chunked_remat=self.config.chunked_remat)
    y_BxTxD = self.wo(merge_heads(self.norm(o_BxTxHxV, g)))
    return y_BxTxD.astype(x_BxTxD.dtype), new_state
