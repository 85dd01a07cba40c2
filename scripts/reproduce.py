"""SANATAN's two-stage claim at one-GPU scale, against Transformer++, GLA and position ablations, at
several seeds.

How to run
  The corpus folder (``--corpus``, default runs/linux) holds ``shards/*.array_record`` (one C/H source
  file per document) and a SentencePiece ``tokenizer.model`` of 16,384 pieces, e.g.

    python scripts/prepare_data.py --input='linux/**/*.[ch]' --kind=text --output_dir=runs/linux/shards \
        --shuffle_seed=0
    python scripts/train_tokenizer.py --input='runs/linux/shards/*.array_record' --kind=array_record \
        --vocab_size=16384 --output=runs/linux/tokenizer.model

  Then, on one GPU (``--stage1_steps`` scales every run; ``--runs=p2,adapt`` for the claim alone;
  ``--seeds=0`` for one seed):

    python scripts/reproduce.py --workdir=runs/reproduce

  Rerunning the same command continues where the last one stopped (after SIGTERM, a crash or a time
  limit); adding seeds or runs later trains only what is new. The chain holds ``--workdir`` (and each run
  its folder) while it runs: a second chain on it stops at once. On a CPU, the same chain in minutes on the
  embedded corpus: ``--tiny``. ``--override KEY=VALUE`` (repeatable) sets a config key in every run that
  has it, e.g. ``data.worker_count=0``.

The claim (MATH §1.4): a model trained at p = 2 and adapted briefly at p = 1 matches the p = 2 model
(3.951 vs 3.966 held-out nats), while the p = 2 weights read out at p = 1 without adaptation collapse
(≈ 9.0). The chain measures the same comparison with the ``repro_*`` presets (configs/sanatan.py,
configs/baselines.py; 8 layers of 512, T = 1024, 32 sequences per step), at every seed of ``--seeds``
(``train.seed``: model initialisation and data order; the held-out set is the same for all):

1. stage 1, p = 2, for S1 steps (``--stage1_steps``), keeping its checkpoints at ``--lengths``;
2. at each length: the p = 2 held-out loss and the same parameters read out at p = 1 (no adaptation);
3. stage 2 from each of ``--adapt_lengths`` (default: every length): p = 1 for 6 % of that length's
   steps at a tenth of the learning rate, continuing stage 1's data stream, evaluated parallel and
   recurrent on the same sequences (their paired difference and max |Δlogit|), with per-layer
   root-gate statistics;
4. controls for S1 + stage-2 steps: Transformer++ (softmax with RoPE, no position table; the softmax
   reference), GLA, SANATAN p = 1 from scratch;
5. position ablations: softmax with the learned table and no RoPE, softmax with neither, SANATAN p = 2
   (S1 steps) and p = 1 from scratch without the table.

The shorter lengths are checkpoints of one cosine schedule of S1 steps (their learning rate has not
decayed), not runs trained to that length. Every run is a folder ``--workdir/s<seed>/<run>``; finished
runs and evaluations are read back from their ``eval_<step>.json``, never trained or computed again.
Output: ``results.md`` (per row the mean over seeds and the spread, max − min; a difference between two
rows counts only when it exceeds both rows' spreads) and ``results.json`` in ``--workdir``, and the
loss curves (``--plot``).
"""

import dataclasses
import json
import math
import os
import shlex
import sys

import jax
import numpy as np
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import plots  # noqa: E402
from benchmarks.train_step import BenchError, apply_overrides, parse_override  # noqa: E402
from configs import baselines, sanatan  # noqa: E402
from lmcore import cli  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore import data as data_lib  # noqa: E402
from lmcore.errors import ConfigError, MissingFileError  # noqa: E402
from lmcore.model import abstract_param_count  # noqa: E402
from lmcore.train import chain  # noqa: E402
from lmcore.train import workdir as workdir_lib  # noqa: E402

RUNS = ("p2", "adapt", "scratch", "transformer_pp", "gla", "softmax_table", "softmax_nope", "p2_no_table",
        "scratch_no_table")
