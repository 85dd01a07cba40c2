"""Run a grid of config overrides and tabulate the held-out losses.

    python scripts/sweep.py --config=configs/sanatan.py:tiny \
        --sweep=model.mixers.sanatan.channels=6,4 --sweep=train.learning_rate=1e-3,3e-3 --root=runs/sweep

Runs from any directory (config and root paths are relative to where it is started). Each point
trains in ``<root>/<point name>``: a rerun resumes unfinished points and skips finished ones (same
command) without evaluating them again. A point that diverges (NaN loss) is marked as such and the grid
goes on. The table (failures marked) is printed and goes to ``<root>/sweep_results.md``, a bar chart to
``<root>/sweep_results.png``. Extra arguments after ``--`` are passed to every run (e.g.
``-- --config.train.steps=200``). Exit status: 0 when every point finished or diverged, 1 when a point
failed otherwise (its reason is in the table; the next run retries it).
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmcore import cli  # noqa: E402
from lmcore import sweep  # noqa: E402

_CONFIG = flags.DEFINE_string("config", None, "Config file and preset (as for train.py).")
_SWEEP = flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,... (repeat for a grid); KEY without 'config.'.")
_ROOT = flags.DEFINE_string("root", "runs/sweep", "Parent folder of the runs.")
flags.mark_flags_as_required(["config"])


def main(argv):
  text, results = sweep.run_sweep(_CONFIG.value, _SWEEP.value, _ROOT.value, list(argv[1:]))
  print(text)
  return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
  app.run(cli.guarded(main))
