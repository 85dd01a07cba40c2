"""Kernel benchmark: forward and forward+backward time of each op, in one process.

For every op and T ∈ {2048, 8192, 32768} at a fixed number of tokens per batch (B = tokens // T):
our Pallas kernels (SANATAN p = 1: the fused-chunk kernels, "pallas_fused"; p = 2: the flash kernels,
"pallas_flash"; Taylor: the blocked and fused-chunk kernels, "pallas_blocked" and "pallas_fused"), our
XLA chunked path, the materialised parallel reference (skipped where
its T×T scores would not fit), cuDNN softmax attention (`jax.nn.dot_product_attention`) and, when
torch and flash-linear-attention are importable, FLA's kernels on the same inputs. Prints a table
with ms, tokens/s, achieved TFLOP/s (from counted FLOPs) and the ratio to the reference named in each row,
and, with ``--out``, appends them to that Markdown file with the date, device and command (the tables of
docs/BENCHMARKS.md are generated from the rows in docs/bench/ by ``scripts/bench_report.py``).

    python scripts/bench_kernels.py [--lengths=2048,8192,32768] [--tokens=16384] [--dtype=bfloat16] \
        [--jsonl=runs/bench/kernels.jsonl] [--fla_ops=sanatan_p1,gated,taylor] [--lock=/tmp/bench.lock] \
        [--tune=sanatan_p1_fused] [--shapes=default,preset,wide] [--auto_only] [--queue=8]

Head shapes (``benchmarks.harness.SHAPE_SETS``): "default" (the shapes of the tables, 12 heads of 64;
Taylor 16 × d' 16 × dv 64), "preset" (the heads of every paper preset of configs/ that runs the op),
"wide" (K, V in 128 / 256 / 512 at H · V = 1024). Rows record their shape; ``--auto_only`` times only
the forms ``implementation="auto"`` chooses between (``AUTO_CASES``: the kernels it may pick and its
XLA form).

Timing (``--queue``): each sample enqueues 8 calls back to back and waits once, so a row is the time the
op costs on the device (inside a compiled train step nothing waits between ops); ``--queue=1,8`` adds a
row per case that waits on every call alone (the host's dispatch and wake-up included). FLA's rows time
the same number of calls between two CUDA events.

Compilation (Triton kernels, FLA autotuning) can take minutes per case: give ``--jsonl`` so that a run
stopped by a time limit continues where it stopped. Several processes (one per T, say) can share one
device when given the same ``--lock``: they compile in parallel and take turns timing, never while
another compiles (XLA's GPU autotuner runs kernels on the device; a row timed beside it comes out
slower).
"""

import datetime
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness as bench  # noqa: E402

_LENGTHS = flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Sequence lengths.")
_TOKENS = flags.DEFINE_integer("tokens", 16384, "Tokens per batch (B = tokens // T, at least 1).")
_OPS = flags.DEFINE_list("ops", ["sanatan_p1", "sanatan_p2", "gated", "taylor", "softmax"], "Ops to time.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Input dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed repetitions (median reported).")
_OUT = flags.DEFINE_string("out", "", "Markdown file the rows are appended to ('' = none).")
_FLA_OPS = flags.DEFINE_list("fla_ops", ["sanatan_p1", "gated", "taylor"],
                             "Ops whose flash-linear-attention kernels are also timed, when importable "
                             "('' = none; FLA autotunes on first use, minutes for chunk_gla).")
_JSONL = flags.DEFINE_string("jsonl", "", "Rows are appended here as they are measured; rows already "
                             "in it are not measured again (a rerun continues a stopped benchmark).")
_TUNE = flags.DEFINE_list("tune", [], "Ops whose Triton kernel is also timed at every setting of "
                          "benchmarks.harness.TUNING (chunk, value tile, warps), e.g. gated; "
                          "sanatan_p2 times the flash kernel at every FLASH_TUNING tiling, "
                          "sanatan_p1_fused the fused-chunk kernel at every FUSED_TUNING tiling, "
                          "taylor_blocked the blocked Taylor kernels at every TAYLOR_BLOCKED_TUNING setting, "
                          "taylor_fused the fused-chunk Taylor kernels at every TAYLOR_FUSED_TUNING tiling.")
_SHAPES = flags.DEFINE_list("shapes", ["default"], "Named sets of head shapes to time each op at: default, "
                            "preset (the paper presets' heads), wide (K, V up to 512); softmax and FLA keep "
                            "their default shapes.")
_AUTO_ONLY = flags.DEFINE_bool("auto_only", False, "Time only the forms implementation='auto' chooses "
                               "between (benchmarks.harness.AUTO_CASES: the kernels it may pick and its XLA "
                               "form), not every precision variant and reference.")
_CASE = flags.DEFINE_multi_string("case", [], "Time only the cases of this name (repeatable), e.g. "
                                  "--case='chunked (xla)' --case='plain chunked (baseline)'; none = all.")
_QUEUE = flags.DEFINE_list("queue", ["8"], "Calls enqueued per wait when timing (benchmarks.rows.time_fn), "
                           "one row per depth: 8 hides the host's dispatch and wake-up behind the device's "
                           "work (the time an op costs inside a compiled step); 1 waits on every call alone "
                           "(the host round trip included, as every table before 2026-12-03 was timed).")
_LOCK = flags.DEFINE_string("lock", "", "A lock file shared by benchmark processes on one device: each "
                            "compiles holding it shared and times holding it exclusively (runs per T "
                            "side by side).")


def _queues() -> list[int]:
  if not all(x.isdigit() and int(x) > 0 for x in _QUEUE.value):
    raise app.UsageError(f"--queue={','.join(_QUEUE.value)}: expected positive integers, e.g. --queue=1,8")
  return [int(x) for x in _QUEUE.value]


def main(argv):
  del argv
  queues = _queues()
  unknown = [op for op in _OPS.value if op not in bench.OPS]
  if unknown:
    raise app.UsageError(f"unknown op {unknown[0]!r} in --ops; valid: {', '.join(bench.OPS)}")
  try:
    for op in _OPS.value:
      bench.shapes_for(op, _SHAPES.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  rows = bench.run_all(ops=_OPS.value, lengths=[int(x) for x in _LENGTHS.value], tokens=_TOKENS.value,
                       dtype=_DTYPE.value, repeats=_REPEATS.value, fla_ops=_FLA_OPS.value, jsonl=_JSONL.value,
                       lock=_LOCK.value, tune=_TUNE.value, shapes=_SHAPES.value, auto_only=_AUTO_ONLY.value,
                       only=tuple(_CASE.value), queues=tuple(queues))
  table = bench.format_table(rows)
  print(table, flush=True)
  if _OUT.value:
    command = "python " + " ".join(sys.argv)
    bench.append_markdown(_OUT.value, [table], datetime.date.today().isoformat(), bench.device_name(),
                          [command])


if __name__ == "__main__":
  app.run(main)
