"""CyFA — gated accumulation without the delta rule (MATH §3).

Per head, with the fp32 state S_t in R^{d_k x d_v}::

    k̂_t = k_t / max(||k_t||_2, k_floor)         normalised key with a floor
    f_t = sigmoid(x W_f + b_f)                   forget gate, per head or key channel (``forget``)
    i_t = sigmoid(x W_i + b_i)                   write gate, per head
    w_t = softplus(x W_w + b_w)                  write strength, per head, used as min(w_t, w_max)
    S_t = f_t ⊙ S_{t-1} + min(w_t, w_max) i_t k̂_t v_tᵀ,     o_t = S_tᵀ q_t
    y   = W_o [RMSNorm(o_t) (⊙ swish(x W_g) when ``output_gate``)]

It runs on the gated op with log_forget = log_sigmoid(x W_f + b_f) and i_t min(w_t, w_max) folded
into k̂. Gate biases start unsaturated (sigmoid' >= 0.017): b_f spaced over the heads from
``forget_bias_min`` = 1 to ``forget_bias_max`` = 4 (half-lives of about 2 to 38 tokens), b_i = 0,
b_w = log(e - 1) (w = 1). Only the gate projections have biases. ``monitors(x)`` returns the seed's
three statistics (final-state norm, gates, write strength) for the training loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.mixers import flops
from lmcore.mixers.base import InitSpec, dense
from lmcore.ops.gated_linear_attention import LinearAttentionState, gated_linear_attention
from lmcore.mixers.common import (HeadRMSNorm, check_linear_attention, decode_tiles, implementation_for,
                                  linear_attention_flops, linear_state_bytes, merge_heads, split_heads)


class CyFAGates(NamedTuple):
  """The fp32 gates of one call."""

  log_forget: jax.Array  # log f: [B, T, H] (forget="head") or [B, T, H, d_k] (forget="channel")
  write: jax.Array  # i: [B, T, H]
  strength: jax.Array  # w before clipping: [B, T, H]


def _gate_projection(d_model: int, width: int, bias_W: jax.Array, *, std: float, dtype,
                     rngs: nnx.Rngs) -> nnx.Linear:
  """A gate logit projection: kernel N(0, std), bias initialised to ``bias_W``."""
  return nnx.Linear(d_model, width, use_bias=True, dtype=dtype, param_dtype=jnp.float32,
                    kernel_init=nnx.initializers.normal(std),
                    bias_init=lambda key, shape, dtype=jnp.float32: bias_W.astype(dtype),
                    rngs=rngs)


class CyFA(nnx.Module):
  """CyFA mixer; state ``LinearAttentionState`` (S [B, H, d_k, d_v], z unused)."""

  @dataclasses.dataclass(frozen=True)
  class Config:
    n_heads: int = 12
    head_dim: int = 64  # d_k
    v_head_dim: int = 64  # d_v
    k_floor: float = 0.1
    w_max: float = 4.0
    forget: str = "head"  # "head" | "channel"
    output_gate: bool = True
    forget_bias_min: float = 1.0
    forget_bias_max: float = 4.0
    norm_eps: float = 1e-5
    implementation: str = "chunked"
    tiles: Any = None  # the named backend's tiling, e.g. {"chunk": 32}; None: its heuristic
    kernel_precision: str = "input"  # "pallas_triton" only: "tf32"/"float32" run the kernels in fp32
    # The kernels' backward state dots in two bf16 parts; False: one rounding, faster
    # (docs/BENCHMARKS.md, Gated linear attention: split state dots).
    kernel_split_state: bool = True

    def __post_init__(self):
      check_linear_attention(self, "CyFA")

  def __init__(self, config: Config, *, d_model: int, init: InitSpec, dtype=jnp.float32,
               rngs: nnx.Rngs):
    if config.forget not in ("head", "channel"):
      raise ValueError(f"CyFA: forget must be 'head' or 'channel', got {config.forget!r}")
    self.config = config
    H, dk, dv = config.n_heads, config.head_dim, config.v_head_dim
    self.wq = dense(d_model, H * dk, std=init.std, dtype=dtype, rngs=rngs)
    self.wk = dense(d_model, H * dk, std=init.std, dtype=dtype, rngs=rngs)
    self.wv = dense(d_model, H * dv, std=init.std, dtype=dtype, rngs=rngs)
    gate = lambda width, bias: _gate_projection(d_model, width, bias, std=init.std, dtype=dtype,
                                                rngs=rngs)
    forget_bias_H = jnp.linspace(config.forget_bias_min, config.forget_bias_max, H)
    channels = 1 if config.forget == "head" else dk
    self.w_forget = gate(H * channels, jnp.repeat(forget_bias_H, channels))
    self.w_write = gate(H, jnp.zeros((H,)))
    self.w_strength = gate(H, jnp.full((H,), math.log(math.e - 1.0)))
    self.wg = (dense(d_model, H * dv, std=init.std, dtype=dtype, rngs=rngs)
               if config.output_gate else None)
    self.norm = HeadRMSNorm(dv, eps=config.norm_eps)
    self.wo = dense(H * dv, d_model, std=init.out_std, dtype=dtype, rngs=rngs)

  def init_state(self, batch_size: int, max_len: int | None = None) -> LinearAttentionState:
    c = self.config
    return LinearAttentionState.zeros(batch_size, c.n_heads, c.head_dim, c.v_head_dim)

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    c = self.config
    return linear_state_bytes(batch_size, c.n_heads, c.head_dim, c.v_head_dim)

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: the dense kernels plus the op per head at F = d_k, V = d_v."""
    c = self.config
    return flops.dense(self) + linear_attention_flops(
        c.implementation, c.tiles, c.n_heads, c.head_dim, c.v_head_dim, seq_len)

  def gates(self, x_BxTxD: jax.Array) -> CyFAGates:
    """log f, i and the unclipped w, in fp32."""
    logits = lambda projection: projection(x_BxTxD).astype(jnp.float32)
    log_forget = jax.nn.log_sigmoid(logits(self.w_forget))
    if self.config.forget == "channel":
      log_forget = split_heads(log_forget, self.config.n_heads)
    return CyFAGates(log_forget, jax.nn.sigmoid(logits(self.w_write)),
                     jax.nn.softplus(logits(self.w_strength)))

  def _written_keys(self, k_BxTxHxK: jax.Array, gates: CyFAGates) -> jax.Array:
    """min(w, w_max) · i · k / max(||k||, k_floor), computed in fp32, returned in k's dtype."""
    k = k_BxTxHxK.astype(jnp.float32)
    norm_BxTxHx1 = jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True))
    write_BxTxHx1 = (jnp.minimum(gates.strength, self.config.w_max) * gates.write)[..., None]
    return (k / jnp.maximum(norm_BxTxHx1, self.config.k_floor) * write_BxTxHx1).astype(
        k_BxTxHxK.dtype)

  def _forward(self, x_BxTxD, state, segment_ids_BxT):
    c, T = self.config, x_BxTxD.shape[1]
    q, k, v = (split_heads(w(x_BxTxD), c.n_heads) for w in (self.wq, self.wk, self.wv))
    gates = self.gates(x_BxTxD)
    o_BxTxHxV, new_state = gated_linear_attention(
        q, self._written_keys(k, gates), v, gates.log_forget, state=state,
        implementation=implementation_for(c.implementation, T), tiles=decode_tiles(c.tiles, T),
        segment_ids=segment_ids_BxT, kernel_precision=c.kernel_precision,
        kernel_split_state=c.kernel_split_state)
    gate = None if self.wg is None else split_heads(self.wg(x_BxTxD), c.n_heads)
    y_BxTxD = self.wo(merge_heads(self.norm(o_BxTxHxV, gate)))
    return y_BxTxD.astype(x_BxTxD.dtype), new_state, gates

  def __call__(self, x_BxTxD, state: LinearAttentionState | None = None, positions_BxT=None,
               segment_ids_BxT=None):
    y_BxTxD, new_state, _ = self._forward(x_BxTxD, state, segment_ids_BxT)
    return y_BxTxD, new_state

  def monitors(self, x_BxTxD: jax.Array,
               segment_ids_BxT: jax.Array | None = None) -> dict[str, jax.Array]:
    """The seed's three monitors on a batch, fp32 scalars: ``state_norm`` (the final state's Frobenius
    norm, mean over batch and heads), mean and std of f and i, statistics of the unclipped w and
    ``write_strength_clipped_frac`` (the share of entries with w > w_max)."""
    _, state, gates = self._forward(x_BxTxD, None, segment_ids_BxT)
    forget, write, strength = jnp.exp(gates.log_forget), gates.write, gates.strength
    return {
        "state_norm": jnp.mean(jnp.sqrt(jnp.sum(state.S * state.S, axis=(-2, -1)))),
        "forget_mean": jnp.mean(forget),
        "forget_std": jnp.std(forget),
        "write_gate_mean": jnp.mean(write),
        "write_gate_std": jnp.std(write),
        "write_strength_mean": jnp.mean(strength),
        "write_strength_std": jnp.std(strength),
        "write_strength_max": jnp.max(strength),
        "write_strength_clipped_frac": jnp.mean((strength > self.config.w_max).astype(jnp.float32)),
    }
