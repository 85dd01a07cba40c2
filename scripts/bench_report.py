"""The tables of ``scripts/bench_gpu.sh DIR``: kernel timings and kernel agreement, printed, appended to
docs/BENCHMARKS.md as one dated block, and plotted (fwd+bwd tokens/s vs T, one panel per op).

    python scripts/bench_report.py DIR [--out=docs/BENCHMARKS.md] [--device="NVIDIA H200"] \
        [--date=YYYY-MM-DD] [--plot=docs/bench_kernels.png]

Every ``*.jsonl`` of DIR but agreement.jsonl whose rows are kernel timings (``benchmarks.harness.Row``)
is read (others, such as train-step rows, are named and skipped); agreement.jsonl holds
``benchmarks.kernel_check.Agreement`` rows. In both, the last row of a key wins (a rerun's retry).
"""

import datetime
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness as bench  # noqa: E402

from benchmarks import plots as bench_plot  # noqa: E402

from benchmarks import kernel_check  # noqa: E402

_OUT = flags.DEFINE_string("out", "docs/BENCHMARKS.md", "Markdown file the block is appended to ('' = none).")
_DEVICE = flags.DEFINE_string("device", "NVIDIA H200", "The device DIR was measured on (named in the header).")
_DATE = flags.DEFINE_string("date", "", "The date of the measurement, YYYY-MM-DD ('' = today).")
_PLOT = flags.DEFINE_string("plot", None, "PNG of tokens/s vs T ('' = none; default: bench_kernels.png next "
                            "to --out, none when --out is '').")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python scripts/bench_report.py DIR [--out=...] [--device=...] [--date=...]")
  directory = argv[1]
  if not os.path.isdir(directory):
    raise app.UsageError(f"{directory} is not a directory; give the DIR of `bash scripts/bench_gpu.sh DIR`")
  rows = bench.with_ratios(bench.load_rows(
      directory, on_skipped=lambda path: print(f"skipped {path}: not kernel timing rows")))
  agreement = sorted(kernel_check.load_latest(os.path.join(directory, "agreement.jsonl")),
                     key=lambda r: (r.dtype != "float32", kernel_check.CHECKED_OPS.index(r.op)))
  if not rows and not agreement:
    raise app.UsageError(f"no rows in {directory}; run `bash scripts/bench_gpu.sh {directory}` first")
  tables = ([kernel_check.format_table(agreement)] if agreement else []) + ([bench.format_table(rows)] if rows else [])
  print("\n\n".join(tables), flush=True)
  if _OUT.value:
    commands = [f"bash scripts/bench_gpu.sh {directory}", "python " + " ".join(sys.argv)]
    bench.append_markdown(_OUT.value, tables, _DATE.value or datetime.date.today().isoformat(), _DEVICE.value,
                          commands, via="scripts/bench_gpu.sh")
  plot = _PLOT.value
  if plot is None:
    plot = os.path.join(os.path.dirname(_OUT.value), "bench_kernels.png") if _OUT.value else ""
  if plot and rows:
    bench_plot.plot_tokens_per_s(rows, plot, title=f"kernels on {_DEVICE.value}")
    print(f"wrote {plot}")


if __name__ == "__main__":
  app.run(main)
