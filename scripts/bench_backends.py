"""Pallas-Triton vs Pallas Mosaic GPU, by measurement, on one op (``benchmarks/backend_probe.py``).

The op is the intra-chunk block of causal linear attention, o_n = mask_causal(q_n k_nᵀ) v_n per
(batch·head, chunk), C = 64, K = V = 64, bf16 in and out, fp32 accumulation. For each T (at fixed
T·BH = ``--tokens``, so BH = tokens // T) every backend is compiled ahead of time, checked against
the fp32 XLA reference (relative L2 of the bf16 output) and timed (median of ``--repeats`` calls after
warm-up, ``benchmarks.harness.time_fn``). Counted FLOPs: 2·C·(K + V) per token, i.e. 4·BH·T·C·K with K = V
(both C×C matmuls in full; the masked half is computed too).
Forward only: the probe kernels have no backward pass (the op benchmarks time forward+backward with
``benchmarks.harness.time_fwd_bwd``).

Backends: xla (einsums with the kernels' rounding), triton (``pl.pallas_call`` + BlockSpecs),
mosaic_gpu (``plgpu.kernel``: TMA, wgmma, masked scores via SMEM) and mosaic_gpu_regs (the same with
the scores as a register wgmma operand).

    python scripts/bench_backends.py [--lengths=2048,8192] [--tokens=786432] [--repeats=20] \
        [--jsonl=PATH] [--backends=xla,triton,mosaic_gpu,mosaic_gpu_regs] [--interpret]

Every backend runs in a child process (``--isolate``, the default) with a time limit, so a kernel that
fails to lower or compile, crashes the process or hangs becomes a row with its error, not a lost run.
``--interpret`` runs the Pallas kernels on the host (Triton interpreter, Pallas' GPU interpreter for
Mosaic GPU) at small default sizes.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import harness as bench  # noqa: E402
from benchmarks import backend_probe as probe  # noqa: E402
from benchmarks import rows as rows_lib  # noqa: E402

GPU_LENGTHS, GPU_TOKENS = [2048, 8192], 96 * 8192
HOST_LENGTHS, HOST_TOKENS = [128], 3 * 128  # --interpret: an odd BH of 3, two chunks
HEAD_DIM = 64
MAX_REL_L2 = 1e-2  # bf16 rounding of scores and output gives ~3e-3
BACKENDS = ["xla", "triton", "mosaic_gpu", "mosaic_gpu_regs"]

_LENGTHS = flags.DEFINE_list("lengths", [], f"Sequence lengths T (default {GPU_LENGTHS}, {HOST_LENGTHS} "
                             "with --interpret).")
_TOKENS = flags.DEFINE_integer("tokens", 0, f"T·BH, fixed across T (default {GPU_TOKENS}, {HOST_TOKENS} "
                               "with --interpret).")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls (median reported).")
_BACKENDS = flags.DEFINE_list("backends", BACKENDS, "Backends to measure.")
_JSONL = flags.DEFINE_string("jsonl", "", "Rows are written here as JSON lines ('' = none).")
_INTERPRET = flags.DEFINE_boolean("interpret", False, "Run the Pallas kernels in interpret mode (CPU).")
_ISOLATE = flags.DEFINE_boolean("isolate", True, "One child process per backend (errors, crashes and "
                                "hangs become rows).")
_CHILD_TIMEOUT = flags.DEFINE_integer("child_timeout", 150, "Seconds a backend's child process may run.")
_LOCK = flags.DEFINE_string("lock", "", "A lock file shared with other benchmark processes on the device: "
                            "timing holds it (benchmarks.harness.exclusive).")
_CHILD = flags.DEFINE_boolean("child", False, "Set by --isolate for its children: measure here, rows to "
                              "--jsonl only (no table).")


@dataclasses.dataclass
class Row:
  backend: str
  length: int
  bh: int
  ms: float | None = None
  tflops: float | None = None
  rel_l2: float | None = None
  status: str = "error"  # ok | mismatch | error | skipped
  note: str = ""
  device: str = ""


def flops(bh: int, length: int, chunk: int = probe.CHUNK, width: int = HEAD_DIM) -> float:
  """4·BH·T·C·K: both [C, C] matmuls (scores, mixing) of every chunk, K = V = ``width``."""
  return 4.0 * bh * length * chunk * width


def one_line(e: BaseException, limit: int = 300) -> str:
  return f"{type(e).__name__}: {' '.join(str(e).split())}"[:limit]


def kernels(interpret: bool) -> dict:
  """Backend name -> op(q, k, v), or a string: why it is skipped here."""
  ops = {"xla": probe.intra_chunk_xla,
         "triton": functools.partial(probe.intra_chunk_triton, interpret=interpret),
         "mosaic_gpu": functools.partial(probe.intra_chunk_mosaic, interpret=interpret),
         "mosaic_gpu_regs": functools.partial(probe.intra_chunk_mosaic, scores_in_smem=False,
                                              interpret=interpret)}
  if interpret:
    ops["mosaic_gpu_regs"] = ("Pallas' GPU interpreter takes wgmma operands from SMEM only "
                              "(a register LHS fails); compiled on a GPU only")
  elif jax.default_backend() != "gpu":
    for name in ("triton", "mosaic_gpu", "mosaic_gpu_regs"):
      ops[name] = f"needs a GPU (this host: {jax.default_backend()}); --interpret runs it here"
  return ops


def inputs(bh: int, length: int):
  """q, k, v [BH, T, 64] bf16 (q scaled by 1/sqrt(K), so the scores are O(1))."""
  keys = jax.random.split(jax.random.key(0), 3)
  shape = (bh, length, HEAD_DIM)
  scales = (HEAD_DIM ** -0.5, 1.0, 1.0)
  return tuple((s * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
               for key, s in zip(keys, scales))


@jax.jit
def rel_l2(o, ref):
  o = o.astype(jnp.float32)
  return jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref)


def measure(name: str, op, args, ref, length: int, bh: int, repeats: int, lock: str = "") -> Row:
  """Compiles ``op`` ahead of time, checks it against ``ref`` and times it (holding ``lock``); any
  error becomes the row."""
  row = Row(name, length, bh, device=bench.device_name())
  if isinstance(op, str):
    return dataclasses.replace(row, status="skipped", note=op)
  try:
    compiled = jax.jit(op).lower(*args).compile()
    row.rel_l2 = float(rel_l2(compiled(*args), ref))
    with bench.exclusive(lock):
      row.ms = bench.time_fn(compiled, *args, repeats=repeats)
  except Exception as e:  # lowering, compilation or a run failed: report it, keep going
    row.note = one_line(e)
    return row
  row.tflops = flops(bh, length) / row.ms / 1e9
  row.status = "ok" if row.rel_l2 <= MAX_REL_L2 else "mismatch"
  if row.status == "mismatch":
    row.note = f"rel L2 above {MAX_REL_L2}"
  return row


def append(path: str, row: Row) -> None:
  if path:
    rows_lib.append_row(path, row)


def load(path: str) -> list[Row]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [Row(**json.loads(line)) for line in f if line.strip()]


def run(names: list[str], lengths: list[int], tokens: int, repeats: int, interpret: bool,
        jsonl: str = "", lock: str = "") -> list[Row]:
  """Every backend in ``names`` at every T in this process, each row appended to ``jsonl`` when made."""
  print(f"{bench.device_name()}; jax {jax.__version__}; C = {probe.CHUNK}, K = V = {HEAD_DIM}, "
        f"T·BH = {tokens}; FLOPs counted 4·BH·T·C·K", flush=True)
  ops, rows = kernels(interpret), []
  for length in lengths:
    bh = max(1, tokens // length)
    args = inputs(bh, length)
    ref = jax.jit(probe.intra_chunk_reference)(*args)
    for name in names:
      row = measure(name, ops[name], args, ref, length, bh, repeats, lock)
      print(f"  {row.backend} T={row.length} BH={row.bh}: {row.ms} ms, rel L2 {row.rel_l2}, {row.status} "
            f"{row.note}", flush=True)
      append(jsonl, row)
      rows.append(row)
  return rows


def run_isolated(names: list[str], lengths: list[int], tokens: int, repeats: int, interpret: bool,
                 timeout: float, lock: str = "") -> list[Row]:
  """``run`` for each backend in a child process limited to ``timeout`` seconds; the rows a child did
  not write (it crashed or hung) are error rows with its exit status and last stderr line."""
  rows = []
  for name in names:
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "rows.jsonl")
      command = [sys.executable, os.path.abspath(__file__), f"--backends={name}",
                 f"--lengths={','.join(map(str, lengths))}", f"--tokens={tokens}", f"--repeats={repeats}",
                 f"--jsonl={path}", f"--lock={lock}", "--child", "--interpret" if interpret else "--nointerpret"]
      try:
        child = subprocess.run(command, stderr=subprocess.PIPE, text=True, timeout=timeout)
        stderr, problem = child.stderr, f"child process exited with {child.returncode}"
      except subprocess.TimeoutExpired as e:
        stderr, problem = e.stderr or "", f"child process killed after {timeout} s (hung or too slow)"
      if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
      done = load(path)
      missing = [length for length in lengths if length not in {row.length for row in done}]
      if missing:
        lines = stderr.strip().splitlines() or [""]
        print(f"  {name}: {problem}; its stderr ends:", *lines[-20:], sep="\n    ", file=sys.stderr, flush=True)
        problem += f": {lines[-1][:240]}" if lines[-1] else ""
      rows += done + [Row(name, length, max(1, tokens // length), note=problem) for length in missing]
  return rows


def format_table(rows: list[Row]) -> str:
  def num(x, fmt):
    return "—" if x is None else format(x, fmt)

  lines = ["| backend | T | BH | ms | TFLOP/s | rel L2 | status | note |", "|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r.length, BACKENDS.index(r.backend))):
    lines.append(f"| {r.backend} | {r.length} | {r.bh} | {num(r.ms, '.4f')} | {num(r.tflops, '.2f')} | "
                 f"{num(r.rel_l2, '.2e')} | {r.status} | {r.note} |")
  return "\n".join(lines)


def main(argv):
  del argv
  interpret = _INTERPRET.value
  lengths = [int(x) for x in _LENGTHS.value] or (HOST_LENGTHS if interpret else GPU_LENGTHS)
  tokens = _TOKENS.value or (HOST_TOKENS if interpret else GPU_TOKENS)
  unknown = set(_BACKENDS.value) - set(BACKENDS)
  if unknown:
    raise app.UsageError(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
  if _CHILD.value or not _ISOLATE.value:
    rows = run(_BACKENDS.value, lengths, tokens, _REPEATS.value, interpret, _JSONL.value, _LOCK.value)
  else:  # the parent leaves the device alone (no JAX backend, no preallocated memory)
    rows = run_isolated(_BACKENDS.value, lengths, tokens, _REPEATS.value, interpret, _CHILD_TIMEOUT.value,
                        _LOCK.value)
    for row in rows:
      append(_JSONL.value, row)
  if not _CHILD.value:
    print(format_table(rows), flush=True)


if __name__ == "__main__":
  app.run(main)
