"""Gated DeltaNet mixer (MATH §4), following FLA's ``fla/layers/gated_deltanet.py::GatedDeltaNet``.

From x [B, T, D], per head h (H heads, key dim K, value dim V):

    q, k, v  = SiLU(ShortConv_W(x Wq)), SiLU(ShortConv_W(x Wk)), SiLU(ShortConv_W(x Wv)), no biases
    q, k    <- q / ||q||, k / ||k||
    beta     = sigmoid(x Wb)                                              [B, T, H], fp32
    log a    = g = -exp(A_log) * softplus(x Wa + dt_bias)                 [B, T, H], fp32, <= 0
    S_t      = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = K^-1/2 S_t^T q_t
    y        = (RMSNorm(o) * swish(x Wg)) Wo                              (RMSNorm over V, per head)

``A_log`` = log A, A ~ U(0, 16]; ``dt_bias`` = softplus^-1(dt), dt log-uniform in [1e-3, 0.1] (floored
at 1e-4), both [H] and, as FLA's ``_no_weight_decay``, excluded from weight decay (``NO_WEIGHT_DECAY``).
Defaults are small (tests, MQAR); FLA's are ``head_dim=256, expand_v=2``. Positions are not used: the
short convolution and the decay carry order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.ops.gated_delta_rule import REGISTRY, DeltaRuleState, Problem, gated_delta_rule
from lmcore.mixers import flops
from lmcore.mixers.base import InitSpec, dense, float_bytes
from lmcore.mixers.short_conv import ShortConv
from lmcore.mixers.common import implementation_for

NO_WEIGHT_DECAY = ("A_log", "dt_bias")
A_INIT_MAX = 16.0
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4
L2_NORM_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum x^2 + eps)


class GatedDeltaNetState(NamedTuple):
  """Decode state: the conv windows [B, W-1, H*K] (q, k) and [B, W-1, H*V] (v), and S, all fp32."""

  conv_q: jax.Array
  conv_k: jax.Array
  conv_v: jax.Array
  delta: DeltaRuleState


def _init_A_log(key: jax.Array, n_heads: int) -> jax.Array:
  """log A with A ~ U(0, 16]: uniform draws lie in [0, 1), so 16 (1 - u) is never 0."""
  return jnp.log(A_INIT_MAX * (1.0 - jax.random.uniform(key, (n_heads,), jnp.float32)))


def _init_dt_bias(key: jax.Array, n_heads: int) -> jax.Array:
  """softplus^-1(dt), dt log-uniform in [DT_MIN, DT_MAX] and >= DT_FLOOR (FLA / Mamba2 init)."""
  log_dt = jax.random.uniform(key, (n_heads,), jnp.float32, math.log(DT_MIN), math.log(DT_MAX))
  dt = jnp.maximum(jnp.exp(log_dt), DT_FLOOR)
  return dt + jnp.log(-jnp.expm1(-dt))


def _l2_normalise(x_BxTxHxK: jax.Array) -> jax.Array:
  """x / sqrt(||x||^2 + eps) over the head dim, computed in fp32, returned in x's dtype."""
  x32 = x_BxTxHxK.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_NORM_EPS)
          ).astype(x_BxTxHxK.dtype)


