"""Benchmark plots: kernels' fwd+bwd tokens/s against T, one panel per op (``scripts/bench_report.py DIR
--plot``), and training tokens/s per preset (``scripts/bench_train.py``)."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plotting reads rows' fields only; importing the harness would start JAX
  from benchmarks.rows import Row


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (imported on first use: plotting is optional)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save(fig, path: str, title: str = "") -> None:
  """Titles ``fig`` (if ``title``), writes it to ``path`` as a PNG (creating the folder) and closes it."""
  import matplotlib.pyplot as plt
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")  # labels beyond the axes included
  plt.close(fig)


def tokens_per_s(row: Row) -> float | None:
  """Forward+backward tokens per second of ``row`` (None when it did not run)."""
  return row.batch * row.length / row.fwdbwd_ms * 1e3 if row.fwdbwd_ms else None


def line_name(row: Row) -> str:
  """The implementation, with the head shape of a row not at its op's default shape."""
  return row.impl + (f" [{row.shape}]" if row.shape else "")


def plot_tokens_per_s(rows: list[Row], path: str, title: str = "") -> None:
  """fwd+bwd tokens/s vs T (log2 x, log y), one panel per op, one line per implementation and head shape
  (in order of appearance, one colour per line name across panels), softmax as a dashed reference line
  in every panel; saved as a PNG."""
  plt = pyplot()

  timed = [r for r in rows if tokens_per_s(r)]
  softmax = [r for r in timed if r.op == "softmax"]
  ops = list(dict.fromkeys(r.op for r in timed if r.op != "softmax")) or ["softmax"]
  impls = dict.fromkeys(line_name(r) for r in timed if r.op != "softmax")
  palette = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")
  colour = {impl: palette(i % palette.N) for i, impl in enumerate(impls)}
  cols = len(ops) if len(ops) <= 3 else math.ceil(math.sqrt(len(ops)))  # 4 panels: 2×2
  nrows = math.ceil(len(ops) / cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4.8 * cols, 3.8 * nrows), squeeze=False)
  for ax, op in zip(axes.flat, ops):
    for impl in dict.fromkeys(line_name(r) for r in softmax):
      series = sorted((r for r in softmax if line_name(r) == impl), key=lambda r: r.length)
      ax.plot([r.length for r in series], [tokens_per_s(r) for r in series], "k--", marker=".", label=impl)
    if op != "softmax":
      op_rows = [r for r in timed if r.op == op]
      for impl in dict.fromkeys(line_name(r) for r in op_rows):
        series = sorted((r for r in op_rows if line_name(r) == impl), key=lambda r: r.length)
        ax.plot([r.length for r in series], [tokens_per_s(r) for r in series], marker="o",
                color=colour[impl], label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("tokens/s (fwd+bwd)")
    ax.set_title(op)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small")
  for ax in list(axes.flat)[len(ops):]:
    ax.set_visible(False)
  save(fig, path, title)


def plot_train_tokens_per_s(rows, path: str, title: str = "") -> None:
  """Training tokens/s per preset (``benchmarks.train_step.TrainRow``), one horizontal bar each, labelled
  with tokens/s and the ratio to softmax; presets that failed are listed with 0. Saved as a PNG."""
  plt = pyplot()

  labels = [r.preset + (f" [{r.variant}]" if r.variant else "") for r in rows]
  values = [r.tokens_per_s or 0.0 for r in rows]
  fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
  colours = ["black" if r.mixers == "softmax" else "tab:blue" for r in rows]
  ax.barh(range(len(rows)), values, color=colours)
  for i, r in enumerate(rows):
    text = "failed" if not r.tokens_per_s else f"{r.tokens_per_s:,.0f}"
    if r.vs_softmax is not None and r.mixers != "softmax":
      text += f" ({r.vs_softmax:.2f}× softmax)"
    ax.text(values[i], i, " " + text, va="center", fontsize="small")
  ax.set_yticks(range(len(rows)), labels)
  ax.invert_yaxis()
  ax.set_xlabel("training tokens/s")
  ax.set_xlim(0, 1.35 * max(values + [1.0]))
  save(fig, path, title)
