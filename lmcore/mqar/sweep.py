"""The MQAR sweep: mixers × widths × learning rates, one JSONL row per run, resumable (MATH §6.5).

A point's learning rates train side by side (``lmcore.mqar.train``); a run already in the JSONL (same
point, lr, epochs and train examples) is skipped. Shapes follow zoology's BASED figure: one head,
BASED's head_dim = d_model; GLA, Gated DeltaNet and CyFA d_k = D/2, d_v = D; the Linear Transformer
d_k = d_v = D; SANATAN d = 16, d_v = D; sliding-window attention varies its window at D = 128.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lmcore.mqar import report
from lmcore.mqar.config import MQARConfig, SweepConfig
from lmcore.mqar.train import RunResult, build_data, train


@dataclasses.dataclass(frozen=True)
class SweepPoint:
  """One model of the grid: series ``label``, registry ``kind``, width and mixer fields."""

  label: str
  kind: str
  d_model: int
  fields: tuple[tuple[str, Any], ...]

  def config(self, base: MQARConfig, learning_rates: Sequence[float]) -> MQARConfig:
    return dataclasses.replace(base, mixer=self.kind, label=self.label, d_model=self.d_model,
                               mixer_fields=dict(self.fields), learning_rates=tuple(learning_rates))


def point(label: str, kind: str, d_model: int, **fields) -> SweepPoint:
  return SweepPoint(label, kind, d_model, tuple(sorted(fields.items())))


def based(d_model: int, feature_dim: int) -> SweepPoint:
  return point("based", "taylor", d_model, n_heads=1, feature_dim=feature_dim, feature="compact",
               implementation="parallel")


def sanatan(p: int, d_model: int, head_dim: int = 16) -> SweepPoint:
  # p >= 2 has no recurrence (MATH §1.2): parallel form, and a k/v cache in the state accounting.
  return point(f"sanatan_p{p}", "sanatan", d_model, n_heads=1, head_dim=head_dim, v_head_dim=d_model,
               p=p, channels=6, implementation="chunked" if p == 1 else "parallel")


def gated(kind: str, d_model: int) -> SweepPoint:
  """GLA (d_k = expand_k·D = D/2), Gated DeltaNet or CyFA (d_k = D/2, d_v = D), one head."""
  if kind == "gla":
    return point("gla", "gla", d_model, n_heads=1, expand_k=0.5, expand_v=1.0)
  return point(kind, kind, d_model, n_heads=1, head_dim=d_model // 2, v_head_dim=d_model)


def linear_transformer(d_model: int) -> SweepPoint:
  return point("linear_transformer", "linear_transformer", d_model, n_heads=1, head_dim=d_model)


def softmax(d_model: int) -> SweepPoint:
  # cuDNN flash attention needs bf16/fp16; MQAR runs in fp32, so the XLA path. No RoPE: zoology's
  # MHA has none (the BaseConv layer carries the order information).
  return point("softmax", "softmax", d_model, n_heads=1, rope=False, implementation="xla")


def swa(window: int, d_model: int = 128) -> SweepPoint:
  return point("swa", "swa", d_model, n_heads=1, window=window)


def full_grid() -> tuple[SweepPoint, ...]:
  """32 points spanning 2^13.1–2^20.1 decode-state bytes (BASED 2^13.2–2^17.4, softmax 2^19–2^20)."""
  return (tuple(based(d, f) for d in (48, 64, 128) for f in (8, 16, 24))
          + tuple(sanatan(p, d) for p in (1, 2) for d in (64, 128, 256))
          + tuple(gated(m, d) for m in ("gla", "gdn", "cyfa") for d in (64, 128, 256))
          + tuple(linear_transformer(d) for d in (64, 128, 256))
          + tuple(softmax(d) for d in (64, 128))
          + tuple(swa(w) for w in (16, 64, 256)))


def default_grid() -> tuple[SweepPoint, ...]:
  """The one-GPU, ten-minute grid (``configs/mqar.py:sweep`` has the budget): 11 points, 2^13.6–2^19
  bytes. BASED at three state sizes; every other mixer once, near BASED's 2^15–2^16 sweet spot
  (SANATAN p = 2 and softmax land at 2^18.3 and 2^19: their caches grow with the sequence)."""
  return ((based(64, 8), based(64, 16), based(128, 16), sanatan(1, 64), sanatan(2, 64))
          + tuple(gated(m, 128) for m in ("gla", "gdn", "cyfa"))
          + (linear_transformer(64), softmax(64), swa(64)))


def grid(name: str) -> tuple[SweepPoint, ...]:
  grids = {"default": default_grid, "full": full_grid}
  if name not in grids:
    raise ValueError(f"unknown MQAR grid {name!r}; valid: {', '.join(grids)}")
  return grids[name]()


def select(points: Iterable[SweepPoint], mixers: Sequence[str] = (),
           widths: Sequence[int] = ()) -> list[SweepPoint]:
  """The points whose label is in ``mixers`` and width in ``widths`` (empty = no filter)."""
  known = {p.label for p in full_grid()}
  unknown = set(mixers) - known
  if unknown:
    raise ValueError(f"unknown MQAR mixer label(s) {sorted(unknown)}; valid: {', '.join(sorted(known))}")
  return [p for p in points if (not mixers or p.label in mixers) and (not widths or p.d_model in widths)]


def with_overrides(base: MQARConfig, selection: SweepConfig, *, mixers: Sequence[str] | None = None,
                   widths: Sequence[int] | None = None, lrs: Sequence[float] | None = None,
                   epochs: int | None = None, train_examples_scale: float | None = None,
                   out: str | None = None,
                   time_budget_s: float | None = None) -> tuple[MQARConfig, SweepConfig]:
  """The command line's overrides (None = keep the config's value)."""
  recipe = {"learning_rates": tuple(map(float, lrs)) if lrs else None, "epochs": epochs,
            "train_examples_scale": train_examples_scale}
  base = dataclasses.replace(base, **{k: v for k, v in recipe.items() if v is not None})
  choice = {"mixers": tuple(mixers) if mixers else None,
            "widths": tuple(map(int, widths)) if widths else None, "out": out,
            "time_budget_s": time_budget_s}
  return base, dataclasses.replace(selection, **{k: v for k, v in choice.items() if v is not None})


def run_key(label: str, d_model: int, fields: dict[str, Any], lr: float, epochs: int,
            train_examples: int) -> tuple:
  return (label, d_model, json.dumps(fields, sort_keys=True), f"{lr:.6g}", epochs, train_examples)


def row_key(row: dict[str, Any]) -> tuple:
  return run_key(row["mixer"], row["d_model"], row["mixer_fields"], row["lr"], row["epochs"],
                 row["train_examples"])


def num_train_examples(config: MQARConfig) -> int:
  return sum(max(1, round(s.num_examples * config.train_examples_scale)) for s in config.train_segments)


def result_rows(result: RunResult) -> list[dict[str, Any]]:
  """One JSONL row per learning rate of a finished run."""
  c = result.config
  return [{"mixer": c.label, "kind": c.mixer, "d_model": c.d_model, "mixer_fields": dict(c.mixer_fields),
           "lr": m.learning_rate, "accuracy": m.accuracy, "slice_accuracy": m.slice_accuracy,
           "state_bytes": result.state_bytes, "params": result.params, "epochs_run": m.epochs_run,
           "stopped_early": m.stopped_early, "train_loss": m.train_loss, "epochs": c.epochs,
           "train_examples": num_train_examples(c), "train_examples_scale": c.train_examples_scale,
           "wall_time_s": round(result.wall_time_s, 2), "lrs_trained_together": len(result.members),
           "date": result.date, "device": result.device}
          for m in result.members]


def run_sweep(base: MQARConfig, points: Sequence[SweepPoint], out_path: str, *, time_budget_s: float = 0.0,
              log: Callable[[str], Any] = print) -> list[dict[str, Any]]:
  """Runs every (point, lr) not yet in ``out_path``, appending rows; with ``time_budget_s`` > 0 no point
  starts that the slowest so far would carry past it. Returns all the grid's rows in ``out_path``."""
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  done = {row_key(row) for row in report.read_rows(out_path)}
  examples = num_train_examples(base)
  start, slowest, data = time.time(), 0.0, None
  for i, p in enumerate(points):
    todo = [lr for lr in base.learning_rates
            if run_key(p.label, p.d_model, dict(p.fields), lr, base.epochs, examples) not in done]
    if not todo:
      log(f"[{i + 1}/{len(points)}] {p.label} d={p.d_model}: all learning rates already in {out_path}")
      continue
    elapsed = time.time() - start
    if time_budget_s and elapsed + slowest > time_budget_s:
      log(f"time budget {time_budget_s:.0f}s reached after {elapsed:.0f}s: {len(points) - i} point(s) left "
          f"for the next call (it resumes from {out_path})")
      break
    log(f"[{i + 1}/{len(points)}] {p.label} d={p.d_model} {dict(p.fields)} lrs={todo} "
        f"({elapsed:.0f}s into the sweep)")
    data = data or build_data(base)  # every point sees the same examples: generate them once
    result = train(p.config(base, todo), data=data, log=log)
    slowest = max(slowest, result.wall_time_s)
    with open(out_path, "a") as f:
      f.writelines(json.dumps(row) + "\n" for row in result_rows(result))
  wanted = {run_key(p.label, p.d_model, dict(p.fields), lr, base.epochs, examples)
            for p in points for lr in base.learning_rates}
  return [row for row in report.read_rows(out_path) if row_key(row) in wanted]


def summary(rows: Sequence[dict[str, Any]]) -> str:
  """Every run, then the best learning rate per point, as markdown tables."""
  return (report.markdown_table(sorted(rows, key=report.sort_key), title="All runs") + "\n\n"
          + report.markdown_table(report.best_per_point(rows), title="Best learning rate per point"))
