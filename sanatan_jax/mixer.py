"""The SANATAN attention layer as an lmcore mixer (MATH §1.1 data flow, §1.2 state, §1.4 size)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.ops.common import pallas_utils
from lmcore.mixers import flops
from lmcore.mixers.base import FusedProjection, InitSpec, dense, float_bytes, scaled_linear
from sanatan_jax import features, gate_stats
from sanatan_jax.ops.sanatan_attention import (REGISTRY, Problem, SanatanState, check_variant,
                                               sanatan_attention)
from sanatan_jax.ops.sanatan_attention.base import has_constant_state, validate_options

OMEGA_INIT = math.pi / 4


def kv_cache_bytes(n: int, n_layers: int, d_model: int, itemsize: int = 4) -> int:
  """Bytes of a softmax KV cache of n tokens, same layout: 2 n L D * itemsize (MATH §1.2)."""
  return 2 * n * n_layers * d_model * itemsize


class SanatanMixer(nnx.Module):
  """Root-parity gated angular attention (MATH §1.1): q, k, v projections, SANATAN, then Wo.

  ``y, new_state = mixer(x_BxTxD, state, positions_BxT, segment_ids_BxT)``; a T = 1 call with a
  state uses ``decode_implementation``. Parameters (no biases): Wq, Wk [D, H d], Wv [D, H dv],
  Wo [H dv, D], omega [H, d] (init pi/4) and lam_raw [H, d] (init N(0, 1), our choice).
  """

  @dataclasses.dataclass(frozen=True)
  class Config:
    """SANATAN layer options; ``learn_omega=False``, ``rotate=False`` are MATH §1.4's ablations."""

    n_heads: int = 4
    head_dim: int = 16
    v_head_dim: int | None = None
    p: int = 1
    channels: int = 6
    three_channel: str = "clean"
    implementation: str = "parallel"
    tiles: Any = None  # the named backend's tiling, e.g. {"chunk": 64} for "chunked"; None: its heuristic
    kernel_precision: str = "input"  # the Triton kernels only: "tf32"/"float32" run them in fp32
    # XLA "chunked": the backward pass recomputes the op's forward instead of keeping its 6d-wide
    # features, score blocks and chunk-state stacks (one more forward of the op for far less memory).
    # "pallas_fused": the backward recomputes the factors of Phi instead of keeping them (3d values
    # per token, head and operand in bf16). Under model.remat the block is recomputed anyway: False
    # there saves a third forward of the op.
    chunked_remat: bool = True
    learn_omega: bool = True
    rotate: bool = True
    decode_implementation: str = "recurrent"

    def __post_init__(self):
      # Names and variants only: "auto" resolves when the layer runs, on the platform it runs on.
      for field in ("implementation", "decode_implementation"):
        REGISTRY.check_name(getattr(self, field))
      validate_options(p=self.p, channels=self.channels, three_channel=self.three_channel)
      check_variant(self.implementation, self.p, self.channels, "SANATAN")
      pallas_utils.check_precision(self.kernel_precision, "SANATAN kernel_precision")
      object.__setattr__(self, "tiles", REGISTRY.tiles(self.implementation, self.tiles, "SANATAN tiles"))

    @property
    def dv(self) -> int:
      return self.head_dim if self.v_head_dim is None else self.v_head_dim

  def __init__(self, config: Config, *, d_model: int, init: InitSpec = InitSpec(),
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.d_model = d_model
    H, d, dv = config.n_heads, config.head_dim, config.dv
    self.wq = dense(d_model, H * d, std=init.std, rngs=rngs, dtype=dtype)
    self.wk = dense(d_model, H * d, std=init.std, rngs=rngs, dtype=dtype)
    self.wv = dense(d_model, H * dv, std=init.std, rngs=rngs, dtype=dtype)
    self.wo = dense(H * dv, d_model, std=init.out_std, rngs=rngs, dtype=dtype)
    self.omega = nnx.Param(jnp.full((H, d), OMEGA_INIT, jnp.float32))
    self.lam_raw = nnx.Param(jax.random.normal(rngs.params(), (H, d), jnp.float32))
    self.qkv: FusedProjection | None = nnx.data(None)  # decoding's form of wq, wk, wv

  def prepare_decode(self) -> None:
    """Wq / sqrt(d), Wk / sqrt(d) and Wv as one matmul (``lmcore.mixers.base``: ``prepare_decode``)."""
    scale = 1.0 / math.sqrt(self.config.head_dim)
    self.qkv = FusedProjection.of([self.wq, self.wk, self.wv], scales=(scale, scale, 1.0))
    self.wq = self.wk = self.wv = None

  def _project(self, x_BxTxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q = x Wq / sqrt(d), k = x Wk / sqrt(d), v = x Wv, split into heads (MATH §1.1 step 1); the
    1 / sqrt(d) scales the kernels (``scaled_linear``)."""
    B, T, _ = x_BxTxD.shape
    H, d = self.config.n_heads, self.config.head_dim
    if self.qkv is not None:
      q_BxTxHd, k_BxTxHd, v_BxTxHV = self.qkv(x_BxTxD)
    else:
      scale = 1.0 / math.sqrt(d)
      q_BxTxHd, k_BxTxHd = (scaled_linear(w, x_BxTxD, scale) for w in (self.wq, self.wk))
      v_BxTxHV = self.wv(x_BxTxD)
    return (q_BxTxHd.reshape(B, T, H, d), k_BxTxHd.reshape(B, T, H, d),
            v_BxTxHV.reshape(B, T, H, self.config.dv))

  def _omega(self) -> jax.Array:
    # "No omega" ablation: the parameter exists (same count, same checkpoint layout) but gets no
    # gradient, so it stays at its pi/4 init.
    omega_Hxd = self.omega[...]
    return omega_Hxd if self.config.learn_omega else jax.lax.stop_gradient(omega_Hxd)

  def __call__(self, x_BxTxD: jax.Array, state: SanatanState | None = None,
               positions_BxT: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, SanatanState | None]:
    cfg = self.config
    B, T, _ = x_BxTxD.shape
    q_BxTxHxd, k_BxTxHxd, v_BxTxHxV = self._project(x_BxTxD)
    decoding = state is not None and T == 1
    o_BxTxHxV, new_state = sanatan_attention(
        q_BxTxHxd, k_BxTxHxd, v_BxTxHxV, self._omega(), self.lam_raw[...],
        positions=positions_BxT, segment_ids=segment_ids_BxT, p=cfg.p, channels=cfg.channels,
        three_channel=cfg.three_channel,
        implementation=cfg.decode_implementation if decoding else cfg.implementation,
        state=state, tiles=None if decoding else cfg.tiles, rotate=cfg.rotate,
        kernel_precision=cfg.kernel_precision, chunked_remat=cfg.chunked_remat)
    return self.wo(o_BxTxHxV.reshape(B, T, cfg.n_heads * cfg.dv)), new_state

  def _check_has_state(self) -> None:
    if not has_constant_state(self.config.p, self.config.channels):
      raise ValueError(
          f"SANATAN with p={self.config.p}, channels={self.config.channels} has no constant-size "
          "state: only p=1 with 6 channels has the exact recurrence (MATH §1.2); p>=2 needs the "
          "(6d)^p-wide tensor-power state. Decode such a model by re-running the whole sequence.")

  def init_state(self, batch_size: int, max_len: int = 0) -> SanatanState:
    """The zero state (``max_len`` is unused: the state does not grow)."""
    del max_len
    self._check_has_state()
    cfg = self.config
    F = cfg.channels * cfg.head_dim
    return SanatanState(S=jnp.zeros((batch_size, cfg.n_heads, F, cfg.dv), jnp.float32),
                        z=jnp.zeros((batch_size, cfg.n_heads, F), jnp.float32),
                        position=jnp.zeros((batch_size,), jnp.int32))

  def state_bytes(self, batch_size: int, max_len: int = 0) -> int:
    """B H (F dv + F) * 4 bytes of fp32 state (MATH §1.2), the position counter not counted."""
    del max_len
    self._check_has_state()
    cfg = self.config
    F = cfg.channels * cfg.head_dim
    return float_bytes((batch_size, cfg.n_heads, F, cfg.dv), (batch_size, cfg.n_heads, F))

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token (``lmcore.mixers.flops``): the projections, 2 · D · (2 H d + H dv)
    + 2 · H dv · D, plus per head the attention over F = channels · d features (6d, 4d or 3d) and
    dv + 1 mixed columns (the normaliser), as the named backend counts it on a GPU (a TPU for the
    Mosaic kernels), "auto" as the backend it resolves to on a GPU (``Backend.flops_per_head``: the
    kernels at their own chunk):

    * quadratic forms (``parallel``, ``pallas_flash``): the causal half, 2 · (F + dv + 1) · (T + 1) / 2;
    * chunked forms (``chunked``, ``pallas_fused``, ``pallas_tpu``) of chunk C:
      2 · C' · (F + dv + 1) + 4 · F · (dv + 1), C' = min(C, T);
    * ``recurrent``: 4 · F · (dv + 1).

    The feature maps (angles, roots, rotation, the power p) are elementwise and not counted.
    """
    cfg = self.config
    dtype = "bfloat16" if cfg.kernel_precision == "input" else "float32"
    problem = Problem(REGISTRY.counting_platform(cfg.implementation), cfg.p, cfg.channels, cfg.head_dim,
                      cfg.dv, seq_len, dtype)
    mixing = REGISTRY.resolve(cfg.implementation, problem).flops_per_head(problem, cfg.tiles)
    return flops.dense(self) + cfg.n_heads * mixing

  def roots(self, x_BxTxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Soft roots r_q, r_k [B, T, H, d] (float32) of this layer, for gate_stats (MATH §1.3)."""
    q_BxTxHxd, k_BxTxHxd, _ = self._project(x_BxTxD)
    omega_Hxd = self.omega[...]
    return tuple(features.soft_roots(features.angles(u.astype(jnp.float32)), omega_Hxd)
                 for u in (q_BxTxHxd, k_BxTxHxd))

  def gate_statistics(self, x_BxTxD: jax.Array) -> dict[str, jax.Array]:
    """The evaluation hook for MATH §1.3: this layer's root-gate statistics as 0-d arrays
    (``gate_stats.gate_statistics_arrays``), traced inside the evaluation's compiled program."""
    r_q, r_k = self.roots(x_BxTxD)
    return gate_stats.gate_statistics_arrays(r_q, r_k)
