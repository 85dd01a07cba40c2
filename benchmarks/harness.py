"""Timing library behind ``scripts/bench_kernels.py``: ops, head shapes, counted FLOPs, timers, table,
markdown.

Every op is timed at its default head shape (``DEFAULT_SHAPES``) or at named sets of shapes
(``SHAPE_SETS``: "preset", the heads of the paper presets of configs/; "wide", K and V of 128 to 512).

Every op benchmark (this module, ``benchmarks.xla_forms``, ``benchmarks.fla``) times forward+backward with
``time_fwd_bwd``: the value and gradient of Σ o · do with respect to every input (``fwd_bwd``), as a
training step differentiates its loss; ``benchmarks.tpu_aot`` and ``benchmarks.kernel_check`` compile
and check that same function.

Counted FLOPs per head (forward; forward+backward is counted as 3× forward):
  * chunked linear attention, feature width F, value width V, chunk C:
    T·(2·C·(F + V) + 4·F·V)  (intra-chunk scores and mixing, state read and write);
  * materialised parallel form: 2·T²·(F + V) / 2 (causal half);
  * softmax attention: 2·T²·(d + V) / 2 (causal half).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import re
import statistics
from typing import Callable

import jax
import jax.numpy as jnp

# The rows' bookkeeping is part of this module's API for the scripts (``bench.Row``, ``bench.time_fn`` ...).
from benchmarks.rows import (CHUNK, Row, RowLog, chunked_flops, device_name, exclusive, shared,  # noqa: F401
                             measure, parallel_flops, time_fn)
from sanatan_jax.ops.sanatan_attention import xla as sanatan_xla
from sanatan_jax.ops.sanatan_attention.pallas_triton_flash import BlockTiles, FlashTiles
from sanatan_jax.ops.sanatan_attention.pallas_triton_fused import FusedTiles, KernelTiles

HEADS, HEAD_DIM = 12, 64  # the 184M SANATAN model's head shape (also GLA's reference shape)
TAYLOR_HEADS, TAYLOR_DIM = 16, 16
TPU_CHUNK = 128  # the Mosaic kernels' smallest compiled chunk
PARALLEL_MAX_SCORES = 2 ** 33  # skip the materialised form beyond ~8.6e9 score entries
GATED_PARALLEL_MAX_SCORES = 2 ** 30  # the gated one's scores are K wide: B·H·T²·K entries (gated_cases)
FP32_PRECISIONS = ("tf32", "float32")  # kernel_precision cases for bf16 inputs (_precision_cases)
SANATAN_CHUNKED = f"chunked (xla, C={sanatan_xla.CHUNK})"  # SANATAN p = 1's XLA form at its heuristic chunk


@dataclasses.dataclass(frozen=True)
class HeadShape:
  """The heads of a case: ``heads`` H of key width ``key`` K (SANATAN's d, Taylor's d') and value width
  ``value`` V; the gated op's forget ``gate``: "channel" (per key channel) or "head" (a scalar)."""

  heads: int
  key: int
  value: int
  gate: str | None = None

  @property
  def label(self) -> str:
    return f"H={self.heads} K={self.key} V={self.value}" + (f" gate={self.gate}" if self.gate else "")


DEFAULT_SHAPES = {"sanatan_p1": HeadShape(HEADS, HEAD_DIM, HEAD_DIM),
                  "sanatan_p2": HeadShape(HEADS, HEAD_DIM, HEAD_DIM),
                  "gated": HeadShape(HEADS, HEAD_DIM, HEAD_DIM, "channel"),
                  "taylor": HeadShape(TAYLOR_HEADS, TAYLOR_DIM, HEAD_DIM),
                  "softmax": HeadShape(HEADS, HEAD_DIM, HEAD_DIM)}
# The heads each paper preset of configs/ gives an op (softmax: the default, the 184M control's).
_SANATAN_PRESETS = (HeadShape(12, 64, 64),  # sanatan.py 184m_* and ablate_* (D = 768)
                    HeadShape(8, 64, 64))  # sanatan.py repro_* (D = 512)
PRESET_SHAPES = {
    "sanatan_p1": _SANATAN_PRESETS,
    "sanatan_p2": _SANATAN_PRESETS,
    "gated": (HeadShape(4, 96, 192, "channel"),  # baselines.py gla_182m (D = 768, expand_k 0.5)
              HeadShape(12, 32, 64, "channel"),  # gla_182m_12heads
              HeadShape(4, 64, 128, "channel"),  # repro_gla (D = 512)
              HeadShape(4, 128, 128, "head")),  # cyfa_equal_state, hybrid_cyfa_gdn
    "taylor": (HeadShape(16, 16, 64),  # based.py 360m* (D = 1024)
               HeadShape(16, 16, 112),  # based.py 1p3b* (D = 1792)
               HeadShape(16, 16, 32)),  # based.py repro_based (D = 512)
}
WIDE = (128, 256, 512)
WIDE_TOTAL = 1024  # H · V of every wide shape


def _wide(keys: tuple[int, ...], gate: str | None = None) -> tuple[HeadShape, ...]:
  return tuple(HeadShape(WIDE_TOTAL // value, key, value, gate) for key in keys for value in WIDE)


# Wide heads: K, V in WIDE. Taylor's key is d' (F = 1 + d' + d'(d' + 1)/2 state rows; BASED's 16):
# V in WIDE at d' = 16, and d' = 32, 64 at V = 128.
WIDE_SHAPES = {"sanatan_p1": _wide(WIDE), "sanatan_p2": _wide(WIDE), "gated": _wide(WIDE, "channel"),
               "taylor": _wide((16,)) + (HeadShape(8, 32, 128), HeadShape(8, 64, 128))}
SHAPE_SETS = {"default": {op: (shape,) for op, shape in DEFAULT_SHAPES.items()},
              "preset": PRESET_SHAPES, "wide": WIDE_SHAPES}


def shapes_for(op_name: str, sets) -> list[HeadShape]:
  """The head shapes of ``op_name`` in the named ``sets`` of SHAPE_SETS, in order, each once; a set that
  does not list the op gives its default shape (softmax: the reference of every table)."""
  unknown = [name for name in sets if name not in SHAPE_SETS]
  if unknown:
    raise ValueError(f"unknown head-shape set {unknown[0]!r} in --shapes; valid: {', '.join(SHAPE_SETS)}")
  default = (DEFAULT_SHAPES[op_name],)
  return list(dict.fromkeys(shape for name in sets for shape in SHAPE_SETS[name].get(op_name, default)))


def shape_label(op_name: str, shape: HeadShape | None) -> str:
  """A row's ``shape``: "" for the op's default shape (as in rows written before shapes), else the label."""
  return "" if shape is None or shape == DEFAULT_SHAPES.get(op_name) else shape.label


def _dims(op_name: str, shape: HeadShape | None) -> tuple[int, int, int]:
  """(H, K, V) of ``shape``, or of the op's default shape."""
  shape = shape or DEFAULT_SHAPES[op_name]
  return shape.heads, shape.key, shape.value


def fwd_bwd(fn: Callable, n_args: int) -> Callable:
  """What every op benchmark runs as forward+backward: ``(do, *args) -> (loss, grads)``, the value and
  the gradient of loss = Σ o · do (in fp32) with respect to each of the ``n_args`` arguments of
  ``fn(*args) -> o``, as a training step differentiates its loss. The value keeps the forward live:
  with the gradient alone, a loss linear in o leaves XLA free to drop the forward of an op whose
  backward recomputes it (``jax.checkpoint``), which a training step, whose later layers read o,
  never does."""
  def loss(do, *args):  # do is an argument, not a closure constant, so XLA does not fold it
    return jnp.sum(fn(*args).astype(jnp.float32) * do.astype(jnp.float32))

  return jax.value_and_grad(loss, argnums=tuple(range(1, n_args + 1)))


def cotangent(fn: Callable, args: tuple) -> jax.Array:
  """do of ``fwd_bwd``: standard normal, o's shape, the first argument's dtype (fixed key)."""
  return jax.random.normal(jax.random.key(1), jax.eval_shape(fn, *args).shape, args[0].dtype)


_LAST_COMPILED: list = []  # [(op, args, forward, fwd_bwd, do)] of the last case compiled


def compile_fwd_bwd(op: Callable, args: tuple, lock: str = "") -> tuple[Callable, Callable, jax.Array]:
  """``op`` and its ``fwd_bwd``, compiled holding ``lock`` shared (``rows.shared``), and do; the last
  case's are reused when timed again at another queue depth."""
  if _LAST_COMPILED and _LAST_COMPILED[0][0] is op and _LAST_COMPILED[0][1] is args:
    return _LAST_COMPILED[0][2:]
  do = cotangent(op, args)
  with shared(lock):
    forward = jax.jit(op).lower(*args).compile()
    backward = jax.jit(fwd_bwd(op, len(args))).lower(do, *args).compile()
  _LAST_COMPILED[:] = [(op, args, forward, backward, do)]
  return forward, backward, do


def time_fwd_bwd(op: Callable, args: tuple, repeats: int, lock: str = "", queue: int = 1
                 ) -> tuple[float, float]:
  """(forward ms, forward+backward ms) of ``op(*args) -> o``: the one timer of every op benchmark.
  Forward+backward is ``fwd_bwd`` (the value and gradient of Σ o · do). JAX arrays: both compiled
  first holding ``lock`` shared, then timed holding it exclusively, ``queue`` calls per wait
  (``time_fn``). torch tensors (flash-linear-attention on a CUDA GPU): the same loss on CUDA-event
  timings (``_torch_times``), holding ``lock`` exclusively."""
  if type(args[0]).__module__.startswith("torch"):
    with exclusive(lock):
      return _torch_times(op, args, repeats, queue)
  forward, backward, do = compile_fwd_bwd(op, args, lock)
  with exclusive(lock):
    return (time_fn(forward, *args, repeats=repeats, queue=queue),
            time_fn(backward, do, *args, repeats=repeats, queue=queue))


def _torch_times(op: Callable, tensors: list, repeats: int, queue: int) -> tuple[float, float]:
  """``time_fwd_bwd`` of a torch op on CUDA tensors: medians of ``repeats`` CUDA-event timings of
  ``queue`` calls launched back to back (divided by ``queue``), after five warm-up calls (FLA autotunes
  on its first calls); forward+backward differentiates Σ o · do with respect to every tensor."""
  import torch

  def forward():
    with torch.no_grad():
      op(*tensors)

  leaves = [t.detach().requires_grad_(True) for t in tensors]
  with torch.no_grad():
    out = op(*tensors)
  generator = torch.Generator(device=out.device).manual_seed(1)
  do = torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float32)

  def forward_backward():
    (op(*leaves).float() * do).sum().backward()
    for leaf in leaves:
      leaf.grad = None

  return _cuda_ms(torch, forward, repeats, queue), _cuda_ms(torch, forward_backward, repeats, queue)


def _cuda_ms(torch, fn: Callable, repeats: int, queue: int) -> float:
  for _ in range(5):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(queue):
      fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / queue)
  return statistics.median(times)


def _randn(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _precision_cases(pallas_case: Callable[[str], Callable], dtype, name: str = "pallas") -> dict:
  """``<name> (tf32)`` and ``<name> (float32)``, ``pallas_case(precision)``: the GPU kernel on fp32
  copies of low-precision inputs (the bf16 agreement limit of 2e-3); none for fp32 inputs or on a TPU."""
  from lmcore.ops.common import pallas_utils

  if jnp.dtype(dtype) == jnp.float32 or pallas_utils.backend() == "tpu":
    return {}
  return {f"{name} ({precision})": pallas_case(precision) for precision in FP32_PRECISIONS}


def _sanatan_args(batch, length, dtype, H=HEADS, d=HEAD_DIM, V=HEAD_DIM):
  """q, k, v, omega, lam_raw of the SANATAN cases (q, k scaled as after the 1/sqrt(d) projection)."""
  keys = jax.random.split(jax.random.key(0), 5)
  shape = (batch, length, H, d)
  return (_randn(keys[0], shape, dtype, d ** -0.5), _randn(keys[1], shape, dtype, d ** -0.5),
          _randn(keys[2], (batch, length, H, V), dtype), jnp.full((H, d), jnp.pi / 4),
          jax.random.normal(keys[3], (H, d)))


def _sanatan_reference(**options):
  """``reference.parallel`` (the materialised form, differentiated by autodiff) as a case."""
  from sanatan_jax.ops.sanatan_attention import base, reference

  return lambda q, k, v, w, l: reference.parallel(q, k, v, w, l, options=base.Options(**options))[0]


def sanatan_cases(batch, length, dtype, shape: HeadShape | None = None):
  """SANATAN p = 1: the kernels of the platform ("pallas_fused", the fused-chunk Triton kernels, and
  their fp32 variants; on a TPU "pallas_tpu", the Mosaic ones), the XLA chunked form (all chunks at
  once, C = 64 and its heuristic chunk), a plain einsum chunked form without documents or states
  (``benchmarks.plain_chunked``, C = 64; a baseline, never chosen by "auto") and the materialised
  reference, each chunked form credited its own chunk."""
  from benchmarks.plain_chunked import plain_chunked
  from lmcore.ops.common import pallas_utils
  from lmcore.ops.common.backend import ChunkTiles
  from sanatan_jax import sanatan_attention
  from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_p1, pallas_triton_fused

  H, d, V = _dims("sanatan_p1", shape)
  args = _sanatan_args(batch, length, dtype, H, d, V)

  def op(impl, tiles=None, **options):
    return lambda q, k, v, w, l: sanatan_attention(q, k, v, w, l, implementation=impl, tiles=tiles,
                                                   **options)[0]

  work = functools.partial(chunked_flops, batch, length, H, 6 * d, V)
  fused = lambda precision: op("pallas_fused", kernel_precision=precision)
  on_tpu = pallas_utils.backend() == "tpu"
  cases = {"pallas_fused": "a Triton (GPU) kernel" if on_tpu else fused("input"),
           **_precision_cases(fused, dtype, "pallas_fused"),
           "chunked (xla)": op("chunked", ChunkTiles(CHUNK)), SANATAN_CHUNKED: op("chunked"),
           "plain chunked (baseline)": plain_chunked}
  flops = {name: work() for name in cases}
  flops[SANATAN_CHUNKED] = work(chunk=sanatan_xla.CHUNK)
  for name in cases:  # the fused kernels' own chunk, by their operands' width
    if name.startswith("pallas_fused"):
      operands = dtype if name == "pallas_fused" else jnp.float32
      flops[name] = work(chunk=pallas_triton_fused.default_tiles(operands).forward.chunk)
  if on_tpu:  # compiled Mosaic chunks are >= 128 tokens
    cases["pallas_tpu"] = op("pallas_tpu")
    flops["pallas_tpu"] = work(chunk=max(pallas_mosaic_tpu_p1.MosaicTiles().chunk, TPU_CHUNK))
  if batch * H * length * length <= PARALLEL_MAX_SCORES:
    cases["parallel (reference)"] = _sanatan_reference()
    flops["parallel (reference)"] = parallel_flops(batch, length, H, 6 * d, V)
  return args, cases, flops


def sanatan_p2_cases(batch, length, dtype, shape: HeadShape | None = None):
  """SANATAN p = 2 (no recurrence): the flash kernels ("pallas_flash", Triton only, and their fp32
  variants) vs the XLA parallel form (query blocks, custom VJP) vs the materialised reference
  (autodiff), each credited the causal half of the scores and mixing, 2·T²·(F + V)/2 per head with
  F = 6d."""
  from lmcore.ops.common import pallas_utils
  from sanatan_jax import sanatan_attention

  H, d, V = _dims("sanatan_p2", shape)

  def op(impl, **options):
    return lambda q, k, v, w, l: sanatan_attention(q, k, v, w, l, p=2, implementation=impl,
                                                   **options)[0]

  flash = lambda precision: op("pallas_flash", kernel_precision=precision)
  on_tpu = pallas_utils.backend() == "tpu"
  cases = {"pallas_flash": "a Triton (GPU) kernel" if on_tpu else flash("input"),
           **_precision_cases(flash, dtype, "pallas_flash"), "parallel (xla)": op("parallel")}
  if batch * H * length * length <= PARALLEL_MAX_SCORES:
    cases["parallel (reference)"] = _sanatan_reference(p=2)
  flops = parallel_flops(batch, length, H, 6 * d, V)
  return _sanatan_args(batch, length, dtype, H, d, V), cases, {name: flops for name in cases}


def _gated_args(batch, length, dtype, shape: HeadShape | None):
  """q, k (scaled by K^-1/2), v and the log forget gate, per key channel or per head (``shape.gate``)."""
  H, K, V = _dims("gated", shape)
  per_head = shape is not None and shape.gate == "head"
  keys = jax.random.split(jax.random.key(0), 4)
  qk = (batch, length, H, K)
  gate_logits = _randn(keys[3], qk[:3] if per_head else qk, jnp.float32) + 4.0
  return (_randn(keys[0], qk, dtype, K ** -0.5), _randn(keys[1], qk, dtype, K ** -0.5),
          _randn(keys[2], (batch, length, H, V), dtype), jax.nn.log_sigmoid(gate_logits) / 16)


def gated_cases(batch, length, dtype, shape: HeadShape | None = None):
  """Gated linear attention: the kernel of this platform ("pallas_triton", and its fp32 variants; on a
  TPU "pallas_tpu"), XLA chunked, and the materialised form on small cases."""
  from lmcore.ops.common import pallas_utils
  from lmcore.ops.common.backend import ChunkTiles
  from lmcore.ops.gated_linear_attention import gated_linear_attention
  from lmcore.ops.gated_linear_attention import pallas_triton

  H, K, V = _dims("gated", shape)
  args = _gated_args(batch, length, dtype, shape)

  def op(impl, **options):
    return lambda q, k, v, g: gated_linear_attention(q, k, v, g, implementation=impl, **options)[0]

  kernel = "pallas_tpu" if pallas_utils.backend() == "tpu" else "pallas_triton"
  cases = {kernel: op(kernel), **_precision_cases(lambda p: op(kernel, kernel_precision=p), dtype, kernel),
           "chunked (xla)": op("chunked", tiles=ChunkTiles(CHUNK))}
  # Per-channel gates make the parallel form's scores K wide: XLA compiles it for many minutes at
  # B·H·T² = 4e8 (T = 2048, K = 64), so it is timed on small cases only.
  if batch * H * length * length * K <= GATED_PARALLEL_MAX_SCORES:
    cases["parallel (reference)"] = op("parallel")
  work = functools.partial(chunked_flops, batch, length, H, K, V)
  flops = {name: work() for name in cases}
  for name in cases:  # the kernels' own chunks (compiled Mosaic chunks are >= 128 tokens)
    if name.startswith("pallas_triton"):
      flops[name] = work(chunk=pallas_triton.CHUNK)
  if "pallas_tpu" in cases:
    flops["pallas_tpu"] = work(chunk=TPU_CHUNK)
  flops["parallel (reference)"] = parallel_flops(batch, length, H, K, V)
  return args, cases, flops


def taylor_cases(batch, length, dtype, shape: HeadShape | None = None):
  """BASED Taylor attention: on a GPU the Triton kernels, "pallas_blocked" and "pallas_fused" (and their
  fp32 variants), on a TPU the Mosaic ones, "pallas_tpu"; XLA chunked and the materialised reference.
  A kernel that does not take the heads is a reason string (a row with a note)."""
  from based_jax.ops.taylor_attention import REGISTRY, Problem, taylor_linear_attention
  from lmcore.ops.common import pallas_utils
  from lmcore.ops.common.backend import ChunkTiles

  H, d, V = _dims("taylor", shape)
  keys = jax.random.split(jax.random.key(0), 3)
  qk_shape = (batch, length, H, d)
  args = (_randn(keys[0], qk_shape, dtype, 0.5), _randn(keys[1], qk_shape, dtype, 0.5),
          _randn(keys[2], (batch, length, H, V), dtype))

  def op(impl, tiles=None, **options):
    return lambda q, k, v: taylor_linear_attention(q, k, v, implementation=impl, tiles=tiles, **options)[0]

  def kernel(impl):
    """The backend's case, its fp32 variants (GPU, bf16 inputs), or why it does not run these heads."""
    backend = REGISTRY.backends[impl]
    if not backend.supports(Problem("gpu", d, V, length)):
      return {impl: f"{impl} needs {backend.requirement}"}
    variants = _precision_cases(lambda precision: op(impl, kernel_precision=precision), dtype)
    return {impl: op(impl), **{name.replace("pallas", impl, 1): fn for name, fn in variants.items()}}

  cases = {}
  for impl in (("pallas_tpu",) if pallas_utils.backend() == "tpu" else ("pallas_blocked", "pallas_fused")):
    cases.update(kernel(impl))
  cases["chunked (xla)"] = op("chunked", ChunkTiles(CHUNK))
  if batch * H * length * length <= PARALLEL_MAX_SCORES:
    cases["parallel (reference)"] = op("parallel")
  F = 1 + d + d * (d + 1) // 2  # the compact feature width, 153 at d' = 16
  flops = {impl: chunked_flops(batch, length, H, F, V) for impl in cases}
  for name in cases:
    if name.startswith("pallas_blocked") or name == "parallel (reference)":
      flops[name] = parallel_flops(batch, length, H, d + 2, V)
    elif name == "pallas_tpu":  # compiled Mosaic chunks hold at least 128 tokens
      flops[name] = chunked_flops(batch, length, H, F, V, chunk=TPU_CHUNK)
  return args, cases, flops


def softmax_cases(batch, length, dtype, shape: HeadShape | None = None):
  """Causal softmax attention, cuDNN on a GPU (XLA elsewhere): the reference of every table."""
  H, K, V = _dims("softmax", shape)
  keys = jax.random.split(jax.random.key(0), 3)
  args = (_randn(keys[0], (batch, length, H, K), dtype), _randn(keys[1], (batch, length, H, K), dtype),
          _randn(keys[2], (batch, length, H, V), dtype))
  implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
  cases = {f"softmax ({implementation})": lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation)}
  return args, cases, {name: parallel_flops(batch, length, H, K, V) for name in cases}


# Gated kernel settings tried by ``--tune=gated`` (its defaults are timed by the plain run; the tilings
# of docs/BENCHMARKS.md, Gated linear attention kernel tiles): the state dots with one bf16 rounding
# (``split=False``), phase 2 by XLA's associative scan instead of the Pallas chunk scan, chunks of 32.
TUNING = {
    "gated": [dict(chunk_size=16, num_warps=8, split=False),
              dict(chunk_size=16, num_warps=8, scan="xla"), dict(chunk_size=32, num_warps=8)],
}


# Tilings of the SANATAN flash kernels tried by ``--tune=sanatan_p2`` (``pallas_triton_flash.FlashTiles``
# of (block, loop, warps, stages) per kernel: forward, dk/dv, dq); the first is its default
# (docs/BENCHMARKS.md, SANATAN p = 2 flash tilings). Four forward stages, forward loops of 128 at two
# and dq loops of 64 at three stages exceed its shared memory.
FLASH_TUNING = [FlashTiles(BlockTiles(128, 64, 4, 3), BlockTiles(128, 32, 8, 4), BlockTiles(128, 64, 8, 2)),
                FlashTiles(BlockTiles(128, 64, 8, 3), BlockTiles(128, 32, 8, 3), BlockTiles(128, 32, 8, 3)),
                FlashTiles(BlockTiles(128, 64, 8, 3), BlockTiles(128, 32, 8, 3), BlockTiles(128, 64, 8, 2)),
                FlashTiles(BlockTiles(128, 64, 8, 2), BlockTiles(128, 32, 8, 2), BlockTiles(128, 32, 8, 2)),
                FlashTiles(BlockTiles(128, 128, 8, 1), BlockTiles(128, 32, 8, 3), BlockTiles(128, 32, 8, 3))]


def _tiles_name(tiles) -> str:
  """"pallas_flash (fwd 128x64 8w 2s, bwd 128x32 8w 2s, dq 128x64 8w 2s)" for a FLASH_TUNING tiling."""
  part = lambda t: f"{t.block}x{t.loop} {t.num_warps}w {t.num_stages}s"
  return f"pallas_flash (fwd {part(tiles.forward)}, bwd {part(tiles.backward)}, dq {part(tiles.dq)})"


def flash_tuning_cases(batch: int, length: int, dtype) -> tuple[tuple, dict, dict]:
  """(args, cases, flops) of the SANATAN p = 2 flash kernel at every FLASH_TUNING tiling."""
  from sanatan_jax.ops.sanatan_attention import pallas_triton_flash as flash

  args, _, flops = sanatan_p2_cases(batch, length, dtype)
  cases = {}
  for tiles in FLASH_TUNING:
    cases[_tiles_name(tiles)] = (
        lambda q, k, v, w, l, tiles=tiles: flash.sanatan_flash_pallas(q, k, v, w, l, p=2, tiles=tiles))
  return args, cases, {name: flops["pallas_flash"] for name in cases}


# Tilings of the SANATAN p = 1 fused-chunk kernels tried by ``--tune=sanatan_p1_fused``
# (``pallas_triton_fused.FusedTiles``: the forward, dq and dk/dv walks' (chunk, value tile, channels per
# program, warps, stages)); the first is its bf16 default. Their rows are the op "sanatan_p1".
_W = KernelTiles
FUSED_TUNING = [FusedTiles(_W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3)),
                FusedTiles(_W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 2)),
                FusedTiles(_W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 4)),
                FusedTiles(_W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3), _W(64, 64, 1, 8, 2)),
                FusedTiles(_W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3), _W(64, 64, 2, 8, 3)),
                FusedTiles(_W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3), _W(64, 32, 1, 4, 3)),
                FusedTiles(_W(64, 64, 1, 4, 3), _W(64, 64, 1, 4, 3), _W(32, 64, 1, 4, 3)),
                FusedTiles(_W(64, 64, 1, 4, 4), _W(64, 64, 1, 4, 4), _W(64, 64, 1, 4, 3))]
