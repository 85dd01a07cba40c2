"""Timing library behind ``scripts/bench_xla_forms.py``: the XLA forms that "auto" runs on TPUs and CPUs,
each beside the form it should keep up with, timed in one process on the same inputs.

  * SANATAN p = 1: the plain einsum form (``benchmarks.plain_chunked``: no documents, no state, no
    recomputation) at chunks of 64 and 128 against the op's "chunked" at the same chunks, with and
    without ``chunked_remat``; target: the default form (``xla.CHUNK``, ``Options.remat``) <= the faster
    plain form at every length.
  * Taylor (BASED): "chunked" at chunks of 128 and 256 with its recomputing backward, and at its
    default chunk without it (``xla.chunked``'s ``remat``), against the kernel "auto" picks on this
    platform; target: <= 2x the kernel. Without a kernel (a CPU) the kernel's row says so.
  * GLA at wide heads (``GLA_SHAPES``): "chunked" against flash-linear-attention's ``chunk_gla`` (torch,
    on a CUDA GPU), whose row says why it is missing where fla is not importable.

Each row is forward and forward+backward in ms, timed by ``harness.time_fwd_bwd`` (the value and gradient
of Σ o · do with respect to every input, ``queue`` calls per wait), and the ratio of its forward+backward
time to its reference row's. Rows carry the device and the command that made them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks import harness, rows

LENGTHS = (2048, 32768)
TOKENS = 16384  # per batch: B = max(1, TOKENS // T)
SANATAN_CHUNKS = (64, 128)  # the plain and chunked SANATAN forms' chunks
TAYLOR_CHUNKS = (128, 256)  # Taylor "chunked" with its recomputing backward
FLA_GLA = "FLA chunk_gla"


@dataclasses.dataclass(frozen=True)
class Heads:
  """H heads of key width K and value width V."""

  heads: int
  key: int
  value: int

  @property
  def label(self) -> str:
    return f"H={self.heads} K={self.key} V={self.value}"


SANATAN_HEADS = Heads(12, 64, 64)  # the 184M model's
TAYLOR_HEADS = Heads(16, 16, 64)  # BASED 360M's: feature dim d' = 16, 16 heads of 64 at D = 1024
# Wide heads, K 192 x V 384 (2 heads at D = 768), and the gla_182m preset's own 4 heads of 96 x 192.
GLA_SHAPES = (Heads(2, 192, 384), Heads(4, 96, 192))
TINY = {"sanatan_p1": Heads(2, 8, 8), "taylor": Heads(2, 4, 8), "gla": (Heads(2, 8, 16),)}
TINY_LENGTH = 128


@dataclasses.dataclass
class FormRow:
  """One timed form; ``reference`` names the row of the same op, length and heads it is compared with
  (``vs_reference``: that row's forward+backward ms over this one's, > 1 is faster)."""

  op: str
  form: str
  length: int
  batch: int
  heads: str
  fwd_ms: float | None = None
  fwdbwd_ms: float | None = None
  reference: str = ""
  vs_reference: float | None = None
  device: str = ""
  command: str = ""
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Case:
  """A form of an op: ``fn(*args) -> o``, or a reason it cannot run here; ``torch``: ``fn`` takes CUDA
  torch copies of the arguments."""

  form: str
  fn: Callable | str
  reference: str = ""
  torch: bool = False


def _randn(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def plain_name(chunk: int) -> str:
  return f"plain einsum (C={chunk})"


def sanatan_cases(batch: int, length: int, heads: Heads, dtype) -> tuple[tuple, list[Case]]:
  """SANATAN p = 1: the plain form and "chunked" with and without its recomputing backward, at each of
  ``SANATAN_CHUNKS`` up to T; each chunked form is compared with the plain one of its chunk."""
  from benchmarks.plain_chunked import plain_chunked
  from lmcore.ops.common.backend import ChunkTiles
  from sanatan_jax.ops.sanatan_attention import sanatan_attention

  H, d, V = heads.heads, heads.key, heads.value
  keys = jax.random.split(jax.random.key(0), 5)
  args = (_randn(keys[0], (batch, length, H, d), dtype, d ** -0.5),
          _randn(keys[1], (batch, length, H, d), dtype, d ** -0.5),
          _randn(keys[2], (batch, length, H, V), dtype),
          jnp.full((H, d), jnp.pi / 4, jnp.float32), _randn(keys[4], (H, d), jnp.float32))

  def chunked(chunk, remat):
    return lambda q, k, v, omega, lam_raw: sanatan_attention(
        q, k, v, omega, lam_raw, implementation="chunked", tiles=ChunkTiles(chunk), chunked_remat=remat)[0]

  cases = []
  for chunk in (c for c in SANATAN_CHUNKS if c <= length):
    plain = (functools.partial(plain_chunked, chunk_size=chunk) if length % chunk == 0
             else f"T={length} is not a multiple of the plain form's chunk")
    cases += [Case(plain_name(chunk), plain),
              Case(f"chunked (C={chunk}, remat)", chunked(chunk, True), plain_name(chunk)),
              Case(f"chunked (C={chunk}, no remat)", chunked(chunk, False), plain_name(chunk))]
  return args, cases


def taylor_cases(batch: int, length: int, heads: Heads, dtype) -> tuple[tuple, list[Case]]:
  """Taylor: the kernel "auto" picks on this platform, "chunked" with its recomputing backward at each
  of ``TAYLOR_CHUNKS`` up to T, and at its default chunk without it."""
  from based_jax.ops.taylor_attention import REGISTRY, problem, taylor_linear_attention
  from based_jax.ops.taylor_attention import xla

  H, d, V = heads.heads, heads.key, heads.value
  keys = jax.random.split(jax.random.key(0), 3)
  args = (_randn(keys[0], (batch, length, H, d), dtype, 0.5),
          _randn(keys[1], (batch, length, H, d), dtype, 0.5), _randn(keys[2], (batch, length, H, V), dtype))

  def chunked(chunk, remat):
    return lambda q, k, v: xla.chunked(q, k, v, chunk=chunk, remat=remat)[0]

  kernel = REGISTRY.resolve_name("auto", problem(args[0], args[2]))
  if kernel == "chunked":
    kernel_case = Case("kernel", f"no kernel on {jax.default_backend()}: 'auto' runs chunked")
  else:
    kernel_case = Case(f"kernel ({kernel})",
                       lambda q, k, v: taylor_linear_attention(q, k, v, implementation=kernel)[0])
  variants = [(chunk, True) for chunk in TAYLOR_CHUNKS if chunk <= length]
  variants += [(xla.CHUNK, False)] if xla.CHUNK <= length else []
  return args, [kernel_case] + [Case(f"chunked (C={chunk}, {'remat' if remat else 'no remat'})",
                                     chunked(chunk, remat), kernel_case.form) for chunk, remat in variants]


def gla_cases(batch: int, length: int, heads: Heads, dtype) -> tuple[tuple, list[Case]]:
  """GLA (per-channel gates): FLA's ``chunk_gla`` where importable, and "chunked"."""
  from lmcore.ops.gated_linear_attention import gated_linear_attention

  H, K, V = heads.heads, heads.key, heads.value
  keys = jax.random.split(jax.random.key(0), 4)
  args = (_randn(keys[0], (batch, length, H, K), dtype, K ** -0.5),
          _randn(keys[1], (batch, length, H, K), dtype, K ** -0.5),
          _randn(keys[2], (batch, length, H, V), dtype),
          jax.nn.log_sigmoid(_randn(keys[3], (batch, length, H, K), jnp.float32) + 4.0) / 16)
  chunked = lambda q, k, v, g: gated_linear_attention(q, k, v, g, implementation="chunked")[0]
  return args, [fla_gla_case(), Case("chunked", chunked, FLA_GLA)]


