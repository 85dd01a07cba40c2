"""SANATAN's two-stage claim at one-GPU scale: p = 2, then a short p = 1 adaptation, against controls.

How to run
  The corpus folder (``--corpus``, default runs/linux) holds ``shards/*.array_record`` (one C/H source
  file per document) and a SentencePiece ``tokenizer.model`` of 16,384 pieces, e.g.

    python scripts/prepare_data.py --input='linux/**/*.[ch]' --kind=text --output_dir=runs/linux/shards \
        --shuffle_seed=0
    python scripts/train_tokenizer.py --input='runs/linux/shards/*.array_record' --kind=array_record \
        --vocab_size=16384 --output=runs/linux/tokenizer.model

  Then, on one GPU (``--stage1_steps`` scales every run; ``--runs=p2,adapt`` for the claim alone):

    python scripts/reproduce.py --workdir=runs/reproduce

  Rerunning the same command continues where the last one stopped (after SIGTERM, a crash or a time
  limit). On a CPU, the same chain in seconds on the embedded corpus: ``--tiny``. ``--override
  KEY=VALUE`` (repeatable) sets a config key in every run that has it, e.g. ``data.worker_count=0``.

The claim (MATH §1.4): a model trained at p = 2 and adapted briefly at p = 1 matches the p = 2 model
(3.951 vs 3.966 held-out nats), while the p = 2 weights read out at p = 1 without adaptation collapse
(≈ 9.0). The chain measures the same comparison with the ``repro_*`` presets (configs/sanatan.py,
configs/baselines.py; 8 layers of 512, T = 1024, 32 sequences per step):

1. stage 1, p = 2, for S1 steps (``--stage1_steps``), keeping its checkpoints at ``--lengths``;
2. at each length: the p = 2 held-out loss and the same parameters read out at p = 1 (no adaptation);
3. stage 2 from each of ``--adapt_lengths`` (default: every length): p = 1 for 6 % of that length's
   steps at a tenth of the learning rate, continuing stage 1's data stream, evaluated parallel and
   recurrent on the same sequences (their paired difference and max |Δlogit|), with per-layer
   root-gate statistics;
4. controls for S1 + stage-2 steps: p = 1 from scratch, softmax attention, GLA.

The shorter lengths are checkpoints of one cosine schedule of S1 steps (their learning rate has not
decayed), not runs trained to that length. Every run is a folder under ``--workdir``; finished runs and
evaluations are read back from their ``eval_<step>.json``, never trained or computed again. Output:
``results.md`` and ``results.json`` in ``--workdir`` and the loss curves (``--plot``).
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

RUNS = ("p2", "adapt", "scratch", "softmax", "gla")
GATE_KEYS = ("frac_saturated_q", "frac_saturated_k", "mismatch_fraction", "mismatch_gate_mean")

_WORKDIR = flags.DEFINE_string("workdir", sanatan.REPRO_WORKDIR, "Where every run of the chain writes.")
_CORPUS = flags.DEFINE_string("corpus", sanatan.REPRO_CORPUS, "Folder holding shards/*.array_record and "
                              "tokenizer.model (with --tiny: only when given).")
_STAGE1_STEPS = flags.DEFINE_integer("stage1_steps", None, "Stage-1 steps; every other count derives from "
                                     "them (default: the preset's, 4,000; --tiny 8).")
_LENGTHS = flags.DEFINE_string("lengths", "0.25,0.5,1", "Fractions of stage 1 at which the p = 1 readout gap "
                               "is measured.")
_ADAPT_LENGTHS = flags.DEFINE_string("adapt_lengths", "", "Fractions of stage 1 that stage 2 adapts from "
                                     "(each one of --lengths; default: all of them).")
_RUNS = flags.DEFINE_list("runs", list(RUNS), f"Runs of the chain, of {', '.join(RUNS)} (adapt needs p2).")
_TINY = flags.DEFINE_bool("tiny", False, "The chain at CPU-test scale (embedded corpus unless --corpus).")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "KEY=VALUE set in every run whose config has KEY "
                                      "(as --config.KEY=VALUE); repeatable.")
_PLOT = flags.DEFINE_string("plot", "", "The loss-curve PNG (default: <workdir>/loss_curves.png).")


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of the chain: its config, folder and where its curve starts (stage 2: after stage 1)."""

  name: str
  label: str
  config: cfg_lib.ExperimentConfig
  workdir: str
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

  def identity(self) -> dict:
    """What a rerun in the same workdir must keep (the runs and adapted lengths may change)."""
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
  return Plan(_WORKDIR.value, scale, corpus, stage1_steps, lengths, adapt, runs, tuple(_OVERRIDE.value))