# Settings of the blocked Taylor kernels tried by ``--tune=taylor_blocked`` (query block, key block,
# warps, pipeline stages; ``taylor_sums_blocked``'s knobs); the first is its default
# (docs/BENCHMARKS.md, Taylor kernel tilings). Their rows belong to the op "taylor".
TAYLOR_BLOCKED_TUNING = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 8, 3)]
# Tilings of the fused-chunk Taylor kernels tried by ``--tune=taylor_fused``, as
# ``pallas_triton_fused.FusedTiles`` fields (chunk, features, block_v, then (warps, stages) of the forward,
# dq, dk/dv and intra kernels); the first is its default (docs/BENCHMARKS.md, Taylor kernel tilings).
# Their rows belong to the op "taylor".
TAYLOR_FUSED_TUNING = [(128, 64, 64, (8, 3), (8, 3), (8, 3), (8, 2)),
                       (64, 64, 64, (4, 3), (4, 3), (8, 3), (4, 2)),
                       (64, 64, 64, (4, 4), (4, 4), (8, 3), (4, 2)),
                       (128, 64, 64, (8, 4), (8, 4), (8, 3), (8, 2)),
                       (64, 32, 64, (4, 3), (4, 3), (8, 3), (4, 2))]
# Spans per row tried by ``--tune=sanatan_p1_spans`` and ``--tune=taylor_spans``: the fused-chunk
# kernels at their default tilings with each row cut into G spans (``lmcore.ops.common.spans``), for
# every G here whose spans keep SPANS_MIN_LENGTH tokens and whole chunks. Rows "pallas_fused (spans=G)"
# of the ops "sanatan_p1" and "taylor".
SPANS_TUNING = (1, 2, 4, 8, 16, 32)
SPANS_MIN_LENGTH = 512
# Tuning names whose rows belong to another op's table.
TUNED_OPS = {"sanatan_p1_fused": "sanatan_p1", "taylor_blocked": "taylor", "taylor_fused": "taylor",
             "sanatan_p1_spans": "sanatan_p1", "taylor_spans": "taylor"}


