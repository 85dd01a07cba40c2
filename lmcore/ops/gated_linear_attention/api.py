"""The gated linear attention op (MATH §3, §4) with an ``implementation=`` switch.

Per head, with the fp32 state S_t in R^{K x V} and f_t = exp(log_forget_t) (a scalar per head, a
vector over the key channels, or 1 when ``log_forget`` is None)::

    S_t = diag(f_t) S_{t-1} + k_t v_tᵀ,     o_t = scale * S_tᵀ q_t     (write, then read)

With ``normalize=True`` (Linear Transformer / Performer / cosFormer) the key sum decays the same
way and divides the read-out; the scale multiplies the scores, so it cancels up to eps (as in FLA)::

    z_t = f_t ⊙ z_{t-1} + k_t,              o_t = scale * S_tᵀ q_t / (scale * q_t · z_t + eps)

This is computed by appending a ones column to v: the last column of the augmented state is z and
the last output column is the normaliser, so every implementation covers both forms unchanged.

Implementations (all compute the same function; tests/ops/gated_linear_attention proves it):
  * ``recurrent``: ``lax.scan`` over tokens in fp32 (reference.py); the decode path;
  * ``parallel``: the materialised T x T form (reference.py), for tests;
  * ``chunked`` / ``xla``: chunks of ``chunk_size`` tokens, ``lax.scan`` over chunks (xla.py);
  * ``pallas``: the Triton-Pallas kernel (pallas_triton.py; interpret mode off GPU), on TPU the
    Mosaic kernel (pallas_mosaic_tpu.py);
  * ``auto`` (or None): ``pallas`` on GPU for heads at most ``KERNEL_MAX_KEY`` x ``KERNEL_MAX_VALUE``
    wide (128 x 256), ``chunked`` otherwise and elsewhere (``resolve_implementation``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax

from lmcore.ops.common import implementations
from lmcore.ops.common import pallas_utils
from lmcore.ops.common import shard_map
from lmcore.ops.gated_linear_attention import pallas_mosaic_tpu
from lmcore.ops.gated_linear_attention import pallas_triton
from lmcore.ops.gated_linear_attention import reference
from lmcore.ops.gated_linear_attention import xla
from lmcore.ops.gated_linear_attention.base import OP, LinearAttentionState, check_shapes, run_backend

Implementation = Literal["recurrent", "parallel", "chunked", "xla", "pallas"]


def _pallas(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, *, scale: float, doc_BxT,
            **options):
  """The kernels of this backend: Mosaic on TPU, else Triton (interpreted off GPU), on each device's
  rows and heads of the mesh in context (``shard_map.run_sharded``)."""
  kernels = pallas_mosaic_tpu if pallas_utils.backend() == "tpu" else pallas_triton
  inputs = dict(q_BxTxHxK=q_BxTxHxK, k_BxTxHxK=k_BxTxHxK, v_BxTxHxV=v_BxTxHxV, g_BxTxHxG=g_BxTxHxG,
                S0_BxHxKxV=S0_BxHxKxV, doc_BxT=doc_BxT)
  layouts = dict(q_BxTxHxK="BTH", k_BxTxHxK="BTH", v_BxTxHxV="BTH", g_BxTxHxG="BTH", S0_BxHxKxV="BH",
                 doc_BxT="B")
  return shard_map.run_sharded(functools.partial(kernels.chunked, scale=scale, **options), inputs, layouts,
                               ("BTH", "BH"))


# Each backend has base.py's contract; the chunked ones also take ``chunk_size``.
IMPLEMENTATIONS: dict[str, Callable] = {
    "recurrent": reference.recurrent,
    "parallel": reference.parallel,
    "chunked": xla.chunked,
    "xla": xla.chunked,
    "pallas": _pallas,
}
_CHUNKED = ("chunked", "xla", "pallas")


# The widest key and value a head may have for "auto" to pick the Triton kernel. Measured on one H200
# (fwd+bwd, bf16, B 8 × T 2048, docs/BENCHMARKS.md), kernel against XLA chunked: per-key gates 12 × 32 × 64
# 1.02 / 3.50 ms, 4 × 64 × 128 1.20 / 2.07 (repro_gla), 4 × 96 × 192 3.58 / 4.79 (GLA 182M), 8 × 128 × 128
# 4.78 / 6.32, 4 × 128 × 256 4.51 / 4.92; per-head gates 4 × 128 × 128 1.00 / 1.69 (CyFA). Beyond: 2 × 128
# × 512 4.36 / 2.91 (XLA ahead); at K = 256 the kernel ran out of memory or took 49.1 ms (XLA 5.98), at
# K = 512 103.9. GLA 182M's whole train step (32 × 2048, cuBLAS GEMMs) is faster on the kernel too:
# 164,802 against 153,826 tok/s in one process. Each program holds a head's whole key width (padded to a
# power of two) and, with per-key gates, a [16, 16, K] fp32 decay block per sub-chunk; values come in
# tiles of 64.
KERNEL_MAX_KEY, KERNEL_MAX_VALUE = 128, 256


def resolve_implementation(implementation: str | None, **problem) -> str:
  """"auto" and None: "pallas" on a GPU for heads of at most ``KERNEL_MAX_KEY`` keys and
  ``KERNEL_MAX_VALUE`` values (``key_dim=``, ``value_dim=``: the kernel's widths, V + 1 for a
  normalised form; unknown widths count as small), else XLA "chunked"; a name of
  ``IMPLEMENTATIONS`` as is; anything else a ValueError."""
  key_dim, value_dim = problem.get("key_dim", 0), problem.get("value_dim", 0)

  def auto() -> str:
    default = pallas_utils.default_implementation()
    if default == "pallas" and (key_dim > KERNEL_MAX_KEY or value_dim > KERNEL_MAX_VALUE):
      return "chunked"
    return default

  return implementations.resolve(OP, implementation, IMPLEMENTATIONS, auto)


def gated_linear_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           log_forget: jax.Array | None = None, *,
                           implementation: Implementation | Literal["auto"] | None = "chunked",
                           state: LinearAttentionState | None = None,
                           chunk_size: int | None = None,
                           normalize: bool = False, eps: float = 1e-6, scale: float = 1.0,
                           segment_ids: jax.Array | None = None, kernel_precision: str = "input",
                           kernel_split_state: bool = True,
                           chunked_remat: bool = True) -> tuple[jax.Array, LinearAttentionState]:
  """Gated (optionally normalised) linear attention; returns (o [B, T, H, V] in q's dtype, state).

  Args:
    q, k: [B, T, H, K] (any feature map already applied by the caller).
    v: [B, T, H, V].
    log_forget: [B, T, H] (scalar per head) or [B, T, H, K] (per key channel) log forget gate,
      values <= 0 (not checked; the chunked form relies on it), accumulated in fp32; None: no decay.
    implementation: a name of ``IMPLEMENTATIONS``; "auto" or None picks the measured fastest for
      the backend and head widths (``resolve_implementation``).
    state: the state before the first token; None means zeros (start of a sequence).
    chunk_size: tokens per chunk of the chunked forms, a power of two; None: the implementation's
      measured best (``xla.CHUNK`` = 64, ``pallas_triton.CHUNK`` = 16; the TPU kernel's own).
    normalize: divide by the decayed key sum (see the module docstring); the state then carries z.
    eps: added to the normaliser.
    scale: multiplies the scores q · k.
    segment_ids: optional int [B, T]; where the id changes between consecutive tokens the state is
      reset and no token sees another segment (packed documents, MATH §6.4). The incoming
      ``state`` belongs to the first token's segment.
    kernel_precision: the Pallas GPU kernel's dot operands, "input" (the inputs' dtype), "tf32" or
      "float32" (fp32 throughout, and o in fp32; ``pallas_utils.PRECISIONS``). Other
      implementations ignore it.
    kernel_split_state: "pallas" only: the kernels' backward takes its state dots' fp32 operands
      as two parts in the inputs' dtype (``pallas_utils.split_dot``; bf16: the gate gradient within
      the XLA path's own error); False: one rounding, faster (H200: 9-14% of the op).
    chunked_remat: "chunked" / "xla" only: the backward pass recomputes the forward from the
      inputs instead of keeping the chunk states and intra-chunk blocks (``xla.chunked``).
  """
  check_shapes(q, k, v, log_forget, state, segment_ids)
  # A normalised form's kernel carries one more value column (the key sum): its width is V + 1.
  implementation = resolve_implementation(implementation, key_dim=q.shape[-1],
                                          value_dim=v.shape[-1] + int(normalize))
  pallas_utils.check_precision(kernel_precision, OP)
  options = {}
  if chunk_size is not None and implementation in _CHUNKED:
    options["chunk_size"] = chunk_size
  if implementation == "pallas":
    options.update(pallas_utils.kernel_options(kernel_precision, OP), split=kernel_split_state)
  if implementation in ("chunked", "xla"):
    options["remat"] = chunked_remat
  backend = IMPLEMENTATIONS[implementation]
  precision = kernel_precision if implementation == "pallas" else "input"
  return run_backend(functools.partial(backend, **options), q, k, v, log_forget, state,
                     normalize=normalize, eps=eps, scale=scale, segment_ids=segment_ids,
                     out_dtype=pallas_utils.output_dtype(q.dtype, precision))
