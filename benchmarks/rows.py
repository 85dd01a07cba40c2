"""Benchmark rows and their bookkeeping, shared by the JAX harness and the FLA bridge: a row per
(op, implementation, length, head shape), a JSONL log that resumes, a timer and a lock for processes
sharing one device, and counted FLOPs (see ``benchmarks.harness``)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import statistics
import time
from typing import Callable

import jax

CHUNK = 64


def fmt(x, spec: str, scale: float = 1.0) -> str:
  """``x * scale`` formatted with ``spec``, or "—" for a value that was not measured."""
  return "—" if x is None else format(x * scale, spec)


@dataclasses.dataclass
class Row:
  """One timed case. ``shape`` names its head shape ("H=4 K=96 V=192", ``harness.HeadShape.label``);
  "" is the op's default shape (``harness.DEFAULT_SHAPES``), as in every row written before it existed.
  ``queue``: calls enqueued per wait when timed (``time_fn``; 1 in every row written before it existed)."""

  op: str
  impl: str
  length: int
  batch: int
  fwd_ms: float | None
  fwdbwd_ms: float | None
  flops_fwd: float
  reference: str = ""
  note: str = ""
  ratio_fwdbwd: float | None = None
  vs_softmax: float | None = None
  shape: str = ""
  queue: int = 1

  @property
  def key(self) -> tuple[str, str, int, str, int]:
    return self.op, self.impl, self.length, self.shape, self.queue


def device_name() -> str:
  device = jax.devices()[0]
  return f"{device.platform}: {getattr(device, 'device_kind', str(device))}"


def goodput_row(config, evaluation: dict, *, control: str, corpus: str, command: str) -> dict:
  """The goodput table's row (docs/BENCHMARKS.md) of a finished run: its config (an ExperimentConfig)
  and final ``evaluation``, which holds the run's ``goodput`` breakdown."""
  return {"device": device_name(), "command": command, "control": control, "corpus": corpus,
          "steps": config.train.steps, "tokens_per_step": config.train.batch_size * config.data.seq_len,
          "worker_count": config.data.worker_count, "loss": evaluation["loss"], **evaluation["goodput"]}


def append_row(path: str, row) -> None:
  """Appends ``row`` (a dict, or a dataclass written as its dict) as one line of the JSON-lines file
  ``path``, making its folder first."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(row if isinstance(row, dict) else dataclasses.asdict(row)) + "\n")


@contextlib.contextmanager
def _flock(lock_path: str, operation: int):
  if not lock_path:
    yield
    return
  with open(lock_path, "a") as f:
    fcntl.flock(f, operation)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def exclusive(lock_path: str = ""):
  """Holds an exclusive ``flock`` on ``lock_path`` (nothing when empty) while timing: benchmark
  processes on one device take turns timing, and none times while another holds it ``shared``."""
  return _flock(lock_path, fcntl.LOCK_EX)


def shared(lock_path: str = ""):
  """Holds a shared ``flock`` on ``lock_path`` (nothing when empty) around device work that is not
  timing: compiling (XLA's GPU autotuner runs candidate kernels on the device) and checking kernels.
  Any number of processes hold it together; a process that times waits until none does."""
  return _flock(lock_path, fcntl.LOCK_SH)


def time_fn(fn: Callable, *args, repeats: int = 10, queue: int = 1) -> float:
  """Median wall time in ms of one call of ``fn(*args)`` (compiled already) after 4 warm-up calls.

  ``queue`` 1: each call is waited on alone, so a sample holds the host's dispatch and its wake-up at
  the end as well as the device's work. ``queue`` > 1: a sample enqueues that many calls back to back
  and waits once, then divides; the host dispatches while the device works, so the time per call is
  the device's (what the op costs inside a compiled step), as long as dispatching a call is quicker
  than running it."""
  for _ in range(4):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = [fn(*args) for _ in range(queue)]
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) * 1e3 / queue)
  return statistics.median(times)


def chunked_flops(batch, length, heads, features, values, chunk=CHUNK):
  return batch * heads * length * (2 * chunk * (features + values) + 4 * features * values)


def parallel_flops(batch, length, heads, features, values):
  return batch * heads * length * length * (features + values)


class RowLog:
  """Rows measured so far, appended to a JSONL file (when given) the moment each is measured.

  Rows already in the file are loaded and not measured again, so a benchmark stopped by a time limit
  continues where it stopped when run again with the same file. A row that failed (an error note, no
  time) is tried again; the file's last row of each (op, implementation, length, shape) wins.
  """

  def __init__(self, path: str = ""):
    self.path, self._rows = path, {}
    if path and os.path.exists(path):
      with open(path) as f:
        for line in f:
          if line.strip():
            row = Row(**json.loads(line))
            self._rows[row.key] = row

  @property
  def rows(self) -> list[Row]:
    return list(self._rows.values())

  def has(self, op: str, impl: str, length: int, shape: str = "", queue: int = 1) -> bool:
    row = self._rows.get((op, impl, length, shape, queue))
    return row is not None and row.fwdbwd_ms is not None

  def add(self, row: Row) -> None:
    self._rows[row.key] = row
    heads = f" [{row.shape}]" if row.shape else ""
    queued = f" ({row.queue} calls per wait)" if row.queue > 1 else ""
    print(f"  {row.op} {row.impl}{heads} T={row.length}: {row.fwd_ms} / {row.fwdbwd_ms} ms{queued} "
          f"{row.note}", flush=True)
    if self.path:
      append_row(self.path, row)


def measure(log: RowLog, op_name: str, impl: str, length: int, batch: int, fn: Callable | str,
            time_fwd_and_fwdbwd: Callable[[Callable], tuple[float, float]], flops: float,
            shape: str = "", queue: int = 1) -> None:
  """Times ``fn`` (a string is a reason it cannot run) unless ``log`` has the row; errors become notes.
  ``shape``: the row's head-shape label ("" for the op's default shape); ``queue``: the calls per wait
  ``time_fwd_and_fwdbwd`` uses, recorded in the row."""
  if log.has(op_name, impl, length, shape, queue):
    return
  row = functools.partial(Row, op_name, impl, length, batch, shape=shape, queue=queue)
  if isinstance(fn, str):
    log.add(row(None, None, 0.0, note=fn))
    return
  try:
    fwd, fwdbwd = time_fwd_and_fwdbwd(fn)
    log.add(row(fwd, fwdbwd, flops))
  except Exception as e:  # An OOM or a backend without the kernel: report it, keep going.
    log.add(row(None, None, 0.0, note=f"{type(e).__name__}: {str(e)[:80]}"))
