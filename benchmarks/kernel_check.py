"""Compiled Pallas kernels against the XLA paths on the same inputs.

For every op of ``benchmarks.harness`` with kernels, every ``pallas*`` case is compared with the op's XLA
reference case (``bench.REFERENCE``): the output o and the gradient of ``sum(o · do)`` with respect to
every input, as relative L2 ``||a - b|| / ||b||``. As in FLA's tests (fla.md §3), the reference is
computed in fp32 — from the same inputs upcast, when the kernel runs in bf16 — at full fp32 matmul
precision (GPUs otherwise use TF32 for fp32 dots), so a bf16 row measures the kernel's own rounding.
A row passes when its largest error is within the limit of its dtype (1e-5 in fp32; 2e-3 in
bf16) or, in bf16, no larger than the XLA reference's own largest error in bf16: a kernel that rounds
its dot operands to bf16 as XLA does cannot be asked to round less. For scale, a bf16 row also reports
that XLA error and the rounding floor: the largest error of the fp32 reference's own results merely rounded to bf16, which no
bf16 kernel can go below. (A kernel with bf16 outputs also gets a bf16 output gradient, which puts its
input gradients about √2 times the floor away even with exact arithmetic; the ``<kernel> (tf32)`` and
``<kernel> (float32)`` cases, ``kernel_precision`` other than "input", return fp32 and reach the floor.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp

from benchmarks import harness as bench
from lmcore.numerics import relative_l2

LIMITS = {"float32": 1e-5, "bfloat16": 2e-3}
CHECKED_OPS = ("sanatan_p1", "sanatan_p2", "gated", "taylor")


@dataclasses.dataclass
class Agreement:
  op: str
  impl: str
  reference: str
  dtype: str
  length: int
  batch: int
  output_rel: float | None
  grad_rel: dict[str, float] | None
  limit: float
  xla_worst: float | None = None  # the XLA reference in the same dtype against fp32 (bf16 rows)
  rounding_floor: float | None = None  # the fp32 reference's results rounded to dtype (bf16 rows)
  note: str = ""

  @property
  def worst(self) -> float | None:
    if self.output_rel is None:
      return None
    return max([self.output_rel, *self.grad_rel.values()])

  @property
  def passed(self) -> bool:
    """Within ``limit``, or (bf16 rows) no worse than the XLA path in the same dtype."""
    return self.worst is not None and self.worst <= max(self.limit, self.xla_worst or 0.0)


def output_and_grads(fn: Callable, args: tuple, precision: str | None = None):
  """o = fn(*args) and d sum(o · do) / d args (do fixed, standard normal, fp32) by the benchmarks'
  ``bench.fwd_bwd``, the function they time."""
  with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
    o = jax.jit(fn)(*args)
    do = jax.random.normal(jax.random.key(7), o.shape, jnp.float32)
    _, grads = jax.jit(bench.fwd_bwd(fn, len(args)))(do, *args)
  return o, grads


def rounding_floor(ref_o: jax.Array, ref_grads: tuple, dtype: str) -> float:
  """max over o and the gradients of ||round_dtype(x) - x|| / ||x||: the error of a perfect kernel
  that returns its results in ``dtype``."""
  return max(relative_l2(x.astype(dtype).astype(jnp.float32), x) for x in (ref_o, *ref_grads))


def check_op(op_name: str, length: int, batch: int, dtype: str) -> list[Agreement]:
  """Every ``pallas*`` case of ``op_name`` against its XLA reference case."""
  args, cases, _ = bench.OPS[op_name](batch, length, jnp.dtype(dtype))
  reference = bench.REFERENCE[op_name]
  ref_args = tuple(a.astype(jnp.float32) for a in args)
  ref_o, ref_grads = output_and_grads(cases[reference], ref_args, "highest")
  names = [f"d_arg{i}" for i in range(len(args))]

  def errors(o, grads):
    return relative_l2(o, ref_o), {n: relative_l2(g, r) for n, g, r in zip(names, grads, ref_grads)}

  xla_worst = floor = None
  if dtype != "float32":
    xla_out, xla_grads = errors(*output_and_grads(cases[reference], args))
    xla_worst = max([xla_out, *xla_grads.values()])
    floor = rounding_floor(ref_o, ref_grads, dtype)
  rows = []
  for impl, fn in cases.items():
    if not impl.startswith("pallas"):
      continue
    row = Agreement(op_name, impl, reference, dtype, length, batch, None, None, LIMITS[dtype], xla_worst,
                    floor)
    if isinstance(fn, str):
      row.note = fn
    else:
      try:
        row.output_rel, row.grad_rel = errors(*output_and_grads(fn, args))
      except Exception as e:  # A kernel that fails to compile is a row, not the end of the check.
        row.note = f"{type(e).__name__}: {str(e)[:120]}"
    rows.append(row)
  return rows


def load(path: str) -> list[Agreement]:
  if not path or not os.path.exists(path):
    return []
  with open(path) as f:
    return [Agreement(**json.loads(line)) for line in f if line.strip()]


def run(*, ops: list[str], dtypes: list[str], length: int, batch: int, jsonl: str = "",
        lock: str = "") -> list[Agreement]:
  """All checks; (op, dtype) pairs already in ``jsonl`` are kept, new rows appended as made. Each
  (op, dtype) holds ``lock`` shared (``rows.shared``): benchmark processes on the device wait to time."""
  rows = load(jsonl)
  done = {(r.op, r.dtype, r.length, r.batch) for r in rows}
  for dtype in dtypes:
    for op_name in ops:
      if (op_name, dtype, length, batch) in done:
        continue
      with bench.shared(lock):
        new = check_op(op_name, length, batch, dtype)
      for row in new:
        print(f"  {row.op} {row.impl} {row.dtype}: worst {row.worst} (limit {row.limit}) {row.note}",
              flush=True)
      rows += new
      if jsonl:
        os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
        with open(jsonl, "a") as f:
          f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in new)
  return rows


def _sci(x: float | None) -> str:
  return "" if x is None else f"{x:.1e}"


def format_table(rows: list[Agreement]) -> str:
  lines = ["| op | kernel | vs (fp32) | dtype | T | B | output rel L2 | worst gradient rel L2 | limit | pass | "
           "XLA path's own worst | rounding floor | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    out = "—" if r.output_rel is None else f"{r.output_rel:.1e}"
    grad = "—" if not r.grad_rel else f"{max(r.grad_rel.values()):.1e}"
    lines.append(f"| {r.op} | {r.impl} | {r.reference} | {r.dtype} | {r.length} | {r.batch} | {out} | "
                 f"{grad} | {r.limit:.0e} | {'yes' if r.passed else 'NO'} | "
                 f"{_sci(r.xla_worst)} | {_sci(r.rounding_floor)} | {r.note} |")
  return "\n".join(lines)
