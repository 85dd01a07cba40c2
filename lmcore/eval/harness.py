"""Downstream tasks through EleutherAI's lm-evaluation-harness (``lm_eval``), for any checkpoint.

``HarnessLM(graphdef, params, rest, tokenizer, window=...)`` is an ``lm_eval`` model: pass it to
``lm_eval.simple_evaluate(model=lm, tasks=[...])`` or use ``evaluate_tasks`` (``eval.py --tasks``).

* ``loglikelihood`` / ``loglikelihood_rolling``: log p(continuation | context) = Σ_t log softmax(z_t)[y_t]
  over the continuation's tokens, fp32. Requests are sorted by length, cut into batches of
  ``batch_size`` rows, right-padded to a power-of-two length (causal models: padding after a token
  cannot change its score) and scored under ``jit``: one compiled program per padded length.
* ``generate_until``: greedy continuations on the compiled decode loop of ``lmcore/eval/generate.py``,
  cut at the first stop sequence (the loop itself stops at EOS or ``max_gen_toks``).
* Contexts longer than the training window (``data.seq_len``): ``long_context="truncate"`` keeps the
  last ``window`` tokens, as lm-eval's Hugging Face model does; ``"stream"`` feeds the whole context
  through the decode state in chunks of ``window`` tokens. Streaming needs every mixer to carry a
  state whose size does not grow with the context and no learned position table: SANATAN p = 1
  (6 channels), BASED (Taylor, sliding window, BaseConv), GLA, Gated DeltaNet, CyFA and the linear
  baselines stream; softmax attention (its KV cache grows) and SANATAN p >= 2 (no decode state) do not.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import lm_eval
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager

from lmcore.errors import ConfigError, MissingFileError
from lmcore.eval.generate import Generator, Sampling, check_can_decode

LONG_CONTEXT = ("truncate", "stream")
SMALLEST_BUCKET = 16  # shorter rows are padded to this many tokens


def bucket(length: int, window: int) -> int:
  """The padded length of a row of ``length`` tokens: the next power of two >= ``SMALLEST_BUCKET``,
  at most ``window`` (then ``window`` itself)."""
  return min(max(SMALLEST_BUCKET, 1 << max(0, length - 1).bit_length()), window)


def chunk_lengths(length: int, window: int) -> list[int]:
  """``length`` as a sum of powers of two (at most ``window`` each, largest first) and a remainder
  below ``SMALLEST_BUCKET`` left out: the prefill calls of a prompt (few distinct compiled shapes)."""
  chunks = []
  while length >= SMALLEST_BUCKET:
    chunk = min(window, 1 << (length.bit_length() - 1))
    chunks.append(chunk)
    length -= chunk
  return chunks


@dataclasses.dataclass(frozen=True)
class Row:
  """One scored sequence: ``inputs[t]`` predicts ``targets[t]``; the last ``n_scored`` targets count."""

  inputs: tuple[int, ...]
  targets: tuple[int, ...]
  n_scored: int


def continuation_row(context: Sequence[int], continuation: Sequence[int], window: int | None) -> Row:
  """The row scoring ``continuation`` after ``context``; ``window``: keep only the last ``window``
  inputs (left truncation), None: keep everything."""
  if not continuation:
    raise ValueError("an lm-eval request has an empty continuation; it has no tokens to score")
  whole = list(context) + list(continuation)
  if window is not None:
    if len(continuation) > window:
      raise ConfigError(f"a continuation of {len(continuation)} tokens is longer than the model's window "
                        f"({window} tokens, data.seq_len); score it with long_context='stream' if the "
                        "model streams, or shorten the task's continuations")
    whole = whole[-(window + 1):]
  return Row(tuple(whole[:-1]), tuple(whole[1:]), len(continuation))


def _row_scores(model, h_BxTxD, targets_BxT, weights_BxT):
  """Σ_t w_t log p(y_t) and whether every weighted target is the argmax, per row (fp32)."""
  logits_BxTxV = model.logits(h_BxTxD)
  logp_BxT = (jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
              - jax.nn.logsumexp(logits_BxTxV, axis=-1))
  greedy_BxT = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT) | (weights_BxT == 0)
  return (logp_BxT * weights_BxT).sum(-1), greedy_BxT.all(-1)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(graphdef, params, rest, inputs_BxT, targets_BxT, weights_BxT):
  """Every row from position 0, no state."""
  model = nnx.merge(graphdef, params, rest)
  h_BxTxD, _ = model.hidden_states(inputs_BxT)
  return _row_scores(model, h_BxTxD, targets_BxT, weights_BxT)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def _score_chunk(graphdef, params, rest, inputs_BxC, targets_BxC, weights_BxC, state):
  """One chunk of every row through the decode state; returns the chunk's scores and the new state."""
  model = nnx.merge(graphdef, params, rest)
  h_BxCxD, state = model.hidden_states(inputs_BxC, state)
  return *_row_scores(model, h_BxCxD, targets_BxC, weights_BxC), state


