"""Checkpoints evaluated, and chains of runs (staged training) that a rerun continues.

``evaluate_checkpoint`` (``eval.py``) evaluates a run's parameters, ``evaluate_tasks`` (``eval.py
--tasks``) scores them on lm-eval tasks; a finished run or evaluation is read back from its
``eval_<step>.json``, its ``metrics.jsonl`` as a loss curve and a training time (the pieces of
``scripts/quickstart.py`` and ``scripts/reproduce.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from lmcore import data as data_lib
from lmcore.config import ExperimentConfig
from lmcore.eval import evaluate
from lmcore.eval.generate import Sampling, check_decodable, check_prompts, sample_to_jsonl
from lmcore.model import with_mixer_overrides
from lmcore.train import checkpoint as ckpt_lib
from lmcore.train import loop as train_lib
from lmcore.train import sharding
from lmcore.train import state as state_lib
from lmcore.train import workdir as workdir_lib


def read_record(out_dir: str, step: int) -> dict[str, Any] | None:
  """The evaluation record ``<out_dir>/eval_<step>.json``, None when there is none."""
  path = os.path.join(out_dir, f"eval_{step}.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def train_or_read(config: ExperimentConfig, workdir: str,
                  accept_config_changes: tuple[str, ...] = ()) -> dict[str, Any]:
  """The final evaluation record of the run ``config`` in ``workdir``: read back when the run finished
  and was evaluated, else trained (resuming its checkpoints, ``accept_config_changes`` as in
  ``train_and_evaluate``) and evaluated. A run stopped by SIGTERM/SIGINT returns
  ``{"stopped_by": ..., "step": ...}`` as ``train_and_evaluate`` does."""
  record = read_record(workdir, config.train.steps)
  if record is not None:
    return record
  return train_lib.train_and_evaluate(config, workdir, accept_config_changes)


def restore_checkpoint(config: ExperimentConfig, workdir: str, step: int | None = None):
  """``(graphdef, params, rest, step)`` of the run's checkpoint (latest unless ``step``), the parameters in
  the model's shardings on the mesh in context (``jax.set_mesh``)."""
  graphdef, abstract_params, abstract_rest = state_lib.abstract_model(config.model)
  mesh = sharding.current_mesh()
  param_shardings = sharding.param_shardings(abstract_params, mesh, config.model.d_model)
  rest_shardings = jax.tree.map(lambda _: sharding.replicated(mesh), abstract_rest)
  params, rest, step, _ = ckpt_lib.load_params(
      workdir, sharding.with_shardings(abstract_params, param_shardings),
      sharding.with_shardings(abstract_rest, rest_shardings), step=step)
  return graphdef, params, rest, step


def evaluate_checkpoint(config: ExperimentConfig, workdir: str, step: int | None = None,
                        prompt: str | Sequence[str] = "", max_new_tokens: int = 64, out_dir: str = "", *,
                        sampling: Sampling = Sampling(), seed: int = 0, samples_path: str = "",
                        stream_tokens: int = 8) -> dict[str, Any]:
  """eval.py: held-out evaluation of a run's checkpoint (latest unless ``step``), optional samples of
  ``max_new_tokens`` after each prompt (one text or several, one batch), printed as they come and
  written to ``samples_path`` (default ``<out_dir>/samples_<step>.jsonl``). Results go to ``out_dir``
  (default: the workdir) and cite the run's config history up to ``step``. The parameters are restored in
  the model's shardings on the mesh in context (``jax.set_mesh``). No lock is taken: a workdir that a run
  is training can be evaluated."""
  prompts = ([prompt] if prompt else []) if isinstance(prompt, str) else list(prompt)
  if prompts:
    check_decodable(config.model)
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer, data_lib.cache_dir(config.data))
  data_lib.check_vocab(tokenizer, config.model.vocab_size)
  if prompts:  # before the held-out evaluation: a prompt that cannot be sampled fails at once
    check_prompts([tokenizer.encode(p) for p in prompts], max_new_tokens, config.model)
  graphdef, params, rest, step = restore_checkpoint(config, workdir, step)
  heldout = data_lib.load_or_build_heldout(config.data, tokenizer, train_lib.heldout_path(config, workdir))
  record = evaluate.evaluate_params(config, out_dir or workdir, graphdef, params, rest, heldout, step,
                                    tokenizer, config_history=workdir_lib.history_until(workdir, step))
  if prompts:
    path = samples_path or os.path.join(out_dir or workdir, f"samples_{step}.jsonl")
    samples = sample_to_jsonl(nnx.merge(graphdef, params, rest), tokenizer, prompts, path,
                              max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                              segment=stream_tokens)
    record["sample"] = samples[0]["completion"]
  return record