def fla_gla_case() -> Case:
  """FLA's ``chunk_gla`` on torch copies of the inputs, or why it cannot run here."""
  try:
    import torch
    from fla.ops.gla import chunk_gla
  except ImportError as e:
    return Case(FLA_GLA, f"skipped: flash-linear-attention is not importable ({e.name})")
  if not torch.cuda.is_available():
    return Case(FLA_GLA, "skipped: no CUDA device for torch")
  return Case(FLA_GLA, lambda q, k, v, g: chunk_gla(q, k, v, g)[0], torch=True)


def _torch_copies(args: tuple) -> list:
  """CUDA torch copies of JAX arrays (bf16 stays bf16, the rest fp32)."""
  import numpy as np
  import torch

  return [torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda().to(
      torch.bfloat16 if a.dtype == jnp.bfloat16 else torch.float32) for a in args]


OPS = {"sanatan_p1": sanatan_cases, "taylor": taylor_cases, "gla": gla_cases}


def op_heads(op: str, tiny: bool) -> tuple[Heads, ...]:
  if tiny:
    shapes = TINY[op]
    return shapes if isinstance(shapes, tuple) else (shapes,)
  return {"sanatan_p1": (SANATAN_HEADS,), "taylor": (TAYLOR_HEADS,), "gla": GLA_SHAPES}[op]


