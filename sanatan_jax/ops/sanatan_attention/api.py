"""SANATAN power-normalised causal attention (MATH §1.1 step 6, §1.2) with an ``implementation=`` switch.

    a_tj = (s_tj / c)^p / (sum_{l<=t} (s_tl / c)^p + eps),  o_t = sum_{j<=t} a_tj v_j,  eps = 1e-6,

with ``s_tj = Phi(q_t).Phi(k_j)`` (sanatan_jax.features; 4ch clips ``s`` at 0, 3ch legacy adds d).

Backends (``REGISTRY``; all compute the same function, tests/ops/sanatan_attention proves it):
  * ``parallel``: the materialised form in blocks of query rows (the causal half), with a custom VJP
    that recomputes the scores (xla.py; ``ParallelTiles``); any p and channel variant;
  * ``chunked``: chunked linear attention, every chunk at once, the states entering the chunks as a
    prefix sum over chunks (xla.py; ``ChunkTiles``); p = 1 with 6 channels;
  * ``recurrent``: the token-by-token write-then-read recurrence (reference.py); p = 1 with 6
    channels; the decode path;
  * ``pallas_fused``: the fused-chunk Triton kernels, fed by the factor kernels
    (pallas_triton_fused.py, pallas_triton_factors.py; ``FusedTiles``); p = 1 with 6 channels; GPUs,
    interpreted on CPUs;
  * ``pallas_flash``: the flash Triton kernels (pallas_triton_flash.py; ``FlashTiles``); every variant
    without a constant-size state; GPUs, interpreted on CPUs;
  * ``pallas_tpu``: the Mosaic TPU kernels (pallas_mosaic_tpu_p1.py; ``MosaicTiles``); p = 1 with 6
    channels; TPUs, interpreted on CPUs; named only, not "auto" (no TPU has timed them);
  * ``auto`` (or None): on GPUs ``pallas_fused`` (heads up to ``pallas_triton_fused.MAX_HEAD_DIM`` x
    ``MAX_VALUE_DIM``), ``pallas_flash`` (up to ``pallas_triton_flash.MAX_HEAD_DIM`` x
    ``MAX_VALUE_DIM``), then ``chunked`` and ``parallel``; on TPUs and CPUs ``chunked``, then
    ``parallel``: the first that runs the problem.

Packed documents: a document is a maximal run of equal ``segment_ids`` in a row
(``segments.document_index``). A token sees only its own document, and an incoming state belongs to
the first document of each row (pass a zero state, or none, when a call starts a new document).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from lmcore.errors import ConfigError
from lmcore.ops.common import pallas_utils
from lmcore.ops.common.backend import Registry
from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_p1
from sanatan_jax.ops.sanatan_attention import pallas_triton_flash
from sanatan_jax.ops.sanatan_attention import pallas_triton_fused
from sanatan_jax.ops.sanatan_attention import reference, xla
from sanatan_jax.ops.sanatan_attention.base import (OP, Options, Problem, SanatanState, check_state,
                                                    validate_options)

Implementation = Literal["parallel", "chunked", "recurrent", "pallas_fused", "pallas_flash", "pallas_tpu",
                         "auto"]

REGISTRY = Registry(OP, {
    "parallel": xla.Parallel(),
    "chunked": xla.Chunked(),
    "recurrent": reference.Recurrent(),
    "pallas_fused": pallas_triton_fused.PallasFused(),
    "pallas_flash": pallas_triton_flash.PallasFlash(),
    "pallas_tpu": pallas_mosaic_tpu_p1.PallasTpu(),
}, auto={"gpu": ("pallas_fused", "pallas_flash", "chunked", "parallel"),
         "tpu": ("chunked", "parallel"), "cpu": ("chunked", "parallel")})


def problem(q: jax.Array, v: jax.Array, *, p: int = 1, channels: int = 6, kernel_precision: str = "input",
            platform: str | None = None) -> Problem:
  """The ``Problem`` of a call on q [B, T, H, d], v [B, T, H, dv], on ``platform`` (default: the
  platform kernels compile for, ``pallas_utils.backend``); the kernels' dot dtype is q's at
  ``kernel_precision`` "input", else float32."""
  platform = pallas_utils.backend() if platform is None else platform
  dtype = q.dtype if kernel_precision == "input" else jnp.float32
  return Problem(platform, p, channels, q.shape[-1], v.shape[-1], q.shape[1], jnp.dtype(dtype).name)


def check_variant(implementation: str | None, p: int, channels: int, where: str) -> None:
  """Raises ConfigError naming ``where`` when the backend ``implementation`` (a valid name) computes
  the power p and channel variant on no platform, listing the names that do; "auto" and None pass."""
  if implementation in ("auto", None):
    return
  variant = Problem("cpu", p, channels)
  if not REGISTRY.backends[implementation].supports(variant):
    names = [name for name, backend in REGISTRY.backends.items() if backend.supports(variant)]
    raise ConfigError(f"{where}: implementation {implementation!r} needs "
                     f"{REGISTRY.backends[implementation].requirement}, got p={p} with {channels} "
                     f"channels; use one of {', '.join([*names, 'auto'])}")


def sanatan_attention(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                      lam_raw: jax.Array, *, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, p: int = 1, channels: int = 6,
                      three_channel: str = "clean",
                      implementation: Implementation | None = "parallel",
                      state: SanatanState | None = None, tiles: Any = None, rotate: bool = True,
                      kernel_precision: str = "input", chunked_remat: bool = True
                      ) -> tuple[jax.Array, SanatanState | None]:
  """SANATAN attention of MATH §1.1 (steps 2-6) for every head.

  Args:
    q, k: [B, T, H, d], already divided by sqrt(d). v: [B, T, H, dv].
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1 offset by ``state.position``.
    segment_ids: optional [B, T] packed-document ids (see the module docstring).
    p, channels, three_channel: the kernel (MATH §1.1 steps 5-6).
    implementation: a name of ``REGISTRY``, or "auto" / None (see the module docstring).
    state: a SanatanState to continue from (p = 1, 6ch only).
    tiles: the backend's tiling (``xla.ParallelTiles``, ``ChunkTiles``,
      ``pallas_triton_fused.FusedTiles``, ``pallas_triton_flash.FlashTiles``,
      ``pallas_mosaic_tpu_p1.MosaicTiles``); None: its heuristic.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    kernel_precision: the Triton kernels' dot operands, "input" (the inputs' dtype), "tf32" or
      "float32" (fp32 throughout, fp32 o; ``pallas_utils.PRECISIONS``); the TPU kernels take "input"
      only; the XLA forms ignore it.
    chunked_remat: "chunked": its backward pass recomputes the forward from the inputs instead of
      keeping the 6d-wide features, score blocks and state stacks (``xla.chunked``);
      "pallas_fused": its backward recomputes the factors of Phi instead of keeping them (3d
      values per token, head and operand in the inputs' dtype).

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 from the Triton kernels at kernel_precision "tf32"/"float32"),
    and the state after the last token for p = 1 with 6 channels (every backend), else None.
  """
  B, _, H, d = q.shape
  # The state check goes first: for a p >= 2 decode call it is the error that explains.
  check_state(state, p, channels, (B, H, channels * d, v.shape[-1]))
  validate_options(p=p, channels=channels, three_channel=three_channel)
  pallas_utils.check_precision(kernel_precision, OP)
  call = problem(q, v, p=p, channels=channels, kernel_precision=kernel_precision)
  backend = REGISTRY.resolve(implementation, call)
  options = Options(p=p, channels=channels, three_channel=three_channel, rotate=rotate,
                    precision=kernel_precision, remat=chunked_remat)
  return backend(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids, state=state,
                 tiles=backend.config(call, tiles), options=options)
