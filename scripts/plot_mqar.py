"""Plot an MQAR sweep: best-lr accuracy vs decode-state bytes, one series per mixer (BASED Fig. 2).

    python scripts/plot_mqar.py --jsonl=runs/mqar/sweep.jsonl --png=runs/mqar/sweep.png

Prints the markdown table of the best learning rate per point (and writes it to ``--table``).
"""

from absl import app, flags

from lmcore.mqar import report

_JSONL = flags.DEFINE_string("jsonl", "runs/mqar/sweep.jsonl", "The sweep's JSONL.")
_PNG = flags.DEFINE_string("png", "runs/mqar/sweep.png", "Where the plot is written.")
_TABLE = flags.DEFINE_string("table", "", "Also write the markdown table here ('' = stdout only).")


def main(argv):
  del argv
  rows = report.read_rows(_JSONL.value)
  if not rows:
    raise app.UsageError(f"no rows in {_JSONL.value}; run scripts/mqar_sweep.py first")
  report.plot_accuracy_vs_state(rows, _PNG.value)
  table = report.markdown_table(report.best_per_point(rows), title="MQAR: best learning rate per point")
  print(table)
  if _TABLE.value:
    with open(_TABLE.value, "w") as f:
      f.write(table + "\n")
  print(f"wrote {_PNG.value}")


if __name__ == "__main__":
  app.run(main)
