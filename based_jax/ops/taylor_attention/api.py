"""Causal Taylor linear attention of BASED (MATH §2.1, based_zoology §1–§2): one function, several
implementations.

Per head, with ``A_tj = phi(q_t)·phi(k_j) = 1 + s + s²/2`` and ``s = q_t·k_j / sqrt(d')``::

    y_t = dt_t · sum_{j<=t} gamma^(t-j) A_tj v_j / (sum_{j<=t} A_tj + eps)

Without the decay ablation ``gamma = 1`` and ``dt = 1`` (the released models). With it
(based_zoology §2.6) ``gamma_h`` is a fixed per-head rate, ``dt`` an input-dependent scalar per
position and head that multiplies the query row, and the denominator stays undecayed. The recurrent
state is ``S = sum_j gamma^(T-1-j) phi(k_j) v_j^T`` [F, dv] and ``z = sum_j phi(k_j)`` [F], both
fp32; a state passed in is the prefix of the same sequence (write-then-read: token t sees itself).

``eps`` defaults to 1e-12, the released code's value; FLA's kernels use 1e-6. Both are far below
the smallest possible denominator (1/2, since every A_tj >= 1/2), so the choice only matters for
bit-level comparisons with one code base or the other.

Packed sequences (``segment_ids`` [B, T]): a new document starts wherever the id changes; tokens see
only keys of their own document, and an incoming state continues the first one (a document that
starts exactly at a call boundary gets a fresh state instead).

Backends (``REGISTRY``; all compute the same function, tests/ops/taylor_attention proves it):
  * ``parallel``: the materialised T x T form (reference.py); every option;
  * ``recurrent``: ``lax.scan`` over tokens (reference.py); every option; the decode path;
  * ``chunked``: every chunk of ``ChunkTiles.chunk`` tokens at once, the states entering them as a
    prefix sum over chunks (xla.py); every option;
  * ``pallas_blocked``: the quadratic form block by block (pallas_triton_blocked.py, Triton; GPUs,
    interpreted on CPUs); no decay ablation, dv <= ``pallas_triton_blocked.MAX_VALUE_DIM``;
  * ``pallas_fused``: the fused-chunk kernels (pallas_triton_fused.py, Triton; GPUs, interpreted on
    CPUs); no decay ablation, d' <= ``pallas_triton_fused.MAX_KEY_DIM``;
  * ``pallas_tpu``: the chunked Mosaic kernels (pallas_mosaic_tpu.py; TPUs, interpreted on CPUs); no
    decay ablation;
  * ``auto`` (or None): on GPUs the Triton kernels where they were measured fastest
    (``PallasBlocked.preferred``, ``PallasFused.preferred``: the blocked kernels at short lengths and
    wider keys, the fused-chunk ones otherwise), else XLA ``chunked``; on TPUs and CPUs ``chunked``.
"""

from __future__ import annotations

from typing import Any, Literal

import jax

from based_jax.ops.taylor_attention import (pallas_mosaic_tpu, pallas_triton_blocked, pallas_triton_fused,
                                            reference, xla)
from based_jax.ops.taylor_attention.base import OP, Options, Problem, TaylorState, check_shapes
from based_jax.taylor import Feature
from lmcore.ops.common import pallas_utils
from lmcore.ops.common.backend import Registry

Implementation = Literal["parallel", "recurrent", "chunked", "pallas_blocked", "pallas_fused", "pallas_tpu",
                         "auto"]

REGISTRY = Registry(OP, {
    "parallel": reference.Parallel(),
    "recurrent": reference.Recurrent(),
    "chunked": xla.Chunked(),
    "pallas_blocked": pallas_triton_blocked.PallasBlocked(),
    "pallas_fused": pallas_triton_fused.PallasFused(),
    "pallas_tpu": pallas_mosaic_tpu.PallasTpu(),
}, auto={"gpu": ("pallas_blocked", "pallas_fused", "chunked"), "tpu": ("chunked",), "cpu": ("chunked",)})


def problem(q: jax.Array, v: jax.Array, *, segments: bool = False, decay: bool = False,
            feature: Feature = "compact", platform: str | None = None) -> Problem:
  """The ``Problem`` of a call on q [B, T, H, d'] and v [B, T, H, dv], on ``platform`` (default: the
  platform kernels compile for, ``pallas_utils.backend``)."""
  platform = pallas_utils.backend() if platform is None else platform
  return Problem(platform, q.shape[-1], v.shape[-1], q.shape[1], segments, decay, feature)


def taylor_linear_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: Implementation | None = "parallel",
    state: TaylorState | None = None, eps: float = 1e-12, feature: Feature = "compact", tiles: Any = None,
    decay: jax.Array | None = None, dt: jax.Array | None = None, segment_ids: jax.Array | None = None,
    kernel_precision: str = "input") -> tuple[jax.Array, TaylorState]:
  """Causal normalised Taylor linear attention (module docstring).

  Args:
    q, k: raw per-head projections [B, T, H, d'] (the feature map is applied here).
    v: values [B, T, H, dv].
    implementation: a name of ``REGISTRY``, or "auto" / None (module docstring).
    state: the state after a prefix of this sequence, or None for the start of a sequence.
    eps: added to the denominator.
    feature: ``compact`` (F = 153 at d' = 16) or ``full`` (F = 273): same function, different
      state width.
    tiles: the backend's tiling (``ChunkTiles``, ``pallas_triton_blocked.BlockedTiles``,
      ``pallas_triton_fused.FusedTiles``, ``pallas_mosaic_tpu.MosaicTiles``); None: its heuristic.
    decay: per-head rates gamma [H] (e.g. ``default_decay_rates(H)``), or None for no decay.
    dt: per-position, per-head query scale [B, T, H], or None for 1.
    segment_ids: packed-document ids [B, T].
    kernel_precision: the Triton kernels' dot operands, "input" (the inputs' dtype), "tf32" or
      "float32" (fp32 throughout, fp32 o; ``pallas_utils.PRECISIONS``); the TPU kernels take "input"
      only; the XLA forms ignore it.

  Returns:
    ``(o, new_state)``: o [B, T, H, dv] in v's dtype (fp32 from the Triton kernels at
    kernel_precision "tf32"/"float32"); the fp32 state after the last token.
  """
  check_shapes(q, k, v, decay, dt, segment_ids)
  pallas_utils.check_precision(kernel_precision, OP)
  call = problem(q, v, segments=segment_ids is not None, decay=decay is not None or dt is not None,
                 feature=feature)
  backend = REGISTRY.resolve(implementation, call)
  return backend(q, k, v, state=state, eps=eps, feature=feature, decay=decay, dt=dt, segment_ids=segment_ids,
                 tiles=backend.config(call, tiles), options=Options(kernel_precision))
