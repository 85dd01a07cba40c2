"""The gated linear attention op (MATH §3, §4) with an ``implementation=`` switch.

Per head, with the fp32 state S_t in R^{K x V} and f_t = exp(log_forget_t) (a scalar per head, a
vector over the key channels, or 1 when ``log_forget`` is None)::

    S_t = diag(f_t) S_{t-1} + k_t v_tᵀ,     o_t = scale * S_tᵀ q_t     (write, then read)

``normalize=True`` (Linear Transformer / Performer / cosFormer) decays the key sum the same way and
divides by it; the scale cancels up to eps (as in FLA)::

    z_t = f_t ⊙ z_{t-1} + k_t,              o_t = scale * S_tᵀ q_t / (scale * q_t · z_t + eps)

computed by appending a ones column to v (the augmented state's last column is z), so every backend
covers both forms. Backends (``REGISTRY``; tests/ops/gated_linear_attention proves they agree):
``recurrent`` and ``parallel`` (reference.py; recurrent is the decode path), ``chunked`` (xla.py),
``pallas_triton`` and ``pallas_tpu`` (the kernels; interpreted on CPUs). "auto" / None: on GPUs
``pallas_triton`` for heads up to ``pallas_triton.MAX_KEY`` x ``MAX_VALUE``, else ``chunked``.
"""

from __future__ import annotations

from typing import Any, Literal

import jax

from lmcore.ops.common import pallas_utils
from lmcore.ops.common.backend import Registry
from lmcore.ops.gated_linear_attention import pallas_mosaic_tpu
from lmcore.ops.gated_linear_attention import pallas_triton
from lmcore.ops.gated_linear_attention import reference
from lmcore.ops.gated_linear_attention import xla
from lmcore.ops.gated_linear_attention.base import (OP, LinearAttentionState, Options, Problem, check_shapes,
                                                    run_backend)

Implementation = Literal["recurrent", "parallel", "chunked", "pallas_triton", "pallas_tpu", "auto"]

REGISTRY = Registry(OP, {
    "recurrent": reference.Recurrent(),
    "parallel": reference.Parallel(),
    "chunked": xla.Chunked(),
    "pallas_triton": pallas_triton.PallasTriton(),
    "pallas_tpu": pallas_mosaic_tpu.PallasMosaicTpu(),
}, auto={"gpu": ("pallas_triton", "chunked"), "tpu": ("chunked",), "cpu": ("chunked",)})


def problem(q: jax.Array, v: jax.Array, normalize: bool = False, platform: str | None = None) -> Problem:
  """The ``Problem`` of a call: the kernels' widths K x (V + normalize) and T, on ``platform`` (default:
  the platform kernels compile for, ``pallas_utils.backend``)."""
  platform = pallas_utils.backend() if platform is None else platform
  return Problem(platform, q.shape[-1], v.shape[-1] + int(normalize), q.shape[1])


def gated_linear_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           log_forget: jax.Array | None = None, *,
                           implementation: Implementation | None = "chunked",
                           state: LinearAttentionState | None = None, tiles: Any = None,
                           normalize: bool = False, eps: float = 1e-6, scale: float = 1.0,
                           segment_ids: jax.Array | None = None, kernel_precision: str = "input",
                           kernel_split_state: bool = True,
                           chunked_remat: bool = True) -> tuple[jax.Array, LinearAttentionState]:
  """Gated (optionally normalised) linear attention; returns (o [B, T, H, V] in q's dtype, state).

  q, k [B, T, H, K] (feature maps already applied); v [B, T, H, V]; ``log_forget`` [B, T, H] or
  [B, T, H, K], <= 0 (not checked; the chunked forms rely on it), None: no decay. ``state`` None: zeros.
  ``tiles``: the backend's tiling (None: its heuristic). ``segment_ids`` [B, T]: the state resets where
  the id changes (MATH §6.4); the incoming state belongs to the first token's segment.
  ``kernel_precision``: the Triton kernels' dot operands (``pallas_utils.PRECISIONS``; not "input":
  o in fp32), "input" only on TPU. ``kernel_split_state``: the kernels' backward state dots in two
  parts (``pallas_utils.split_dot``). ``chunked_remat``: ``chunked``'s backward recomputes its forward.
  """
  check_shapes(q, k, v, log_forget, state, segment_ids)
  pallas_utils.check_precision(kernel_precision, OP)
  call = problem(q, v, normalize)
  name = REGISTRY.resolve_name(implementation, call)
  backend = REGISTRY.backends[name]
  options = Options(precision=kernel_precision, split_state=kernel_split_state, remat=chunked_remat)
  precision = kernel_precision if name == "pallas_triton" else "input"

  def run(q, k, v, g, S0, *, scale, doc_BxT):
    return backend(q, k, v, g, S0, scale=scale, doc_BxT=doc_BxT, tiles=backend.config(call, tiles),
                   options=options)

  return run_backend(run, q, k, v, log_forget, state, normalize=normalize, eps=eps, scale=scale,
                     segment_ids=segment_ids, out_dtype=pallas_utils.output_dtype(q.dtype, precision))
