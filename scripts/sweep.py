"""Run a grid of config overrides and tabulate the held-out losses.

    python scripts/sweep.py --config=configs/sanatan.py:tiny \
        --sweep=model.mixers.sanatan.channels=6,4 --sweep=train.learning_rate=1e-3,3e-3 --root=runs/sweep

Each point trains in ``<root>/<point name>`` (rerunning resumes / skips finished points); the table
goes to ``<root>/sweep_results.md`` and a bar chart to ``<root>/sweep_results.png``. Extra arguments
after ``--`` are passed to every run (e.g. ``-- --config.train.steps=200``).
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmcore import sweep  # noqa: E402

_CONFIG = flags.DEFINE_string("config", None, "Config file and preset (as for train.py).")
_SWEEP = flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,... (repeat for a grid); KEY without 'config.'.")
_ROOT = flags.DEFINE_string("root", "runs/sweep", "Parent folder of the runs.")
flags.mark_flags_as_required(["config"])


def main(argv):
  print(sweep.run_sweep(_CONFIG.value, _SWEEP.value, _ROOT.value, list(argv[1:])))


if __name__ == "__main__":
  app.run(main)