def _padded(rows: Sequence[Row], batch_size: int, length: int):
  """Inputs, targets (int32) and weights (fp32) [batch_size, length]; missing rows weigh nothing."""
  inputs, targets = np.zeros((batch_size, length), np.int32), np.zeros((batch_size, length), np.int32)
  weights = np.zeros((batch_size, length), np.float32)
  for b, row in enumerate(rows):
    n = len(row.inputs)
    inputs[b, :n], targets[b, :n] = row.inputs, row.targets
    weights[b, n - row.n_scored:n] = 1.0
  return inputs, targets, weights


def why_cannot_stream(model) -> str | None:
  """None when ``model`` can stream contexts through its state (see the module docstring), else why not."""
  if model.config.max_positions:
    return f"it has a learned position table of {model.config.max_positions} positions"
  try:
    check_can_decode(model)
  except (ValueError, NotImplementedError) as e:
    return str(e)
  sizes = {model.state_bytes(1, n) for n in (256, 512)}
  if len(sizes) > 1:
    return "a mixer's decode state grows with the context (softmax attention's KV cache)"
  return None


class HarnessLM(TemplateLM):
  """An ``lm_eval`` model over one set of parameters (see the module docstring).

  ``tokenizer``: the run's (``encode``, ``decode``, ``eos_id``); EOS also stands for an empty context,
  as documents are separated by it in training. ``window``: the training context (``data.seq_len``).
  """

  def __init__(self, graphdef, params, rest, tokenizer, *, window: int, batch_size: int = 8,
               long_context: str = "truncate"):
    super().__init__()
    if long_context not in LONG_CONTEXT:
      raise ConfigError(f"long_context={long_context!r}; choose one of {', '.join(LONG_CONTEXT)}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
      raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    self.graphdef, self.params, self.rest = graphdef, params, rest
    self.tokenizer, self.window, self.batch_size = tokenizer, window, batch_size
    self._model = nnx.merge(graphdef, params, rest)
    if long_context == "stream":
      reason = why_cannot_stream(self._model)
      if reason is not None:
        raise ConfigError(f"long_context='stream' needs a fixed-size decode state, and this model has none: "
                          f"{reason}. Use long_context='truncate'.")
    self.long_context = long_context
    self._generator: Generator | None = None
    self.seconds = 0.0  # spent in the request methods (tokenizing, compiling, scoring, decoding)

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def max_length(self) -> int:
    return self.window

  @property
  def tokenizer_name(self) -> str:
    return getattr(self.tokenizer, "name", type(self.tokenizer).__name__)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    return list(self.tokenizer.encode(string))

  def tok_decode(self, ids) -> str:
    return self.tokenizer.decode(ids)

  # -- scoring ------------------------------------------------------------------------------------

  def score_rows(self, rows: Sequence[Row]) -> list[tuple[float, bool]]:
    """(Σ log p over each row's scored targets, whether they are all greedy), in the order given."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].inputs))
    results: list[tuple[float, bool] | None] = [None] * len(rows)
    pending = []
    for start in range(0, len(order), self.batch_size):
      batch = [rows[i] for i in order[start:start + self.batch_size]]
      pending.append((order[start:start + self.batch_size], self._score_batch(batch)))
    for indices, (sums_B, greedy_B) in pending:  # fetched after every batch was dispatched
      sums_B, greedy_B = np.asarray(sums_B, np.float64), np.asarray(greedy_B)
      for b, i in enumerate(indices):
        results[i] = (float(sums_B[b]), bool(greedy_B[b]))
    return results

  def _score_batch(self, batch: Sequence[Row]):
    longest = max(len(row.inputs) for row in batch)
    if longest <= self.window:
      inputs, targets, weights = _padded(batch, self.batch_size, bucket(longest, self.window))
      return _score(self.graphdef, self.params, self.rest, inputs, targets, weights)
    n_chunks = math.ceil(longest / self.window)
    inputs, targets, weights = _padded(batch, self.batch_size, n_chunks * self.window)
    state = self._model.init_state(self.batch_size, self.window)
    sums_B, greedy_B = jnp.zeros((self.batch_size,)), jnp.ones((self.batch_size,), bool)
    for c in range(n_chunks):
      cut = slice(c * self.window, (c + 1) * self.window)
      chunk_sums_B, chunk_greedy_B, state = _score_chunk(
          self.graphdef, self.params, self.rest, inputs[:, cut], targets[:, cut], weights[:, cut], state)
      sums_B, greedy_B = sums_B + chunk_sums_B, greedy_B & chunk_greedy_B
    return sums_B, greedy_B

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    start = time.perf_counter()
    window = None if self.long_context == "stream" else self.window
    results = self.score_rows([continuation_row(context, continuation, window)
                               for _, context, continuation in requests])
    self.seconds += time.perf_counter() - start
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def rolling_rows(self, text: str) -> list[Row]:
    """The rows whose scores sum to log p(text | EOS): windows of lm-eval's rolling scheme (every token
    scored once, each with up to ``window`` tokens of context), or one row when streaming."""
    ids = self.tok_encode(text)
    if self.long_context == "stream":
      return [continuation_row([self.eot_token_id], ids, None)] if ids else []
    windows = lm_eval_utils.get_rolling_token_windows(ids, self.eot_token_id, self.window, 1)
    return [continuation_row(context, continuation, self.window)
            for context, continuation in map(lm_eval_utils.make_disjoint_window, windows)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    start = time.perf_counter()
    per_request = [self.rolling_rows(request.args[0]) for request in requests]
    scores = self.score_rows([row for rows in per_request for row in rows])
    self.seconds += time.perf_counter() - start
    results, start = [], 0
    for request, rows in zip(requests, per_request):
      total = sum(score for score, _ in scores[start:start + len(rows)])
      start += len(rows)
      self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
      results.append(total)
    return results

  # -- generation ---------------------------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    start = time.perf_counter()
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
    results: list[str | None] = [None] * len(requests)
    for indices in groups.values():
      kwargs = dict(requests[indices[0]].args[1])
      for i, text in zip(indices, self.generate([requests[i].args[0] for i in indices], **kwargs)):
        results[i] = text
        self.cache_hook.add_partial("generate_until", requests[i].args, text)
    self.seconds += time.perf_counter() - start
    return results

  def generate(self, contexts: Sequence[str], *, until=None, max_gen_toks: int = 256, do_sample: bool = False,
               temperature: float = 0.0, **ignored) -> list[str]:
    """The continuation of every context up to the first of the ``until`` strings (excluded), EOS or
    ``max_gen_toks`` tokens; greedy unless ``do_sample`` with ``temperature`` > 0."""
    until = [until] if isinstance(until, str) else list(until or [])
    sampling = Sampling(temperature=float(temperature) if do_sample else 0.0)
    prompts = [self._prompt_ids(context, max_gen_toks) for context in contexts]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    texts: list[str] = [""] * len(prompts)
    for start in range(0, len(order), self.batch_size):
      indices = order[start:start + self.batch_size]
      for i, ids in zip(indices, self._generate_batch([prompts[i] for i in indices], max_gen_toks, sampling)):
        texts[i] = _cut_at_stops(self.tok_decode(ids), until)
    return texts

  def _prompt_ids(self, context: str, max_gen_toks: int) -> list[int]:
    ids = self.tok_encode(context) or [self.eot_token_id]
    if self.long_context == "stream":
      return ids
    if max_gen_toks >= self.window:
      raise ConfigError(f"max_gen_toks={max_gen_toks} leaves no room for a context in the model's window of "
                        f"{self.window} tokens; ask the task for fewer tokens")
    return ids[-(self.window - max_gen_toks):]

  def _generate_batch(self, prompts: list[list[int]], max_gen_toks: int,
                      sampling: Sampling) -> list[list[int]]:
    """Prefill the shortest prompt's length in power-of-two chunks, then the decode loop (which feeds
    every row's remaining prompt tokens before sampling)."""
    if self._generator is None:
      try:
        self._generator = Generator(self._model)
      except (ValueError, NotImplementedError) as e:
        raise ConfigError(f"generation tasks need a model that decodes token by token, and this one "
                          f"cannot: {e} Evaluate it on loglikelihood tasks only.") from None
    n = len(prompts)
    rows = prompts + [prompts[0]] * (self.batch_size - n)
    lengths = np.array([len(r) for r in rows])
    prefill = chunk_lengths(int(lengths.min()), self.window)
    done = sum(prefill)
    forced_len = max(1, int(lengths.max()) - done)
    forced_BxF = np.zeros((self.batch_size, 1 << (forced_len - 1).bit_length()), np.int32)
    for b, row in enumerate(rows):
      forced_BxF[b, :len(row) - done] = row[done:]
    # Rows that finish early keep being fed until the last one stops: room for every step of the loop.
    max_len = 1 << (done + forced_BxF.shape[1] + max_gen_toks - 1).bit_length()
    state = None if prefill else self._generator.init_state(self.batch_size, max_len)
    logits_BxV = jnp.zeros((self.batch_size, self._model.config.vocab_size), jnp.float32)
    offset = 0
    for chunk in prefill:  # without a prefill, the decode loop feeds the first prompt token itself
      chunk_BxC = np.array([row[offset:offset + chunk] for row in rows], np.int32)
      logits_BxV, state = self._generator.prefill(chunk_BxC, state, max_len=max_len)
      offset += chunk
    out_BxS, n_new_B, _ = self._generator.decode(
        logits_BxV, state, max_new_tokens=max_gen_toks, sampling=sampling, eos_id=self.eot_token_id,
        forced_BxF=forced_BxF, n_forced_B=lengths - done)
    out_BxS, n_new_B = np.asarray(out_BxS), np.asarray(n_new_B)
    forced_B = lengths - done
    return [[t for t in out_BxS[b, forced_B[b]:forced_B[b] + n_new_B[b]].tolist() if t != self.eot_token_id]
            for b in range(n)]