def load(path: str) -> dict[tuple, FormRow]:
  """Rows of a JSONL file by (op, form, length, heads), timed ones only (a failed row is run again)."""
  found = {}
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = FormRow(**json.loads(line))
          if row.fwdbwd_ms is not None:
            found[row.op, row.form, row.length, row.heads] = row
  return found


def run(ops=tuple(OPS), lengths=LENGTHS, tokens: int = TOKENS, dtype="bfloat16", repeats: int = 10,
        queue: int = 8, tiny: bool = False, jsonl: str = "", command: str = "") -> list[FormRow]:
  """Every op x length x head shape, one after another in this process; rows already timed in ``jsonl``
  are kept, and every new row is appended to it as soon as it is measured. A form that fails (out of
  memory, say) is a row with a note."""
  done, out = load(jsonl), []
  device = rows.device_name()
  for op in ops:
    for length in lengths:
      for heads in op_heads(op, tiny):
        batch = max(1, tokens // length)
        args, cases = OPS[op](batch, length, heads, jnp.dtype(dtype))
        for case in cases:
          key = (op, case.form, length, heads.label)
          row = done.get(key) or _measure(case, args, repeats, queue, FormRow(
              op, case.form, length, batch, heads.label, reference=case.reference, device=device,
              command=command), jsonl)
          out.append(row)
  return with_ratios(out)


def _measure(case: Case, args: tuple, repeats: int, queue: int, row: FormRow, jsonl: str) -> FormRow:
  if isinstance(case.fn, str):
    row.note = case.fn
  else:
    try:
      inputs = _torch_copies(args) if case.torch else args
      row.fwd_ms, row.fwdbwd_ms = harness.time_fwd_bwd(case.fn, inputs, repeats, queue=queue)
    except Exception as e:  # an out-of-memory error, say: a row with the reason, and on to the next
      row.note = f"{type(e).__name__}: {str(e)[:100]}"
  print(f"  {row.op} {row.form} [{row.heads}] T={row.length}: {row.fwd_ms} / {row.fwdbwd_ms} ms {row.note}",
        flush=True)
  if jsonl:
    rows.append_row(jsonl, row)
  return row


def with_ratios(found: list[FormRow]) -> list[FormRow]:
  """Sets each row's ``vs_reference`` from its reference row's forward+backward time."""
  by_key = {(r.op, r.form, r.length, r.heads): r for r in found}
  for r in found:
    ref = by_key.get((r.op, r.reference, r.length, r.heads))
    if ref is not None and ref.fwdbwd_ms and r.fwdbwd_ms:
      r.vs_reference = ref.fwdbwd_ms / r.fwdbwd_ms
  return found


def format_table(found: list[FormRow]) -> str:
  """The rows as a Markdown table."""
  lines = ["| op | form | heads | T | B | fwd ms | fwd+bwd ms | vs reference (fwd+bwd) | note |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in found:
    ratio = "" if r.vs_reference is None else f"{r.vs_reference:.2f}× {r.reference}"
    lines.append(f"| {r.op} | {r.form} | {r.heads} | {r.length} | {r.batch} | {rows.fmt(r.fwd_ms, '.3f')} | "
                 f"{rows.fmt(r.fwdbwd_ms, '.3f')} | {ratio} | {r.note} |")
  return "\n".join(lines)
