"""``train_and_evaluate(config, workdir)``: the training loop.

batch (per-process shard) -> global array on the mesh -> jitted step (bf16 activations, fp32 params,
optimizer state and loss; micro-batches by ``lax.scan``) -> AdamW -> metrics one step late (no host
sync on the hot path) -> JSONL, progress line, wandb -> Orbax save. A workdir with checkpoints
resumes; SIGTERM/SIGINT save and return; ``train.init_from`` loads parameters only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import signal
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax._src import config as jax_config

from lmcore import data as data_lib
from lmcore import loss as loss_lib
from lmcore import model_card
from lmcore.config import ExperimentConfig, TrainConfig, to_jsonable
from lmcore.errors import Diverged
from lmcore.eval import evaluate
from lmcore.train import goodput
from lmcore.train import metrics
from lmcore.train import perf
from lmcore.train import sharding
from lmcore.train import state as state_lib
from lmcore.train import workdir as workdir_lib
from lmcore.train.optim import learning_rate_schedule
from lmcore.train.state import Run, build_run


class StopRequested:
  """Set by SIGTERM/SIGINT; the loop polls it at every step and saves before returning."""

  def __init__(self):
    self.signal_name: str | None = None

  def install(self):
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
      signal.signal(s, self._handle)
    return previous

  def _handle(self, signum, _frame):
    self.signal_name = signal.Signals(signum).name

  @staticmethod
  def restore(previous):
    for s, handler in previous.items():
      signal.signal(s, handler)


def make_train_step(graphdef, tx, config: ExperimentConfig, shardings: sharding.TrainShardings | None = None):
  """(params, opt_state, rest, batch, step) -> (params, opt_state, metrics); micro-batches via lax.scan.

  ``shardings``: explicit in/out shardings (parameters and optimizer state donated); parameters are
  gathered over ``fsdp`` once per step and each micro-batch's gradient reduce-scattered before it is
  accumulated. Trace it under ``jax.set_mesh(shardings.mesh)`` (the kernels' ``shard_map`` reads it).
  """
  accum = config.train.grad_accum
  use_segments = config.data.segment_ids
  schedule = learning_rate_schedule(config.train)

  def batch_loss(params, rest, batch):
    return loss_lib.loss_fn(graphdef, params, rest, batch, use_segments, config.train.loss_impl,
                            config.train.loss_block_tokens)

  def grads_of(params, rest, batch):
    return jax.value_and_grad(batch_loss)(params, rest, batch)

  def constrain(tree, field: str):
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, getattr(shardings, field))

  def micro_batches(batch):
    # Micro-batch j holds rows j, j + accum, j + 2·accum, ...: a batch split over devices in contiguous
    # blocks of rows is then split the same way in every micro-batch, with no data movement.
    def split(x):
      x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
      return constrain(x, "micro_batch")
    return jax.tree.map(split, batch)

  def train_step(params, opt_state, rest, batch, step):
    compute_params = constrain(params, "compute_params")
    if accum == 1:
      loss, grads = grads_of(compute_params, rest, batch)
      grads = constrain(grads, "params")
    else:
      micro = micro_batches(batch)

      def body(carry, micro_batch):
        loss, grads = grads_of(compute_params, rest, micro_batch)
        return jax.tree.map(jnp.add, carry, (loss, constrain(grads, "params"))), None

      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
      (loss, grads), _ = jax.lax.scan(body, zeros, micro)
      loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
    with jax.named_scope("optimizer"):  # labels the update's ops in profiles
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads),
                               "learning_rate": schedule(step)}

  if shardings is None:
    return jax.jit(train_step, donate_argnums=(0, 1))
  s = shardings
  return jax.jit(train_step, in_shardings=(s.params, s.opt_state, s.rest, s.batch, s.replicated),
                 out_shardings=(s.params, s.opt_state, s.replicated), donate_argnums=(0, 1))


def _save(run: Run, last_loss: float | None) -> None:
  if last_loss is not None and not math.isfinite(last_loss):
    raise Diverged(
        f"loss is {last_loss} at step {run.step}; not saving. The last good checkpoint "
        f"(step {run.checkpointer.latest_step()}) is kept. Lower train.learning_rate or check the data.")
  run.checkpointer.save(run.step, state_lib.train_state(run), run.data_iterator, run.meta)


def write_run_info(run: Run, writer: metrics.MetricWriter) -> dict[str, Any]:
  """The first log lines: what is being trained and on what (with the corpus fingerprint), and the config
  changes accepted on resume; returns the model card. ``run_info.json`` is the first start's."""
  card = model_card.card(run.config.model, run.config.data.seq_len)
  info = {"config": to_jsonable(run.config), "model_card": card, "tokenizer": run.tokenizer.name,
          "data_fingerprint": run.meta["data_fingerprint"], "devices": [str(d) for d in jax.devices()]}
  if writer.enabled:
    workdir_lib.write_run_info(run.workdir, info, fresh=run.step == 0)
  writer.console(model_card.format_card(card))
  if history := workdir_lib.history_line(run.workdir):
    writer.console(history)
  return card


def train_and_evaluate(config: ExperimentConfig, workdir: str,
                       accept_config_changes: tuple[str, ...] = ()) -> dict[str, Any]:
  """Trains to ``train.steps`` (resuming if possible), evaluates, returns the final eval record (with the
  run's wall-time breakdown under ``"goodput"``). The run holds ``workdir`` throughout
  (``workdir.claim``): another process on it stops, and a resume whose config changes the run stops
  unless ``accept_config_changes`` names the changed fields."""
  clock = goodput.PhaseClock(goodput.take_process_start())
  with clock.phase("startup/claim"), workdir_lib.claim(config, workdir, accept_config_changes):
    clock.switch("startup")
    return _train_and_evaluate(config, workdir, clock)


def _train_and_evaluate(config: ExperimentConfig, workdir: str, clock: goodput.PhaseClock) -> dict[str, Any]:
  stop = StopRequested()
  previous_handlers = stop.install()
  run = writer = closing = None
  try:
    setup_compilation_cache(config)
    run = build_run(config, workdir, phase=lambda part: clock.phase(f"startup/{part}"))
    writer = metrics.MetricWriter(workdir, config.wandb, to_jsonable(config))
    card = write_run_info(run, writer)
    with clock.phase("startup/heldout"):
      heldout = data_lib.load_or_build_heldout(config.data, run.tokenizer, heldout_path(config, workdir))
    with jax.set_mesh(run.shardings.mesh):  # the Pallas kernels' shard_map reads the mesh from here
      _loop(run, writer, stop, heldout, clock, card["flops_per_token_train"])
      # The workers stop and the last save commits while the evaluation reads the held-out set.
      closing = threading.Thread(target=run.data_iterator.close, name="close-data")
      closing.start()
      if stop.signal_name:
        _shutdown(run, writer, clock, closing)
        writer.console(_stopped_line(run, stop.signal_name))
        return {"stopped_by": stop.signal_name, "step": run.step}
      # Training is saved; from here SIGINT / SIGTERM interrupt the evaluation instead of waiting for it.
      StopRequested.restore(previous_handlers)
      try:
        record = evaluate_run(run, heldout, writer, clock)
      except KeyboardInterrupt as e:
        raise type(e)(f"The evaluation was interrupted; step {run.step} is saved: evaluate it with "
                      f"eval.py --config=<the same config> --workdir={run.workdir}.") from None
    return {**record, "goodput": _shutdown(run, writer, clock, closing)}
  finally:
    if closing is not None:
      closing.join()
    if run is not None:
      run.data_iterator.close()
      run.checkpointer.close()
    if writer is not None:
      writer.close()
    StopRequested.restore(previous_handlers)


def _shutdown(run: Run, writer: metrics.MetricWriter, clock: goodput.PhaseClock,
              closing: threading.Thread) -> dict[str, Any]:
  """Waits for the last save's commit and the data workers' stop (``closing``), closes the checkpointer
  and the writers, then reports where the wall time went: a ``goodput`` row in ``metrics.jsonl``, the
  same record added to the final ``eval_<step>.json``, and one console line."""
  with clock.phase("shutdown/checkpoint_commit"):
    run.checkpointer.wait()
  with clock.phase("shutdown/data_workers"):
    closing.join()
  with clock.phase("shutdown/writers"):
    run.checkpointer.close()
    writer.close()
  record = clock.record()
  writer.write(run.step, {"goodput": record})
  evaluate.add_to_record(run.workdir, run.step, {"goodput": record})
  writer.console(goodput.summary_line(record))
  return record


def _stopped_line(run: Run, signal_name: str) -> str:
  if run.checkpointer.latest_step() == run.step and run.step:
    return f"{signal_name} received: saved step {run.step} and stopped."
  return f"{signal_name} received before the first step finished: stopped, nothing was saved."


def setup_compilation_cache(config: ExperimentConfig) -> str | None:
  """``train.compilation_cache``: the persistent compilation cache under the cache dir (see
  ``perf.enable_compilation_cache``); returns its directory, None when off."""
  if not config.train.compilation_cache:
    return None
  return perf.enable_compilation_cache(data_lib.cache_dir(config.data))


def heldout_path(config: ExperimentConfig, workdir: str) -> str:
  return config.data.heldout.path or os.path.join(workdir, "heldout.npz")


def _loop(run: Run, writer: metrics.MetricWriter, stop: StopRequested, heldout, clock: goodput.PhaseClock,
          flops_per_token: float | None = None) -> None:
  """Steps to ``train.steps``; every second of it charged to one phase of ``clock`` (start-up until the
  first batch is in hand, then compile, steps, data wait, checkpoint, eval)."""
  config, train = run.config, run.config.train
  if run.step >= train.steps:
    return
  tokens_per_step = train.batch_size * config.data.seq_len
  monitor_fn = make_monitor_fn(run.graphdef) if train.monitor_every else None
  profile = perf.ProfileWindow(train.profile_steps, os.path.join(run.workdir, "profile"), run.step + 1)
  with concurrent.futures.ThreadPoolExecutor(1) as ahead:
    # The input pipeline starts its workers and makes the first batch while the step compiles.
    first = ahead.submit(next, run.data_iterator)
    with clock.phase("compile"):
      train_step = compile_train_step(run, state_lib.abstract_batch(config, run.shardings))
    with clock.phase("startup/first_batch"):
      batch = sharding.global_batch(first.result(), run.shardings.mesh)
  throughput = metrics.Throughput(run.step, flops_per_token, clock)
  pending = None  # (step, device metrics) of the previous step, fetched after the next dispatch
  last_loss = None
  clock.switch("steps")
  while True:
    profile.before(run.step + 1)
    run.params, run.opt_state, step_metrics = train_step(run.params, run.opt_state, run.rest, batch, run.step)
    run.step += 1
    if traced := profile.after(run.step, step_metrics):
      writer.console(traced)
    if pending is not None:
      last_loss = _log(pending, writer, throughput, tokens_per_step, train)
    pending = (run.step, step_metrics)
    if run.step % train.checkpoint_every == 0 or run.step == train.steps or stop.signal_name:
      last_loss = _log(pending, writer, throughput, tokens_per_step, train)
      pending = None
      with clock.phase("checkpoint"):
        _save(run, last_loss)
    if train.eval_every and run.step % train.eval_every == 0 and run.step < train.steps:
      with clock.phase("eval/heldout"):
        _periodic_eval(run, heldout, writer)
    if train.monitor_every and run.step % train.monitor_every == 0:
      with clock.phase("eval/monitors"):
        monitors = monitor_fn(run.params, run.rest, batch["tokens"][:, :-1])
        writer.write(run.step, {f"monitor/layer{i}/{k}": v for i, m in monitors.items() for k, v in m.items()})
    if run.step >= train.steps or stop.signal_name:
      break
    batch = goodput.fetch_beside(clock, lambda: sharding.global_batch(next(run.data_iterator), run.shardings.mesh),
                                 running=jax.tree.leaves(step_metrics))
  if pending is not None:
    _log(pending, writer, throughput, tokens_per_step, train)
  clock.switch("shutdown")
  profile.close()


# TrainConfig fields that only the loop reads: runs that differ in nothing else share one train step.
LOOP_ONLY_FIELDS = ("seed", "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_last",
                    "keep_every", "init_from", "init_data_from", "monitor_every", "compilation_cache",
                    "profile_steps")
_DEFAULT_TRAIN = TrainConfig()


def step_key(graphdef, config: ExperimentConfig, shardings: sharding.TrainShardings, inputs) -> tuple:
  """Everything the compiled train step depends on, hashable: the step builder, the model (graph and
  config), the train config but for ``LOOP_ONLY_FIELDS`` (the optimizer is built from it), whether
  batches carry segments, the shardings, the inputs' shapes, dtypes and shardings, and JAX's tracing
  settings. Equal keys lower to the same program."""
  train = dataclasses.replace(config.train, **{f: getattr(_DEFAULT_TRAIN, f) for f in LOOP_ONLY_FIELDS})
  placements = jax.tree.flatten([getattr(shardings, f.name) for f in dataclasses.fields(shardings)])
  leaves, treedef = jax.tree.flatten(inputs)
  signature = tuple((np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "sharding", None)) for x in leaves)
  return (make_train_step, graphdef, config.model, train, config.data.segment_ids,
          tuple(placements[0]), placements[1], treedef, signature, jax_config.trace_context())


