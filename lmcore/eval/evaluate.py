"""Held-out evaluation (MATH §6.3): token-mean cross-entropy in nats, perplexity, paired
implementations, and the gate statistics of mixers that have them (MATH §1.3).

``graphdef`` + ``params`` + ``rest`` are merged inside jitted functions, so the same parameters can be
read out by another implementation or power p by changing only the graphdef (``model_graphdef``).
Per-batch results stay on the device until the last batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lmcore import data as data_lib
from lmcore.config import ExperimentConfig, ModelConfig
from lmcore.errors import Diverged
from lmcore.eval.generate import check_can_decode
from lmcore.loss import forward, nll_sum, split_batch, token_nll
from lmcore.model import LanguageModel, with_mixer_overrides

logger = logging.getLogger(__name__)


def model_graphdef(config: ModelConfig):
  """The structure of ``LanguageModel(config)`` without allocating its parameters."""
  return nnx.split(_abstract_model(config), nnx.Param, ...)[0]


def _abstract_model(config: ModelConfig) -> LanguageModel:
  return nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))


def _batches(heldout: dict[str, np.ndarray], batch_size: int, max_batches: int):
  n = heldout["tokens"].shape[0]
  starts = range(0, n, batch_size)
  if max_batches:
    starts = list(starts)[:max_batches]
  for start in starts:
    yield {k: v[start:start + batch_size] for k, v in heldout.items()}


def _host_sum(values) -> float:
  """The fp64 sum of per-batch device scalars, fetched together."""
  return float(np.sum(np.asarray(jax.device_get(values), np.float64)))


@functools.partial(jax.jit, static_argnames=("graphdef", "use_segments", "loss_impl", "block_tokens"))
def _batch_nll(graphdef, params, rest, batch, *, use_segments: bool, loss_impl: str, block_tokens: int):
  """Σ over the batch's tokens of −log p(target), fp32 (``loss.nll_sum``)."""
  inputs, targets, positions, segments = split_batch(batch, use_segments)
  return nll_sum(graphdef, params, rest, inputs, targets, positions, segments, loss_impl=loss_impl,
                 block_tokens=block_tokens)


def heldout_loss(graphdef, params, rest, heldout: dict[str, np.ndarray], *, batch_size: int,
                 use_segments: bool = False, max_batches: int = 0, loss_impl: str = "auto",
                 block_tokens: int = 0) -> dict[str, float]:
  """Token-mean cross-entropy (nats) and perplexity over the held-out windows (``loss_impl`` as in
  training: the fused loss never forms the [B, T, V] logits)."""
  sums, count = [], 0
  for batch in _batches(heldout, batch_size, max_batches):
    sums.append(_batch_nll(graphdef, params, rest, batch, use_segments=use_segments, loss_impl=loss_impl,
                           block_tokens=block_tokens))
    count += batch["tokens"][:, 1:].size
  loss = _host_sum(sums) / count
  return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


@functools.partial(jax.jit, static_argnames=("graphdef_a", "graphdef_b", "use_segments"))
def _paired_batch(graphdef_a, graphdef_b, params, rest, batch, *, use_segments: bool):
  """Both implementations' NLL sums over the batch and the max |Δlogit| between them."""
  inputs, targets, positions, segments = split_batch(batch, use_segments)
  logits_a = forward(graphdef_a, params, rest, inputs, positions, segments)
  logits_b = forward(graphdef_b, params, rest, inputs, positions, segments)
  nll_a, nll_b = token_nll(logits_a, targets), token_nll(logits_b, targets)
  return nll_a.sum(), nll_b.sum(), jnp.abs(logits_a - logits_b).max()


def paired_loss(graphdef_a, graphdef_b, params, rest, heldout: dict[str, np.ndarray], *, batch_size: int,
                use_segments: bool = False, max_batches: int = 0) -> dict[str, float]:
  """The same parameters and sequences through two implementations: both losses, their paired
  difference (mean of per-token NLL_b − NLL_a) and the max |Δlogit| over every position."""
  results, count = [], 0
  for batch in _batches(heldout, batch_size, max_batches):
    results.append(_paired_batch(graphdef_a, graphdef_b, params, rest, batch, use_segments=use_segments))
    count += batch["tokens"][:, 1:].size
  sums_a, sums_b, max_dlogits = zip(*results)
  sum_a, sum_b = _host_sum(sums_a), _host_sum(sums_b)
  return {"loss_a": sum_a / count, "loss_b": sum_b / count, "paired_diff": (sum_b - sum_a) / count,
          "max_abs_dlogit": float(np.max(jax.device_get(max_dlogits))), "tokens": count}


