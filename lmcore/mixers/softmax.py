"""Softmax attention (Transformer++ style, MATH §4): causal MHA, RoPE or none, KV-cache decoding.

A prompt fed to a cache that is known to be empty while tracing (``init_state`` called inside the same
jitted function, as ``lmcore.eval.generate`` prefills a new state) runs through the training forward's
attention (cuDNN's flash attention on GPUs) and writes its keys and values into the cache: no score
array of the cache's length, no chunking. Any other call attends over the preallocated cache.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lmcore.mixers.base import FusedProjection, InitSpec, dense, float_bytes
from lmcore.mixers import flops
from lmcore.ops.common.layout import default_positions
from lmcore.mixers.rotary import rotary


class KVCache(NamedTuple):
  """Decode state: keys/values of every position so far; ``length`` tokens are filled (scalar int32;
  a numpy value in a new cache, so that a call tracing it knows the cache is empty)."""

  k: jax.Array  # [B, S, H, d]
  v: jax.Array  # [B, S, H, d]
  length: jax.Array | np.ndarray  # []


class SoftmaxAttention(nnx.Module):
  """y = Wo · softmax(q kᵀ / √d + causal mask) v, heads concatenated; no biases."""

  @dataclasses.dataclass(frozen=True)
  class Config:
    n_heads: int = 4
    head_dim: int = 0  # 0: d_model // n_heads
    rope: bool = True  # False: no positional signal here (use the backbone's absolute table)
    rope_base: float = 10000.0
    implementation: str = ""  # "" picks cuDNN on GPU and XLA elsewhere; or "xla" / "cudnn"
    cache_dtype: str = "float32"  # the decode KV cache: "float32", or "bfloat16" (half the bytes)

    def __post_init__(self):
      if self.cache_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"softmax cache_dtype must be 'float32' or 'bfloat16', got {self.cache_dtype!r}")

  def __init__(self, config: Config, *, d_model: int, init: InitSpec, dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.config = config
    self.n_heads = config.n_heads
    self.head_dim = config.head_dim or d_model // config.n_heads
    inner = self.n_heads * self.head_dim
    self.wq = dense(d_model, inner, std=init.std, dtype=dtype, rngs=rngs)
    self.wk = dense(d_model, inner, std=init.std, dtype=dtype, rngs=rngs)
    self.wv = dense(d_model, inner, std=init.std, dtype=dtype, rngs=rngs)
    self.wo = dense(inner, d_model, std=init.out_std, dtype=dtype, rngs=rngs)
    self.qkv: FusedProjection | None = nnx.data(None)  # decoding's form of wq, wk, wv

  def prepare_decode(self) -> None:
    """Wq, Wk and Wv as one matmul (``lmcore.mixers.base``: ``prepare_decode``)."""
    self.qkv = FusedProjection.of([self.wq, self.wk, self.wv])
    self.wq = self.wk = self.wv = None

  def init_state(self, batch_size: int, max_len: int) -> KVCache:
    shape = (batch_size, max_len, self.n_heads, self.head_dim)
    dtype = jnp.dtype(self.config.cache_dtype)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), np.zeros((), np.int32))

  def state_bytes(self, batch_size: int, max_len: int) -> int:
    return float_bytes((2, batch_size, max_len, self.n_heads, self.head_dim),
                       itemsize=jnp.dtype(self.config.cache_dtype).itemsize)

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: the four projections plus per head the causal half of the scores and
    mixing, 2 · 2d · (T + 1) / 2, whatever the implementation."""
    d = self.head_dim
    return flops.dense(self) + self.n_heads * flops.quadratic(d, d, seq_len)

  def __call__(self, x_BxTxD, state: KVCache | None = None, positions_BxT=None, segment_ids_BxT=None):
    B, T, _ = x_BxTxD.shape
    if positions_BxT is None:
      start = None if state is None else jnp.broadcast_to(state.length, (B,))
      positions_BxT = default_positions(B, T, start)
    if self.qkv is not None:
      projections = self.qkv(x_BxTxD)
    else:
      projections = [w(x_BxTxD) for w in (self.wq, self.wk, self.wv)]
    q_BxTxHxd, k_BxTxHxd, v_BxTxHxd = (u.reshape(B, T, self.n_heads, self.head_dim) for u in projections)
    if self.config.rope:
      q_BxTxHxd = rotary(q_BxTxHxd, positions_BxT, self.config.rope_base)
      k_BxTxHxd = rotary(k_BxTxHxd, positions_BxT, self.config.rope_base)
    if state is None:
      o_BxTxHxd, new_state = self._attend_full(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, segment_ids_BxT), None
    else:
      if segment_ids_BxT is not None:
        raise NotImplementedError("softmax decoding with segment_ids is not supported; decode one "
                                  "document per row (segment_ids=None).")
      o_BxTxHxd, new_state = self._attend(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, state)
    y_BxTxD = self.wo(o_BxTxHxd.reshape(B, T, -1).astype(x_BxTxD.dtype))
    return y_BxTxD, new_state

  def _implementation(self) -> str | None:
    if self.config.implementation:
      return self.config.implementation
    return "cudnn" if jax.default_backend() == "gpu" else "xla"

  def _attend_full(self, q, k, v, segment_ids_BxT):
    if segment_ids_BxT is None:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self._implementation())
    T = q.shape[1]
    same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    mask_Bx1xTxT = (same_BxTxT & jnp.tril(jnp.ones((T, T), bool)))[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask_Bx1xTxT, implementation="xla")

  def _attend(self, q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, state: KVCache):
    """A prompt into a cache known to be empty: the training forward's attention over the prompt
    alone, its keys and values written at 0; else ``_attend_cache``."""
    if not _known_empty(state):
      return self._attend_cache(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, state)
    T, S = q_BxTxHxd.shape[1], state.k.shape[1]
    if T > S:
      raise ValueError(f"a prompt of {T} tokens does not fit a KV cache of {S}; make the state with "
                       f"max_len >= {T}")
    o_BxTxHxd = self._attend_full(q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, None)
    write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), 0, axis=1)
    return o_BxTxHxd, KVCache(write(state.k, k_BxTxHxd), write(state.v, v_BxTxHxd), jnp.int32(T))

  def _attend_cache(self, q_BxTxHxd, k_BxTxHxd, v_BxTxHxd, state: KVCache):
    """Writes the new keys/values at ``length`` and attends causally over the filled cache: operands
    in the cache's dtype, scores, softmax and sums in fp32."""
    T, S = q_BxTxHxd.shape[1], state.k.shape[1]
    start, dtype = state.length, state.k.dtype
    k_cache = jax.lax.dynamic_update_slice_in_dim(state.k, k_BxTxHxd.astype(dtype), start, axis=1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(state.v, v_BxTxHxd.astype(dtype), start, axis=1)
    scores_BxHxTxS = jnp.einsum("bthd,bshd->bhts", q_BxTxHxd.astype(dtype), k_cache,
                                precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32) / jnp.sqrt(self.head_dim)
    visible_TxS = jnp.arange(S)[None, :] <= (start + jnp.arange(T))[:, None]
    scores_BxHxTxS = jnp.where(visible_TxS, scores_BxHxTxS, -jnp.inf)
    probs_BxHxTxS = jax.nn.softmax(scores_BxHxTxS, axis=-1)
    o_BxTxHxd = jnp.einsum("bhts,bshd->bthd", probs_BxHxTxS.astype(dtype), v_cache,
                           precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return o_BxTxHxd, KVCache(k_cache, v_cache, start + T)


def _known_empty(state: KVCache) -> bool:
  """Whether the cache's length is known to be 0 while tracing (a numpy or Python value, not a traced
  or device array)."""
  return isinstance(state.length, (int, np.integer, np.ndarray)) and int(state.length) == 0