def configure(cd, plan: Plan, overrides) -> tuple[cfg_lib.ExperimentConfig, set[str]]:
  """The typed config of one run: the chain's shared held-out set, then ``overrides``; and the override
  keys it lacks."""
  cd.data.heldout.path = os.path.join(plan.workdir, "heldout.npz")
  try:
    missing = apply_overrides(cd, overrides)
  except BenchError as e:
    raise ConfigError(str(e)) from None
  return cfg_lib.experiment_config(cd), set(missing)


def build_runs(plan: Plan) -> list[Run]:
  """Every run of the plan, in chain order, with its config checked."""
  s1, scale, corpus, root = plan.stage1_steps, plan.scale, plan.corpus, plan.workdir
  p2_dir = os.path.join(root, "p2")
  specs = [("p2", "stage 1: SANATAN p = 2", sanatan.repro_p2(s1, plan.lengths, scale, corpus), "p2", {})]
  for step in plan.adapt_from if "adapt" in plan.runs else ():
    view = {} if step == s1 else {"view_of": p2_dir}
    init = chain.view_path(p2_dir, step) if view else p2_dir
    specs.append(("adapt", f"stage 2: SANATAN p = 1 adapted from stage-1 step {step:,}",
                  sanatan.repro_p1_adapt(step, init, scale, corpus), f"p1_adapt_{step}", dict(view, start_step=step)))
  controls = {"scratch": ("SANATAN p = 1 from scratch", sanatan.repro_p1_scratch),
              "softmax": ("softmax attention", baselines.repro_softmax), "gla": ("GLA", baselines.repro_gla)}
  specs += [(name, label, build(s1, scale, corpus), name if name != "scratch" else "p1_scratch", {})
            for name, (label, build) in controls.items() if name in plan.runs]
  overrides = [parse_override(o) for o in plan.overrides]
  runs, missing = [], None
  for name, label, cd, folder, fields in specs:
    config, lacking = configure(cd, plan, overrides)
    missing = lacking if missing is None else missing & lacking
    if name in plan.runs:
      runs.append(Run(name, label, config, os.path.join(root, folder), **fields))
  if missing:
    key = sorted(missing)[0]
    raise cli.unknown_override(specs[0][2], key) or ConfigError(f"--override {key}: no run has this key.")
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
  print(f"== [{index}/{total}] {run.label}: {steps:,} steps -> {run.workdir}"
        f"{' (finished: read back)' if done else ''} ==", flush=True)
  if run.view_of:
    chain.step_view(run.view_of, run.start_step)
  record = chain.train_or_read(run.config, run.workdir)
  if "stopped_by" in record:
    print(f"{record['stopped_by']} received: stopped at step {record['step']}; rerun the same command to "
          "continue.", flush=True)
    return None
  print(f"   held-out loss {record['loss']:.4f} nats", flush=True)
  return record


