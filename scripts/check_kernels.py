"""Compiled Pallas kernels vs the XLA paths, outputs and gradients: one table, one command.

    python scripts/check_kernels.py [--length=1024] [--batch=2] [--dtypes=float32,bfloat16] \
        [--jsonl=runs/bench/agreement.jsonl] [--out=NOTES.md] [--lock=/tmp/bench.lock]

Rows already in ``--jsonl`` are not checked again (Triton compiles take minutes; a run stopped by a time
limit continues). The table is printed and appended to ``--out`` with the date, device and command.
Off GPU/TPU the kernels run in interpret mode (slow: use a short --length).
"""

import datetime
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness as bench  # noqa: E402

from benchmarks import kernel_check  # noqa: E402

_OPS = flags.DEFINE_list("ops", list(kernel_check.CHECKED_OPS), "Ops whose kernels are checked.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Input dtypes.")
_LENGTH = flags.DEFINE_integer("length", 1024, "Sequence length T (not a multiple of every chunk: try 1000).")
_BATCH = flags.DEFINE_integer("batch", 2, "Batch size B.")
_JSONL = flags.DEFINE_string("jsonl", "", "Rows are appended here as they are made; rows in it are kept.")
_OUT = flags.DEFINE_string("out", "", "Markdown file the table is appended to ('' = none).")
_LOCK = flags.DEFINE_string("lock", "", "A lock file shared with benchmark processes on the device: the "
                            "checks hold it shared, so that no process times while they run.")


def _check_flags() -> None:
  """Exits with one line naming the first unknown op or dtype."""
  for flag, given, valid in (("--ops", _OPS.value, kernel_check.CHECKED_OPS),
                             ("--dtypes", _DTYPES.value, kernel_check.LIMITS)):
    unknown = [x for x in given if x not in valid]
    if unknown:
      sys.exit(f"error: {flag}: unknown {unknown[0]!r}; use some of {', '.join(valid)}")


def main(argv):
  del argv
  _check_flags()
  rows = kernel_check.run(ops=_OPS.value, dtypes=_DTYPES.value, length=_LENGTH.value, batch=_BATCH.value,
                          jsonl=_JSONL.value, lock=_LOCK.value)
  table = kernel_check.format_table(rows)
  print(table, flush=True)
  if _OUT.value:
    with open(_OUT.value, "a") as f:
      f.write(f"\n## {datetime.date.today().isoformat()} — kernel agreement on {bench.device_name()}\n\n"
              f"`python {' '.join(sys.argv)}`\n\n{table}\n")
  if not all(r.passed for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
