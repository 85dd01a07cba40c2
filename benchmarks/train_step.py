"""The whole training step of the paper presets, timed in one process (``scripts/bench_train.py``).

Each preset runs the project's own step (``lmcore.train.loop.make_train_step``: model, loss, AdamW with
clipping and schedule, gradient accumulation) on synthetic tokens, at a common global batch and sequence
length, keeping the preset's micro-batch (its memory plan: ``batch_size / grad_accum``). Measured per
preset: compile seconds (lowering + XLA compilation), ms per step and tokens/s over the timed steps
(after warm-up steps), MFU from the model card's training FLOPs per token and, as in the papers' "6N"
convention, from 6 × parameters, XLA's memory plan of the compiled step and the device's peak memory.
With a profile directory, a few more steps are traced with ``jax.profiler`` and their kernel time is
broken down by category, scope and kernel (``benchmarks/profile_summary.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import gc
import importlib
import gzip
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from benchmarks import profile_summary
from benchmarks.rows import append_row, fmt

GIB = 2 ** 30


def _softmax_184m() -> ml_collections.ConfigDict:
  """Softmax attention with a learned position table on the SANATAN 184M backbone: the same embedding,
  absolute position table, 12 layers of SwiGLU and width, 12 heads of 64; no RoPE. The like-for-like
  row of SANATAN's own positions; the softmax reference is ``transformer_pp_184m``."""
  from configs import common, sanatan

  return common.experiment(
      model=dict(sanatan.MODEL_184M, pattern="softmax*12"),
      mixers={"softmax": dict(n_heads=12, head_dim=64, rope=False)}, train=sanatan.paper_train(),
      data=sanatan.paper_data(), sources=sanatan.paper_sources(), tokenizer=sanatan.paper_tokenizer(),
      heldout=sanatan.paper_heldout(), name="softmax_184m")


# Long-context shapes: the 184M recipe's 65,536 tokens per step in one micro-batch of longer sequences.
LONG_CONTEXT = {"8k": (8, 8192), "32k": (2, 32768)}
LONG_CONTEXT_MODELS = {"sanatan_p1_184m": ("sanatan", "184m_p1_scratch"),
                       "transformer_pp_184m": ("baselines", "transformer_pp_184m"),
                       "gla_182m": ("baselines", "gla_182m")}


def _long_context(module: str, preset: str, batch: int, seq_len: int):
  """``module:preset`` at ``batch`` × ``seq_len`` in one micro-batch, without a position table (the
  fixed-state mixers and RoPE carry position; a table would cap the length)."""
  def build() -> ml_collections.ConfigDict:
    cd = importlib.import_module(f"configs.{module}").get_config(preset)
    cd.train.batch_size, cd.train.grad_accum, cd.data.seq_len = batch, 1, seq_len
    cd.model.max_positions = 0
    cd.name = f"{cd.name}_{seq_len}"
    return cd
  return build


# Named presets: (config module, preset) or a builder. Any "module:preset" of configs/ works too.
PRESETS = {
    "transformer_pp_184m": ("baselines", "transformer_pp_184m"),
    "softmax_184m": _softmax_184m,
    "sanatan_p1_184m": ("sanatan", "184m_p1_scratch"),
    "sanatan_p2_184m": ("sanatan", "184m_p2"),
    "gla_182m": ("baselines", "gla_182m"),
    "cyfa": ("baselines", "cyfa_equal_state"),
    "transformer_pp_360m": ("baselines", "transformer_pp_360m"),
    "based_360m": ("based", "360m"),
    "transformer_pp_1p3b": ("baselines", "transformer_pp_1p3b"),
    "based_1p3b": ("based", "1p3b"),
    **{f"{model}_{length}": _long_context(*entry, *shape) for length, shape in LONG_CONTEXT.items()
       for model, entry in LONG_CONTEXT_MODELS.items()},
}
# Presets whose shape is part of their definition: timed at it unless --batch / --seq_len say otherwise.
OWN_SHAPE = frozenset(f"{model}_{length}" for length in LONG_CONTEXT for model in LONG_CONTEXT_MODELS)
# bench_train's default selection: every preset at the common 32 × 2048.
DEFAULT_PRESETS = [name for name in PRESETS if name not in OWN_SHAPE]
DEFAULT_BATCH, DEFAULT_SEQ_LEN = 32, 2048


class BenchError(ValueError):
  """A flag a user can fix; the message names it and the fix."""


