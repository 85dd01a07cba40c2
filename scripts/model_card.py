"""Print a config's model card: parameters, recurrent-state bytes per sequence, FLOPs per token.

    python scripts/model_card.py --config=configs/baselines.py:cyfa_equal_state

These are the three numbers that must match before two models are compared. Nothing is
allocated: the model is built abstractly (``nnx.eval_shape``) and FLOPs are counted analytically
(``lmcore/model_card.py``; ``--json`` also gives the forward count by part).
"""

import json
import os
import sys

from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmcore import cli  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore import model_card  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file and preset.", lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "Print the card as JSON.")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  config = cfg_lib.experiment_config(_CONFIG.value)
  card = model_card.card(config.model, config.data.seq_len)
  print(json.dumps(card, indent=1) if _JSON.value else model_card.format_card(card))


if __name__ == "__main__":
  cli.run(main)
