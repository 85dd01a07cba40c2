"""The quick start (``make demo``): SANATAN's two-stage schedule, tiny, on the embedded corpus.

Stage 1 trains p = 2; the stage-1 parameters are then read out at p = 1 without adaptation (the
paper's control); stage 2 trains p = 1 from the stage-1 parameters, continuing its data stream, and is
evaluated with the parallel and the recurrent implementation on the same held-out sequences. One table
compares them. Running it again resumes each stage from its checkpoints instead of starting over.

    python scripts/quickstart.py --workdir=runs/quickstart
"""

import dataclasses
import json
import os
import sys
import time

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import sanatan  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore.train import chain  # noqa: E402
from lmcore.train import loop as train_lib  # noqa: E402
from lmcore import xla_flags  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "runs/quickstart", "Where both stages write.")
_STAGE1_STEPS = flags.DEFINE_integer("stage1_steps", None, "Override stage-1 steps (default: the preset's).")
_STAGE2_STEPS = flags.DEFINE_integer("stage2_steps", None, "Override stage-2 steps (default: the preset's).")


def _with_steps(config: cfg_lib.ExperimentConfig, steps: int | None, **train_fields):
  fields = dict(train_fields, **({"steps": steps} if steps else {}))
  return dataclasses.replace(config, train=dataclasses.replace(config.train, **fields))


def stage_configs(workdir: str, stage1_steps: int | None, stage2_steps: int | None):
  stage1_dir = os.path.join(workdir, "stage1_p2")
  stage1 = _with_steps(cfg_lib.experiment_config(sanatan.get_config("tiny")), stage1_steps)
  stage2 = _with_steps(cfg_lib.experiment_config(sanatan.get_config("tiny_p1_adapt")), stage2_steps,
                       init_from=stage1_dir, init_data_from=stage1_dir)
  return stage1, stage2, stage1_dir, os.path.join(workdir, "stage2_p1")


def unadapted_readout(stage1: cfg_lib.ExperimentConfig, stage1_dir: str, step: int) -> dict:
  """The stage-1 parameters of ``step`` evaluated at p = 1 (MATH §1.4's unadapted control)."""
  return chain.readout(stage1, stage1_dir, step, os.path.join(stage1_dir, "readout_p1"), p=1)


def results_table(stage1: dict, readout: dict, stage2: dict) -> str:
  if "paired_diff" not in stage2:
    reason = stage2.get("paired_skipped", "eval.paired is off, or it does not apply to this model")
    raise SystemExit(f"stage 2's paired evaluation did not run: {reason}")
  rows = [("stage 1, p = 2 (parallel)", stage1["loss"]),
          ("stage 1 read out at p = 1, no adaptation", readout["loss"]),
          ("stage 2, p = 1 (parallel)", stage2["loss_parallel"]),
          ("stage 2, p = 1 (recurrent)", stage2["loss_recurrent"])]
  lines = ["| model | held-out loss (nats) |", "|---|---|"]
  lines += [f"| {name} | {loss:.4f} |" for name, loss in rows]
  lines.append(f"| unigram entropy of the training corpus | {stage1['unigram_entropy']:.4f} |")
  lines.append(f"| a unigram model's held-out loss | {stage1['unigram_heldout_xent']:.4f} |")
  lines.append(f"\nstage 2 paired parallel vs recurrent: loss difference {stage2['paired_diff']:.2e} nats, "
               f"max |Δlogit| {stage2['max_abs_dlogit']:.2e}")
  return "\n".join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO.
  start = time.time()
  stage1, stage2, stage1_dir, stage2_dir = stage_configs(_WORKDIR.value, _STAGE1_STEPS.value, _STAGE2_STEPS.value)
  print("== stage 1: SANATAN p = 2 ==", flush=True)
  record1 = train_lib.train_and_evaluate(stage1, stage1_dir)
  if "stopped_by" in record1:
    return  # SIGTERM/SIGINT: stage 1 saved its checkpoint; rerun to continue.
  print("== stage 1 read out at p = 1 (unadapted control) ==", flush=True)
  readout = unadapted_readout(stage1, stage1_dir, record1["step"])
  print("== stage 2: SANATAN p = 1, initialised from stage 1 ==", flush=True)
  record2 = train_lib.train_and_evaluate(stage2, stage2_dir)
  if "stopped_by" in record2:
    return
  table = results_table(record1, readout, record2)
  print(f"\n{table}\n\n(total {time.time() - start:.0f} s; runs in {_WORKDIR.value})", flush=True)
  with open(os.path.join(_WORKDIR.value, "results.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump({"stage1": record1, "readout_p1": readout, "stage2": record2}, f, indent=1)


if __name__ == "__main__":
  xla_flags.apply_defaults()  # before JAX starts
  app.run(main)