def _fused_name(tiles) -> str:
  """"pallas_fused (fwd 64x64 c1 4w 2s, dq ..., dkv ...)" for a FUSED_TUNING tiling."""
  part = lambda t: f"{t.chunk}x{t.block_v} c{t.channels} {t.num_warps}w {t.num_stages}s"
  return f"pallas_fused (fwd {part(tiles.forward)}, dq {part(tiles.dq)}, dkv {part(tiles.dkv)})"


def fused_tuning_cases(batch: int, length: int, dtype) -> tuple[tuple, dict, dict]:
  """(args, cases, flops) of the SANATAN p = 1 fused-chunk kernels at every FUSED_TUNING tiling."""
  from sanatan_jax.ops.sanatan_attention import pallas_triton_fused as fused

  args = _sanatan_args(batch, length, dtype)
  cases, flops = {}, {}
  for tiles in FUSED_TUNING:
    name = _fused_name(tiles)
    cases[name] = lambda q, k, v, w, l, tiles=tiles: fused.sanatan_fused_pallas(q, k, v, w, l,
                                                                                tiles=tiles)[0]
    flops[name] = chunked_flops(batch, length, HEADS, 6 * HEAD_DIM, HEAD_DIM, chunk=tiles.forward.chunk)
  return args, cases, flops