_COMPILED_STEPS: dict[str, Any] = {}  # lowered train step (its text) -> its executable, in this process
# Executables kept (the oldest goes first): one per distinct step of a reproduction chain's seed (its
# 13 runs), so that the next seed's runs find theirs.
_COMPILED_STEPS_KEPT = 16
_STEP_TEXTS: dict[tuple, str] = {}  # step_key -> the text its step lowered to


def compile_train_step(run: Run, batch):
  """The train step compiled ahead of its first call for ``batch``'s shapes and shardings (arrays or
  ShapeDtypeStructs), so that compilation is timed on its own; calling it runs what the jitted step
  would. Runs of one process share one executable when their ``step_key``s are equal (nothing is
  traced then) or their steps lower to the same program."""
  inputs = (run.params, run.opt_state, run.rest, batch, run.step)
  key = step_key(run.graphdef, run.config, run.shardings, inputs)
  if _STEP_TEXTS.get(key) in _COMPILED_STEPS:
    return _COMPILED_STEPS[_STEP_TEXTS[key]]
  lowered = make_train_step(run.graphdef, run.tx, run.config, run.shardings).lower(*inputs)
  text = lowered.as_text()
  if text not in _COMPILED_STEPS:
    while len(_COMPILED_STEPS) >= _COMPILED_STEPS_KEPT:
      _forget_step(next(iter(_COMPILED_STEPS)))
    _COMPILED_STEPS[text] = lowered.compile()
  _STEP_TEXTS[key] = text
  return _COMPILED_STEPS[text]


