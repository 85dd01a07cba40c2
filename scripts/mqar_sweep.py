"""The MQAR sweep (MATH §6.5): mixers × widths × learning rates -> one JSONL row per run, resumable.

    python scripts/mqar_sweep.py --config=configs/mqar.py:sweep --out=runs/mqar/sweep.jsonl
    python scripts/mqar_sweep.py --mixers=based,softmax --widths=64 --lrs=1e-3,1e-2 --epochs=4

Runs already in ``--out`` are skipped; the table of every run and of the best learning rate per point
is printed at the end. The budget of the default grid is in ``configs/mqar.py``.
"""

from absl import flags
from ml_collections import config_flags

from lmcore.mqar import config as mqar_config
from lmcore.mqar import sweep
from lmcore import cli

_CONFIG = config_flags.DEFINE_config_file("config", "configs/mqar.py:sweep", "MQAR config file and preset.",
                                          lock_config=True)
_MIXERS = flags.DEFINE_list("mixers", None, "Series labels to run (default: all of the config's grid).")
_WIDTHS = flags.DEFINE_list("widths", None, "d_model values to run (default: all of the grid's).")
_LRS = flags.DEFINE_list("lrs", None, "Learning rates (default: the config's, zoology's four).")
_EPOCHS = flags.DEFINE_integer("epochs", None, "Epochs per run, also the cosine's T_max.")
_SCALE = flags.DEFINE_float("train_examples_scale", None, "Fraction of every train segment's examples.")
_OUT = flags.DEFINE_string("out", None, "JSONL file the rows are appended to.")
_BUDGET = flags.DEFINE_float("time_budget_s", None,
                             "Start no new point past this many seconds (0: no limit).")


def main(argv):
  del argv
  base, selection = mqar_config.parse(_CONFIG.value)
  base, selection = sweep.with_overrides(
      base, selection, mixers=_MIXERS.value, widths=_WIDTHS.value, lrs=_LRS.value, epochs=_EPOCHS.value,
      train_examples_scale=_SCALE.value, out=_OUT.value, time_budget_s=_BUDGET.value)
  points = sweep.select(sweep.grid(selection.grid), selection.mixers, selection.widths)
  rows = sweep.run_sweep(base, points, selection.out, time_budget_s=selection.time_budget_s)
  print(sweep.summary(rows))


if __name__ == "__main__":
  cli.run(main)  # the project's XLA flags first, then one line for a bad --config