def _setting_name(setting: dict) -> str:
  """"pallas_triton (C=32, 8 warps, block_v 64)" for a TUNING entry."""
  parts = [f"C={setting['chunk_size']}", f"{setting['num_warps']} warps"]
  parts += [f"{key} {value}" for key, value in setting.items() if key not in ("chunk_size", "num_warps")]
  return f"pallas_triton ({', '.join(parts)})"


def taylor_blocked_tuning_cases(batch: int, length: int, dtype) -> tuple[tuple, dict, dict]:
  """(args, cases, flops) of the blocked Taylor kernels at every TAYLOR_BLOCKED_TUNING setting."""
  from based_jax.ops.taylor_attention import pallas_triton_blocked as blocked

  args, _, flops = taylor_cases(batch, length, dtype)
  cases = {}
  for block_q, block_k, warps, stages in TAYLOR_BLOCKED_TUNING:
    name = f"pallas_blocked ({block_q}x{block_k} {warps}w {stages}s)"
    cases[name] = functools.partial(
        lambda q, k, v, **knobs: blocked.taylor_linear_attention_blocked(q, k, v, **knobs)[0],
        block_q=block_q, block_k=block_k, num_warps=warps, num_stages=stages)
  return args, cases, {name: flops["pallas_blocked"] for name in cases}


