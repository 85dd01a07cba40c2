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

  Every finished run leaves a portable record, ``--workdir/records/s<seed>/<run>.json`` (KBs: its
  evaluation, loss curve, config, training seconds; stage 1's readouts; the recall score), and a rerun
  reads a recorded run back without training it or needing its checkpoints. Copying ``records/`` into
  a fresh workdir (another machine, the same command and settings) carries the finished runs over;
  ``results.md``, ``results.json`` and the plot are built from the records alone. Stage 2 starts from
  stage 1's checkpoints, which stay on the machine that trained stage 1: stage 1 (``p2``) and stage 2
  (``adapt``) finish in one sitting, and a stage 2 whose stage 1 is recorded without its checkpoints
  is refused in one line before anything trains.

  Recall (``--recall_task``, a folder written by ``scripts/make_recall_task.py`` from the held-out files):

    python scripts/make_recall_task.py --input='runs/linux/shards/*.array_record' --kind=array_record \
        --tokenizer=runs/linux/tokenizer.model --max_tokens=1000 --output_dir=runs/linux/recall_task
    python scripts/reproduce.py --workdir=runs/reproduce --recall_task=runs/linux/recall_task

  scores the final checkpoint of each of ``RECALL_RUNS`` right after it trains (or when its record lacks
  the score and the checkpoint is here) and keeps the accuracy in its record.

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
   reference), GLA, BASED (Taylor linear attention, sliding windows and short convolutions), SANATAN
   p = 1 from scratch;
5. position ablations: softmax with the learned table and no RoPE, softmax with neither, SANATAN p = 2
   (S1 steps) and p = 1 from scratch without the table.

