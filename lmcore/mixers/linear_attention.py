"""Normalised linear-attention baselines (MATH §4): Linear Transformer, Performer, cosFormer.

All three are, per head (head_dim d for q, k and v; no biases; scale 1; eps 1e-6)::

    o_t = sum_{j<=t} φ(q_t)·φ(k_j) v_j / (sum_{j<=t} φ(q_t)·φ(k_j) + eps),    y = W_o o

by the op with ``normalize=True``; they differ in the feature map φ:
  * LinearTransformer: φ(x) = elu(x) + 1 (Katharopoulos et al.);
  * Performer (FAVOR+): φ(x) = exp(W x' - ||x'||² / 2) / sqrt(m), x' = x / d^{1/4}, so E[φ(q)·φ(k)] =
    exp(q·k / sqrt(d)); W [m, d] per head: orthogonal random features drawn once, never trained;
  * CosFormer: φ(x_i) = [relu(x) cos(π i / 2M), relu(x) sin(π i / 2M)] at position i, so that
    φ(q_i)·φ(k_j) = relu(q)·relu(k) cos(π (i - j) / 2M); M = ``max_len``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.mixers import flops
from lmcore.mixers.base import InitSpec, dense, float_bytes
from lmcore.mixers.common import (check_linear_attention, decode_tiles, implementation_for,
                                  linear_attention_flops, linear_state_bytes, merge_heads, split_heads)
from lmcore.ops.common.layout import default_positions
from lmcore.ops.common.segments import document_index
from lmcore.ops.gated_linear_attention import LinearAttentionState, gated_linear_attention


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
  """Fields shared by the three baselines."""

  n_heads: int = 12
  head_dim: int = 64
  implementation: str = "chunked"
  tiles: Any = None  # the named backend's tiling, e.g. {"chunk": 32}; None: its heuristic
  kernel_precision: str = "input"  # "pallas_triton" only: "tf32"/"float32" run the kernels in fp32
  eps: float = 1e-6

  def __post_init__(self):
    check_linear_attention(self, "linear attention")


class _NormalisedLinearAttention(nnx.Module):
  """Projections (q, k, v: D -> H·d and o: H·d -> D, no biases) and the normalised op call."""

  def __init__(self, config: LinearAttentionConfig, *, d_model: int, init: InitSpec,
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    inner = config.n_heads * config.head_dim
    self.wq = dense(d_model, inner, std=init.std, dtype=dtype, rngs=rngs)
    self.wk = dense(d_model, inner, std=init.std, dtype=dtype, rngs=rngs)
    self.wv = dense(d_model, inner, std=init.std, dtype=dtype, rngs=rngs)
    self.wo = dense(inner, d_model, std=init.out_std, dtype=dtype, rngs=rngs)

  def feature_width(self) -> int:
    """F: the width of φ(q), φ(k) per head (d here)."""
    return self.config.head_dim

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: the four projections plus the op per head at F = ``feature_width()``
    and V = d + 1 (the ones column), ``linear_attention_flops``; feature maps are elementwise."""
    c = self.config
    return flops.dense(self) + linear_attention_flops(
        c.implementation, c.tiles, c.n_heads, self.feature_width(), c.head_dim + 1, seq_len)

  def _project(self, x_BxTxD):
    H = self.config.n_heads
    return tuple(split_heads(w(x_BxTxD), H) for w in (self.wq, self.wk, self.wv))

  def _attend(self, x_BxTxD, phi_q, phi_k, v, state: LinearAttentionState | None,
              segment_ids_BxT, log_forget=None):
    """Normalised linear attention of the features, then W_o: (y, new LinearAttentionState)."""
    c = self.config
    o_BxTxHxd, new_state = gated_linear_attention(
        phi_q.astype(v.dtype), phi_k.astype(v.dtype), v, log_forget, state=state,
        normalize=True, eps=c.eps, implementation=implementation_for(c.implementation, v.shape[1]),
        tiles=decode_tiles(c.tiles, v.shape[1]), segment_ids=segment_ids_BxT,
        kernel_precision=c.kernel_precision)
    return self.wo(merge_heads(o_BxTxHxd)).astype(x_BxTxD.dtype), new_state


class LinearTransformer(_NormalisedLinearAttention):
  """φ(x) = elu(x) + 1; state ``LinearAttentionState`` (S [B, H, d, d], z [B, H, d])."""

  Config = LinearAttentionConfig

  def init_state(self, batch_size: int, max_len: int | None = None) -> LinearAttentionState:
    c = self.config
    return LinearAttentionState.zeros(batch_size, c.n_heads, c.head_dim, c.head_dim)

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    c = self.config
    return linear_state_bytes(batch_size, c.n_heads, c.head_dim, c.head_dim)

  def __call__(self, x_BxTxD, state: LinearAttentionState | None = None, positions_BxT=None,
               segment_ids_BxT=None):
    q, k, v = self._project(x_BxTxD)
    phi = lambda x: jax.nn.elu(x.astype(jnp.float32)) + 1.0
    return self._attend(x_BxTxD, phi(q), phi(k), v, state, segment_ids_BxT)