def _taylor_fused_name(entry) -> str:
  """"pallas_fused (C=64, F=64, BV=64, fwd 4w 2s, dq ..., dkv ..., intra ...)" for a
  TAYLOR_FUSED_TUNING entry."""
  kernels = ", ".join(f"{name} {w}w {s}s" for name, (w, s) in zip(("fwd", "dq", "dkv", "intra"), entry[3:]))
  return f"pallas_fused (C={entry[0]}, F={entry[1]}, BV={entry[2]}, {kernels})"


def taylor_fused_tuning_cases(batch: int, length: int, dtype) -> tuple[tuple, dict, dict]:
  """(args, cases, flops) of the fused-chunk Taylor kernels at every TAYLOR_FUSED_TUNING tiling."""
  from based_jax.ops.taylor_attention import pallas_triton_fused as fused

  args, _, flops = taylor_cases(batch, length, dtype)
  cases = {}
  for entry in TAYLOR_FUSED_TUNING:
    tiles = fused.FusedTiles(*entry)
    cases[_taylor_fused_name(entry)] = (
        lambda q, k, v, tiles=tiles: fused.taylor_fused_pallas(q, k, v, tiles=tiles)[0])
  return args, cases, {name: flops["pallas_fused"] for name in cases}


def spans_tuning_cases(op_name: str, batch: int, length: int, dtype) -> tuple[tuple, dict, dict]:
  """(args, cases, flops) of the fused-chunk kernels of "sanatan_p1_spans" or "taylor_spans" at every
  SPANS_TUNING count that cuts ``length`` into spans of whole chunks, SPANS_MIN_LENGTH or longer."""
  from based_jax.ops.taylor_attention import pallas_triton_fused as taylor_fused
  from sanatan_jax.ops.sanatan_attention import pallas_triton_fused as fused

  if op_name == "sanatan_p1_spans":
    args, _, flops = sanatan_cases(batch, length, dtype)
    chunk = fused.FusedTiles().forward.chunk
    run = lambda count: lambda q, k, v, w, l: fused.sanatan_fused_pallas(
        q, k, v, w, l, tiles=fused.FusedTiles(spans=count))[0]
  else:
    args, _, flops = taylor_cases(batch, length, dtype)
    chunk = taylor_fused.FusedTiles().chunk
    run = lambda count: lambda q, k, v: taylor_fused.taylor_fused_pallas(
        q, k, v, tiles=taylor_fused.FusedTiles(spans=count))[0]
  counts = [G for G in SPANS_TUNING if length % (G * chunk) == 0 and length // G >= SPANS_MIN_LENGTH]
  cases = {f"pallas_fused (spans={G})": run(G) for G in counts}
  return args, cases, {name: flops["pallas_fused"] for name in cases}


def tuning_cases(op_name: str, batch: int, length: int, dtype) -> tuple[tuple, dict, dict]:
  """(args, cases, flops) of the Triton kernel of ``op_name`` at every TUNING setting; for
  "sanatan_p2", the flash kernel at every FLASH_TUNING tiling; for "sanatan_p1_fused", the
  fused-chunk kernel at every FUSED_TUNING tiling; for "sanatan_p1_spans" and "taylor_spans", the
  fused-chunk kernels at every SPANS_TUNING count (``spans_tuning_cases``)."""
  from lmcore.ops.gated_linear_attention import pallas_triton as pallas
  from lmcore.ops.gated_linear_attention.base import run_backend

  if op_name == "sanatan_p2":
    return flash_tuning_cases(batch, length, dtype)
  if op_name == "sanatan_p1_fused":
    return fused_tuning_cases(batch, length, dtype)
  if op_name == "taylor_blocked":
    return taylor_blocked_tuning_cases(batch, length, dtype)
  if op_name == "taylor_fused":
    return taylor_fused_tuning_cases(batch, length, dtype)
  if op_name in ("sanatan_p1_spans", "taylor_spans"):
    return spans_tuning_cases(op_name, batch, length, dtype)
  if op_name not in TUNING:
    raise ValueError(f"no tuning settings for op {op_name!r}; tunable: "
                     f"{', '.join([*TUNING, 'sanatan_p2', 'sanatan_p1_fused', *TUNED_OPS])}")
  args, _, _ = OPS[op_name](batch, length, dtype)
  kernels = {"gated": lambda *a, **setting: run_backend(functools.partial(pallas.chunked, **setting), *a)}
  kernel = kernels[op_name]
  features = HEAD_DIM
  cases, flops = {}, {}
  for setting in TUNING[op_name]:
    name = _setting_name(setting)
    cases[name] = lambda *a, setting=setting: kernel(*a, **setting)[0]
    flops[name] = chunked_flops(batch, length, HEADS, features, HEAD_DIM, chunk=setting["chunk_size"])
  return args, cases, flops


OPS = {"sanatan_p1": sanatan_cases, "sanatan_p2": sanatan_p2_cases, "gated": gated_cases,
       "taylor": taylor_cases, "softmax": softmax_cases}
REFERENCE = {"sanatan_p1": "chunked (xla)", "sanatan_p2": "parallel (xla)", "gated": "chunked (xla)",
             "taylor": "chunked (xla)"}
# The forms "auto" chooses between on a GPU (``--auto_only`` times only these): the XLA form it falls
# back to first (SANATAN p = 1: at its heuristic chunk; a row's ratio reference when REFERENCE's
# case was not timed), then the kernels it may pick. Ops not listed keep every case.
AUTO_CASES = {"sanatan_p1": (SANATAN_CHUNKED, "pallas_fused"),
              "sanatan_p2": ("parallel (xla)", "pallas_flash"),
              "gated": ("chunked (xla)", "pallas_triton"),
              "taylor": ("chunked (xla)", "pallas_blocked", "pallas_fused")}


def _decisive_first(op_name: str, cases: dict) -> dict:
  """``cases`` reordered to time first the forms "auto" chooses between (AUTO_CASES), then the op's
  REFERENCE, then the rest in their order: a run cut short by its time limit loses the least needed
  rows)."""
  first = [name for name in (*AUTO_CASES.get(op_name, ()), REFERENCE.get(op_name)) if name in cases]
  return {**{name: cases[name] for name in first},
          **{name: fn for name, fn in cases.items() if name not in first}}


def _op_cases(op_name: str, batch: int, length: int, dtype, shape: HeadShape | None, tune: bool,
              auto_only: bool, only: tuple[str, ...] = ()) -> tuple[tuple, dict, dict]:
  """(args, cases, flops) of one op and shape: ``tune``, its TUNING settings (default shape);
  ``auto_only``, only its AUTO_CASES; ``only``, only the cases of those names (() = every one)."""
  if tune:
    return tuning_cases(op_name, batch, length, dtype)
  args, cases, flops = OPS[op_name](batch, length, dtype, shape)
  cases = _decisive_first(op_name, cases)
  if auto_only and op_name in AUTO_CASES:
    cases = {name: fn for name, fn in cases.items() if name in AUTO_CASES[op_name]}
  if only:
    cases = {name: fn for name, fn in cases.items() if name in only}
  return args, cases, flops


def run_op(log: RowLog, op_name: str, length: int, tokens: int, dtype: str, repeats: int,
           lock: str = "", tune: bool = False, shape: HeadShape | None = None,
           auto_only: bool = False, only: tuple[str, ...] = (), queues: tuple[int, ...] = (1,)) -> None:
  """Times every case of ``op_name`` (``tune``: its TUNING settings instead; ``auto_only``: its
  AUTO_CASES; ``only``: the cases of those names) at one length and head ``shape`` (None: the
  default), a row per queue depth of ``queues`` (calls per wait, ``time_fn``)."""
  batch = max(1, tokens // length)
  args, cases, flops = _op_cases(op_name, batch, length, jnp.dtype(dtype), shape, tune, auto_only,
                                 only)
  label = shape_label(op_name, shape)
  for impl, fn in cases.items():
    for queue in queues:
      measure(log, TUNED_OPS.get(op_name, op_name), impl, length, batch, fn,
              lambda fn, queue=queue: time_fwd_bwd(fn, args, repeats, lock, queue=queue), flops[impl],
              shape=label, queue=queue)


def fla_rows(log: RowLog, ops: list[str], length: int, tokens: int, repeats: int, lock: str = "",
             queues: tuple[int, ...] = (1,)) -> None:
  """flash-linear-attention on the same shapes, for ``ops`` (torch + fla importable, CUDA only), a row
  per queue depth."""
  from benchmarks import fla as bench_fla  # torch-side code kept apart from the JAX ops

  for queue in queues:
    bench_fla.run(log, ops, length, tokens, repeats, time_fwd_bwd, lock, queue=queue)


def _reference_row(by_key: dict, row: Row) -> Row | None:
  """The row ``row`` is compared with: its op's REFERENCE case, else the XLA form of its AUTO_CASES, at
  the same length and head shape."""
  for impl in (REFERENCE.get(row.op), AUTO_CASES.get(row.op, (None,))[0]):
    ref = by_key.get((row.op, impl, row.length, row.shape, row.queue))
    if ref is not None:
      return ref
  return None


def with_ratios(rows: list[Row]) -> list[Row]:
  """Ratio of each row's fwd+bwd time to the reference implementation of its op, length and head shape,
  and of every op to cuDNN softmax (its default shape) at the same length."""
  by_key = {r.key: r for r in rows}
  softmax = {(r.length, r.queue): r for r in rows if r.op == "softmax" and not r.shape}
  for r in rows:
    ref = _reference_row(by_key, r) or softmax.get((r.length, r.queue))
    if ref is not None and ref is not r and r.fwdbwd_ms and ref.fwdbwd_ms:
      r.reference = f"{ref.op}/{ref.impl}"
      r.ratio_fwdbwd = ref.fwdbwd_ms / r.fwdbwd_ms
    sm = softmax.get((r.length, r.queue))
    if sm is not None and r.op != "softmax" and r.fwdbwd_ms and sm.fwdbwd_ms:
      r.vs_softmax = sm.fwdbwd_ms / r.fwdbwd_ms
  return rows


def run_all(*, ops: list[str], lengths: list[int], tokens: int, dtype: str, repeats: int,
            fla_ops: list[str], jsonl: str = "", lock: str = "", tune: list[str] = (),
            shapes: list[str] = ("default",), auto_only: bool = False,
            only: tuple[str, ...] = (), queues: tuple[int, ...] = (1,)) -> list[Row]:
  """Every op at every length and head shape of the sets ``shapes`` (``shapes_for``; ``auto_only``:
  only the forms "auto" chooses between, AUTO_CASES; ``only``: only the cases of those names), the
  TUNING settings of the ops in ``tune``, then
  FLA's kernels for ``fla_ops`` (default shapes), a row per queue depth of ``queues`` (calls per wait,
  ``time_fn``); rows already in ``jsonl`` are kept and not measured again. Timing holds ``lock`` (see
  ``exclusive``)."""
  plan = {op_name: shapes_for(op_name, shapes) for op_name in ops}  # bad set names fail before timing
  log = RowLog(jsonl)
  for length in lengths:
    for op_name in ops:
      for shape in plan[op_name]:
        run_op(log, op_name, length, tokens, dtype, repeats, lock, shape=shape, auto_only=auto_only,
               only=only, queues=queues)
    for op_name in tune:
      run_op(log, op_name, length, tokens, dtype, repeats, lock, tune=True, queues=queues)
    if fla_ops:
      try:
        fla_rows(log, fla_ops, length, tokens, repeats, lock, queues)
      except ImportError as e:
        print(f"  FLA skipped at T={length}: {e}", flush=True)
  return with_ratios([r for r in log.rows if r.length in lengths])


def _heads(row: Row) -> str:
  """The head shape of ``row`` for a table: its label, or its op's default shape's."""
  default = DEFAULT_SHAPES.get(row.op)
  return row.shape or (default.label if default else "")


def format_table(rows: list[Row]) -> str:
  """The rows as a markdown table; with a "heads" column when any row has a non-default head shape and
  a "calls per wait" column when any row was timed with calls queued (``time_fn``)."""
  def ms(x):
    return "—" if x is None else f"{x:.3f}"

  shaped, queued = any(r.shape for r in rows), any(r.queue > 1 for r in rows)
  heads = lambda r: f" {_heads(r)} |" if shaped else ""
  queue = lambda r: f" {r.queue} |" if queued else ""
  lines = ["| op | implementation |" + (" heads |" if shaped else "") + " T | B |"
           + (" calls per wait |" if queued else "") + " fwd ms | fwd+bwd ms | "
           "tok/s (fwd+bwd) | TFLOP/s (fwd+bwd) | speed-up vs | vs softmax | note |",
           "|---|---|" + ("---|" if shaped else "") + "---|---|" + ("---|" if queued else "")
           + "---|---|---|---|---|---|---|"]
  for r in rows:
    tokens_per_s = "—" if not r.fwdbwd_ms else f"{r.batch * r.length / r.fwdbwd_ms * 1e3:,.0f}"
    tflops = "—" if not r.fwdbwd_ms or not r.flops_fwd else f"{3 * r.flops_fwd / r.fwdbwd_ms / 1e9:.1f}"
    ratio = "" if r.ratio_fwdbwd is None else f"{r.ratio_fwdbwd:.2f}× {r.reference}"
    vs_softmax = "" if r.vs_softmax is None else f"{r.vs_softmax:.2f}×"
    lines.append(f"| {r.op} | {r.impl} |{heads(r)} {r.length} | {r.batch} |{queue(r)} {ms(r.fwd_ms)} | "
                 f"{ms(r.fwdbwd_ms)} | {tokens_per_s} | {tflops} | {ratio} | {vs_softmax} | {r.note} |")
  return "\n".join(lines)


def _file_order(path: str) -> tuple:
  """``kernels_<T>.jsonl`` by T first, then the other files (``fla.jsonl``) by name."""
  name = os.path.basename(path)
  return (not name.startswith("kernels_"), [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])


def holds_timing_rows(path: str) -> bool:
  """Whether the first row of the JSONL file ``path`` is a kernel timing row (``Row``'s fields), not,
  say, a train-step or agreement row kept in the same directory; an empty file counts as one."""
  with open(path) as f:
    first = next((line for line in f if line.strip()), None)
  fields = {field.name for field in dataclasses.fields(Row)}
  return first is None or set(json.loads(first)) <= fields


def load_rows(directory: str, skip: tuple[str, ...] = ("agreement.jsonl",),
              on_skipped: Callable[[str], None] | None = None) -> list[Row]:
  """Every Row of the ``*.jsonl`` files in ``directory`` that hold timing rows (``holds_timing_rows``;
  those named in ``skip`` aside; ``on_skipped`` is called with the path of every other file), the last row of
  each (op, implementation, length, shape, queue depth) winning, sorted by length, then op (softmax first,
  then as in ``OPS``), then head shape (the default first, then in order of first appearance), then
  implementation in order of first appearance, then queue depth. Ratios are cleared (see
  ``with_ratios``)."""
  merged = {}
  paths = [p for p in glob.glob(os.path.join(directory, "*.jsonl")) if os.path.basename(p) not in skip]
  for path in sorted(paths, key=_file_order):
    if not holds_timing_rows(path):
      if on_skipped:
        on_skipped(path)
      continue
    for row in RowLog(path).rows:
      merged[row.key] = dataclasses.replace(row, reference="", ratio_fwdbwd=None, vs_softmax=None)
  op_order = ["softmax", *(op for op in OPS if op != "softmax")]
  impl_order, shape_order = {}, {"": 0}
  for row in merged.values():
    impl_order.setdefault((row.op, row.impl), len(impl_order))
    shape_order.setdefault(row.shape, len(shape_order))

  def key(row):
    op_rank = op_order.index(row.op) if row.op in op_order else len(op_order)
    return row.length, op_rank, row.op, shape_order[row.shape], impl_order[row.op, row.impl], row.queue

  return sorted(merged.values(), key=key)


def append_markdown(path: str, tables: list[str], date: str, device: str, commands: list[str],
                    via: str = "", topic: str = "kernels") -> None:
  """Appends one dated block to ``path`` (started with a title when new): the header ``## DATE — TOPIC
  on DEVICE (VIA)``, the commands that made it, then the tables."""
  header = "" if os.path.exists(path) else "# Benchmarks\n\nDated measurements; each block names its device and command.\n"
  title = f"## {date} — {topic} on {device}" + (f" ({via})" if via else "")
  command_line = ", then ".join(f"`{c}`" for c in commands)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    f.write(f"{header}\n{title}\n\n{command_line}\n\n" + "\n\n".join(tables) + "\n")
