"""MQAR results: best learning rate per point, markdown tables, accuracy vs state bytes (BASED Fig. 2).

Rows are the sweep's JSONL dicts (``lmcore.mqar.sweep.result_rows``). A point is one model trained
with one schedule: (mixer, d_model, mixer fields, epochs, train examples); its value is the best
accuracy over the learning rates tried, as zoology's figure takes the best lr per model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

# Fields shared by every point of a series (one head etc.) are left out of the table's "fields".
_COMMON_FIELDS = {"n_heads", "implementation", "feature", "channels", "rope", "expand_v"}


def read_rows(path: str) -> list[dict[str, Any]]:
  """The JSONL rows of ``path`` ([] if it does not exist yet)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def point_key(row: dict[str, Any]) -> tuple:
  return (row["mixer"], row["d_model"], json.dumps(row["mixer_fields"], sort_keys=True), row["epochs"],
          row["train_examples"])


def sort_key(row: dict[str, Any]) -> tuple:
  return (row["mixer"], row["state_bytes"], row["d_model"], row["lr"])


def best_per_point(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The highest-accuracy row of every point, sorted by mixer then state bytes."""
  best: dict[tuple, dict[str, Any]] = {}
  for row in rows:
    key = point_key(row)
    if key not in best or row["accuracy"] > best[key]["accuracy"]:
      best[key] = row
  return sorted(best.values(), key=sort_key)


def _fields(row: dict[str, Any]) -> str:
  shown = {k: v for k, v in row["mixer_fields"].items() if k not in _COMMON_FIELDS}
  return " ".join(f"{k}={v}" for k, v in sorted(shown.items()))


def markdown_table(rows: Sequence[dict[str, Any]], title: str = "") -> str:
  """One line per row: mixer, width, fields, state bytes (and log2), params, lr, accuracy, slices."""
  slices = sorted({name for row in rows for name in row["slice_accuracy"]},
                  key=lambda name: tuple(int(part.lstrip("Lkv")) for part in name.split("_")))
  header = (["mixer", "d_model", "fields", "state bytes", "log2", "params", "lr", "epochs", "accuracy"]
            + slices)
  lines = ([f"### {title}", ""] if title else []) + [
      "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in rows:
    cells = [row["mixer"], str(row["d_model"]), _fields(row), f"{row['state_bytes']:,}",
             f"{math.log2(row['state_bytes']):.1f}", f"{row['params']:,}", f"{row['lr']:.3g}",
             f"{row['epochs_run']}/{row['epochs']}", f"{row['accuracy']:.3f}"]
    cells += [f"{row['slice_accuracy'][name]:.3f}" if name in row["slice_accuracy"] else ""
              for name in slices]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot_accuracy_vs_state(rows: Sequence[dict[str, Any]], path: str, title: str = "MQAR") -> None:
  """Best-lr accuracy against decode-state bytes (log2 axis), one series per mixer, saved as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  best = best_per_point(rows)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for mixer in sorted({row["mixer"] for row in best}):
    series = sorted((row for row in best if row["mixer"] == mixer), key=lambda r: r["state_bytes"])
    ax.plot([r["state_bytes"] for r in series], [r["accuracy"] for r in series], marker="o", label=mixer)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("decode state (bytes, batch 1, 1024 tokens)")
  ax.set_ylabel("MQAR accuracy (best lr)")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize="small")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