class RandomFeatures(nnx.Variable):
  """A buffer drawn once at init: in the model state, but not a Param (no gradient, no decay)."""


def orthogonal_random_features(key: jax.Array, n_heads: int, n_features: int,
                               dim: int) -> jax.Array:
  """FAVOR+ orthogonal random features [H, m, d]: blocks of d Haar-distributed orthogonal directions
  (QR of a Gaussian matrix, signs fixed), each row scaled to the norm of a Gaussian d-vector so that
  rows are marginally N(0, I_d) and the kernel estimate unbiased."""
  blocks = -(-n_features // dim)
  direction_key, norm_key = jax.random.split(key)
  gaussian = jax.random.normal(direction_key, (n_heads, blocks, dim, dim), jnp.float32)
  Q, R = jnp.linalg.qr(gaussian)
  Q = Q * jnp.sign(jnp.diagonal(R, axis1=-2, axis2=-1))[..., None, :]
  rows_HxMxd = jnp.swapaxes(Q, -1, -2).reshape(n_heads, blocks * dim, dim)[:, :n_features]
  norms_HxM = jnp.linalg.norm(jax.random.normal(norm_key, (n_heads, n_features, dim)), axis=-1)
  return rows_HxMxd * norms_HxM[..., None]


class PerformerState(NamedTuple):
  """The op's state over the m features, and the running key max of the stabilised variant."""

  attn: LinearAttentionState  # S [B, H, m, d], z [B, H, m]
  key_max: jax.Array  # [B, H] fp32; -inf until a first token is seen (always, when unstabilised)


def _segmented_cummax(x_BxTxH: jax.Array, restart_BxTxH: jax.Array) -> jax.Array:
  """Running max along T that restarts where ``restart`` is set."""

  def combine(a, b):
    (max_a, restart_a), (max_b, restart_b) = a, b
    return jnp.where(restart_b, max_b, jnp.maximum(max_a, max_b)), restart_a | restart_b

  return jax.lax.associative_scan(combine, (x_BxTxH, restart_BxTxH), axis=1)[0]


def running_key_max(key_max_BxTxH: jax.Array, initial_max_BxH: jax.Array, doc_BxT: jax.Array):
  """The Performer's key stabiliser: (running max m_t [B, T, H], log_forget [B, T, H]).

  m_t is the largest key log-feature of the document up to t (with the carried ``initial_max`` in
  the first document). S̃_t = S_t exp(-m_t) = exp(m_{t-1} - m_t) S̃_{t-1} + exp(log φ(k_t) - m_t) v_tᵀ
  is a gated linear attention with gate <= 0 and key features <= 1; exp(-m_t) cancels between
  numerator and normaliser (up to eps). The gate is 0 at a document start (the state resets).
  """
  first_BxH = key_max_BxTxH[:, 0]
  initial_max_BxH = jnp.where(jnp.isfinite(initial_max_BxH), initial_max_BxH, first_BxH)
  starts_BxT = jnp.concatenate([jnp.zeros_like(doc_BxT[:, :1], bool),
                                doc_BxT[:, 1:] != doc_BxT[:, :-1]], axis=1)
  starts_BxTxH = jnp.broadcast_to(starts_BxT[..., None], key_max_BxTxH.shape)
  m_BxTxH = _segmented_cummax(key_max_BxTxH, starts_BxTxH)
  in_first_doc_BxTx1 = (doc_BxT == 0)[..., None]
  m_BxTxH = jnp.where(in_first_doc_BxTx1, jnp.maximum(m_BxTxH, initial_max_BxH[:, None]), m_BxTxH)
  previous_BxTxH = jnp.concatenate([initial_max_BxH[:, None], m_BxTxH[:, :-1]], axis=1)
  return m_BxTxH, jnp.where(starts_BxTxH, 0.0, previous_BxTxH - m_BxTxH)


class Performer(_NormalisedLinearAttention):
  """FAVOR+ positive random features; state ``PerformerState``. ``stabilize=True`` (MATH's
  stabilised Performer) subtracts in log space a query's own max over the m features (it cancels) and
  the keys' ``running_key_max`` (carried in the state), both constants to autodiff as in the
  Performer reference code."""

  @dataclasses.dataclass(frozen=True)
  class Config(LinearAttentionConfig):
    n_features: int = 64  # m; with d = 64 the state matches the other baselines (64 x 64 a head)
    stabilize: bool = True

  def __init__(self, config: Config, *, d_model: int, init: InitSpec, dtype=jnp.float32,
               rngs: nnx.Rngs):
    super().__init__(config, d_model=d_model, init=init, dtype=dtype, rngs=rngs)
    self.features = RandomFeatures(orthogonal_random_features(
        rngs.params(), config.n_heads, config.n_features, config.head_dim))

  def init_state(self, batch_size: int, max_len: int | None = None) -> PerformerState:
    c = self.config
    return PerformerState(
        LinearAttentionState.zeros(batch_size, c.n_heads, c.n_features, c.head_dim),
        jnp.full((batch_size, c.n_heads), -jnp.inf, jnp.float32))

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    c = self.config
    return (linear_state_bytes(batch_size, c.n_heads, c.n_features, c.head_dim)
            + float_bytes((batch_size, c.n_heads)))

  def feature_width(self) -> int:
    """F = m random features per head."""
    return self.config.n_features

  def flops_per_token(self, seq_len: int) -> float:
    """The base count at F = m plus the random-feature projections of q and k, 4 d m per head."""
    c = self.config
    return super().flops_per_token(seq_len) + c.n_heads * 4.0 * c.head_dim * c.n_features

  def log_features(self, x_BxTxHxd: jax.Array) -> jax.Array:
    """log φ(x) = W x' - ||x'||² / 2 - log(m) / 2 with x' = x / d^{1/4}, fp32 [B, T, H, m]."""
    x = x_BxTxHxd.astype(jnp.float32) * self.config.head_dim**-0.25
    projected = jnp.einsum("bthd,hmd->bthm", x, self.features[...],
                           precision=jax.lax.Precision.HIGHEST)
    half_norm = 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)
    return projected - half_norm - 0.5 * math.log(self.config.n_features)

  def __call__(self, x_BxTxD, state: PerformerState | None = None, positions_BxT=None,
               segment_ids_BxT=None):
    B, T, _ = x_BxTxD.shape
    state = self.init_state(B) if state is None else state
    q, k, v = self._project(x_BxTxD)
    log_q, log_k = self.log_features(q), self.log_features(k)
    if not self.config.stabilize:
      y, attn = self._attend(x_BxTxD, jnp.exp(log_q), jnp.exp(log_k), v, state.attn,
                             segment_ids_BxT)
      return y, PerformerState(attn, state.key_max)
    log_q = log_q - jax.lax.stop_gradient(jnp.max(log_q, axis=-1, keepdims=True))
    doc_BxT = document_index(segment_ids_BxT, B, T)
    m_BxTxH, log_forget_BxTxH = jax.lax.stop_gradient(
        running_key_max(jnp.max(log_k, axis=-1), state.key_max, doc_BxT))
    phi_k = jnp.exp(log_k - m_BxTxH[..., None])
    y, attn = self._attend(x_BxTxD, jnp.exp(log_q), phi_k, v, state.attn, segment_ids_BxT,
                           log_forget_BxTxH)
    return y, PerformerState(attn, m_BxTxH[:, -1])


