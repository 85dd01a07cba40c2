"""The between-chunk recurrence alone (``lmcore/ops/common/chunk_scan.py``): XLA's associative scan and the
Pallas kernel at several tiles and unrolls, on state stacks of two shapes (a 6d-wide SANATAN p = 1 one and
the gated kernel's).

For each T ∈ {2048, 8192, 32768} at B·T = 16384 tokens (B at least 1), H = 12, values V = 64:
SANATAN's stack has R = 6·64 rows per chunk of 32 tokens, the gated kernel's R = 64 rows per chunk of 16.
Times the forward walk (held states in bf16, as the kernels use them) and reports the achieved bandwidth
from the bytes the Pallas kernel must move (c and a read in fp32, held states written in bf16).

    python scripts/bench_chunk_scan.py [--lengths=2048,8192,32768] [--stacks=sanatan_p1,gated] [--repeats=20] \
        [--out=NOTES.md]
"""

import datetime
import functools
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import harness as bench  # noqa: E402
from lmcore.ops.common.chunk_scan import chunk_scan  # noqa: E402

STACKS = {"sanatan_p1": (32, 6 * 64), "gated": (16, 64)}  # chunk, rows per chunk
SETTINGS = [("xla", {})] + [("pallas", dict(block_rows=br, unroll=u))
                            for br, u in ((32, 8), (16, 8), (8, 8), (32, 16), (16, 16), (8, 16), (32, 32))]

_LENGTHS = flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Sequence lengths.")
_STACKS = flags.DEFINE_list("stacks", list(STACKS), "Which kernels' state stacks to scan.")
_TOKENS = flags.DEFINE_integer("tokens", 16384, "Tokens per batch (B = tokens // T, at least 1).")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed repetitions (median reported).")
_OUT = flags.DEFINE_string("out", "", "Markdown file the table is appended to ('' = none).")


def _stack(batch: int, length: int, chunk: int, rows: int):
  """c [B, 12, N, R, 64], a [B, 12, N, R] (keep factors near 1), edge [B, 12, R, 64]; fp32."""
  keys = jax.random.split(jax.random.key(0), 3)
  N = length // chunk
  c = jax.random.normal(keys[0], (batch, bench.HEADS, N, rows, bench.HEAD_DIM), jnp.float32)
  a = jax.random.uniform(keys[1], (batch, bench.HEADS, N, rows), jnp.float32, 0.9, 1.0)
  edge = jax.random.normal(keys[2], (batch, bench.HEADS, rows, bench.HEAD_DIM), jnp.float32)
  return c, a, edge


def _row(op: str, length: int, batch: int, name: str, ms: float | None, gbytes: float, note: str = "") -> str:
  rate = "—" if ms is None else f"{gbytes / ms * 1e3:,.0f}"
  time = "—" if ms is None else f"{ms:.3f}"
  return f"| {op} | {length} | {batch} | {name} | {time} | {rate} | {note} |"


def main(argv):
  del argv
  lines = ["| stack | T | B | scan | ms | GB/s (Pallas bytes) | note |", "|---|---|---|---|---|---|---|"]
  unknown = set(_STACKS.value) - set(STACKS)
  if unknown:
    raise app.UsageError(f"unknown stacks {sorted(unknown)}; choose from {list(STACKS)}")
  for length in (int(x) for x in _LENGTHS.value):
    batch = max(1, _TOKENS.value // length)
    for op in _STACKS.value:
      chunk, rows = STACKS[op]
      c, a, edge = _stack(batch, length, chunk, rows)
      gbytes = (c.size * 4 + a.size * 4 + c.size * 2) / 1e9
      for implementation, options in SETTINGS:
        name = implementation + "".join(f", {k} {v}" for k, v in options.items())
        fn = jax.jit(functools.partial(chunk_scan, out_dtype=jnp.bfloat16, implementation=implementation,
                                       **options))
        try:
          compiled = fn.lower(c, a, edge).compile()
          line = _row(op, length, batch, name, bench.time_fn(compiled, c, a, edge, repeats=_REPEATS.value), gbytes)
        except Exception as e:  # a setting that fails to compile or run is a row, not the end
          line = _row(op, length, batch, name, None, gbytes, f"{type(e).__name__}: {str(e)[:80]}")
        print(line, flush=True)
        lines.append(line)
  table = "\n".join(lines)
  if _OUT.value:
    bench.append_markdown(_OUT.value, [table], datetime.date.today().isoformat(), bench.device_name(),
                          ["python " + " ".join(sys.argv)], via="chunk scan")


if __name__ == "__main__":
  app.run(main)