def _cut_at_stops(text: str, until: Sequence[str]) -> str:
  for stop in until:
    if stop:
      text = text.split(stop, 1)[0]
  return text


# -- tasks, results and their record ---------------------------------------------------------------


def task_manager(task_path: str = "", names: Sequence[str] = ()):
  """lm-eval's ``TaskManager``: the task YAMLs under ``task_path`` alone when they hold every one of
  ``names`` (indexing lm-eval's own few thousand tasks is skipped), else those and lm-eval's."""
  if task_path:
    if not os.path.isdir(task_path):
      raise MissingFileError(f"--task_path={task_path!r} is not a folder; give the folder of the task YAMLs")
    local = TaskManager(include_path=task_path, include_defaults=False)
    if all(name in local.all_tasks for name in names):
      return local
  return TaskManager(include_path=task_path or None)


def load_tasks(manager, names: Sequence[str]) -> list[Any]:
  """lm-eval's Task (or Group) objects of ``names``, built one by one so that a failure names its task:
  an unknown name or a dataset missing offline is one ``ConfigError`` / ``MissingFileError`` line."""
  specs = []
  for name in names:
    try:
      loaded = manager.load(name)
    except KeyError:
      raise ConfigError(f"unknown task {name!r}: it is not one of lm-eval's tasks nor a task YAML under "
                        "--task_path; list lm-eval's with `lm-eval ls tasks`") from None
    except OSError as e:
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise MissingFileError(
          f"task {name!r} cannot read its dataset ({first}). Datasets are read offline from the Hugging "
          "Face cache (HF_HOME; HF_DATASETS_OFFLINE=1): fetch it once where there is network with "
          "`python -c \"import datasets; datasets.load_dataset('<its dataset_path>')\"` and copy the cache, "
          "or write a local-file task YAML and pass its folder as --task_path (README, Downstream "
          "evaluation)") from None
    if name in loaded["groups"]:
      specs.append(loaded["groups"][name])
    else:
      specs.extend(loaded["tasks"].values())
  return specs


