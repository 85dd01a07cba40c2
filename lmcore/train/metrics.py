"""Metric writers (process 0 only): ``metrics.jsonl`` in the workdir, a console progress line, wandb.

wandb is imported lazily and only when ``wandb.mode`` is not "disabled"; the run id is stored in
``<workdir>/wandb_run_id`` so that a resumed run continues the same wandb run. Without the package,
"offline" (the default) falls back to "disabled" with one console line; "online" is an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import sys
from typing import Any

import jax

from lmcore.config import WandbConfig
from lmcore.errors import ConfigError


def format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress_line(step: int, total: int, loss: float, interval: "Interval", mfu: float | None = None,
                  peak_bytes: int | None = None) -> str:
  """One console line; MFU (a fraction) and the device's peak memory appear where they are known."""
  parts = [f"step {step}/{total}", f"loss {loss:.4f}", f"{interval.tokens_per_s:,.0f} tok/s",
           f"{interval.step_s * 1e3:.1f} ms/step"]
  if mfu is not None:
    parts.append(f"MFU {100 * mfu:.1f}%")
  if peak_bytes is not None:
    parts.append(f"peak {peak_bytes / 2 ** 30:.1f} GiB")
  parts.append(f"goodput {100 * interval.goodput:.0f}%")
  return " | ".join(parts + [f"ETA {format_duration((total - step) * interval.wall_per_step_s)}"])


class MetricWriter:
  """Appends ``{"step": s, **metrics}`` rows to ``metrics.jsonl`` and mirrors them to wandb."""

  def __init__(self, workdir: str, wandb_config: WandbConfig, run_config: dict[str, Any]):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._wandb_run = None
    if self.enabled and wandb_config.mode != "disabled":
      self._wandb_run = _init_wandb(workdir, wandb_config, run_config)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": step, **{k: _to_python(v) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    if self._wandb_run is not None:
      self._wandb_run.log(row, step=step)

  def console(self, line: str) -> None:
    if self.enabled:
      print(line, flush=True)
      sys.stdout.flush()

  def close(self) -> None:
    if self._wandb_run is not None:
      self._wandb_run.finish()
      self._wandb_run = None


def _to_python(value: Any) -> Any:
  if hasattr(value, "item"):
    return value.item()
  return value


def _init_wandb(workdir: str, config: WandbConfig, run_config: dict[str, Any]):
  os.environ.setdefault("WANDB_SILENT", "true")
  try:
    import wandb  # Lazy: only runs that log to wandb pay for the import.
  except ImportError:
    if config.mode == "online":
      raise ConfigError("wandb.mode='online' needs the wandb package: pip install wandb, or set "
                        "--config.wandb.mode=disabled.") from None
    print(f"wandb is not installed: wandb.mode={config.mode!r} falls back to 'disabled' (metrics still go to "
          f"{os.path.join(workdir, 'metrics.jsonl')}; pip install wandb to keep wandb logs).", flush=True)
    return None

  id_path = os.path.join(workdir, "wandb_run_id")
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip()
  else:
    run_id = secrets.token_hex(4)
    with open(id_path, "w") as f:
      f.write(run_id)
  return wandb.init(project=config.project, name=config.name or os.path.basename(os.path.abspath(workdir)),
                    id=run_id, resume="allow", dir=workdir, mode=config.mode, config=run_config)


@dataclasses.dataclass(frozen=True)
class Interval:
  """One logging interval: ``tokens_per_s`` and ``step_s`` over the time spent in steps (evaluations,
  checkpoints and compilation excluded); ``wall_per_step_s`` over all of it (the ETA's rate);
  ``goodput``: the run's step time over its wall time so far."""

  tokens_per_s: float
  step_s: float
  wall_per_step_s: float
  goodput: float


class Throughput:
  """Step rates over the interval since the last ``update``, read off the run's phase clock (an object
  with ``phase_s(phase)``, ``wall_s()`` and ``goodput()``); ``flops_per_token`` (the model
  card's training FLOPs, None when unknown) turns tokens/s into MFU."""

  def __init__(self, start_step: int, flops_per_token: float | None, clock):
    self._clock = clock
    self._step = start_step
    self._steps_s, self._wall_s = self._readings()
    self.flops_per_token = flops_per_token

  def _readings(self) -> tuple[float, float]:
    return self._clock.phase_s("steps"), self._clock.wall_s()

  def update(self, step: int, tokens_per_step: int) -> Interval:
    steps_s, wall_s = self._readings()
    count = max(step - self._step, 1)
    step_s = max(steps_s - self._steps_s, 1e-9) / count
    wall_per_step_s = (wall_s - self._wall_s) / count
    self._step, self._steps_s, self._wall_s = step, steps_s, wall_s
    return Interval(tokens_per_step / step_s, step_s, wall_per_step_s, self._clock.goodput())