REFERENCE = "transformer_pp"  # the row every other is compared with in the summary
GATE_KEYS = ("frac_saturated_q", "frac_saturated_k", "mismatch_fraction", "mismatch_gate_mean")

_WORKDIR = flags.DEFINE_string("workdir", sanatan.REPRO_WORKDIR, "Where every run of the chain writes.")
_CORPUS = flags.DEFINE_string("corpus", sanatan.REPRO_CORPUS, "Folder holding shards/*.array_record and "
                              "tokenizer.model (with --tiny: only when given).")
_STAGE1_STEPS = flags.DEFINE_integer("stage1_steps", None, "Stage-1 steps; every other count derives from "
                                     "them (default: the preset's, 4,000; --tiny 4).")
_LENGTHS = flags.DEFINE_string("lengths", ",".join(map(str, sanatan.REPRO_LENGTHS)), "Fractions of stage 1 at "
                               "which the p = 1 readout gap is measured.")
_ADAPT_LENGTHS = flags.DEFINE_string("adapt_lengths", "", "Fractions of stage 1 that stage 2 adapts from "
                                     "(each one of --lengths; default: all of them).")
_RUNS = flags.DEFINE_list("runs", list(RUNS), f"Runs of the chain, of {', '.join(RUNS)} (adapt needs p2).")
_SEEDS = flags.DEFINE_list("seeds", [str(s) for s in sanatan.REPRO_SEEDS], "Seeds (train.seed: model "
                           "initialisation and data order); every run trains at each.")
_TINY = flags.DEFINE_bool("tiny", False, "The chain at CPU-test scale (embedded corpus unless --corpus).")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "KEY=VALUE set in every run whose config has KEY "
                                      "(as --config.KEY=VALUE); repeatable.")
