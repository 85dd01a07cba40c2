"""Sweeps as lists of config overrides (never edited files): a grid of ``--config.k=v`` runs.

Each point trains through ``train.py`` in its own workdir (a rerun resumes it) and records its
command and outcome in ``<workdir>/sweep_point.json``: a rerun with the same command skips a finished
or diverged point (``Diverged.exit_code``); any other failure is retried on the next run. A point whose
workdir another process holds (``WorkdirInUse.exit_code``) is reported and left to that process: its
``sweep_point.json`` is not written. Downstream
task results that ``eval.py --tasks`` wrote into the points' workdirs are tabulated with them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from lmcore import cli
from lmcore.errors import ConfigError, Diverged, WorkdirInUse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train.py")
POINT_FILE = "sweep_point.json"


@dataclasses.dataclass
class PointResult:
  """The outcome of one grid point: "done" (with its eval record), "diverged" or "failed" (with why)."""

  overrides: dict[str, str]
  status: str
  record: dict[str, Any] | None = None
  reason: str = ""
  skipped: bool = False  # finished by an earlier run of the same command


def parse_axis(spec: str) -> tuple[str, list[str]]:
  """``"model.mixers.sanatan.channels=6,4"`` -> ("model.mixers.sanatan.channels", ["6", "4"])."""
  key, sep, values = spec.partition("=")
  if not sep or not values:
    raise ConfigError(f"--sweep {spec!r}: expected KEY=V1,V2,... (e.g. train.learning_rate=1e-3,3e-3)")
  return key.strip(), [v.strip() for v in values.split(",")]


def check_axes(specs: list[str], fixed: list[str], config: Mapping[str, Any]) -> None:
  """``ConfigError`` before anything runs for an axis that names no key of ``config`` (the ConfigDict
  of the preset), or one that a fixed ``--config.<key>=`` override also sets."""
  fixed_keys = {cli.override_key(arg) for arg in fixed}
  for key, _ in map(parse_axis, specs):
    error = cli.unknown_override(config, key)
    if error is not None:
      raise error
    if key in fixed_keys:
      raise ConfigError(f"--sweep {key}=... and --config.{key} both set {key}; keep one of them.")


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


TASK_RECORD = re.compile(r"eval_(\d+)_(.+)\.json")


def task_rows(workdir: str) -> list[dict[str, Any]]:
  """The downstream-task results of one run (``eval.py --tasks`` writes ``eval_<step>_<tasks>.json``):
  one row per (task, metric), from the latest step that scored it."""
  names = os.listdir(workdir) if os.path.isdir(workdir) else []
  latest: dict[tuple[str, str], dict[str, Any]] = {}
  records = sorted((int(m[1]), m[0]) for m in map(TASK_RECORD.fullmatch, names) if m)
  for _, name in records:
    with open(os.path.join(workdir, name)) as f:
      record = json.load(f)
    for row in record["results"]:
      latest[(row["task"], row["metric"])] = {**row, "step": record["step"]}
  return [latest[key] for key in sorted(latest)]


def task_table(workdirs: Mapping[str, str]) -> str:
  """Markdown: one row per (run, task, metric) of ``task_rows`` over ``{run name: workdir}``; empty
  when no run has any."""
  lines = []
  for run, workdir in workdirs.items():
    for r in task_rows(workdir):
      stderr = "" if r["stderr"] is None else f" ± {r['stderr']:.4f}"
      lines.append(f"| {run} | {r['task']} | {r['metric']} | {r['value']:.4f}{stderr} | {r['n']} | "
                   f"{r['step']} |")
  if not lines:
    return ""
  return "\n".join(["| run | task | metric | value | n | step |", "|---|---|---|---|---|---|", *lines])


def point_args(config: str, overrides: dict[str, str], workdir: str, extra: list[str]) -> list[str]:
  """The ``train.py`` arguments of one point (what identifies a finished point)."""
  return [f"--config={config}", f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in overrides.items()],
          *extra]


def _read_point(workdir: str) -> dict[str, Any] | None:
  path = os.path.join(workdir, POINT_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _write_point(workdir: str, args: list[str], result: PointResult) -> None:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, POINT_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump({"args": args, "status": result.status, "reason": result.reason, "record": result.record}, f,
              indent=1)
  os.replace(path + ".tmp", path)


def _run_train(args: list[str]) -> tuple[int, str]:
  """Runs ``train.py args`` with stdout passed through and stderr echoed; (exit code, last stderr line)."""
  cmd = [sys.executable, TRAIN, *args]
  print(f"== {' '.join(cmd)}", flush=True)
  proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
  tail: collections.deque[str] = collections.deque(maxlen=20)

  def echo():
    for line in proc.stderr:
      sys.stderr.write(line)
      if line.strip():
        tail.append(line.strip())

  reader = threading.Thread(target=echo, daemon=True)
  reader.start()
  code = proc.wait()
  reader.join()
  return code, (tail[-1] if tail else f"exit code {code}")


def run_point(config: str, overrides: dict[str, str], workdir: str, extra: list[str]) -> PointResult:
  """Trains one grid point (resuming its workdir) unless the same command finished it before."""
  args = point_args(config, overrides, workdir, extra)
  previous = _read_point(workdir)
  if previous and previous["args"] == args and previous["status"] in ("done", "diverged"):
    print(f"== {point_name(overrides)}: {previous['status']} in an earlier run, skipped", flush=True)
    return PointResult(overrides, previous["status"], previous["record"], previous["reason"], skipped=True)
  code, last_line = _run_train(args)
  if code == WorkdirInUse.exit_code:
    return PointResult(overrides, "failed", reason=last_line)
  record = latest_eval(workdir) if code == 0 else None
  if code == 0 and record is not None:
    result = PointResult(overrides, "done", record)
  elif code == Diverged.exit_code:
    result = PointResult(overrides, "diverged", reason=last_line)
  else:
    result = PointResult(overrides, "failed", reason=last_line if code else "no eval_<step>.json was written")
  _write_point(workdir, args, result)
  return result


def table(results: list[PointResult]) -> str:
  """Markdown: one row per point; failed and diverged points say so in place of the loss."""
  keys = list(results[0].overrides) if results else []
  lines = ["| " + " | ".join(keys + ["held-out loss", "perplexity", "step", "status"]) + " |",
           "|" + "---|" * (len(keys) + 4)]
  for r in results:
    values = [r.overrides[k] for k in keys]
    if r.status == "done":
      values += [f"{r.record['loss']:.4f}", f"{r.record['perplexity']:.2f}", str(r.record["step"]), "ok"]
    else:
      values += ["—", "—", "—", f"**{r.status.upper()}**: {r.reason}".replace("|", "/")]
    lines.append("| " + " | ".join(values) + " |")
  return "\n".join(lines)


def plot(results: list[PointResult], path: str, title: str) -> None:
  """Bar chart of the held-out losses; failed points get an empty slot labelled as failed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [point_name(r.overrides) + ("" if r.status == "done" else f"\n({r.status})") for r in results]
  fig, ax = plt.subplots(figsize=(max(4, 0.9 * len(results) + 2), 3.5))
  ax.bar(range(len(results)), [r.record["loss"] if r.status == "done" else 0.0 for r in results])
  ax.set_xticks(range(len(results)), names, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel("held-out loss (nats)")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_sweep(config: str, specs: list[str], root: str, extra: list[str]) -> tuple[str, list[PointResult]]:
  """Runs every grid point (continuing past failures); writes and returns the table, and the results."""
  os.makedirs(root, exist_ok=True)
  points = {point_name(o): os.path.join(root, point_name(o)) for o in grid(specs)}
  results = [run_point(config, o, points[point_name(o)], extra) for o in grid(specs)]
  text = table(results)
  tasks = task_table(points)
  if tasks:
    text += f"\n\ndownstream tasks (eval.py --tasks):\n\n{tasks}"
  with open(os.path.join(root, "sweep_results.md"), "w") as f:
    f.write(f"config: `{config}`\n\n{text}\n")
  plot(results, os.path.join(root, "sweep_results.png"), config)
  return text, results
