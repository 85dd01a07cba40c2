"""Metric writers (process 0 only): ``metrics.jsonl`` in the workdir, a console progress line, wandb.

wandb is imported lazily and only when ``wandb.mode`` is not "disabled"; the run id is stored in
``<workdir>/wandb_run_id`` so that a resumed run continues the same wandb run. Without the package,
"offline" (the default) falls back to "disabled" with one console line; "online" is an error.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from typing import Any

import jax

from lmcore.config import WandbConfig
from lmcore.errors import ConfigError


def format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress_line(step: int, total: int, loss: float, tokens_per_s: float, step_s: float,
                  mfu: float | None = None, peak_bytes: int | None = None) -> str:
  """One console line; MFU (a fraction) and the device's peak memory appear where they are known."""
  eta = (total - step) * step_s
  parts = [f"step {step}/{total}", f"loss {loss:.4f}", f"{tokens_per_s:,.0f} tok/s", f"{step_s * 1e3:.1f} ms/step"]
  if mfu is not None:
    parts.append(f"MFU {100 * mfu:.1f}%")
  if peak_bytes is not None:
    parts.append(f"peak {peak_bytes / 2 ** 30:.1f} GiB")
  return " | ".join(parts + [f"ETA {format_duration(eta)}"])


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


class Throughput:
  """Tokens/s and seconds/step over the interval since the last call; ``flops_per_token`` (the model
  card's training FLOPs, None when unknown) turns tokens/s into MFU."""

  def __init__(self, start_step: int, flops_per_token: float | None = None):
    self._time = time.perf_counter()
    self._step = start_step
    self.flops_per_token = flops_per_token

  def update(self, step: int, tokens_per_step: int) -> tuple[float, float]:
    now = time.perf_counter()
    steps = max(step - self._step, 1)
    step_s = (now - self._time) / steps
    self._time, self._step = now, step
    return tokens_per_step / step_s, step_s