@dataclasses.dataclass
class TrainRow:
  preset: str
  variant: str  # the --sweep value ("" without a sweep)
  mixers: str  # the mixer kinds of the model, "+"-joined
  batch: int
  seq_len: int
  grad_accum: int
  params: int
  step_ms: float | None = None
  tokens_per_s: float | None = None
  flops_per_token: float | None = None  # the model card's training FLOPs per token
  mfu: float | None = None
  mfu_6n: float | None = None
  compile_s: float | None = None
  xla_memory_gib: float | None = None  # arguments + outputs + temporaries of the compiled step
  peak_memory_gib: float | None = None  # the device's peak since the process started
  loss: float | None = None
  positions: str = ""  # "table" (learned absolute), "RoPE", "table + RoPE" or "none"
  vs_softmax: float | None = None  # tok/s over the reference softmax row's (``with_ratios``)
  reference: str = ""  # the preset of that row
  note: str = ""
  profile: str = ""  # the kernel-time breakdown (markdown) of the traced steps


def preset_config(name: str) -> ml_collections.ConfigDict:
  """The ConfigDict of a named preset or of ``module:preset`` (a file of configs/)."""
  if name in PRESETS:
    entry = PRESETS[name]
    if callable(entry):
      return entry()
    module, preset = entry
  elif ":" in name:
    module, preset = name.split(":", 1)
    module = os.path.splitext(os.path.basename(module))[0]
  else:
    raise BenchError(f"--presets: unknown preset {name!r}; use one of {', '.join(PRESETS)} or "
                     f"'<config file>:<preset>' (e.g. 'sanatan:tiny').")
  try:
    config_module = importlib.import_module(f"configs.{module}")
  except ModuleNotFoundError:
    raise BenchError(f"--presets: no config file configs/{module}.py (in {name!r}).") from None
  if preset not in config_module.PRESETS:
    raise BenchError(f"--presets: configs/{module}.py has no preset {preset!r}; valid: "
                     f"{', '.join(config_module.PRESETS)}.")
  return config_module.get_config(preset)


def parse_override(text: str) -> tuple[str, Any]:
  """"a.b=value" -> ("a.b", value); the value is a Python literal where it parses as one, else a string."""
  key, sep, raw = text.partition("=")
  if not sep or not key.strip():
    raise BenchError(f"--override {text!r}: give KEY=VALUE, e.g. train.loss_impl=materialized.")
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  return key.strip(), value


def _has_path(cd: ml_collections.ConfigDict, key: str) -> bool:
  node = cd
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return True


def preset_overrides(spec: str) -> tuple[str, list[tuple[str, Any]]]:
  """"NAME@KEY=VALUE@KEY=VALUE" -> (NAME, its own overrides), applied after --override and --sweep."""
  name, *own = spec.split("@")
  return name, [parse_override(o) for o in own]


def apply_overrides(cd: ml_collections.ConfigDict, overrides: list[tuple[str, Any]]) -> list[str]:
  """Sets every override whose key the preset has; returns the keys it does not have (e.g. another
  family's mixer)."""
  missing = []
  for key, value in overrides:
    if not _has_path(cd, key):
      missing.append(key)
      continue
    parent, _, leaf = key.rpartition(".")
    node = cd
    for part in parent.split(".") if parent else []:
      node = node[part]
    if isinstance(node[leaf], float) and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    try:
      node[leaf] = value
    except TypeError as e:
      raise BenchError(f"--override {key}={value!r}: {e}") from None
  return missing