class CosFormerState(NamedTuple):
  """The op's state over the 2d features, and the number of tokens seen (default positions)."""

  attn: LinearAttentionState  # S [B, H, 2d, d], z [B, H, 2d]
  position: jax.Array  # [B] int32


class CosFormer(_NormalisedLinearAttention):
  """cosFormer re-weighting; positions from ``positions_BxT`` or the state's counter."""

  @dataclasses.dataclass(frozen=True)
  class Config(LinearAttentionConfig):
    max_len: int = 2048  # M: the weights cos(π (i - j) / 2M) stay >= 0 while i - j <= M

  def init_state(self, batch_size: int, max_len: int | None = None) -> CosFormerState:
    c = self.config
    return CosFormerState(
        LinearAttentionState.zeros(batch_size, c.n_heads, 2 * c.head_dim, c.head_dim),
        jnp.zeros((batch_size,), jnp.int32))

  def state_bytes(self, batch_size: int, max_len: int | None = None) -> int:
    c = self.config
    return linear_state_bytes(batch_size, c.n_heads, 2 * c.head_dim, c.head_dim) + 4 * batch_size

  def feature_width(self) -> int:
    """F = 2d: the cos and sin halves."""
    return 2 * self.config.head_dim

  def features(self, x_BxTxHxd: jax.Array, positions_BxT: jax.Array) -> jax.Array:
    """[relu(x) cos(π i / 2M), relu(x) sin(π i / 2M)], fp32 [B, T, H, 2d]."""
    angle_BxT = (math.pi / (2 * self.config.max_len)) * positions_BxT.astype(jnp.float32)
    angle_BxTx1x1 = angle_BxT[..., None, None]
    r = jax.nn.relu(x_BxTxHxd.astype(jnp.float32))
    return jnp.concatenate([r * jnp.cos(angle_BxTx1x1), r * jnp.sin(angle_BxTx1x1)], axis=-1)

  def __call__(self, x_BxTxD, state: CosFormerState | None = None, positions_BxT=None,
               segment_ids_BxT=None):
    B, T, _ = x_BxTxD.shape
    state = self.init_state(B) if state is None else state
    if positions_BxT is None:
      positions_BxT = default_positions(B, T, state.position)
    q, k, v = self._project(x_BxTxD)
    phi_q, phi_k = self.features(q, positions_BxT), self.features(k, positions_BxT)
    y, attn = self._attend(x_BxTxD, phi_q, phi_k, v, state.attn, segment_ids_BxT)
    return y, CosFormerState(attn, state.position + T)