def tokens_per_step(config: cfg_lib.ExperimentConfig) -> int:
  return config.train.batch_size * config.data.seq_len


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
    print(f"== stage 1 at step {step:,}: p = 2 and the unadapted p = 1 readout ==", flush=True)
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
  """Every run in order; the results record, or None when a run was stopped."""
  summaries, lengths = {}, []
  for index, run in enumerate(runs, 1):
    record = train(run, index, len(runs))
    if record is None:
      return None
    key = run.name if run.name != "adapt" else f"adapt_{run.start_step}"
    summaries[key] = run_summary(run, record)
    if run.name == "p2":
      lengths = readouts(run, record, plan)
  for row in lengths:
    adapted = summaries.get(f"adapt_{row['step']}")
    row["adapted_loss"] = adapted and adapted["loss"]
    row["adapted_minus_p2"] = adapted and adapted["loss"] - row["loss_p2"]
  return {"stage1_steps": plan.stage1_steps, "runs": summaries, "lengths": lengths,
          "gate_stats": gate_comparison(runs, summaries, lengths)}


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


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _num(value, fmt: str = ".4f") -> str:
  return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def results_markdown(results: dict, device: str, command: str) -> str:
  runs, lengths, gates = results["runs"], results["lengths"], results["gate_stats"]
  lines = ["| run | steps | tokens | params | train s | held-out loss (nats) |", "|---|---|---|---|---|---|"]
  lines += [f"| {r['label']} | {r['steps']:,} | {_count(r['tokens'])} | {r['params']:,} | "
            f"{r['train_seconds']:,.0f} | {r['loss']:.4f} |" for r in runs.values()]
  if lengths:
    lines += ["", "| stage-1 step (fraction) | tokens | p = 2 | p = 1 read out, not adapted | readout gap | "
              "p = 1 adapted | adapted − p = 2 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']:,} ({r['fraction']:.2f}) | {_count(r['tokens'])} | {r['loss_p2']:.4f} | "
              f"{r['loss_p1_readout']:.4f} | {r['gap']:+.4f} | {_num(r['adapted_loss'])} | "
              f"{_num(r['adapted_minus_p2'], '+.4f')} |" for r in lengths]
    lines.append(f"\nThe shorter lengths are checkpoints of one cosine schedule of {results['stage1_steps']:,} "
                 "steps (their learning rate had not decayed), not runs trained to that length.")
  stage2 = [r for r in runs.values() if r["start_step"]]
  if stage2:
    lines += ["", "| stage 2 adapted from step | parallel | recurrent | paired diff (nats) | max abs Δlogit |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['start_step']:,} | {_num(r['eval'].get('loss_parallel'))} | "
              f"{_num(r['eval'].get('loss_recurrent'))} | {_num(r['eval'].get('paired_diff'), '.2e')} | "
              f"{_num(r['eval'].get('max_abs_dlogit'), '.2e')} |" for r in stage2]
  if gates.get("stage1"):
    both = bool(gates["stage2"])
    lines += ["", f"Root-gate statistics per layer (MATH §1.3), stage 1 at step {gates['stage1_step']:,}"
              + (" → stage 2 adapted from it:" if both else ":"), "",
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


def plot_curves(runs: list[Run], lengths: list[dict], path: str, stage1_steps: int) -> None:
  """Training loss (a moving average over 1 % of stage 1) and held-out points against tokens, stage 2
  continuing from its stage-1 step; the unadapted readouts as crosses. Right: the last 30 % of tokens."""
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
  colours = dict(zip(RUNS, ("tab:blue", None, "tab:green", "black", "tab:red")))
  adapted = [r.start_step for r in runs if r.name == "adapt"]  # darker orange: adapted later
  oranges = plt.get_cmap("Oranges")
  window = max(1, stage1_steps // 100)
  visible, end = [], 0.0
  for run in runs:
    colour = colours[run.name] or oranges(0.45 + 0.5 * adapted.index(run.start_step) / max(1, len(adapted) - 1))
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
    for ax in axes:
      ax.plot(x, smooth, color=colour, label=run.label, lw=1.2, marker="." if len(x) < 3 else None)
      ax.plot(offset + eval_steps * per_step, eval_loss, "o", color=colour, ms=4)
  if lengths:
    axes[0].plot([r["tokens"] for r in lengths], [r["loss_p1_readout"] for r in lengths], "kx", ms=8,
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
    ax.set_title(title)
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


def main(argv):
  del argv
  cli.show_library_logs()
  plan = make_plan()
  runs = build_runs(plan)
  check_inputs(plan, runs[0].config)
  start_workdir(plan)
  results = run_chain(plan, runs)
  if results is None:
    return
  device = jax.devices()[0].device_kind
  command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
  table = results_markdown(results, device, command)
  plot_path = _PLOT.value or os.path.join(plan.workdir, "loss_curves.png")
  plot_curves(runs, results["lengths"], plot_path, plan.stage1_steps)
  with open(os.path.join(plan.workdir, "results.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(plan.workdir, "results.json"), "w") as f:
    json.dump(to_json({**results, "device": device, "command": command}), f, indent=1)
  print(f"\n{table}\n\nwrote {plan.workdir}/results.md, results.json and {plot_path}", flush=True)


if __name__ == "__main__":
  cli.run(main)
