"""SANATAN power-normalised causal attention (MATH §1.1 step 6, §1.2): one function, eight forms.

    a_tj = (s_tj / c)^p / (sum_{l<=t} (s_tl / c)^p + eps),  o_t = sum_{j<=t} a_tj v_j,  eps = 1e-6,

with ``s_tj = Phi(q_t).Phi(k_j)`` (sanatan_jax.features; 4ch clips ``s`` at 0, 3ch legacy adds d).

* ``parallel`` (xla.py): the materialised form in blocks of query rows (the causal half), with a
  custom VJP that recomputes the scores; any p and channel variant. Its plain autodiff form,
  ``reference.parallel``, is the tests' reference.
* ``recurrent`` (reference.py; p = 1, 6ch): the token-by-token write-then-read recurrence.
* ``blocked`` (xla.py): ``parallel`` tiled over query and key blocks, never a T x T array.
* ``chunked`` (xla.py; p = 1, 6ch): chunked linear attention, every chunk at once, the states entering
  the chunks as a cumulative sum over chunks (fp32).
* ``chunked_scan`` (xla.py; p = 1, 6ch): the same chunks one ``lax.scan`` step each.
* ``pallas``: kernels with the features computed inside them and a custom VJP. p = 1 with 6ch: the
  chunked recurrence, parallel over chunks (pallas_triton_p1.py; its own chunk, not
  ``chunk_size``; on a TPU the Mosaic kernels of pallas_mosaic_tpu_p1.py). Every other p and
  channel variant: the blocked, flash-style kernels (pallas_triton_blocked.py; their own blocks,
  not ``block_size``), no state; on a TPU their Mosaic form (pallas_mosaic_tpu_blocked.py).
* ``pallas_flash``: ``pallas`` with the flash kernels of pallas_triton_flash.py (features from the
  factor kernels for 6 channels, else from XLA; ``flash_features``; causal and document block skipping, their
  own tiles) wherever ``pallas`` runs the blocked ones;
  GPUs (Triton) only, interpreted on a CPU.
* ``pallas_fused`` (p = 1, 6ch): the fused-chunk Triton kernels of pallas_triton_fused.py (the features'
  factors cos, sin and r, and their VJP, from the small kernels of pallas_triton_factors.py; each
  program carrying its channels' state through the chunks in order; their own tiles, not
  ``chunk_size``); GPUs only, interpreted on a CPU.
* ``auto`` (or None): p = 1 with 6ch ``pallas_fused`` on GPUs and XLA ``chunked`` elsewhere; every
  other variant ``pallas_flash`` on GPUs and XLA ``parallel`` elsewhere; heads wider than the kernels
  were measured to win at take XLA on GPUs too (``resolve_implementation``).

Packed documents: a document is a maximal run of equal ``segment_ids`` in a row
(``segments.document_index``). A token sees only its own document, and an incoming state belongs to
the first document of each row (pass a zero state, or none, when a call starts a new document).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax

from lmcore.ops.common import implementations, pallas_utils, shard_map
from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_blocked
from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_p1
from sanatan_jax.ops.sanatan_attention import pallas_triton_blocked
from sanatan_jax.ops.sanatan_attention import pallas_triton_flash
from sanatan_jax.ops.sanatan_attention import pallas_triton_fused
from sanatan_jax.ops.sanatan_attention import pallas_triton_p1
from sanatan_jax.ops.sanatan_attention import reference, xla
from sanatan_jax.ops.sanatan_attention.base import (Options, SanatanState, check_state,
                                                    has_constant_state, validate_options)

Implementation = Literal["parallel", "blocked", "chunked", "chunked_scan", "recurrent", "pallas",
                         "pallas_flash", "pallas_fused", "auto"]
# A form: (q, k, v, omega, lam_raw, *, positions, segment_ids, state, options) -> (o, state).
Backend = Callable[..., tuple[jax.Array, SanatanState | None]]


# Each array's leading dimensions for the kernels' shard_map (shard_map.run_sharded).
_LAYOUTS = dict(q="BTH", k="BTH", v="BTH", omega="H", lam_raw="H", positions="B", segment_ids="B", state="BH")


def _pallas(q, k, v, omega, lam_raw, *, positions=None, segment_ids=None, state=None,
            options: Options = Options(), flash: bool = False
            ) -> tuple[jax.Array, SanatanState | None]:
  """The kernels for the backend (Mosaic on TPU, else Triton): p = 1 with 6 channels the chunked
  ones, with a state; every other variant the blocked ones (``flash``: the flash ones, GPU only),
  without. Each device of the mesh in context runs them on its own rows and heads
  (``shard_map.run_sharded``)."""
  kernel_options = pallas_utils.kernel_options(options.kernel_precision, "sanatan_attention")
  on_tpu = pallas_utils.backend() == "tpu"
  inputs = dict(q=q, k=k, v=v, omega=omega, lam_raw=lam_raw, positions=positions, segment_ids=segment_ids)
  if has_constant_state(options.p, options.channels):
    p1 = pallas_mosaic_tpu_p1.sanatan_p1_tpu if on_tpu else pallas_triton_p1.sanatan_p1_pallas
    kernel = functools.partial(p1, rotate=options.rotate, **kernel_options)
    return shard_map.run_sharded(kernel, dict(inputs, state=state), _LAYOUTS,
                                 ("BTH", SanatanState(S="BH", z="BH", position="B")))
  if flash and on_tpu:
    raise NotImplementedError(
        "sanatan_attention: implementation='pallas_flash' is a Triton (GPU) kernel; on a TPU use "
        "'pallas' (the Mosaic kernels) or 'blocked'")
  if flash:
    blocked = pallas_triton_flash.sanatan_flash_pallas
  else:
    blocked = (pallas_mosaic_tpu_blocked.sanatan_blocked_tpu if on_tpu
               else pallas_triton_blocked.sanatan_blocked_pallas)
  if flash:
    kernel_options = dict(kernel_options, features=options.flash_features)
  kernel = functools.partial(blocked, p=options.p, channels=options.channels,
                             three_channel=options.three_channel, rotate=options.rotate, **kernel_options)
  return shard_map.run_sharded(kernel, inputs, _LAYOUTS, "BTH"), None


def _pallas_fused(q, k, v, omega, lam_raw, *, positions=None, segment_ids=None, state=None,
                  options: Options = Options()) -> tuple[jax.Array, SanatanState]:
  """The fused-chunk Triton kernels (p = 1, 6 channels; ``validate_options`` has checked), each
  device of the mesh in context on its own rows and heads (``shard_map.run_sharded``)."""
  kernel_options = pallas_utils.kernel_options(options.kernel_precision, "sanatan_attention")
  if pallas_utils.backend() == "tpu":
    raise NotImplementedError(
        "sanatan_attention: implementation='pallas_fused' is a Triton (GPU) kernel; on a TPU use "
        "'pallas' (the Mosaic kernels) or 'chunked'")
  kernel = functools.partial(pallas_triton_fused.sanatan_fused_pallas, rotate=options.rotate,
                             tiles_spec=options.fused_tiles, remat=options.chunked_remat,
                             **kernel_options)
  inputs = dict(q=q, k=k, v=v, omega=omega, lam_raw=lam_raw, positions=positions,
                segment_ids=segment_ids, state=state)
  return shard_map.run_sharded(kernel, inputs, _LAYOUTS,
                               ("BTH", SanatanState(S="BH", z="BH", position="B")))


IMPLEMENTATIONS: dict[str, Backend] = {
    "parallel": xla.parallel,
    "blocked": xla.blocked,
    "chunked": xla.chunked,
    "chunked_scan": xla.chunked_scan,
    "recurrent": reference.recurrent,
    "pallas": _pallas,
    "pallas_flash": functools.partial(_pallas, flash=True),
    "pallas_fused": _pallas_fused,
}


# The widest heads "auto" gives the Triton kernels, from their timings against XLA on the H200 (fwd+bwd,
# B 8 × T 2048, docs/BENCHMARKS.md). Flash (p >= 2): compiled and faster at 64 (2.55× parallel); at 128 its
# tiles need more shared memory than the chip's 227 KiB. Fused-chunk (p = 1): faster than XLA chunked at
# every measured head of d <= 128 (d × dv = 64 × 64 1.41×, 128 × 128 1.26×, 128 × 256 1.16×, 128 × 512
# 1.03×); at d = 256 it loses with dv = 512 (0.70×) and at d = 512 it does not compile.
FLASH_MAX_HEAD_DIM = 64
FLASH_MAX_VALUE_DIM = 64
FUSED_MAX_HEAD_DIM = 128
FUSED_MAX_VALUE_DIM = 512


def resolve_implementation(implementation: str | None, **problem) -> str:
  """The form "auto" (or None) runs for ``p=``, ``channels=``, ``head_dim=`` and ``value_dim=``
  (default 1, 6 and unknown widths, which count as small; other problem facts are ignored); a name of
  ``IMPLEMENTATIONS`` passes through, any other raises ValueError.

  Measured on one H200 (fwd+bwd, 12 heads of 64, bf16, one call at a time; docs/BENCHMARKS.md also has
  GPU times): p = 1 with 6 channels,
  the fused-chunk kernels ("pallas_fused") 1.61 / 3.29 ms at 8 × 2048 / 1 × 32768 against XLA
  "chunked" (C = 128) 4.56 / 7.95 and the chunk-parallel kernel ("pallas") 6.54 / 12.7, agreeing with
  XLA in fp32 to 1.2e-6 on the GPU (bf16: 6.5e-3, below XLA's own 8.4e-3); p = 2,
  the flash kernels ("pallas_flash") 3.40 ms at 8 × 2048 (with XLA's features; 2.92 ms of GPU time
  with the factor kernels', their default) against XLA "parallel" 9.76, agreeing to
  1.5e-6. So on GPUs "auto" is "pallas_fused" for the constant-state case and "pallas_flash" for every
  other power and channel variant; elsewhere it is XLA "chunked" and XLA "parallel" (the Mosaic kernels
  have not been timed on a TPU; compiled for a TPU v4 at 8 × 2048 per chip, "parallel"'s roofline
  time is 14.9 ms against "blocked"'s 95.3 in 1.1 against 1.6 GiB of temporaries). Heads wider than
  ``FLASH_MAX_HEAD_DIM`` / ``FLASH_MAX_VALUE_DIM`` (flash) or ``FUSED_MAX_HEAD_DIM`` /
  ``FUSED_MAX_VALUE_DIM`` (fused) take the XLA form ("parallel", "chunked") on GPUs.
  """
  p, channels = problem.get("p", 1), problem.get("channels", 6)
  d, dv = problem.get("head_dim", 0), problem.get("value_dim", 0)
  on_gpu = pallas_utils.backend() == "gpu"

  def auto() -> str:
    if has_constant_state(p, channels):
      fits = d <= FUSED_MAX_HEAD_DIM and dv <= FUSED_MAX_VALUE_DIM
      return "pallas_fused" if on_gpu and fits else "chunked"
    if on_gpu and d <= FLASH_MAX_HEAD_DIM and dv <= FLASH_MAX_VALUE_DIM:
      return "pallas_flash"
    return "parallel"

  return implementations.resolve("sanatan_attention", implementation, IMPLEMENTATIONS, auto)


def sanatan_attention(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                      lam_raw: jax.Array, *, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, p: int = 1, channels: int = 6,
                      three_channel: str = "clean",
                      implementation: Implementation | None = "parallel",
                      state: SanatanState | None = None, chunk_size: int = 64,
                      block_size: int = 128, rotate: bool = True,
                      kernel_precision: str = "input", chunked_remat: bool = True,
                      fused_tiles: str = "", flash_features: str = "auto"
                      ) -> tuple[jax.Array, SanatanState | None]:
  """SANATAN attention of MATH §1.1 (steps 2-6) for every head.

  Args:
    q, k: [B, T, H, d], already divided by sqrt(d). v: [B, T, H, dv].
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1 offset by ``state.position``.
    segment_ids: optional [B, T] packed-document ids (see the module docstring).
    p, channels, three_channel: the kernel (MATH §1.1 steps 5-6).
    implementation: "parallel" | "blocked" | "chunked" | "chunked_scan" | "recurrent" | "pallas"
      | "pallas_flash" | "pallas_fused" (same function);
      "auto" or None picks the measured fastest for the backend (``resolve_implementation``).
    state: a SanatanState to continue from (p = 1, 6ch only).
    chunk_size, block_size: tile lengths of "chunked" / "chunked_scan" and of "blocked" / "parallel"
      (its query rows; on TPUs at least ``xla.PARALLEL_MIN_ROWS``, 256).
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    kernel_precision: the Pallas GPU kernels' dot operands, "input" (the inputs' dtype), "tf32"
      or "float32" (fp32 throughout, fp32 o; ``pallas_utils.PRECISIONS``). Other implementations
      ignore it.
    chunked_remat: "chunked": its backward pass recomputes the forward from the inputs instead of
      keeping the 6d-wide features, score blocks and state stacks (``xla.chunked``);
      "pallas_fused": its backward recomputes the factors of Phi instead of keeping them (3d
      values per token, head and operand in the inputs' dtype).
    fused_tiles: "pallas_fused" only: tilings replacing the kernels' defaults
      (``pallas_triton_fused.parse_tiles``), e.g. "forward=64x16x6x4x3", and the spans per row,
      e.g. "spans=8" ("spans=1": rows whole; ``lmcore.ops.common.spans``); "" keeps the defaults.
    flash_features: "pallas_flash" only: where its feature channels come from, "xla", "kernels"
      (6 channels) or "auto" ("kernels" for 6 channels, else "xla";
      ``pallas_triton_flash.FEATURE_SOURCES``).

  Returns:
    o [B, T, H, dv] in v's dtype (fp32 from the kernels at kernel_precision "tf32"/"float32"),
    and the state after the last token for p = 1 with 6 channels
    (every implementation), else None.
  """
  B, _, H, d = q.shape
  implementation = resolve_implementation(implementation, p=p, channels=channels, head_dim=d,
                                          value_dim=v.shape[-1])
  # The state check goes first: for a p >= 2 decode call it is the error that explains.
  check_state(state, p, channels, (B, H, channels * d, v.shape[-1]))
  validate_options(p=p, channels=channels, three_channel=three_channel,
                   implementation=implementation)
  pallas_utils.check_precision(kernel_precision, "sanatan_attention")
  pallas_triton_flash.check_features(flash_features, channels, "sanatan_attention", "flash_features")
  options = Options(p=p, channels=channels, three_channel=three_channel, rotate=rotate,
                    chunk_size=chunk_size, block_size=block_size,
                    kernel_precision=kernel_precision, chunked_remat=chunked_remat,
                    fused_tiles=fused_tiles, flash_features=flash_features)
  return IMPLEMENTATIONS[implementation](q, k, v, omega, lam_raw, positions=positions,
                                         segment_ids=segment_ids, state=state, options=options)