def override_graphdef(config: ModelConfig, kinds=None, **mixer_overrides):
  return model_graphdef(with_mixer_overrides(config, kinds, **mixer_overrides))


def _paired_kinds(config: ModelConfig) -> set[str]:
  """Mixers with a parallel/chunked vs recurrent choice (softmax's ``implementation`` picks a backend)."""
  return {kind for kind, cfg in config.mixers.items()
          if kind != "softmax" and "implementation" in {f.name for f in dataclasses.fields(cfg)}}


def _why_no_constant_state(config: ModelConfig) -> str | None:
  """None when every mixer of the model has a decode state, else the mixer's reason why not (SANATAN
  p >= 2 has no constant-size state, so its recurrent form does not exist)."""
  try:
    check_can_decode(_abstract_model(config))
  except (ValueError, NotImplementedError) as e:
    return str(e)
  return None


def paired_evaluation(config: ExperimentConfig, params, rest, heldout) -> dict[str, Any]:
  """MATH §6.3: the same sequences with ``paired_a`` (default: as trained) and ``paired_b`` (default:
  recurrent); nothing (logged) without a fixed-state mixer, ``{"paired_skipped": reason}`` when the
  requested implementations cannot run."""
  kinds = _paired_kinds(config.model)
  reason = _why_no_constant_state(config.model) if kinds else "no fixed-state mixer in this model"
  if reason is not None:
    logger.info("paired evaluation does not apply: %s", reason)
    return {}
  ev = config.eval
  name_a = ev.paired_a or "as_trained"
  try:
    graphdef_a = (override_graphdef(config.model, kinds, implementation=ev.paired_a) if ev.paired_a
                  else model_graphdef(config.model))
    graphdef_b = override_graphdef(config.model, kinds, implementation=ev.paired_b)
    result = paired_loss(graphdef_a, graphdef_b, params, rest, heldout, batch_size=ev.batch_size,
                         use_segments=config.data.segment_ids, max_batches=config.train.eval_batches)
  except (ValueError, NotImplementedError) as e:
    return {"paired_skipped": f"{type(e).__name__}: {e}"}
  return {f"loss_{name_a}": result["loss_a"], f"loss_{ev.paired_b}": result["loss_b"],
          "paired_diff": result["paired_diff"], "max_abs_dlogit": result["max_abs_dlogit"]}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _gate_statistics(graphdef, params, rest, tokens_BxT) -> dict[int, dict[str, jax.Array]]:
  """{layer: the mixer's ``gate_statistics(x_BxTxD)`` arrays} for every layer that has the hook."""
  model = nnx.merge(graphdef, params, rest)
  return {layer: block.mixer.gate_statistics(x_BxTxD)
          for layer, (block, x_BxTxD) in enumerate(zip(model.blocks, model.mixer_inputs(tokens_BxT)))
          if hasattr(block.mixer, "gate_statistics")}


def gate_statistics(config: ExperimentConfig, graphdef, params, rest, heldout) -> list[dict[str, Any]]:
  """MATH §1.3: one record per layer whose mixer has a ``gate_statistics(x_BxTxD) -> dict of arrays``
  hook (traced: it runs inside one compiled program with the whole model), on the first
  ``eval.gate_stats_sequences`` windows; empty when no mixer has one."""
  tokens_BxT = heldout["tokens"][:config.eval.gate_stats_sequences, :-1]
  layers = jax.device_get(_gate_statistics(graphdef, params, rest, tokens_BxT))
  return [{"layer": layer, **{k: np.asarray(v).item() for k, v in stats.items()}}
          for layer, stats in sorted(layers.items())]


