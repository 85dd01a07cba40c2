"""Where a reproduction-size run's wall time goes: one control of ``scripts/reproduce.py`` trained in a
fresh workdir, its phase breakdown printed and written as a bench row.

    python scripts/bench_goodput.py                                  # Transformer++ on the embedded corpus
    python scripts/bench_goodput.py --corpus=runs/linux --stage1_steps=1200 --out=runs/bench_goodput
    python scripts/bench_goodput.py --control=scratch_no_table --override=data.worker_count=0

The control trains ``stage1_steps`` + stage 2's steps (1,272 for 1,200), with the chain's checkpoints
(every steps // 8), held-out evaluations (4) and data workers (8). The row (``<out>/goodput.jsonl``:
device, command, control, steps, tokens per step, wall seconds, goodput, seconds per phase and per part)
feeds the goodput table of docs/BENCHMARKS.md. The workdir is ``<out>/run``, removed first when it holds
a finished run of this script.
"""

import json
import os
import shlex
import shutil
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rows as rows_lib  # noqa: E402
from benchmarks.train_step import BenchError, apply_overrides, parse_override  # noqa: E402
from configs import baselines, sanatan  # noqa: E402
from lmcore import cli  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore.errors import ConfigError  # noqa: E402
from lmcore.train import goodput  # noqa: E402
from lmcore.train import loop as train_lib  # noqa: E402

CONTROLS = {"transformer_pp": baselines.transformer_pp_repro, "gla": baselines.repro_gla,
            "scratch": sanatan.repro_p1_scratch, "scratch_no_table": sanatan.repro_p1_scratch_no_table}

_CONTROL = flags.DEFINE_enum("control", "transformer_pp", list(CONTROLS), "The reproduction control trained.")
_CORPUS = flags.DEFINE_string("corpus", "", "Folder holding shards/*.array_record and tokenizer.model "
                              "(as scripts/reproduce.py's --corpus); '' = the embedded corpus.")
_STAGE1_STEPS = flags.DEFINE_integer("stage1_steps", 1200, "The chain's stage-1 steps: the control trains "
                                     "these plus stage 2's.")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "KEY=VALUE set in the control's config; repeatable.")
_OUT = flags.DEFINE_string("out", "runs/bench_goodput", "Directory of goodput.jsonl and the run's workdir.")

MARK = "bench_goodput.json"  # in a workdir this script made: it may remove it


def control_config(control: str, corpus: str, stage1_steps: int, overrides: list[str]) -> cfg_lib.ExperimentConfig:
  cd = CONTROLS[control](stage1_steps, sanatan.REPRO_GPU, corpus or None)
  try:
    missing = apply_overrides(cd, [parse_override(o) for o in overrides])
  except BenchError as e:
    raise ConfigError(str(e)) from None
  if missing:
    raise cli.unknown_override(cd, missing[0]) or ConfigError(f"--override {missing[0]}: no such key.")
  return cfg_lib.experiment_config(cd)


def fresh_workdir(path: str) -> str:
  """``path``, emptied when an earlier run of this script made it; refused when something else is there."""
  if os.path.isdir(path) and os.listdir(path):
    if not os.path.isfile(os.path.join(path, MARK)):
      raise ConfigError(f"{path} holds files this script did not write; choose another --out.")
    shutil.rmtree(path)
  os.makedirs(path)
  with open(os.path.join(path, MARK), "w") as f:
    json.dump({"made_by": "scripts/bench_goodput.py"}, f)
  return path


def main(argv):
  del argv
  cli.show_library_logs()
  config = control_config(_CONTROL.value, _CORPUS.value, _STAGE1_STEPS.value, _OVERRIDE.value)
  os.makedirs(_OUT.value, exist_ok=True)
  workdir = fresh_workdir(os.path.join(_OUT.value, "run"))
  record = train_lib.train_and_evaluate(config, workdir)
  if "goodput" not in record:  # stopped by a signal
    return
  command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
  rows_lib.append_row(os.path.join(_OUT.value, "goodput.jsonl"), rows_lib.goodput_row(
      config, record, control=_CONTROL.value, corpus=_CORPUS.value or "embedded", command=command))
  print(f"{_CONTROL.value}, {config.train.steps:,} steps: {goodput.summary_line(record['goodput'])}\n"
        f"wrote {os.path.join(_OUT.value, 'goodput.jsonl')}", flush=True)


if __name__ == "__main__":
  cli.run(main)