def _forget_step(text: str) -> None:
  del _COMPILED_STEPS[text]
  for key in [k for k, t in _STEP_TEXTS.items() if t == text]:
    del _STEP_TEXTS[key]


def make_monitor_fn(graphdef):
  """Per-layer mixer monitors (MATH §3: CyFA's state norm, gate and write-strength statistics) for
  every layer whose mixer has a ``monitors(x)`` method, on the current batch."""

  @jax.jit
  def monitor_fn(params, rest, tokens_BxT):
    model = nnx.merge(graphdef, params, rest)
    inputs = model.mixer_inputs(tokens_BxT)
    return {i: block.mixer.monitors(x) for i, (block, x) in enumerate(zip(model.blocks, inputs))
            if hasattr(block.mixer, "monitors")}

  return monitor_fn


def _log(pending, writer, throughput, tokens_per_step, train) -> float:
  step, device_metrics = pending
  values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
  if not math.isfinite(values["loss"]):
    raise Diverged(f"loss is {values['loss']} at step {step}. Checkpoints already written are "
                             f"kept; lower train.learning_rate or check the data.")
  if step % train.log_every == 0 or step == train.steps or step == 1:
    interval = throughput.update(step, tokens_per_step)
    values.update(tokens_per_s=interval.tokens_per_s, step_s=interval.step_s, goodput=interval.goodput)
    mfu, peak_bytes = perf.mfu(interval.tokens_per_s, throughput.flops_per_token), perf.peak_memory_bytes()
    values.update({k: v for k, v in (("mfu", mfu), ("peak_memory_bytes", peak_bytes)) if v is not None})
    writer.console(metrics.progress_line(step, train.steps, values["loss"], interval, mfu, peak_bytes))
  writer.write(step, values)
  return values["loss"]


