"""BASED sequence mixers as NNX modules (MATH §2.1–§2.3; interface in ``lmcore/mixers/base.py``).

Parameter names follow the released PyTorch checkpoints (``proj_q``, ``Wqkv``, ``in_proj``,
``out_proj``, …) so that a weight converter maps them one to one. Output projections are drawn
with ``init.out_std``, every other projection with ``init.std``; convolution taps (and the zoology
conv bias) keep PyTorch's Conv1d default U(±1/sqrt(K)) (based_zoology §5.3).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from based_jax.base_conv import silu_gated_conv, zoology_gated_conv
from based_jax.ops.taylor_attention import (REGISTRY, Problem, TaylorState, default_decay_rates,
                                            taylor_linear_attention, zero_state)
from based_jax.sliding_window import (WindowState, rotary, sliding_window_attention,
                                      zero_window_state)
from based_jax.taylor import feature_width
from lmcore.ops.common import pallas_utils
from lmcore.mixers import flops
from lmcore.mixers.base import InitSpec, dense, float_bytes
from lmcore.ops.common.layout import default_positions


def _head_dim(d_model: int, n_heads: int) -> int:
  if d_model % n_heads:
    raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
  return d_model // n_heads


def _conv_taps(shape: tuple[int, ...], taps: int, rngs: nnx.Rngs) -> nnx.Param:
  """PyTorch's depthwise Conv1d default init: U(±1/sqrt(fan_in)), fan_in = kernel size."""
  bound = taps ** -0.5
  return nnx.Param(jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound))


