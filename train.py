"""Train a model: ``python train.py --config=configs/<file>.py:<preset> [--config.a.b=v ...] --workdir=DIR``.

A workdir that already holds checkpoints resumes from the latest one. A run holds its workdir: a second
process on it stops at once. A resume with a config that changes the model, the data or the optimisation
stops unless ``--accept_config_changes`` names the changed fields (``lmcore/train/workdir.py``).
"""

from absl import flags
from ml_collections import config_flags

from lmcore import cli
from lmcore import config as cfg_lib
from lmcore.train import sharding
from lmcore.train import loop as train_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file and preset, e.g. configs/sanatan.py:tiny.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, eval_<step>.json.")
_ACCEPT = flags.DEFINE_list("accept_config_changes", [], "Config fields (e.g. train.learning_rate) a resume "
                            "may change; each change is recorded in <workdir>/config_history.jsonl.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  cli.show_library_logs()  # absl (and Orbax's per-save logs) at WARNING, lmcore at INFO
  sharding.initialize_distributed()
  config = cfg_lib.experiment_config(_CONFIG.value)
  train_lib.train_and_evaluate(config, _WORKDIR.value, tuple(_ACCEPT.value))


if __name__ == "__main__":
  cli.run(main)
