"""Sweeps as lists of config overrides (never edited files): a grid of ``--config.k=v`` runs.

Each grid point trains through ``train.py`` in its own workdir (so a rerun resumes or skips finished
points) and the held-out losses are tabulated and plotted.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from typing import Any


def parse_axis(spec: str) -> tuple[str, list[str]]:
  """``"model.mixers.sanatan.channels=6,4"`` -> ("model.mixers.sanatan.channels", ["6", "4"])."""
  key, sep, values = spec.partition("=")
  if not sep or not values:
    raise ValueError(f"--sweep {spec!r}: expected KEY=V1,V2,... (e.g. train.learning_rate=1e-3,3e-3)")
  return key.strip(), [v.strip() for v in values.split(",")]


def grid(specs: list[str]) -> list[dict[str, str]]:
  axes = [parse_axis(s) for s in specs]
  keys = [k for k, _ in axes]
  return [dict(zip(keys, combo)) for combo in itertools.product(*(vals for _, vals in axes))]


def point_name(overrides: dict[str, str]) -> str:
  parts = [f"{key.split('.')[-1]}={value}" for key, value in overrides.items()]
  return re.sub(r"[^A-Za-z0-9_.=-]", "_", "_".join(parts)) or "base"


def latest_eval(workdir: str) -> dict[str, Any] | None:
  evals = [f for f in os.listdir(workdir) if re.fullmatch(r"eval_\d+\.json", f)] if os.path.isdir(workdir) else []
  if not evals:
    return None
  newest = max(evals, key=lambda f: int(f[5:-5]))
  with open(os.path.join(workdir, newest)) as f:
    return json.load(f)


def run_point(config: str, overrides: dict[str, str], workdir: str, extra: list[str]) -> dict[str, Any]:
  """Trains one grid point (resuming its workdir) and returns its final eval record."""
  cmd = [sys.executable, "train.py", f"--config={config}", f"--workdir={workdir}",
         *[f"--config.{k}={v}" for k, v in overrides.items()], *extra]
  print(f"== {' '.join(cmd)}", flush=True)
  subprocess.run(cmd, check=True)
  record = latest_eval(workdir)
  if record is None:
    raise RuntimeError(f"{workdir} finished without an eval_<step>.json")
  return record


def table(rows: list[tuple[dict[str, str], dict[str, Any]]]) -> str:
  keys = list(rows[0][0]) if rows else []
  lines = ["| " + " | ".join(keys + ["held-out loss", "perplexity", "step"]) + " |",
           "|" + "---|" * (len(keys) + 3)]
  for overrides, record in rows:
    lines.append("| " + " | ".join([overrides[k] for k in keys] +
                                   [f"{record['loss']:.4f}", f"{record['perplexity']:.2f}", str(record["step"])]) + " |")
  return "\n".join(lines)


def plot(rows: list[tuple[dict[str, str], dict[str, Any]]], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [point_name(o) for o, _ in rows]
  fig, ax = plt.subplots(figsize=(max(4, 0.9 * len(rows) + 2), 3.5))
  ax.bar(range(len(rows)), [r["loss"] for _, r in rows])
  ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel("held-out loss (nats)")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_sweep(config: str, specs: list[str], root: str, extra: list[str]) -> str:
  os.makedirs(root, exist_ok=True)
  rows = [(o, run_point(config, o, os.path.join(root, point_name(o)), extra)) for o in grid(specs)]
  text = table(rows)
  with open(os.path.join(root, "sweep_results.md"), "w") as f:
    f.write(f"config: `{config}`\n\n{text}\n")
  plot(rows, os.path.join(root, "sweep_results.png"), config)
  return text