The shorter lengths are checkpoints of one cosine schedule of S1 steps (their learning rate has not
decayed), not runs trained to that length. Every run is a folder ``--workdir/s<seed>/<run>``; finished
runs are read back from their record, or from their ``eval_<step>.json``, never trained or computed
again. Output: ``results.md`` (per row the mean over seeds and the spread, max − min; a difference
between two rows counts only when it exceeds both rows' spreads; recall beside the held-out loss) and
``results.json`` in ``--workdir``, and the loss curves (``--plot``); ``goodput.jsonl`` there gets one row
per run trained (where its wall time went: the goodput table's rows of docs/BENCHMARKS.md).
"""

import collections
import dataclasses
import glob
import hashlib
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
from benchmarks import rows as rows_lib  # noqa: E402
from benchmarks.train_step import BenchError, apply_overrides, parse_override  # noqa: E402
from configs import based, baselines, sanatan  # noqa: E402
from lmcore import cli  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore import data as data_lib  # noqa: E402
from lmcore.errors import ConfigError, MissingFileError  # noqa: E402
from lmcore.model import abstract_param_count  # noqa: E402
from lmcore.train import chain, sharding  # noqa: E402
from lmcore.train import workdir as workdir_lib  # noqa: E402

RUNS = ("p2", "adapt", "scratch", "transformer_pp", "gla", "based", "softmax_table", "softmax_nope", "p2_no_table",
        "scratch_no_table")
REFERENCE = "transformer_pp"  # the row every other is compared with in the summary
# The runs scored on --recall_task (stage 2: from the longest adapted length). Stage 1 and SANATAN p = 2
# without the table are not: p = 2 has no decode state to generate with.
RECALL_RUNS = ("adapt", "scratch", "transformer_pp", "gla", "based", "scratch_no_table")
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
_FROM_RECORDS = flags.DEFINE_bool("from_records", False, "Build the tables and plot from the portable records "
                                  "in <workdir>/records only: runs without one are left out (and named), "
                                  "nothing trains or is scored.")
_RECALL_TASK = flags.DEFINE_string("recall_task", "", "A recall task folder of scripts/make_recall_task.py: "
                                   f"the final checkpoints of {', '.join(RECALL_RUNS)} are scored on it.")
_RECALL_LIMIT = flags.DEFINE_integer("recall_limit", 0, "Recall examples scored per run at most (0: all).")
_RECALL_BATCH_SIZE = flags.DEFINE_integer("recall_batch_size", 32, "Recall prompts generated per batch.")


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
class RecallTask:
  """The recall task of ``--recall_task``: a scored record counts only for the same examples and limit."""

  path: str
  name: str
  sha256: str  # of the task's examples file
  limit: int = 0
  batch_size: int = 32

  def identity(self) -> dict:
    return {"task": self.name, "sha256": self.sha256, "limit": self.limit}


def recall_task(path: str, limit: int, batch_size: int) -> RecallTask:
  """The task of the folder ``path`` (one ``<task>.yaml`` beside its ``<task>.jsonl``)."""
  yamls = sorted(glob.glob(os.path.join(path, "*.yaml")))
  examples = os.path.splitext(yamls[0])[0] + ".jsonl" if len(yamls) == 1 else ""
  if not os.path.isfile(examples):
    raise MissingFileError(f"--recall_task={path} holds no single <task>.yaml beside its <task>.jsonl; write it "
                           "with scripts/make_recall_task.py (the command is in this script's docstring).")
  if limit < 0 or batch_size < 1:
    raise ConfigError(f"--recall_limit={limit} --recall_batch_size={batch_size}: give a limit >= 0 (0: every "
                      "example) and a batch size >= 1.")
  with open(examples, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  return RecallTask(path, os.path.basename(os.path.splitext(examples)[0]), digest, limit, batch_size)


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
  recall: RecallTask | None = None

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
  recall = recall_task(_RECALL_TASK.value, _RECALL_LIMIT.value, _RECALL_BATCH_SIZE.value) if _RECALL_TASK.value \
      else None
  return Plan(_WORKDIR.value, scale, corpus, stage1_steps, lengths, adapt, runs, tuple(_OVERRIDE.value),
              seeds(_SEEDS.value), recall)


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
    "based": ("BASED (Taylor, sliding window, BaseConv; no table)", based.repro_based, "based"),
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


# -- portable records: what a finished run leaves for a rerun on any machine ---------------------------

RECORD_FORMAT = 1
GOODPUT_ROWS = "goodput.jsonl"  # in --workdir: each run this workdir trained, where its wall time went
WORKDIR = "<workdir>"  # how a record writes the paths inside --workdir (a copy may live elsewhere)
# Config keys that do not change what a run measures: a record of another machine's setting still counts.
UNMEASURED_KEYS = ("wandb", "data.cache_dir", "data.token_cache", "data.token_cache_processes",
                   "data.worker_kind", "train.compilation_cache", "train.profile_steps")


def record_path(workdir: str, seed: int, key: str) -> str:
  return os.path.join(workdir, "records", f"s{seed}", f"{key}.json")


def portable_config(config: cfg_lib.ExperimentConfig, workdir: str) -> dict:
  """The config as JSON with every path inside ``workdir`` written from ``WORKDIR``."""
  root = workdir.rstrip("/")
  def portable(value):
    if isinstance(value, dict):
      return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [portable(v) for v in value]
    if isinstance(value, str) and (value == root or value.startswith(root + "/")):
      return WORKDIR + value[len(root):]
    return value
  return json.loads(json.dumps(portable(cfg_lib.to_jsonable(config))))


def config_difference(stored, planned, key: str = "") -> str | None:
  """The first key whose value differs between two portable configs (``key=stored -> planned``), None
  when none does; keys only one of them has (fields added or removed since) and ``UNMEASURED_KEYS`` are
  not compared."""
  if key in UNMEASURED_KEYS:
    return None
  if isinstance(stored, dict) and isinstance(planned, dict):
    for name in stored.keys() & planned.keys():
      found = config_difference(stored[name], planned[name], f"{key}.{name}" if key else name)
      if found:
        return found
    return None
  return None if stored == planned else f"{key}={stored!r} -> {planned!r}"


def read_run_record(run: Run, plan: Plan) -> dict | None:
  """The portable record of ``run``, None when there is none; one line when it records another run."""
  path = record_path(plan.workdir, run.seed, run_key(run))
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    record = json.load(f)
  if record.get("format") != RECORD_FORMAT:
    changed = f"format {record.get('format')!r}, read here: {RECORD_FORMAT}"
  elif record["chain"] != json.loads(json.dumps(plan.identity())):
    changed = f"a chain planned as {record['chain']}, not {plan.identity()}"
  else:
    changed = config_difference(record["config"], portable_config(run.config, plan.workdir))
  if changed:
    raise ConfigError(f"{path} records a run set up otherwise ({changed}); rerun with its settings, or remove the "
                      "record to train that run again.")
  return record


def write_record(plan: Plan, run: Run, record: dict) -> dict:
  """Writes ``record`` as ``run``'s portable record; returns it as it reads back (NaN as null)."""
  path = record_path(plan.workdir, run.seed, run_key(run))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(to_json(record), f, indent=1)
  os.replace(path + ".tmp", path)
  return json.loads(json.dumps(to_json(record)))


def new_record(run: Run, evaluation: dict, plan: Plan) -> dict:
  """The portable record of a run finished in its folder: its final evaluation (with any timing it
  holds) and gate statistics, its loss curve and training seconds, its config; stage 1's readouts at
  every length (they read its checkpoints, so they are made now)."""
  rows = chain.read_metrics(run.workdir)
  record = {"format": RECORD_FORMAT, "run": run_key(run), "seed": run.seed, "label": run.label,
            "device": jax.devices()[0].device_kind, "chain": plan.identity(),
            "config": portable_config(run.config, plan.workdir), "eval": evaluation,
            "gate_stats": read_gate_stats(run.workdir, evaluation.get("gate_stats_file")),
            "train_seconds": chain.training_seconds(rows),
            "curve": {"train": chain.curve_points(rows), "eval": chain.curve_points(rows, "eval/loss")}}
  if run.name == "p2":
    record["lengths"] = readouts(run, evaluation, plan)
  return record


def readouts(stage1: Run, record: dict, plan: Plan) -> list[dict]:
  """Per stage-1 length: the p = 2 held-out loss (and its gate statistics) and the unadapted p = 1
  readout of the same parameters."""
  rows = []
  for step in plan.length_steps:
    print(f"== seed {stage1.seed}, stage 1 at step {step:,}: p = 2 and the unadapted p = 1 readout ==", flush=True)
    p2 = record if step == plan.stage1_steps else chain.evaluate_step(stage1.config, stage1.workdir, step)
    p1 = chain.readout(stage1.config, stage1.workdir, step, os.path.join(stage1.workdir, "readout_p1"), p=1)
    rows.append({"step": step, "fraction": step / plan.stage1_steps, "tokens": step * tokens_per_step(stage1.config),
                 "loss_p2": p2["loss"], "loss_p1_readout": p1["loss"], "gap": p1["loss"] - p2["loss"],
                 "gate_stats": read_gate_stats(stage1.workdir, p2.get("gate_stats_file"))})
  return rows


def read_gate_stats(folder: str, filename: str | None) -> list[dict]:
  """The per-layer records of ``<folder>/<filename>`` (an evaluation's ``gate_stats_file``)."""
  if not filename:
    return []
  with open(os.path.join(folder, filename)) as f:
    return [json.loads(line) for line in f if line.strip()]


def recalled(run: Run, plan: Plan) -> bool:
  """Whether ``run`` is one the recall table shows."""
  return run.name in RECALL_RUNS and (run.name != "adapt" or run.start_step == max(plan.adapt_from))


def add_recall(run: Run, record: dict, plan: Plan) -> dict:
  """``record`` with the score of the run's final checkpoint on ``plan.recall`` (when the run is one of
  ``RECALL_RUNS``), measured now unless the record holds it; unchanged when the checkpoint is not here."""
  task = plan.recall
  if task is None or not recalled(run, plan) or (record.get("recall") or {}).get("identity") == task.identity():
    return record
  steps = run.config.train.steps
  if not chain.has_checkpoint(run.workdir, steps):
    print(f"   recall not measured: {run.workdir} keeps no checkpoint of step {steps:,} (it stays on the machine "
          "that trained the run)", flush=True)
    return record
  print(f"== seed {run.seed}, {run.label}: recall on {task.name} ==", flush=True)
  with jax.set_mesh(sharding.make_mesh(run.config.mesh)):  # the kernels' shard_map reads the mesh from here
    scored = cli.import_tasks().evaluate_tasks(run.config, run.workdir, [task.name], step=steps, task_path=task.path,
                                  limit=task.limit, batch_size=task.batch_size)
  row = next(r for r in scored["results"] if r["task"] == task.name)
  return write_record(plan, run, {**record, "recall": {
      "identity": task.identity(), "metric": row["metric"], "accuracy": row["value"], "stderr": row["stderr"],
      "n": row["n"], "seconds": scored["seconds"]}})


def finish(run: Run, record: dict | None, plan: Plan, index: int, total: int) -> dict | None:
  """The portable record of one run: ``record`` (read back), else trained (or read back from its folder)
  and written; None when training was stopped by a signal."""
  if record is None:
    evaluation = train(run, index, total)
    if evaluation is None:
      return None
    record = write_record(plan, run, new_record(run, evaluation, plan))
    rows_lib.append_row(os.path.join(plan.workdir, GOODPUT_ROWS), rows_lib.goodput_row(
        run.config, evaluation, control=f"{run_key(run)}, seed {run.seed}", corpus=plan.corpus or "embedded",
        command=invocation()))
  else:
    print(f"== [{index}/{total}] seed {run.seed}, {run.label}: {run.config.train.steps:,} steps (recorded: read "
          f"back from {record_path(plan.workdir, run.seed, run_key(run))}) ==\n"
          f"   held-out loss {record['eval']['loss']:.4f} nats", flush=True)
  return add_recall(run, record, plan)


def check_stage2_sources(plan: Plan, runs: list[Run]) -> None:
  """Every stage 2 still to train finds its stage-1 checkpoint here, or its stage 1 trains here first.
  A stage 1 recorded elsewhere left its checkpoints there."""
  for run in runs:
    if run.name != "adapt" or os.path.isfile(record_path(plan.workdir, run.seed, run_key(run))) \
        or chain.has_checkpoint(run.workdir):  # stage 2 resumes its own checkpoint
      continue
    stage1_record = record_path(plan.workdir, run.seed, "p2")
    stage1 = os.path.join(plan.workdir, f"s{run.seed}", "p2")
    if os.path.isfile(stage1_record) and not chain.has_checkpoint(stage1, run.start_step):
      raise MissingFileError(
          f"stage 2 at seed {run.seed} starts from stage 1's checkpoint of step {run.start_step:,}, and {stage1} "
          f"has none: stage 1 is recorded ({stage1_record}) but was trained elsewhere. Stage 1 and stage 2 finish "
          f"in one sitting: remove {os.path.dirname(stage1_record)}/p2.json and adapt_*.json to train both here, "
          "or leave adapt out of --runs.")


def run_chain(plan: Plan, runs: list[Run]) -> dict[tuple[int, str], dict] | None:
  """Every run in order; their portable records by (seed, run key), or None when a run was stopped.
  Records that do not fit the plan and stage 2 without its stage 1 fail before anything trains."""
  recorded = [read_run_record(run, plan) for run in runs]
  check_stage2_sources(plan, runs)
  records = {}
  for index, (run, record) in enumerate(zip(runs, recorded), 1):
    record = finish(run, record, plan, index, len(runs))
    if record is None:
      return None
    records[(run.seed, run_key(run))] = record
  return records


def run_summary(run: Run, record: dict) -> dict:
  steps = run.config.train.steps
  return {"label": run.label, "workdir": run.workdir, "steps": steps, "tokens": steps * tokens_per_step(run.config),
          "params": abstract_param_count(run.config.model), "train_seconds": record["train_seconds"],
          "loss": record["eval"]["loss"], "start_step": run.start_step, "eval": record["eval"],
          "recall": record.get("recall")}


def results_from_records(plan: Plan, runs: list[Run], records: dict[tuple[int, str], dict]) -> dict:
  """The results record (per seed, and their ``summary``) from the runs' portable records alone."""
  per_seed: dict[str, dict] = {}
  for run in runs:
    record = records[(run.seed, run_key(run))]
    result = per_seed.setdefault(str(run.seed), {"runs": {}, "lengths": []})
    result["runs"][run_key(run)] = run_summary(run, record)
    if run.name == "p2":
      result["lengths"] = [dict(row) for row in record["lengths"]]
  for seed, result in per_seed.items():
    for row in result["lengths"]:
      adapted = result["runs"].get(f"adapt_{row['step']}")
      row["adapted_loss"] = adapted and adapted["loss"]
      row["adapted_minus_p2"] = adapted and adapted["loss"] - row["loss_p2"]
    seed_runs = [r for r in runs if str(r.seed) == seed]
    result["gate_stats"] = gate_comparison(seed_runs, {run_key(r): records[(r.seed, run_key(r))] for r in seed_runs},
                                           result["lengths"])
  return {"stage1_steps": plan.stage1_steps, "seeds": per_seed,
          "summary": summarize(per_seed, plan.stage1_steps, plan.recall)}


def gate_comparison(runs: list[Run], records: dict[str, dict], lengths: list[dict]) -> dict:
  """Per-layer gate statistics of stage 1 at the longest adapted length and of stage 2 from it."""
  stage1 = next((r for r in runs if r.name == "p2"), None)
  if stage1 is None:
    return {}
  adapted = [r for r in runs if r.name == "adapt"]
  step = adapted[-1].start_step if adapted else stage1.config.train.steps
  row = next(r for r in lengths if r["step"] == step)
  stage2 = records[f"adapt_{step}"]["gate_stats"] if adapted else []
  return {"stage1_step": step, "stage1": row["gate_stats"], "stage2": stage2}


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


def summarize(per_seed: dict[str, dict], stage1_steps: int, task: RecallTask | None = None) -> dict:
  """Per run and per stage-1 length, over the seeds: mean and spread of each loss; each run's mean
  against Transformer++'s; the source's differences beside the chain's; recall (``recall_summary``)."""
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
  return {"runs": runs, "lengths": length_rows, "source": source_comparison(per_seed, stage1_steps),
          "recall": recall_summary(per_seed, runs, task)}


def recall_summary(per_seed: dict[str, dict], runs: dict[str, dict], task: RecallTask | None) -> dict:
  """Per run with a recall score: the accuracy at each seed, their mean and spread, beside the run's
  held-out loss (over every seed). Scores of one task only: ``task``'s, else the one most records hold;
  ``left_out`` counts the others."""
  def identity(summary: dict) -> str | None:
    return json.dumps(summary["recall"]["identity"], sort_keys=True) if summary.get("recall") else None
  held = [identity(s) for r in per_seed.values() for s in r["runs"].values() if identity(s)]
  if task is None and not held:
    return {}
  wanted = json.dumps(task.identity(), sort_keys=True) if task else collections.Counter(held).most_common(1)[0][0]
  rows = {}
  for key, row in runs.items():
    scores = {seed: r["runs"][key]["recall"] for seed, r in per_seed.items()
              if key in r["runs"] and identity(r["runs"][key]) == wanted}
    if scores:
      rows[key] = {"label": row["label"], "accuracies": {seed: v["accuracy"] for seed, v in scores.items()},
                   "examples": max(v["n"] or 0 for v in scores.values()), "loss": {k: row[k] for k in ("mean", "spread", "n")},
                   **mean_spread([v["accuracy"] for v in scores.values()])}
  return {"identity": json.loads(wanted), "runs": rows, "left_out": sum(h != wanted for h in held)}


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


def _with_spread(stat: dict, fmt: str = ".4f", spread_fmt: str = ".4f") -> str:
  if stat["mean"] is None:
    return "–"
  return _num(stat["mean"], fmt) + (f" ± {stat['spread'] / 2:{spread_fmt}}" if stat["n"] > 1 else "")


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
  lines += recall_markdown(summary.get("recall") or {}, seeds)
  lines += ["", f"device: {device}; command: `{command}`"]
  return "\n".join(lines)


def recall_markdown(recall: dict, seeds: list[str]) -> list[str]:
  """The recall table: accuracy per seed, mean ± half spread, beside the held-out loss."""
  if not recall.get("runs"):
    return []
  task = recall["identity"]
  examples = max(r["examples"] for r in recall["runs"].values())
  lines = ["", f"Recall on `{task['task']}` ({examples:,} held-out examples per run; the function's name given one "
           "line of its body, scored by containment; sha256 " + task["sha256"][:12] + "):", "",
           "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | recall, mean ± half spread | held-out loss |",
           "|---" * (3 + len(seeds)) + "|"]
  for r in recall["runs"].values():
    cells = [_num(r["accuracies"].get(s), ".3f") for s in seeds]
    lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {_with_spread(r, '.3f', '.3f')} | "
                 f"{_with_spread(r['loss'])} |")
  if recall["left_out"]:
    lines.append(f"\n{recall['left_out']} recorded scores of another recall task or limit are left out.")
  return lines


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
  window = max(1, min(window, len(values)))
  return np.convolve(values, np.ones(window) / window, mode="valid")


COLOURS = dict(zip(RUNS, ("tab:blue", None, "tab:green", "black", "tab:red", "tab:purple", "tab:gray", "tab:brown",
                          "tab:cyan", "tab:olive")))
SEED_STYLES = ("-", "--", ":", "-.")


def curves(run: Run, record: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(steps, training loss, eval steps, held-out loss) of a run: from its ``metrics.jsonl`` when it is
  here, else from its record."""
  rows = chain.read_metrics(run.workdir)
  if rows:
    return (*chain.loss_curve(rows), *chain.loss_curve(rows, "eval/loss"))
  def columns(points):
    array = np.array(points, dtype=np.float64).reshape(-1, 2)
    return array[:, 0].astype(np.int64), array[:, 1]
  return (*columns(record["curve"]["train"]), *columns(record["curve"]["eval"]))


def plot_curves(runs: list[Run], records: dict[tuple[int, str], dict], results: dict, path: str,
                stage1_steps: int) -> None:
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
    per_step = tokens_per_step(run.config)
    offset = run.start_step * per_step
    steps, loss, eval_steps, eval_loss = curves(run, records[(run.seed, run_key(run))])
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


def invocation() -> str:
  """This process's command line, as a shell would take it."""
  return " ".join(shlex.quote(a) for a in ["python", *sys.argv])


def write_results(plan: Plan, runs: list[Run], records: dict) -> None:
  """``results.md``, ``results.json`` and the loss curves in ``--workdir``, from the runs' records."""
  results = results_from_records(plan, runs, records)
  device = ", ".join(sorted({record.get("device", "unknown") for record in records.values()}))  # that trained them
  command = invocation()
  table = results_markdown(results, device, command)
  plot_path = _PLOT.value or os.path.join(plan.workdir, "loss_curves.png")
  plot_curves(runs, records, results, plot_path, plan.stage1_steps)
  with open(os.path.join(plan.workdir, "results.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(plan.workdir, "results.json"), "w") as f:
    json.dump(to_json({**results, "device": device, "command": command}), f, indent=1)
  print(f"\n{table}\n\nwrote {plan.workdir}/results.md, results.json and {plot_path}", flush=True)


def recorded_runs(plan: Plan, runs: list[Run]) -> list[Run]:
  """The runs of ``runs`` that have a portable record; the others are named on the console (a
  ``ConfigError`` when none has)."""
  recorded = [r for r in runs if os.path.isfile(record_path(plan.workdir, r.seed, run_key(r)))]
  left_out = [f"{run_key(r)} (seed {r.seed})" for r in runs if r not in recorded]
  if not recorded:
    raise ConfigError(f"--from_records: {plan.workdir}/records holds no record of these runs; copy the records "
                      "there, or leave out --from_records to train them.")
  if left_out:
    print(f"Not in the tables (no record): {', '.join(left_out)}", flush=True)
  return recorded


def main(argv):
  del argv
  cli.show_library_logs()
  plan = make_plan()
  runs = build_runs(plan)
  if _FROM_RECORDS.value:
    runs = recorded_runs(plan, runs)
  if not all(os.path.isfile(record_path(plan.workdir, r.seed, run_key(r))) for r in runs):
    check_inputs(plan, runs[0].config)  # only training reads the corpus: recorded runs build the table anywhere
  with workdir_lib.WorkdirLock(plan.workdir):
    start_workdir(plan)
    records = run_chain(plan, runs)
    if records is not None:
      write_results(plan, runs, records)


if __name__ == "__main__":
  cli.run(main)