def run_tasks(lm: HarnessLM, names: Sequence[str], *, task_path: str = "", limit: int | None = None,
              num_fewshot: int | None = None, bootstrap_iters: int = 1000) -> dict[str, Any]:
  """``lm_eval.simple_evaluate`` of ``lm`` on ``names``; returns lm-eval's results dict. Means have a
  closed-form stderr; the other aggregations get ``bootstrap_iters`` resamples on the host (lm-eval's
  default is 100,000)."""
  manager = task_manager(task_path, names)
  return lm_eval.simple_evaluate(model=lm, tasks=load_tasks(manager, names), limit=limit,
                                 num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters, log_samples=False,
                                 task_manager=manager)


def result_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per (task, metric) of lm-eval's results: task, metric, value, stderr (None when lm-eval
  has none), n (examples scored). A metric under a filter other than "none" is named metric,filter."""
  rows = []
  for task, metrics in results["results"].items():
    n = results.get("n-samples", {}).get(task, {}).get("effective")
    for key, value in metrics.items():
      metric, comma, filter_name = key.partition(",")  # other keys (alias, sample_len) are no metrics
      if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
        continue
      stderr = metrics.get(f"{metric}_stderr,{filter_name}")
      rows.append({"task": task, "metric": metric if filter_name == "none" else key, "value": float(value),
                   "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "n": n})
  return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """The rows as one aligned text table: task, metric, value ± stderr, n."""
  header = ("task", "metric", "value", "stderr", "n")
  lines = [[r["task"], r["metric"], f"{r['value']:.4f}",
            "" if r["stderr"] is None else f"± {r['stderr']:.4f}", "" if r["n"] is None else str(r["n"])]
           for r in rows]
  widths = [max(len(x) for x in column) for column in zip(header, *lines)]
  return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *lines])


def record_path(out_dir: str, step: int, names: Sequence[str]) -> str:
  """``<out_dir>/eval_<step>_<tasks>.json``: the task names joined by "+", other characters as "_"."""
  tasks = re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(names))
  return os.path.join(out_dir, f"eval_{step}_{tasks}.json")


def evaluate_tasks(lm: HarnessLM, names: Sequence[str], *, out_dir: str, step: int, name: str, card: dict,
                   task_path: str = "", limit: int | None = None, num_fewshot: int | None = None
                   ) -> dict[str, Any]:
  """``eval.py --tasks``: runs the tasks, prints their table, writes ``record_path(...)`` (process 0).
  ``examples_per_s``: examples over the seconds spent in the model's request methods (compilation
  included, loading the tasks not)."""
  start = lm.seconds
  results = run_tasks(lm, names, task_path=task_path, limit=limit, num_fewshot=num_fewshot)
  seconds = lm.seconds - start
  rows = result_rows(results)
  examples = sum(n["effective"] for n in results.get("n-samples", {}).values())
  record = {"step": step, "name": name, "tasks": list(names), "limit": limit, "num_fewshot": num_fewshot,
            "batch_size": lm.batch_size, "long_context": lm.long_context, "window": lm.window,
            "results": rows, "examples": examples, "seconds": seconds,
            "examples_per_s": examples / seconds if seconds else None, "model_card": card}
  path = record_path(out_dir, step, names)
  if jax.process_index() == 0:
    os.makedirs(out_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
  print(format_table(rows), flush=True)
  print(f"{examples} examples, {seconds:.1f} s in the model; wrote {path}", flush=True)
  return record