_PLOT = flags.DEFINE_string("plot", "", "The loss-curve PNG (default: <workdir>/loss_curves.png).")
_ACCEPT = flags.DEFINE_list("accept_config_changes", [], "Config fields a resumed run may change (as "
                            "train.py's flag); each change is recorded in that run's config_history.jsonl.")


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of the chain: its config, folder and where its curve starts (stage 2: after stage 1)."""

  name: str
  label: str
  config: cfg_lib.ExperimentConfig
  workdir: str
  seed: int = 0
  start_step: int = 0  # stage 2: the stage-1 step it adapts
  view_of: str = ""  # stage 2 from an earlier step: the stage-1 folder whose step it reads (chain.step_view)


@dataclasses.dataclass(frozen=True)
class Plan:
  workdir: str
  scale: sanatan.ReproScale
  corpus: str | None
  stage1_steps: int
  lengths: tuple[float, ...]
  adapt_from: tuple[int, ...]  # stage-1 steps
  runs: tuple[str, ...]
  overrides: tuple[str, ...]
  seeds: tuple[int, ...] = sanatan.REPRO_SEEDS

  def identity(self) -> dict:
    """What a rerun in the same workdir must keep (the runs, seeds and adapted lengths may change)."""
    return {"tiny": self.scale is sanatan.REPRO_TINY, "corpus": self.corpus,
            "stage1_steps": self.stage1_steps, "length_steps": list(self.length_steps),
            "overrides": list(self.overrides)}

  @property
  def length_steps(self) -> tuple[int, ...]:
    return sanatan.length_steps(self.stage1_steps, self.lengths)


def fractions(text: str, flag: str) -> tuple[float, ...]:
  try:
    return tuple(float(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise ConfigError(f"--{flag}={text!r}: give comma-separated fractions of stage 1, e.g. 0.25,0.5,1.") from None


def make_plan() -> Plan:
  scale = sanatan.REPRO_TINY if _TINY.value else sanatan.REPRO_GPU
  corpus = _CORPUS.value if (not _TINY.value or flags.FLAGS["corpus"].present) else None
  stage1_steps = _STAGE1_STEPS.value or scale.stage1_steps
  if stage1_steps < 1:
    raise ConfigError(f"--stage1_steps={stage1_steps}: give a positive number of steps.")
  lengths = fractions(_LENGTHS.value, "lengths")
  steps = sanatan.length_steps(stage1_steps, lengths)
  sanatan.stage1_checkpointing(stage1_steps, lengths, scale.saves)  # a length grid too fine fails here
  adapt = sanatan.length_steps(stage1_steps, fractions(_ADAPT_LENGTHS.value, "adapt_lengths") or lengths)
  if not set(adapt) <= set(steps):
    raise ConfigError(f"--adapt_lengths={_ADAPT_LENGTHS.value!r} gives stage-1 steps {list(adapt)}, not all among "
                      f"those of --lengths {list(steps)}; stage 2 starts from a kept length.")
  unknown = [r for r in _RUNS.value if r not in RUNS]
  if unknown or not _RUNS.value:
    raise ConfigError(f"--runs={','.join(_RUNS.value)}: choose among {','.join(RUNS)}.")
  runs = tuple(r for r in RUNS if r in _RUNS.value or (r == "p2" and "adapt" in _RUNS.value))
  return Plan(_WORKDIR.value, scale, corpus, stage1_steps, lengths, adapt, runs, tuple(_OVERRIDE.value),
              seeds(_SEEDS.value))


def seeds(values: list[str]) -> tuple[int, ...]:
  try:
    parsed = tuple(dict.fromkeys(int(v) for v in values))
  except ValueError:
    parsed = ()
  if not parsed or min(parsed) < 0:
    raise ConfigError(f"--seeds={','.join(values)}: give distinct non-negative integers, e.g. 0,1.")
  return parsed


def configure(cd, plan: Plan, overrides) -> tuple[cfg_lib.ExperimentConfig, set[str]]:
  """The typed config of one run: the chain's shared held-out set, then ``overrides``; and the override
  keys it lacks."""
  cd.data.heldout.path = os.path.join(plan.workdir, "heldout.npz")
  try:
    missing = apply_overrides(cd, overrides)
  except BenchError as e:
    raise ConfigError(str(e)) from None
  return cfg_lib.experiment_config(cd), set(missing)


# name -> (label, preset builder, folder) of the runs trained as one piece (not stage 2).
CONTROLS = {
    "scratch": ("SANATAN p = 1 from scratch", sanatan.repro_p1_scratch, "p1_scratch"),
    "transformer_pp": ("Transformer++ (softmax, RoPE, no table)", baselines.transformer_pp_repro, "transformer_pp"),
    "gla": ("GLA (no table)", baselines.repro_gla, "gla"),
    "softmax_table": ("softmax, learned table, no RoPE", baselines.repro_softmax_table, "softmax_table"),
    "softmax_nope": ("softmax, no table, no RoPE", baselines.repro_softmax_nope, "softmax_nope"),
    "p2_no_table": ("SANATAN p = 2, no table (stage-1 steps)", sanatan.repro_p2_no_table, "p2_no_table"),
    "scratch_no_table": ("SANATAN p = 1 from scratch, no table", sanatan.repro_p1_scratch_no_table,
                         "p1_scratch_no_table"),
}


def seed_specs(plan: Plan, seed: int) -> list[tuple]:
  """(name, label, ConfigDict, folder, Run fields) of every run at ``seed``, in chain order."""
  s1, scale, corpus = plan.stage1_steps, plan.scale, plan.corpus
  root = os.path.join(plan.workdir, f"s{seed}")
  p2_dir = os.path.join(root, "p2")
  specs = [("p2", "stage 1: SANATAN p = 2", sanatan.repro_p2(s1, plan.lengths, scale, corpus), "p2", {})]
  for step in plan.adapt_from if "adapt" in plan.runs else ():
    view = {} if step == s1 else {"view_of": p2_dir}
    init = chain.view_path(p2_dir, step) if view else p2_dir
    specs.append(("adapt", f"stage 2: SANATAN p = 1 adapted from stage-1 step {step:,}",
                  sanatan.repro_p1_adapt(step, init, scale, corpus), f"p1_adapt_{step}", dict(view, start_step=step)))
  specs += [(name, label, build(s1, scale, corpus), folder, {})
            for name, (label, build, folder) in CONTROLS.items() if name in plan.runs]
  for _, _, cd, _, fields in specs:
    cd.train.seed = seed
    fields["seed"] = seed
  return [(name, label, cd, os.path.join(root, folder), fields) for name, label, cd, folder, fields in specs]


def build_runs(plan: Plan) -> list[Run]:
  """Every run of the plan, seed after seed, in chain order, with its config checked."""
  overrides = [parse_override(o) for o in plan.overrides]
  runs, missing, first = [], None, None
  for seed in plan.seeds:
    for name, label, cd, workdir, fields in seed_specs(plan, seed):
      first = cd if first is None else first
      config, lacking = configure(cd, plan, overrides)
      missing = lacking if missing is None else missing & lacking
      if name in plan.runs:
        runs.append(Run(name, label, config, workdir, **fields))
  if missing:
    key = sorted(missing)[0]
    raise cli.unknown_override(first, key) or ConfigError(f"--override {key}: no run has this key.")
  return runs


def check_inputs(plan: Plan, config: cfg_lib.ExperimentConfig) -> None:
  """The corpus and tokenizer exist and fit the model, before any folder is created."""
  if plan.corpus is not None:
    wanted = {"shards/*.array_record": os.path.join(plan.corpus, "shards"),
              "tokenizer.model": os.path.join(plan.corpus, "tokenizer.model")}
    absent = [name for name, path in wanted.items() if not os.path.exists(path)]
    if absent:
      raise MissingFileError(f"--corpus={plan.corpus} has no {' and no '.join(absent)}; build the corpus as the "
                             "docstring of scripts/reproduce.py shows, or pass --corpus=<folder holding both> "
                             "(--tiny alone runs on the embedded corpus).")
  data_lib.check_paths(config.data)
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer, data_lib.cache_dir(config.data))
  data_lib.check_vocab(tokenizer, config.model.vocab_size)


def start_workdir(plan: Plan) -> None:
  """Creates ``--workdir`` with ``chain.json``, or checks that the chain in it was planned the same way."""
  path = os.path.join(plan.workdir, "chain.json")
  if os.path.isfile(path):
    with open(path) as f:
      stored = json.load(f)
    changed = {k: (stored.get(k), v) for k, v in plan.identity().items() if stored.get(k) != v}
    if changed:
      details = "; ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in changed.items())
      raise ConfigError(f"--workdir={plan.workdir} holds a chain planned otherwise ({details}); rerun with its "
                        "settings or choose a new --workdir.")
    return
  os.makedirs(plan.workdir, exist_ok=True)
  with open(path, "w") as f:
    json.dump(plan.identity(), f, indent=1)


def train(run: Run, index: int, total: int) -> dict | None:
  """Trains (or reads back) one run; None when it was stopped by a signal."""
  steps = run.config.train.steps
  done = chain.read_record(run.workdir, steps) is not None
  print(f"== [{index}/{total}] seed {run.seed}, {run.label}: {steps:,} steps -> {run.workdir}"
        f"{' (finished: read back)' if done else ''} ==", flush=True)
  if run.view_of:
    chain.step_view(run.view_of, run.start_step)
  record = chain.train_or_read(run.config, run.workdir, tuple(_ACCEPT.value))
  if "stopped_by" in record:
    print(f"{record['stopped_by']} received: stopped at step {record['step']}; rerun the same command to "
          "continue.", flush=True)
    return None
  print(f"   held-out loss {record['loss']:.4f} nats", flush=True)
  return record


def tokens_per_step(config: cfg_lib.ExperimentConfig) -> int:
  return config.train.batch_size * config.data.seq_len


def run_key(run: Run) -> str:
  return run.name if run.name != "adapt" else f"adapt_{run.start_step}"


def run_summary(run: Run, record: dict) -> dict:
  steps = run.config.train.steps
  return {"label": run.label, "workdir": run.workdir, "steps": steps, "tokens": steps * tokens_per_step(run.config),
          "params": abstract_param_count(run.config.model),
          "train_seconds": chain.training_seconds(chain.read_metrics(run.workdir)), "loss": record["loss"],
          "start_step": run.start_step, "eval": record}


def readouts(stage1: Run, record: dict, plan: Plan) -> list[dict]:
  """Per stage-1 length: the p = 2 held-out loss and the unadapted p = 1 readout of the same parameters."""
  rows = []
  for step in plan.length_steps:
    print(f"== seed {stage1.seed}, stage 1 at step {step:,}: p = 2 and the unadapted p = 1 readout ==", flush=True)
    p2 = record if step == plan.stage1_steps else chain.evaluate_step(stage1.config, stage1.workdir, step)
    p1 = chain.readout(stage1.config, stage1.workdir, step, os.path.join(stage1.workdir, "readout_p1"), p=1)
    rows.append({"step": step, "fraction": step / plan.stage1_steps, "tokens": step * tokens_per_step(stage1.config),
                 "loss_p2": p2["loss"], "loss_p1_readout": p1["loss"], "gap": p1["loss"] - p2["loss"],
                 "gate_stats_file": p2.get("gate_stats_file")})
  return rows


def read_gate_stats(folder: str, filename: str | None) -> list[dict]:
  """The per-layer records of ``<folder>/<filename>`` (an evaluation's ``gate_stats_file``)."""
  if not filename:
    return []
  with open(os.path.join(folder, filename)) as f:
    return [json.loads(line) for line in f if line.strip()]


def run_chain(plan: Plan, runs: list[Run]) -> dict | None:
  """Every run in order; the results record (per seed, and their ``summary``), or None when a run was
  stopped."""
  per_seed: dict[str, dict] = {}
  for index, run in enumerate(runs, 1):
    record = train(run, index, len(runs))
    if record is None:
      return None
    result = per_seed.setdefault(str(run.seed), {"runs": {}, "lengths": []})
    result["runs"][run_key(run)] = run_summary(run, record)
    if run.name == "p2":
      result["lengths"] = readouts(run, record, plan)
  for seed, result in per_seed.items():
    for row in result["lengths"]:
      adapted = result["runs"].get(f"adapt_{row['step']}")
      row["adapted_loss"] = adapted and adapted["loss"]
      row["adapted_minus_p2"] = adapted and adapted["loss"] - row["loss_p2"]
    result["gate_stats"] = gate_comparison([r for r in runs if str(r.seed) == seed], result["runs"],
                                           result["lengths"])
  return {"stage1_steps": plan.stage1_steps, "seeds": per_seed, "summary": summarize(per_seed, plan.stage1_steps)}


def gate_comparison(runs: list[Run], summaries: dict, lengths: list[dict]) -> dict:
  """Per-layer gate statistics of stage 1 at the longest adapted length and of stage 2 from it."""
  stage1 = next((r for r in runs if r.name == "p2"), None)
  if stage1 is None:
    return {}
  adapted = [r for r in runs if r.name == "adapt"]
  step = adapted[-1].start_step if adapted else stage1.config.train.steps
  row = next(r for r in lengths if r["step"] == step)
  stage2 = read_gate_stats(adapted[-1].workdir, summaries[f"adapt_{step}"]["eval"].get("gate_stats_file")) \
      if adapted else []
  return {"stage1_step": step, "stage1": read_gate_stats(stage1.workdir, row["gate_stats_file"]), "stage2": stage2}


def mean_spread(values) -> dict:
  """The mean and the spread (max − min) of the values that exist, and how many there are."""
  values = [v for v in values if v is not None]
  if not values:
    return {"mean": None, "spread": None, "n": 0}
  return {"mean": float(np.mean(values)), "spread": float(max(values) - min(values)), "n": len(values)}


def beyond_spreads(a: dict, b: dict) -> bool | None:
  """Whether two rows' means differ by more than either row's spread; None below two seeds each."""
  if a["n"] < 2 or b["n"] < 2:
    return None
  return abs(a["mean"] - b["mean"]) > max(a["spread"], b["spread"])


# MATH §1.4, the source's 184M model at 10B tokens: the differences the chain is read against.
SOURCE = {"readout_gap": 9.0 - 3.966, "adapted_minus_p2": 3.951 - 3.966, "gla_minus_adapted": 3.348 - 3.951}


def summarize(per_seed: dict[str, dict], stage1_steps: int) -> dict:
  """Per run and per stage-1 length, over the seeds: mean and spread of each loss; each run's mean
  against Transformer++'s; the source's differences beside the chain's."""
  grouped: dict[str, list[dict]] = {}
  for result in per_seed.values():
    for key, summary in result["runs"].items():
      grouped.setdefault(key, []).append(summary)
  def chain_order(key: str):  # RUNS' order; stage 2 by its stage-1 step
    return (RUNS.index("adapt"), int(key[6:])) if key.startswith("adapt_") else (RUNS.index(key), 0)
  runs = {}
  for key, summaries in sorted(grouped.items(), key=lambda kv: chain_order(kv[0])):
    first = summaries[0]
    runs[key] = {"label": first["label"], "steps": first["steps"], "tokens": first["tokens"], "params": first["params"],
                 "start_step": first["start_step"], "train_seconds": float(np.mean([s["train_seconds"] for s in summaries])),
                 "losses": {seed: r["runs"][key]["loss"] for seed, r in per_seed.items() if key in r["runs"]},
                 **mean_spread([s["loss"] for s in summaries])}
  reference = runs.get(REFERENCE)
  for row in runs.values():
    compared = reference is not None and row is not reference
    row["minus_reference"] = row["mean"] - reference["mean"] if compared else None
    row["beyond_spreads"] = beyond_spreads(row, reference) if compared else None
  lengths = {}
  for result in per_seed.values():
    for row in result["lengths"]:
      lengths.setdefault(row["step"], []).append(row)
  length_rows = [{"step": step, "fraction": rows[0]["fraction"], "tokens": rows[0]["tokens"],
                  **{field: mean_spread([r[field] for r in rows])
                     for field in ("loss_p2", "loss_p1_readout", "gap", "adapted_loss", "adapted_minus_p2")}}
                 for step, rows in sorted(lengths.items())]
  return {"runs": runs, "lengths": length_rows, "source": source_comparison(per_seed, stage1_steps)}


def source_comparison(per_seed: dict[str, dict], stage1_steps: int) -> list[dict]:
  """The source's differences (``SOURCE``) and the chain's at the end of stage 1, over the seeds."""
  def per_seed_values(fn):
    values = []
    for result in per_seed.values():
      try:
        values.append(fn(result))
      except (KeyError, StopIteration, TypeError):
        continue
    return mean_spread(values)

  def last(result):
    return next(r for r in result["lengths"] if r["step"] == stage1_steps)
  adapted = f"adapt_{stage1_steps}"
  return [
      {"what": "p = 1 read out, not adapted − p = 2", "source": SOURCE["readout_gap"],
       **per_seed_values(lambda r: last(r)["gap"])},
      {"what": "stage 2 (p = 1 adapted) − p = 2", "source": SOURCE["adapted_minus_p2"],
       **per_seed_values(lambda r: r["runs"][adapted]["loss"] - last(r)["loss_p2"])},
      {"what": "GLA − stage 2", "source": SOURCE["gla_minus_adapted"],
       **per_seed_values(lambda r: r["runs"]["gla"]["loss"] - r["runs"][adapted]["loss"])},
  ]


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _num(value, fmt: str = ".4f") -> str:
  return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def _with_spread(stat: dict, fmt: str = ".4f") -> str:
  if stat["mean"] is None:
    return "–"
  return _num(stat["mean"], fmt) + (f" ± {stat['spread'] / 2:.4f}" if stat["n"] > 1 else "")


def _verdict(value: bool | None) -> str:
  return "–" if value is None else "yes" if value else "no"


def results_markdown(results: dict, device: str, command: str) -> str:
  summary, seeds = results["summary"], list(results["seeds"])
  runs, lengths = summary["runs"], summary["lengths"]
  lines = ["| run | steps | tokens | params | train s | " + " | ".join(f"seed {s}" for s in seeds)
           + " | mean ± half spread | − Transformer++ | beyond both spreads |",
           "|---" * (8 + len(seeds)) + "|"]
  for r in runs.values():
    cells = [_num(r["losses"].get(s)) for s in seeds]
    lines.append(f"| {r['label']} | {r['steps']:,} | {_count(r['tokens'])} | {r['params']:,} | "
                 f"{r['train_seconds']:,.0f} | " + " | ".join(cells) + f" | {_with_spread(r)} | "
                 f"{_num(r['minus_reference'], '+.4f')} | {_verdict(r['beyond_spreads'])} |")
  lines.append("\nHeld-out loss (nats) at each seed; spread: max − min over the seeds. A difference between two "
               "rows is real only when it exceeds both rows' spreads (\"beyond both spreads\", against "
               "Transformer++; \"–\" with fewer than two seeds).")
  if lengths:
    lines += ["", "| stage-1 step (fraction) | tokens | p = 2 | p = 1 read out, not adapted | readout gap | "
              "p = 1 adapted | adapted − p = 2 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']:,} ({r['fraction']:.2f}) | {_count(r['tokens'])} | {_with_spread(r['loss_p2'])} | "
              f"{_with_spread(r['loss_p1_readout'])} | {_with_spread(r['gap'], '+.4f')} | "
              f"{_with_spread(r['adapted_loss'])} | {_with_spread(r['adapted_minus_p2'], '+.4f')} |" for r in lengths]
    lines.append(f"\nMeans over the seeds ± half their spread. The shorter lengths are checkpoints of one cosine "
                 f"schedule of {results['stage1_steps']:,} steps (their learning rate had not decayed), not runs "
                 "trained to that length.")
  source = [r for r in summary["source"] if r["n"]]
  if source:
    lines += ["", "| difference (nats) | source: 184M, 10B tokens (MATH §1.4) | this chain |", "|---|---|---|"]
    lines += [f"| {r['what']} | {r['source']:+.3f} | {_with_spread(r, '+.4f')} |" for r in source]
  stage2 = [(seed, r) for seed, result in results["seeds"].items() for r in result["runs"].values() if r["start_step"]]
  if stage2:
    lines += ["", "| seed | stage 2 adapted from step | parallel | recurrent | paired diff (nats) | max abs Δlogit |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {seed} | {r['start_step']:,} | {_num(r['eval'].get('loss_parallel'))} | "
              f"{_num(r['eval'].get('loss_recurrent'))} | {_num(r['eval'].get('paired_diff'), '.2e')} | "
              f"{_num(r['eval'].get('max_abs_dlogit'), '.2e')} |" for seed, r in stage2]
  gates = results["seeds"][seeds[0]]["gate_stats"] if seeds else {}
  if gates.get("stage1"):
    both = bool(gates["stage2"])
    lines += ["", f"Root-gate statistics per layer (MATH §1.3), seed {seeds[0]}, stage 1 at step "
              f"{gates['stage1_step']:,}" + (" → stage 2 adapted from it:" if both else ":"), "",
              "| layer | " + " | ".join(GATE_KEYS) + " |", "|---" * (len(GATE_KEYS) + 1) + "|"]
    for i, layer in enumerate(gates["stage1"]):
      after = gates["stage2"][i] if both else {}
      cells = [_num(layer.get(k), ".3f") + (f" → {_num(after.get(k), '.3f')}" if both else "") for k in GATE_KEYS]
      lines.append(f"| {layer['layer']} | " + " | ".join(cells) + " |")
  lines += ["", f"device: {device}; command: `{command}`"]
  return "\n".join(lines)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
  window = max(1, min(window, len(values)))
  return np.convolve(values, np.ones(window) / window, mode="valid")


COLOURS = dict(zip(RUNS, ("tab:blue", None, "tab:green", "black", "tab:red", "tab:gray", "tab:brown", "tab:cyan",
                          "tab:olive")))
SEED_STYLES = ("-", "--", ":", "-.")


def plot_curves(runs: list[Run], results: dict, path: str, stage1_steps: int) -> None:
  """Training loss (a moving average over 1 % of stage 1) and held-out points against tokens, stage 2
  continuing from its stage-1 step, one line style per seed; the unadapted readouts (mean over the
  seeds) as crosses. Right: the last 30 % of tokens."""
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
  adapted = sorted({r.start_step for r in runs if r.name == "adapt"})  # darker orange: adapted later
  oranges = plt.get_cmap("Oranges")
  seeds = list(dict.fromkeys(r.seed for r in runs))
  window = max(1, stage1_steps // 100)
  visible, end = [], 0.0
  for run in runs:
    colour = COLOURS[run.name] or oranges(0.45 + 0.5 * adapted.index(run.start_step) / max(1, len(adapted) - 1))
    rows = chain.read_metrics(run.workdir)
    per_step = tokens_per_step(run.config)
    offset = run.start_step * per_step
    steps, loss = chain.loss_curve(rows)
    eval_steps, eval_loss = chain.loss_curve(rows, "eval/loss")
    if not len(steps):
      continue
    smooth = moving_average(loss, window)
    x = offset + steps[len(steps) - len(smooth):] * per_step
    visible.append((x, smooth))
    end = max(end, x[-1])
    first_seed = run.seed == seeds[0]
    for ax in axes:
      ax.plot(x, smooth, color=colour, label=run.label if first_seed else None, lw=1.2,
              ls=SEED_STYLES[seeds.index(run.seed) % len(SEED_STYLES)], marker="." if len(x) < 3 else None)
      ax.plot(offset + eval_steps * per_step, eval_loss, "o", color=colour, ms=4)
  lengths = results["summary"]["lengths"]
  if lengths:
    axes[0].plot([r["tokens"] for r in lengths], [r["loss_p1_readout"]["mean"] for r in lengths], "kx", ms=8,
                 label="stage 1 read out at p = 1, not adapted")
  low = 0.7 * end
  tail = np.concatenate([y[x >= low] for x, y in visible] or [np.zeros(1)])
  if tail.size:
    margin = 0.05 * (tail.max() - tail.min() or 1.0)
    axes[1].set_ylim(tail.min() - margin, tail.max() + margin)
  axes[1].set_xlim(low, end * 1.01 or 1.0)
  for ax, title in zip(axes, ("every run", "the last 30 % of tokens")):
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats); dots: held-out")
    ax.set_title(title + ("; one line style per seed" if len(seeds) > 1 else ""))
    ax.grid(True, alpha=0.3)
  axes[0].legend(fontsize="x-small")
  plots.save(fig, path, "SANATAN two-stage reproduction: loss curves")


def to_json(value):
  """NaN / inf (a gate mean with nothing mismatched) as null: results.json stays strict JSON."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json(v) for v in value]
  return value


def write_results(plan: Plan, runs: list[Run], results: dict) -> None:
  """``results.md``, ``results.json`` and the loss curves in ``--workdir``."""
  device = jax.devices()[0].device_kind
  command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
  table = results_markdown(results, device, command)
  plot_path = _PLOT.value or os.path.join(plan.workdir, "loss_curves.png")
  plot_curves(runs, results, plot_path, plan.stage1_steps)
  with open(os.path.join(plan.workdir, "results.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(plan.workdir, "results.json"), "w") as f:
    json.dump(to_json({**results, "device": device, "command": command}), f, indent=1)
  print(f"\n{table}\n\nwrote {plan.workdir}/results.md, results.json and {plot_path}", flush=True)


def main(argv):
  del argv
  cli.show_library_logs()
  plan = make_plan()
  runs = build_runs(plan)
  check_inputs(plan, runs[0].config)
  with workdir_lib.WorkdirLock(plan.workdir):
    start_workdir(plan)
    results = run_chain(plan, runs)
    if results is not None:
      write_results(plan, runs, results)


if __name__ == "__main__":
  cli.run(main)
