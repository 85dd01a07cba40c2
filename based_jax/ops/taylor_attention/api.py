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

Implementations (``IMPLEMENTATIONS``):

* ``parallel``, ``recurrent`` (reference.py): materialised T x T scores; a scan over tokens.
* ``chunked`` (xla.py): a scan over chunks; no ``segment_ids``.
* ``pallas``: the chunked kernels, ``pallas_triton.py`` (Triton) off TPU, ``pallas_mosaic_tpu.py``
  (Mosaic) where ``pallas_utils.backend()`` is "tpu"; no decay ablation.
* ``pallas_blocked``: the quadratic form block by block (``pallas_triton_blocked.py``, Triton;
  interpreted off GPU); no decay ablation.
* ``pallas_fused``: the fused-chunk kernels (``pallas_triton_fused.py``, Triton; interpreted off
  GPU): the state carried through the chunks in registers; no decay ablation.
* ``auto``: see ``resolve_implementation`` (the kernels on GPUs for heads up to
  ``KERNEL_MAX_KEY_DIM`` x ``KERNEL_MAX_VALUE_DIM``, XLA otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax

from based_jax.ops.taylor_attention import (pallas_mosaic_tpu, pallas_triton, pallas_triton_blocked,
                                            pallas_triton_fused)
from based_jax.ops.taylor_attention.base import BLOCKED_BELOW, TaylorState, check_args
from based_jax.ops.taylor_attention.reference import parallel, recurrent
from based_jax.ops.taylor_attention.xla import chunked
from based_jax.taylor import Feature
from lmcore.ops.common import implementations, pallas_utils, shard_map

Implementation = Literal["parallel", "chunked", "recurrent", "pallas", "pallas_blocked", "pallas_fused",
                         "auto"]


# Each array's leading dimensions for the kernels' shard_map (shard_map.run_sharded).
_LAYOUTS = dict(q="BTH", k="BTH", v="BTH", state="BH", segment_ids="B")
_OUT_LAYOUTS = ("BTH", TaylorState(S="BH", z="BH"))


def _pallas(q, k, v, *, state, eps, feature, chunk_size, decay, dt, segment_ids,
            kernel_precision):
  """The chunked kernels of the current backend: Mosaic on a TPU, Triton elsewhere; each device of
  the mesh in context runs them on its own rows and heads (``shard_map.run_sharded``)."""
  del decay, dt  # check_args rejects them
  options = pallas_utils.kernel_options(kernel_precision, "taylor_linear_attention")
  kernels = (pallas_mosaic_tpu.taylor_linear_attention_tpu if pallas_utils.backend() == "tpu"
             else pallas_triton.taylor_linear_attention_pallas)
  kernel = functools.partial(kernels, eps=eps, feature=feature, chunk_size=chunk_size, **options)
  return shard_map.run_sharded(kernel, dict(q=q, k=k, v=v, state=state, segment_ids=segment_ids), _LAYOUTS,
                               _OUT_LAYOUTS)


def _pallas_blocked(q, k, v, *, state, eps, feature, chunk_size, decay, dt, segment_ids,
                    kernel_precision):
  """The blocked Triton kernels plus the prefix state's read, per device like ``_pallas``."""
  del chunk_size, decay, dt  # check_args rejects decay and dt
  kernel = functools.partial(pallas_triton_blocked.taylor_linear_attention_blocked, eps=eps, feature=feature,
                             precision=kernel_precision)
  return shard_map.run_sharded(kernel, dict(q=q, k=k, v=v, state=state, segment_ids=segment_ids), _LAYOUTS,
                               _OUT_LAYOUTS)


def _pallas_fused(q, k, v, *, state, eps, feature, chunk_size, decay, dt, segment_ids, kernel_precision):
  """The fused-chunk Triton kernels at their own tiling (``pallas_triton_fused.Tiles``), per device
  like ``_pallas``."""
  del chunk_size, decay, dt  # check_args rejects decay and dt
  kernel = functools.partial(pallas_triton_fused.taylor_fused_pallas, eps=eps, feature=feature,
                             precision=kernel_precision)
  return shard_map.run_sharded(kernel, dict(q=q, k=k, v=v, state=state, segment_ids=segment_ids), _LAYOUTS,
                               _OUT_LAYOUTS)


IMPLEMENTATIONS: dict[str, Callable[..., tuple[jax.Array, TaylorState]]] = {
    "parallel": parallel,
    "chunked": chunked,
    "recurrent": recurrent,
    "pallas": _pallas,
    "pallas_blocked": _pallas_blocked,
    "pallas_fused": _pallas_fused,
}


# The heads "auto" gives the Triton kernels, from H200 fwd+bwd timings at 16,384 tokens
# (docs/BENCHMARKS.md, resolve_implementation). d' = 16, T = 8192, ms of the fused-chunk / chunked /
# blocked kernel: dv = 64: 2.25 / 4.65 / 4.81; dv = 112 (BASED 1.3B): 3.34 / 6.30 / 6.64; dv = 128, 256,
# 512 (H dv = 1024): 2.21 / 4.23 / 3.61, 2.32 / 3.51 / 4.94, 2.27 / 3.14 / - (the blocked kernels hold a
# head's whole dv in shared memory and exceed it from dv = 512, ``BLOCKED_MAX_VALUE_DIM``); XLA chunked
# 15.0-20.4. Wider keys favour the blocked kernel, whose work grows with d' where the others' state
# grows with d'²: at dv = 128, T = 8192, d' = 32: blocked 3.74, fused 5.89, chunked 10.66; d' = 64:
# blocked 4.10, chunked 29.15 (the fused kernels take d' <= ``pallas_triton_fused.MAX_KEY_DIM``); XLA
# 28.0 / 68.2. Wider heads take XLA.
KERNEL_MAX_KEY_DIM = 64
KERNEL_MAX_VALUE_DIM = 512
BLOCKED_MAX_VALUE_DIM = 256
# Key dims up to this take the fused-chunk kernels from ``BLOCKED_BELOW`` on; wider ones the blocked
# kernels at every length.
FUSED_MAX_KEY_DIM = 16


def resolve_implementation(implementation: str | None, **problem) -> str:
  """The form "auto" (or None) runs for this problem; other names are checked and pass through.

  Reads ``length`` (T), ``decay`` (the decay ablation is on: ``decay`` or ``dt`` given),
  ``segments`` (``segment_ids`` given), ``key_dim`` (d') and ``value_dim`` (dv; unknown widths
  count as small). On a GPU without the decay ablation (which the kernels lack), for heads of at
  most ``KERNEL_MAX_KEY_DIM`` x ``KERNEL_MAX_VALUE_DIM``, the Pallas kernels: for dv <=
  ``BLOCKED_MAX_VALUE_DIM``, "pallas_blocked" below T = ``BLOCKED_BELOW`` or for d' >
  ``FUSED_MAX_KEY_DIM``, else "pallas_fused"; for wider values "pallas_fused" (d' <=
  ``pallas_triton_fused.MAX_KEY_DIM``) or "pallas". H200 fwd+bwd at d' = 16, dv = 64 against XLA
  chunked: blocked 9.5× at T = 2048 (GPU time; it beats the fused kernels up to T = 4096, ``base.py``),
  fused 7.8× / 14.7× at 8192 / 32768 (the chunked kernel 2.1× / 2.8× / 3.8× / 5.7× at 2048 ...
  32768). Otherwise XLA (TPUs too: the Mosaic kernels, compiled by libtpu in the tests, have not been
  timed on a TPU): "chunked", or with ``segments``, which chunked does not take, "parallel", the
  fastest XLA form that does (0.86× chunked at T = 2048 on the H200, at the cost of B H T² fp32
  scores); "recurrent" is a T-step serial scan, the decode path.
  """
  key_dim, value_dim = problem.get("key_dim", 0), problem.get("value_dim", 0)
  narrow = key_dim <= KERNEL_MAX_KEY_DIM and value_dim <= KERNEL_MAX_VALUE_DIM

  def auto() -> str:
    if pallas_utils.backend() != "gpu" or not narrow or problem.get("decay", False):
      return "parallel" if problem.get("segments", False) else "chunked"
    if value_dim > BLOCKED_MAX_VALUE_DIM:
      return "pallas_fused" if key_dim <= pallas_triton_fused.MAX_KEY_DIM else "pallas"
    length = problem.get("length")
    short = length is not None and length < BLOCKED_BELOW
    return "pallas_blocked" if short or key_dim > FUSED_MAX_KEY_DIM else "pallas_fused"

  return implementations.resolve("taylor_linear_attention", implementation, IMPLEMENTATIONS, auto)


def taylor_linear_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: Implementation = "parallel",
    state: TaylorState | None = None, eps: float = 1e-12, feature: Feature = "compact",
    chunk_size: int = 64, decay: jax.Array | None = None, dt: jax.Array | None = None,
    segment_ids: jax.Array | None = None, kernel_precision: str = "input"
    ) -> tuple[jax.Array, TaylorState]:
  """Causal normalised Taylor linear attention (module docstring).

  Args:
    q, k: raw per-head projections [B, T, H, d'] (the feature map is applied here).
    v: values [B, T, H, dv].
    implementation: a name of ``IMPLEMENTATIONS`` (module docstring), all the same function, or
      ``auto`` (``resolve_implementation``).
    state: the state after a prefix of this sequence, or None for the start of a sequence.
    eps: added to the denominator.
    feature: ``compact`` (F = 153 at d' = 16) or ``full`` (F = 273): same function, different
      state width.
    chunk_size: tokens per chunk of ``chunked`` and ``pallas`` (``pallas_fused`` has its own
      tiling, ``pallas_triton_fused.Tiles``).
    decay: per-head rates gamma [H] (e.g. ``default_decay_rates(H)``), or None for no decay.
    dt: per-position, per-head query scale [B, T, H], or None for 1.
    segment_ids: packed-document ids [B, T] (all but ``chunked``).
    kernel_precision: the Pallas GPU kernels' dot operands, "input" (the inputs' dtype), "tf32"
      or "float32" (fp32 throughout, fp32 o; ``pallas_utils.PRECISIONS``). Other implementations
      ignore it.

  Returns:
    ``(o, new_state)``: o [B, T, H, dv] in v's dtype (fp32 from the kernels at kernel_precision
    "tf32"/"float32"); the fp32 state after the last token.
  """
  implementation = resolve_implementation(implementation, length=q.shape[1],
                                          decay=decay is not None or dt is not None,
                                          segments=segment_ids is not None, key_dim=q.shape[-1],
                                          value_dim=v.shape[-1])
  check_args(q, k, v, implementation, decay, dt, segment_ids)
  pallas_utils.check_precision(kernel_precision, "taylor_linear_attention")
  return IMPLEMENTATIONS[implementation](
      q, k, v, state=state, eps=eps, feature=feature, chunk_size=chunk_size, decay=decay, dt=dt,
      segment_ids=segment_ids, kernel_precision=kernel_precision)