def summary_lines(config: ExperimentConfig, record: dict[str, Any]) -> list[str]:
  """The console lines of one evaluation record; a requested paired evaluation that could not run
  says why."""
  lines = [f"held-out loss {record['loss']:.4f} nats (ppl {record['perplexity']:.2f}) over "
           f"{record['tokens']:,} tokens; unigram entropy of the training corpus "
           f"{record['unigram_entropy']:.4f} nats (a unigram model's held-out loss: "
           f"{record['unigram_heldout_xent']:.4f})"]
  if "paired_diff" in record:
    lines.append(f"paired {config.eval.paired_a or 'as trained'} vs {config.eval.paired_b}: "
                 f"diff {record['paired_diff']:.2e} nats, max |Δlogit| {record['max_abs_dlogit']:.2e}")
  if "paired_skipped" in record:
    lines.append(f"paired evaluation skipped: {record['paired_skipped']}")
  return lines


def _check_finite(record: dict[str, Any], step: int) -> None:
  """A result that is NaN or inf is not written or printed (JSON has no NaN; a NaN loss is no number)."""
  bad = sorted(k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v))
  if bad:
    raise Diverged(f"evaluation of step {step} gives non-finite {', '.join(f'{k}={record[k]}' for k in bad)}: "
                   "the parameters overflow on the held-out data (a diverged run, or a model read out at "
                   "settings it was not trained for); nothing was written.")


def _no_phase(part: str):
  del part
  return contextlib.nullcontext()


def evaluate_params(config: ExperimentConfig, out_dir: str, graphdef, params, rest, heldout, step: int,
                    tokenizer, writer=None, phase=None, *,
                    config_history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
  """The full held-out evaluation of one set of parameters; writes ``<out_dir>/eval_<step>.json``.
  ``phase(part)``: a context manager around each part (``heldout``, ``unigram``, ``paired``,
  ``gate_stats``), e.g. a run's phase clock. ``config_history``: the config changes accepted on the
  run's resumes up to ``step`` (the run's ``config_history.jsonl`` rows), cited in the record."""
  phase = phase or _no_phase
  os.makedirs(out_dir, exist_ok=True)
  record: dict[str, Any] = {"step": step, "name": config.name}
  if config_history is not None:
    record["config_history"] = config_history
  with phase("heldout"):
    record.update(heldout_loss(graphdef, params, rest, heldout, batch_size=config.eval.batch_size,
                               use_segments=config.data.segment_ids, max_batches=config.train.eval_batches,
                               loss_impl=config.train.loss_impl, block_tokens=config.train.loss_block_tokens))
  _check_finite(record, step)
  with phase("unigram"):
    record.update(data_lib.unigram_baseline(config.data, tokenizer, heldout["tokens"]))
  if config.eval.paired:
    with phase("paired"):
      record.update(paired_evaluation(config, params, rest, heldout))
  with phase("gate_stats"):
    layers = gate_statistics(config, graphdef, params, rest, heldout) if config.eval.gate_stats else []
  writes = jax.process_index() == 0  # every process computes the record; one writes it
  if layers:
    if writes:
      with open(os.path.join(out_dir, f"gate_stats_{step}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in layers)
    record["gate_stats_file"] = f"gate_stats_{step}.jsonl"
  _check_finite(record, step)
  if writes:
    _write_record(os.path.join(out_dir, f"eval_{step}.json"), record)
  lines = summary_lines(config, record)
  if writer is not None:
    writer.write(step, {f"eval/{k}": v for k, v in record.items() if isinstance(v, (int, float))})
    for line in lines:
      writer.console(line)
  else:
    print("\n".join(lines), flush=True)
  print(f"wrote {os.path.join(out_dir, f'eval_{step}.json')}", flush=True)
  return record


def _write_record(path: str, record: dict[str, Any]) -> None:
  """Writes the JSON ``record`` to ``path`` atomically (a temporary file renamed)."""
  with open(path + ".tmp", "w") as f:
    json.dump(record, f, indent=1, allow_nan=False)
  os.replace(path + ".tmp", path)


def add_to_record(out_dir: str, step: int, fields: dict[str, Any]) -> None:
  """Adds ``fields`` to ``<out_dir>/eval_<step>.json`` (process 0; nothing when there is no record)."""
  path = os.path.join(out_dir, f"eval_{step}.json")
  if jax.process_index() != 0 or not os.path.isfile(path):
    return
  with open(path) as f:
    record = json.load(f)
  _write_record(path, {**record, **fields})