class GatedDeltaNet(nnx.Module):
  """Gated DeltaNet: short conv + SiLU, L2-normalised q, k, gated delta rule, gated RMSNorm."""

  @dataclasses.dataclass(frozen=True)
  class Config:
    """``v_head_dim`` overrides ``expand_v * head_dim`` (FLA's default expand_v is 2; ours is 1)."""

    n_heads: int = 4
    head_dim: int = 16
    v_head_dim: int | None = None
    expand_v: float = 1.0
    conv_size: int = 4
    implementation: str = "chunked"
    tiles: Any = None  # the named backend's tiling (``chunked``: {"chunk": 64}); None: its heuristic
    norm_eps: float = 1e-5

    def __post_init__(self):
      REGISTRY.check_name(self.implementation)
      object.__setattr__(self, "tiles", REGISTRY.tiles(self.implementation, self.tiles, "GatedDeltaNet tiles"))

    @property
    def value_dim(self) -> int:
      if self.v_head_dim is not None:
        return self.v_head_dim
      value_dim = self.expand_v * self.head_dim
      if not float(value_dim).is_integer():
        raise ValueError(f"GatedDeltaNet: expand_v * head_dim = {value_dim} is not an integer; "
                         "choose expand_v accordingly or set v_head_dim")
      return int(value_dim)

  def __init__(self, config: Config, *, d_model: int, init: InitSpec = InitSpec(),
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config, self.dtype = config, dtype
    heads = config.n_heads
    key_width, value_width = heads * config.head_dim, heads * config.value_dim
    proj = lambda width: dense(d_model, width, std=init.std, rngs=rngs, dtype=dtype)
    self.q_proj, self.k_proj = proj(key_width), proj(key_width)
    self.v_proj, self.g_proj = proj(value_width), proj(value_width)
    conv = lambda width: ShortConv(width, config.conv_size, activation=jax.nn.silu, rngs=rngs)
    self.q_conv, self.k_conv, self.v_conv = conv(key_width), conv(key_width), conv(value_width)
    # beta and the decay are gates: projected and activated in fp32.
    self.b_proj = dense(d_model, heads, std=init.std, rngs=rngs)
    self.a_proj = dense(d_model, heads, std=init.std, rngs=rngs)
    self.A_log = nnx.Param(_init_A_log(rngs.params(), heads))
    self.dt_bias = nnx.Param(_init_dt_bias(rngs.params(), heads))
    self.o_norm = nnx.RMSNorm(config.value_dim, epsilon=config.norm_eps, dtype=jnp.float32,
                              rngs=rngs)
    self.o_proj = dense(value_width, d_model, std=init.out_std, rngs=rngs, dtype=dtype)

  def init_state(self, batch_size: int, max_len: int | None = None) -> GatedDeltaNetState:
    """Zero conv windows and zero S; the state size does not depend on ``max_len``."""
    del max_len
    config = self.config
    return GatedDeltaNetState(
        self.q_conv.init_state(batch_size), self.k_conv.init_state(batch_size),
        self.v_conv.init_state(batch_size),
        DeltaRuleState.zeros(batch_size, config.n_heads, config.head_dim, config.value_dim))

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    """fp32 bytes of the decode state per sequence: S, 4 H K V, and conv windows, 4 (W-1)(2 H K + H V)."""
    del max_len
    config = self.config
    S_bytes = float_bytes((batch_size, config.n_heads, config.head_dim, config.value_dim))
    convs = (self.q_conv, self.k_conv, self.v_conv)
    conv_bytes = sum(conv.state_bytes(batch_size) for conv in convs)
    return S_bytes + conv_bytes

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: the dense kernels, the short convolutions and per head the rule's
    backend on its counting platform (``Backend.flops_per_head``)."""
    c = self.config
    H, K, V = c.n_heads, c.head_dim, c.value_dim
    convs = flops.short_conv(c.conv_size, H * (2 * K + V))
    problem = Problem(REGISTRY.counting_platform(c.implementation), K, V, seq_len)
    rule = REGISTRY.resolve(c.implementation, problem).flops_per_head(problem, c.tiles)
    return flops.dense(self) + convs + H * rule

  def _gates(self, x_BxTxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log alpha = -exp(A_log) softplus(x Wa + dt_bias), beta = sigmoid(x Wb)), fp32 [B, T, H]."""
    x32_BxTxD = x_BxTxD.astype(jnp.float32)
    dt_BxTxH = jax.nn.softplus(self.a_proj(x32_BxTxD) + self.dt_bias[...])
    return -jnp.exp(self.A_log[...]) * dt_BxTxH, jax.nn.sigmoid(self.b_proj(x32_BxTxD))

  def __call__(self, x_BxTxD: jax.Array, state: GatedDeltaNetState | None = None,
               positions_BxT: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, GatedDeltaNetState]:
    """y [B, T, D] in x's dtype and the state after the last token (see the module docstring)."""
    del positions_BxT
    config = self.config
    batch_size, length, _ = x_BxTxD.shape
    per_head = (batch_size, length, config.n_heads, -1)
    x_BxTxD = x_BxTxD.astype(self.dtype)
    state = self.init_state(batch_size) if state is None else state
    q, conv_q = self.q_conv(self.q_proj(x_BxTxD), state.conv_q, segment_ids_BxT)
    k, conv_k = self.k_conv(self.k_proj(x_BxTxD), state.conv_k, segment_ids_BxT)
    v, conv_v = self.v_conv(self.v_proj(x_BxTxD), state.conv_v, segment_ids_BxT)
    log_alpha_BxTxH, beta_BxTxH = self._gates(x_BxTxD)
    o_BxTxHxV, delta = gated_delta_rule(
        _l2_normalise(q.reshape(per_head)), _l2_normalise(k.reshape(per_head)), v.reshape(per_head),
        log_alpha_BxTxH, beta_BxTxH, implementation=implementation_for(config.implementation, length),
        state=state.delta, tiles=config.tiles if length > 1 else None, segment_ids=segment_ids_BxT)
    gate_BxTxHxV = self.g_proj(x_BxTxD).reshape(per_head).astype(jnp.float32)
    o_BxTxHxV = self.o_norm(o_BxTxHxV.astype(jnp.float32)) * jax.nn.silu(gate_BxTxHxV)
    y_BxTxD = self.o_proj(o_BxTxHxV.reshape(batch_size, length, -1).astype(self.dtype))
    return y_BxTxD, GatedDeltaNetState(conv_q, conv_k, conv_v, delta)