def _periodic_eval(run: Run, heldout, writer) -> None:
  train = run.config.train
  result = evaluate.heldout_loss(run.graphdef, run.params, run.rest, heldout,
                                 batch_size=run.config.eval.batch_size, use_segments=run.config.data.segment_ids,
                                 max_batches=train.eval_batches, loss_impl=train.loss_impl,
                                 block_tokens=train.loss_block_tokens)
  writer.write(run.step, {f"eval/{k}": v for k, v in result.items()})
  writer.console(f"eval step {run.step}: held-out loss {result['loss']:.4f} nats "
                 f"(ppl {result['perplexity']:.2f}, {result['tokens']:,} tokens)")


def evaluate_run(run: Run, heldout, writer: metrics.MetricWriter | None = None,
                 clock: goodput.PhaseClock | None = None) -> dict[str, Any]:
  """Held-out loss (+ paired implementations for fixed-state models); writes ``eval_<step>.json``; each
  part charged to ``clock``'s ``eval/<part>``."""
  phase = (lambda part: clock.phase(f"eval/{part}")) if clock is not None else None
  return evaluate.evaluate_params(run.config, run.workdir, run.graphdef, run.params, run.rest, heldout,
                                  run.step, run.tokenizer, writer, phase=phase,
                                  config_history=workdir_lib.history_until(run.workdir, run.step))