def evaluate_step(config: ExperimentConfig, workdir: str, step: int, out_dir: str = "") -> dict[str, Any]:
  """The held-out evaluation of checkpoint ``step`` of ``workdir`` under ``config``, written to
  ``<out_dir>/eval_<step>.json`` (default: the workdir) or read back from it."""
  out_dir = out_dir or workdir
  record = read_record(out_dir, step)
  if record is None:
    with jax.set_mesh(sharding.make_mesh(config.mesh)):  # the kernels' shard_map reads the mesh from here
      record = evaluate_checkpoint(config, workdir, step, out_dir=out_dir)
  return record


def readout(config: ExperimentConfig, workdir: str, step: int, out_dir: str, **mixer_overrides) -> dict[str, Any]:
  """Checkpoint ``step`` read out with mixer fields replaced (e.g. a p = 2 SANATAN model at ``p=1``,
  MATH §1.4's unadapted control): the held-out loss only, no paired implementations, no gate statistics."""
  readout_config = dataclasses.replace(
      config, model=with_mixer_overrides(config.model, **mixer_overrides),
      eval=dataclasses.replace(config.eval, paired=False, gate_stats=False))
  return evaluate_step(readout_config, workdir, step, out_dir)


def view_path(workdir: str, step: int) -> str:
  """Where ``step_view(workdir, step)`` puts its folder."""
  return os.path.join(workdir, "views", str(step))


def has_checkpoint(workdir: str, step: int | None = None) -> bool:
  """Whether ``workdir`` keeps the checkpoint of ``step`` (any step when None)."""
  folder = os.path.join(workdir, "checkpoints")
  if step is not None:
    return os.path.isdir(os.path.join(folder, str(step)))
  return os.path.isdir(folder) and any(n.isdigit() for n in os.listdir(folder))


def step_view(workdir: str, step: int) -> str:
  """A folder ``view_path(workdir, step)`` whose only checkpoint is ``step`` of ``workdir`` (a relative
  symbolic link): ``train.init_from`` and ``train.init_data_from`` read a run's latest step, and this
  makes an earlier kept step the latest."""
  source = os.path.join(workdir, "checkpoints", str(step))
  if not os.path.isdir(source):
    kept = sorted(int(n) for n in os.listdir(os.path.dirname(source)) if n.isdigit()) if os.path.isdir(
        os.path.dirname(source)) else []
    raise ckpt_lib.CheckpointError(f"{workdir} keeps no checkpoint of step {step} (kept: {kept}); it was "
                                   "trained with other settings. Use a new workdir.")
  view = view_path(workdir, step)
  link = os.path.join(view, "checkpoints", str(step))
  if not os.path.islink(link):
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(os.path.relpath(source, os.path.dirname(link)), link)
  return view


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The rows of ``<workdir>/metrics.jsonl`` in the order written (empty when there is none)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def loss_curve(rows: list[dict[str, Any]], key: str = "loss") -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of ``key`` in step order; where a resumed run logged a step again, its last value."""
  values = {row["step"]: row[key] for row in rows if key in row}
  steps = np.array(sorted(values), dtype=np.int64)
  return steps, np.array([values[s] for s in steps], dtype=np.float64)


def curve_points(rows: list[dict[str, Any]], key: str = "loss", max_points: int = 500) -> list[list[float]]:
  """``[[step, value], ...]`` of ``loss_curve(rows, key)`` in at most ``max_points`` points: a longer
  curve is cut into ``max_points`` runs of consecutive points, each given as its last step and its mean."""
  steps, values = loss_curve(rows, key)
  if len(steps) > max_points:
    groups = np.array_split(np.arange(len(steps)), max_points)
    steps = np.array([steps[g[-1]] for g in groups])
    values = np.array([values[g].mean() for g in groups])
  return [[int(s), float(v)] for s, v in zip(steps, values)]


def training_seconds(rows: list[dict[str, Any]]) -> float:
  """Seconds spent training, summed over the run's processes (resumes included): every ``log_every``-th
  row's ``step_s`` is the mean step time since the previous such row of its process; a process starts
  where the step count stops rising."""
  total, previous, anchor = 0.0, None, 0
  for row in rows:
    if "loss" not in row:
      continue
    step = row["step"]
    if previous is None or step <= previous:
      anchor = step - 1
    if "step_s" in row:
      total += row["step_s"] * (step - anchor)
      anchor = step
    previous = step
  return total