class TaylorLinearAttention(nnx.Module):
  """Taylor linear attention (MATH §2.1): normalised, 2nd-order Taylor features, no positions.

  Parameters: ``proj_q``, ``proj_k`` D -> H·d', ``proj_v`` D -> D, ``out_proj`` D -> D (no biases);
  with ``decay=True`` also ``dt_proj`` D -> H with bias and no activation (the decay notebook's
  ``Linear(d_model, H)``, based_zoology §2.6). One-token calls (decode) run ``decode_implementation``
  at its own default tiling.
  """

  @dataclasses.dataclass(frozen=True)
  class Config:
    n_heads: int = 16
    feature_dim: int = 16
    feature: Literal["full", "compact"] = "compact"
    implementation: str = "chunked"  # a name of ``taylor_attention.REGISTRY`` or "auto"
    tiles: Any = None  # the named backend's tiling, e.g. {"chunk": 32}; None: its heuristic
    kernel_precision: str = "input"  # Triton kernels only: "tf32"/"float32" run them in fp32
    eps: float = 1e-12
    decay: bool = False
    decode_implementation: Literal["parallel", "chunked", "recurrent"] = "recurrent"

    def __post_init__(self):
      REGISTRY.check_name(self.implementation)
      REGISTRY.check_name(self.decode_implementation)
      pallas_utils.check_precision(self.kernel_precision, "Taylor kernel_precision")
      object.__setattr__(self, "tiles", REGISTRY.tiles(self.implementation, self.tiles, "Taylor tiles"))

  def __init__(self, config: Config, *, d_model: int, init: InitSpec = InitSpec(),
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.d_model = d_model
    self.head_dim = _head_dim(d_model, config.n_heads)
    qk_width = config.n_heads * config.feature_dim
    self.proj_q = dense(d_model, qk_width, std=init.std, rngs=rngs, dtype=dtype)
    self.proj_k = dense(d_model, qk_width, std=init.std, rngs=rngs, dtype=dtype)
    self.proj_v = dense(d_model, d_model, std=init.std, rngs=rngs, dtype=dtype)
    self.out_proj = dense(d_model, d_model, std=init.out_std, rngs=rngs, dtype=dtype)
    self.dt_proj = (dense(d_model, config.n_heads, std=init.std, rngs=rngs, dtype=dtype,
                          use_bias=True) if config.decay else None)

  def __call__(self, x_BxTxD: jax.Array, state: TaylorState | None = None,
               positions_BxT: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, TaylorState]:
    del positions_BxT  # The linear-attention branch has no position encoding.
    cfg = self.config
    batch, length, _ = x_BxTxD.shape
    heads = (batch, length, cfg.n_heads)
    q_BxTxHxK = self.proj_q(x_BxTxD).reshape(*heads, cfg.feature_dim)
    k_BxTxHxK = self.proj_k(x_BxTxD).reshape(*heads, cfg.feature_dim)
    v_BxTxHxV = self.proj_v(x_BxTxD).reshape(*heads, self.head_dim)
    decode = length == 1
    o_BxTxHxV, state = taylor_linear_attention(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxV,
        implementation=cfg.decode_implementation if decode else cfg.implementation,
        state=state, eps=cfg.eps, feature=cfg.feature, tiles=None if decode else cfg.tiles,
        decay=default_decay_rates(cfg.n_heads) if cfg.decay else None,
        dt=self.dt_proj(x_BxTxD) if cfg.decay else None, segment_ids=segment_ids_BxT,
        kernel_precision=cfg.kernel_precision)
    return self.out_proj(o_BxTxHxV.reshape(batch, length, self.d_model)), state

  def init_state(self, batch_size: int, max_len: int | None = None) -> TaylorState:
    """Zero fp32 state ``S`` [B, H, F, dv], ``z`` [B, H, F]; independent of ``max_len``."""
    del max_len
    cfg = self.config
    return zero_state(batch_size, cfg.n_heads, cfg.feature_dim, self.head_dim, cfg.feature)

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    """``B · H · (F · dv + F)`` fp32 values."""
    del max_len
    cfg = self.config
    f = feature_width(cfg.feature_dim, cfg.feature)
    return float_bytes((batch_size, cfg.n_heads, f, self.head_dim), (batch_size, cfg.n_heads, f))

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token (``lmcore.mixers.flops``): the projections, 2 · D · (2 H d' + D)
    + 2 · D · D (+ 2 · D · H with the decay), plus per head the count of the backend
    (``Backend.flops_per_head``; "auto" as it resolves on a GPU, where it depends on T and the head
    widths) at d', dv = D / H and dv + 1 mixed columns (the normaliser): the quadratic forms
    (``parallel``, ``pallas_blocked``) 2 · (d' + dv + 1) · (T + 1) / 2; the chunked ones
    2 · C' · (d' + dv + 1) + 4 · F · (dv + 1), C' = min(chunk, T), scores from the raw q · k (width
    d') and F the state rows (``chunked``: ``feature``'s width; ``pallas_fused``: ``full``'s;
    ``pallas_tpu``: ``compact``'s); ``recurrent`` 4 · F · (dv + 1)."""
    cfg = self.config
    problem = Problem(REGISTRY.counting_platform(cfg.implementation), cfg.feature_dim, self.head_dim, seq_len,
                      decay=cfg.decay, feature=cfg.feature)
    backend = REGISTRY.resolve(cfg.implementation, problem)
    return flops.dense(self) + cfg.n_heads * backend.flops_per_head(problem, cfg.tiles)


class SlidingWindowAttention(nnx.Module):
  """Sliding-window softmax attention (MATH §2.2) with rotary q, k and a ring-buffer decode state.

  Parameters: fused ``Wqkv`` D -> 3D (split as [three, heads, head_dim]) and ``out_proj`` D -> D,
  no biases. ``window`` is the true look-back (the released configs' 128 / 256 mean 64 / 128 here).
  """

  @dataclasses.dataclass(frozen=True)
  class Config:
    n_heads: int = 16
    window: int = 64
    rope_base: float = 10000.0
    implementation: Literal["blocked", "full"] = "blocked"
    block_size: int = 64

  def __init__(self, config: Config, *, d_model: int, init: InitSpec = InitSpec(),
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.d_model = d_model
    self.dtype = dtype
    self.head_dim = _head_dim(d_model, config.n_heads)
    self.Wqkv = dense(d_model, 3 * d_model, std=init.std, rngs=rngs, dtype=dtype)
    self.out_proj = dense(d_model, d_model, std=init.out_std, rngs=rngs, dtype=dtype)

  def __call__(self, x_BxTxD: jax.Array, state: WindowState | None = None,
               positions_BxT: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, WindowState]:
    cfg = self.config
    batch, length, _ = x_BxTxD.shape
    qkv_BxTx3xHxK = self.Wqkv(x_BxTxD).reshape(batch, length, 3, cfg.n_heads, self.head_dim)
    q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = (qkv_BxTx3xHxK[:, :, i] for i in range(3))
    if positions_BxT is None:
      positions_BxT = default_positions(batch, length, None if state is None else state.length)
    q_BxTxHxK = rotary(q_BxTxHxK, positions_BxT, cfg.rope_base)
    k_BxTxHxK = rotary(k_BxTxHxK, positions_BxT, cfg.rope_base)
    o_BxTxHxK, state = sliding_window_attention(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, window=cfg.window, state=state,
        segment_ids=segment_ids_BxT, implementation=cfg.implementation, block_size=cfg.block_size)
    return self.out_proj(o_BxTxHxK.reshape(batch, length, self.d_model)), state

  def init_state(self, batch_size: int, max_len: int | None = None) -> WindowState:
    """Empty ring buffer of ``window + 1`` rotated keys/values, compute dtype (any max_len)."""
    del max_len
    cfg = self.config
    return zero_window_state(batch_size, cfg.window, cfg.n_heads, self.head_dim, self.head_dim,
                             self.dtype)

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    """The ring buffer, ``B · (window + 1) · 2D`` values (the two int32 counters per row aside)."""
    del max_len
    return float_bytes((batch_size, self.config.window + 1, 2 * self.d_model),
                       itemsize=jnp.dtype(self.dtype).itemsize)

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token (``lmcore.mixers.flops``): the projections, 2 · D · 3D + 2 · D · D,
    plus per head (d = D / H):

    * ``blocked``: 2 · 2d per visible key, token t seeing min(t + 1, window + 1) keys, averaged
      over t < T (4 · d · (window + 1) once T >> window); the keys of the two blocks a query block
      reads that the window hides are not counted;
    * ``full`` (every key of the call, masked): the causal half, 2 · 2d · (T + 1) / 2.
    """
    cfg, d = self.config, self.head_dim
    if cfg.implementation == "full":
      mixing = flops.quadratic(d, d, seq_len)
    else:
      mixing = flops.sliding_window(d, d, cfg.window, seq_len)
    return flops.dense(self) + cfg.n_heads * mixing


class _ConvWindow:
  """Decode state of a short causal convolution: its last K-1 inputs, [B, K-1, conv_width]."""

  config: "BaseConv.Config"
  conv_width: int
  dtype: jnp.dtype

  def init_state(self, batch_size: int, max_len: int | None = None) -> jax.Array:
    """Zero window of the last K-1 conv inputs (compute dtype; any max_len)."""
    del max_len
    return jnp.zeros((batch_size, self.config.kernel_size - 1, self.conv_width), self.dtype)

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    del max_len
    return float_bytes((batch_size, self.config.kernel_size - 1, self.conv_width),
                       itemsize=jnp.dtype(self.dtype).itemsize)


class BaseConv(_ConvWindow, nnx.Module):
  """LM BaseConv (MATH §2.3): ``out_proj(SiLU(conv(u1)) ⊙ u2)``, ``[u1 | u2] = in_proj(x)``.

  Parameters: ``in_proj`` D -> 4D with bias, depthwise ``conv_kernel`` [K, 2D] without bias,
  ``out_proj`` 2D -> D with bias (6D² + 11D for K = 3). Decode state: the last K-1 pre-conv ``u1``.
  """

  @dataclasses.dataclass(frozen=True)
  class Config:
    kernel_size: int = 3
    # The backward recomputes the gated convolution from in_proj's output (far less memory); under
    # model.remat the block is recomputed anyway, and False saves a third forward.
    gate_remat: bool = True

  def __init__(self, config: Config, *, d_model: int, init: InitSpec = InitSpec(),
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.d_model = d_model
    self.conv_width = 2 * d_model
    self.dtype = dtype
    self.in_proj = dense(d_model, 4 * d_model, std=init.std, rngs=rngs, dtype=dtype, use_bias=True)
    self.conv_kernel = _conv_taps((config.kernel_size, 2 * d_model), config.kernel_size, rngs)
    self.out_proj = dense(2 * d_model, d_model, std=init.out_std, rngs=rngs, dtype=dtype,
                          use_bias=True)

  def __call__(self, x_BxTxD: jax.Array, state: jax.Array | None = None,
               positions_BxT: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    del positions_BxT  # A convolution needs no positions.
    u1_BxTxE, u2_BxTxE = jnp.split(self.in_proj(x_BxTxD), 2, axis=-1)
    y_BxTxE, state = silu_gated_conv(u1_BxTxE, u2_BxTxE, self.conv_kernel[...], state=state,
                                     segment_ids=segment_ids_BxT, remat=self.config.gate_remat)
    return self.out_proj(y_BxTxE), state

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token (``lmcore.mixers.flops``), any ``seq_len``: ``in_proj`` 2 · D · 4D,
    ``out_proj`` 2 · 2D · D and the depthwise convolution 2 · K · 2D (the gate is elementwise)."""
    del seq_len
    return flops.dense(self) + flops.short_conv(self.config.kernel_size, self.conv_width)


class ZoologyBaseConv(_ConvWindow, nnx.Module):
  """zoology's synthetic BaseConv (based_zoology §4.2): ``conv(x) ⊙ projection(x) + x``.

  Parameters: ``projection`` D -> D with bias, depthwise ``conv_kernel`` [K, D], ``conv_bias`` [D].
  No activation (zoology's ``use_act=False``), internal residual. Decode state: the last K-1 inputs.
  """

  @dataclasses.dataclass(frozen=True)
  class Config:
    kernel_size: int = 3

  def __init__(self, config: Config, *, d_model: int, init: InitSpec = InitSpec(),
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.d_model = d_model
    self.conv_width = d_model
    self.dtype = dtype
    self.projection = dense(d_model, d_model, std=init.std, rngs=rngs, dtype=dtype, use_bias=True)
    self.conv_kernel = _conv_taps((config.kernel_size, d_model), config.kernel_size, rngs)
    self.conv_bias = _conv_taps((d_model,), config.kernel_size, rngs)

  def __call__(self, x_BxTxD: jax.Array, state: jax.Array | None = None,
               positions_BxT: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    del positions_BxT  # A convolution needs no positions.
    return zoology_gated_conv(x_BxTxD, self.projection(x_BxTxD), self.conv_kernel[...],
                              self.conv_bias[...], state=state, segment_ids=segment_ids_BxT)

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token (``lmcore.mixers.flops``), any ``seq_len``: ``projection``
    2 · D · D and the depthwise convolution 2 · K · D."""
    del seq_len
    return flops.dense(self) + flops.short_conv(self.config.kernel_size, self.conv_width)