def bench_config(name: str, *, batch: int | None, seq_len: int | None, overrides: list[tuple[str, Any]]):
  """The typed config of preset ``name`` at global batch ``batch`` and ``seq_len`` (None: the preset's
  own for ``OWN_SHAPE``, else 32 × 2048), the preset's micro-batch kept (grad_accum = batch /
  micro-batch), then ``overrides``; and the override keys the preset lacks."""
  from lmcore import config as cfg_lib

  cd = preset_config(name)
  own = name in OWN_SHAPE
  batch = batch or (cd.train.batch_size if own else DEFAULT_BATCH)
  seq_len = seq_len or (cd.data.seq_len if own else DEFAULT_SEQ_LEN)
  micro = max(1, cd.train.batch_size // cd.train.grad_accum)
  cd.train.batch_size = batch
  cd.train.grad_accum = max(1, batch // micro) if batch % micro == 0 else 1
  cd.data.seq_len = seq_len
  if cd.model.max_positions and cd.model.max_positions < seq_len:
    cd.model.max_positions = seq_len
  missing = apply_overrides(cd, overrides)
  try:
    return cfg_lib.experiment_config(cd), missing
  except cfg_lib.ConfigError as e:
    raise BenchError(f"preset {name}: {e}") from None


def positions(model) -> str:
  """How the model sees positions: its learned table, RoPE in its mixers, both, or neither."""
  rope = any(getattr(model.mixers[kind], "rope", False) for kind in set(model.layer_kinds()))
  table = model.max_positions > 0
  return {(True, True): "table + RoPE", (True, False): "table", (False, True): "RoPE"}.get((table, rope), "none")


def synthetic_batch(config, seed: int = 0) -> dict[str, np.ndarray]:
  """Uniform random tokens [B, T + 1] (and one document per row where the preset packs documents)."""
  B, T = config.train.batch_size, config.data.seq_len
  rng = np.random.default_rng(seed)
  batch = {"tokens": rng.integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32)}
  if config.data.segment_ids:
    batch["positions"] = np.broadcast_to(np.arange(T + 1, dtype=np.int32), (B, T + 1)).copy()
    batch["segment_ids"] = np.zeros((B, T + 1), np.int32)
  return batch


def _memory_plan_bytes(compiled) -> int | None:
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
  except Exception:  # Not every backend reports a memory plan.
    return None


def measure(name: str, config, *, steps: int, warmup: int, variant: str = "", profile: str = "",
            profile_steps: int = 2) -> TrainRow:
  """Compiles and times ``config``'s train step on synthetic tokens (see the module docstring), with the
  mesh, shardings and initialisation of a training run (``lmcore.train.state``); then, with a
  ``profile`` directory, traces ``profile_steps`` more steps and writes their breakdown there
  (``write_profile``)."""
  from lmcore import model_card
  from lmcore.train import perf, sharding
  from lmcore.train import state as state_lib
  from lmcore.train.loop import make_train_step
  from lmcore.train.optim import make_optimizer

  mesh = sharding.make_mesh(config.mesh)
  sharding.check_batch(mesh, config.train.batch_size, config.train.grad_accum)
  tx = make_optimizer(config.train)
  graphdef, _, _, shardings = state_lib.make_shardings(config, mesh, tx)
  params, rest = state_lib.init_params(config, shardings)
  opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
  batch = sharding.global_batch(synthetic_batch(config), mesh)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  row = TrainRow(name, variant, "+".join(sorted(set(config.model.layer_kinds()))), config.train.batch_size,
                 config.data.seq_len, config.train.grad_accum, n_params, positions=positions(config.model))

  with jax.set_mesh(mesh):  # the Pallas kernels' shard_map reads the mesh from here
    start = time.perf_counter()
    compiled = make_train_step(graphdef, tx, config, shardings).lower(params, opt_state, rest, batch, 0).compile()
    row.compile_s = time.perf_counter() - start
    plan = _memory_plan_bytes(compiled)
    row.xla_memory_gib = None if plan is None else plan / GIB
    for step in range(warmup):
      params, opt_state, metrics = compiled(params, opt_state, rest, batch, step)
    jax.block_until_ready(params)
    start = time.perf_counter()
    for step in range(warmup, warmup + steps):
      params, opt_state, metrics = compiled(params, opt_state, rest, batch, step)
    jax.block_until_ready((params, metrics))
  step_s = (time.perf_counter() - start) / steps
  row.step_ms, row.tokens_per_s = step_s * 1e3, row.batch * row.seq_len / step_s
  row.loss = float(metrics["loss"])
  peak = perf.peak_memory_bytes()
  row.peak_memory_gib = None if peak is None else peak / GIB
  if perf.peak_flops() is not None:  # no MFU without a peak (CPUs): skip the card's lowering
    row.flops_per_token = model_card.card(config.model, config.data.seq_len)["flops_per_token_train"]
    row.mfu = perf.mfu(row.tokens_per_s, row.flops_per_token)
    row.mfu_6n = perf.mfu(row.tokens_per_s, 6 * n_params)
  if profile:
    trace_dir = os.path.join(profile, "trace", profile_summary.file_stem(name, variant))
    try:  # a failed trace keeps the timing
      with jax.set_mesh(mesh), jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for step in range(warmup + steps, warmup + steps + profile_steps):
          params, opt_state, _ = compiled(params, opt_state, rest, batch, step)
        jax.block_until_ready(params)
      hlo_text = compiled.as_text()
      with gzip.open(os.path.join(trace_dir, "compiled_hlo.txt.gz"), "wt") as f:  # to re-read the trace later
        f.write(hlo_text)
      row.profile = write_profile(name, variant, trace_dir, profile, steps=profile_steps,
                                  hlo_text=hlo_text, step_ms=row.step_ms)
    except Exception as e:
      row.note = f"profile: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
  return row


def write_profile(name: str, variant: str, trace_dir: str, out_dir: str, *, steps: int, hlo_text: str,
                  step_ms: float | None) -> str:
  """Summarises the trace in ``trace_dir`` (``profile_summary``), prints it and writes
  ``<out_dir>/<preset>[_<variant>]_breakdown.{md,json}``; returns the markdown's path."""
  breakdown = profile_summary.summarize(profile_summary.load_trace(trace_dir), steps=steps, hlo_text=hlo_text,
                                        step_ms=step_ms, top=30)
  title = f"{name} {variant}".strip()
  md, _ = profile_summary.write(breakdown, out_dir, profile_summary.file_stem(name, variant), title)
  print(profile_summary.to_markdown(breakdown, title), flush=True)
  print(f"wrote {md}", flush=True)
  return md


def run(presets: list[str], *, batch: int | None, seq_len: int | None, steps: int, warmup: int = 2,
        overrides: list[str] = (), sweep: str = "", jsonl: str = "", profile: str = "",
        profile_steps: int = 2) -> list[TrainRow]:
  """Every preset (× every ``sweep`` value, "KEY=V1,V2"), one after another in this process; a preset
  that fails (out of memory, say) becomes a row with a note. Rows are appended to ``jsonl`` as they
  are measured. With ``profile`` (a directory), each preset's timed steps are followed by
  ``profile_steps`` traced ones, summarised into that directory (``measure``)."""
  if profile and profile_steps < 1:
    raise BenchError(f"--profile_steps={profile_steps}: trace at least 1 step, e.g. --profile_steps=2.")
  parsed = [parse_override(o) for o in overrides]
  variants = [("", [])]
  if sweep:
    key, _, values = sweep.partition("=")
    if not values:
      raise BenchError(f"--sweep {sweep!r}: give KEY=V1,V2, e.g. train.loss_impl=fused,materialized.")
    variants = [(f"{key}={v}", [parse_override(f"{key}={v}")]) for v in values.split(",")]
  configs, unused = [], {key for key, _ in parsed + variants[-1][1]}
  for spec in presets:
    name, own = preset_overrides(spec)
    for variant, extra in variants:
      config, missing = bench_config(name, batch=batch, seq_len=seq_len, overrides=parsed + extra + own)
      if missing_own := [key for key, _ in own if key in missing]:
        raise BenchError(f"--presets {spec!r}: preset {name} has no {', '.join(missing_own)}; check the "
                         f"spelling (keys as in --config.<key> of train.py).")
      unused -= {key for key, _ in parsed + extra} - set(missing)
      label = "@".join(part for part in (variant, *spec.split("@")[1:]) if part)
      if extra and extra[0][0] in missing:  # the preset lacks the swept key: measure it once
        configs.append((name, "@".join(spec.split("@")[1:]), config))
        break
      configs.append((name, label, config))
  if unused:
    raise BenchError(f"--override/--sweep: no selected preset has {', '.join(sorted(unused))}; check the spelling "
                     f"(keys as in --config.<key> of train.py).")
  rows = []
  for name, variant, config in configs:
    print(f"{name} {variant}: batch {config.train.batch_size} × {config.data.seq_len}, "
          f"grad_accum {config.train.grad_accum}", flush=True)
    try:
      row = measure(name, config, steps=steps, warmup=warmup, variant=variant, profile=profile,
                    profile_steps=profile_steps)
    except Exception as e:  # OOM or a missing kernel: report it and go on with the next preset.
      row = TrainRow(name, variant, "+".join(sorted(set(config.model.layer_kinds()))),
                     config.train.batch_size, config.data.seq_len, config.train.grad_accum, 0,
                     positions=positions(config.model), note=failure_note(e, name, variant, config))
    print(f"  {format_row_line(row)}", flush=True)
    rows.append(row)
    if jsonl:
      append_row(jsonl, row)
    gc.collect()
    jax.clear_caches()
  return with_ratios(rows)


def failure_note(error: Exception, name: str, variant: str, config) -> str:
  """The note of a preset that failed: the error's first line; out of memory, also the override that
  halves the micro-batch (NAME@train.grad_accum=2N, replacing a grad_accum the variant set) while the
  micro-batch can still be halved."""
  first = str(error).splitlines()[0][:120] if str(error) else ""
  note = f"{type(error).__name__}: {first}"
  batch, accum = config.train.batch_size, config.train.grad_accum
  if "RESOURCE_EXHAUSTED" in str(error) and batch % (2 * accum) == 0:
    kept = [part for part in variant.split("@") if part and not part.startswith("train.grad_accum=")]
    spec = "@".join([name, *kept, f"train.grad_accum={2 * accum}"])
    note = (f"out of memory at micro-batch {batch // accum} × {config.data.seq_len}; "
            f"--presets={spec} halves it. {note}")
  return note


def is_transformer_pp(row: TrainRow) -> bool:
  """Softmax attention with RoPE and no position table: the softmax reference."""
  return row.mixers == "softmax" and row.positions == "RoPE"


def with_ratios(rows: list[TrainRow]) -> list[TrainRow]:
  """tokens/s of each row over the reference's at the same sequence length: in the same variant, else
  the one measured without a variant (a softmax preset lacks a swept mixer key). The reference is the
  Transformer++ row (``is_transformer_pp``) where one was measured, else the softmax-only row; none
  without either."""
  references: dict[tuple[str, int], TrainRow] = {}
  for r in rows:
    if r.mixers == "softmax" and r.tokens_per_s:
      key = (r.variant, r.seq_len)
      held = references.get(key)
      if held is None or (is_transformer_pp(r) and not is_transformer_pp(held)):
        references[key] = r
  for r in rows:
    ref = references.get((r.variant, r.seq_len)) or references.get(("", r.seq_len))
    r.vs_softmax = r.tokens_per_s / ref.tokens_per_s if ref is not None and r.tokens_per_s else None
    r.reference = ref.preset if ref is not None and r.vs_softmax is not None else ""
  return rows


def format_row_line(r: TrainRow) -> str:
  if r.tokens_per_s is None:
    return f"failed: {r.note}"
  return (f"{r.tokens_per_s:,.0f} tok/s, {fmt(r.step_ms, '.1f')} ms/step, MFU {fmt(r.mfu, '.1%')}, "
          f"compile {fmt(r.compile_s, '.1f')} s, XLA plan {fmt(r.xla_memory_gib, '.2f')} GiB, "
          f"device peak {fmt(r.peak_memory_gib, '.2f')} GiB, loss {fmt(r.loss, '.3f')}")


def format_table(rows: list[TrainRow]) -> str:
  lines = ["| preset | variant | mixers | positions | B × T (accum) | params | step ms | tok/s | vs reference "
           "| MFU | MFU (6N) | compile s | XLA plan GiB | device peak GiB | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    vs = "" if r.vs_softmax is None else f"{r.vs_softmax:.2f}× {r.reference}"
    lines.append(
        f"| {r.preset} | {r.variant} | {r.mixers} | {r.positions} | {r.batch} × {r.seq_len} ({r.grad_accum}) | "
        f"{r.params / 1e6:,.1f}M | {fmt(r.step_ms, '.1f')} | {fmt(r.tokens_per_s, ',.0f')} | {vs} | "
        f"{fmt(r.mfu, '.1%')} | {fmt(r.mfu_6n, '.1%')} | {fmt(r.compile_s, '.1f')} | "
        f"{fmt(r.xla_memory_gib, '.2f')} | {fmt(r.peak_memory_gib, '.2f')} | {r.note} |")
  return "\n".join(lines)


def notes(rows: list[TrainRow]) -> str:
  """What the columns mean, under the table."""
  return ("Positions: the learned absolute table, RoPE, both or none; \"table\" softmax rows are the "
          "like-for-like comparison with SANATAN's table, not the softmax reference. vs reference: tok/s over "
          "the named row's at the same length (Transformer++, softmax with RoPE and no table, where measured). "
          "MFU: the model card's training FLOPs per token (3 × its analytic forward count, "
          "lmcore/model_card.py) × tokens/s over the devices' dense bf16 peak; MFU (6N): "
          "6 × parameters instead. XLA plan: arguments + outputs + temporaries of the compiled step. Device "
          "peak: `memory_stats()['peak_bytes_in_use']` since the process started (monotone over the rows: "
          "a row's own peak is at most this).")


def report(rows: list[TrainRow], *, out: str, markdown: str, command: str) -> str:
  """Prints the table, appends it (with the command) as a dated block to ``markdown`` ('' = none) and
  plots tokens/s per preset into ``<out>/train_step.png``; returns the table."""
  from benchmarks import harness, plots

  table = format_table(rows)
  print(table, flush=True)
  device = harness.device_name()
  if markdown:
    harness.append_markdown(markdown, [table, notes(rows)], datetime.date.today().isoformat(), device,
                            [command], topic="train step")
  plot = os.path.join(out, "train_step.png")
  plots.plot_train_tokens_per_s(rows, plot, title=f"train step on {device}")
  print(f"wrote {plot}", flush=True)
  return table
