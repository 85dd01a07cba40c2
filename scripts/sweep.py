"""Run a grid of config overrides and tabulate the held-out losses.

    python scripts/sweep.py --config=configs/sanatan.py:tiny \
        --sweep=model.mixers.sanatan.channels=6,4 --sweep=train.learning_rate=1e-3,3e-3 \
        --config.train.steps=200 --root=runs/sweep

Runs from any directory (config and root paths are relative to where it is started). ``--config.a.b=v``
overrides, as train.py takes them, apply to every point; a key may be swept or fixed, not both, and a
key the preset does not have fails before anything runs. Each point trains in ``<root>/<point name>``: a
rerun resumes unfinished points and skips finished ones (same command) without evaluating them again. A
point that diverges (NaN loss) is marked as such and the grid goes on. The table (failures marked) is
printed and goes to ``<root>/sweep_results.md``, a bar chart to ``<root>/sweep_results.png``;
downstream task results that ``eval.py --tasks`` wrote into the points' workdirs follow as a second
table (rerun the same command after evaluating the points to collect them). Arguments
after ``--`` are passed to every run unchecked. Exit status: 0 when every point finished or diverged, 1
when a point failed otherwise (its reason is in the table; the next run retries it).
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmcore import cli  # noqa: E402
from lmcore import sweep  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file and preset (as for train.py); "
                                          "--config.a.b=v overrides apply to every point.", lock_config=True)
_SWEEP = flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,... (repeat for a grid); KEY without 'config.'.")
_ROOT = flags.DEFINE_string("root", "runs/sweep", "Parent folder of the runs.")
flags.mark_flags_as_required(["config"])


def main(argv):
  fixed = cli.config_overrides(sys.argv[1:])
  sweep.check_axes(_SWEEP.value, fixed, _CONFIG.value)
  text, results = sweep.run_sweep(flags.FLAGS["config"].config_filename, _SWEEP.value, _ROOT.value,
                                  [*fixed, *argv[1:]])
  print(text)
  return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
  cli.run(main)
