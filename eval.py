"""Evaluate a run: ``python eval.py --config=configs/<file>.py:<preset> --workdir=DIR [--step=N]``.

Reports held-out cross-entropy (nats), perplexity and tokens, paired parallel/recurrent losses for
fixed-state models, and writes ``DIR/eval_<step>.json``. ``--prompt`` also samples a continuation.
A p = 2 SANATAN run read out at p = 1 (the paper's unadapted control):
``--config.model.mixers.sanatan.p=1``.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from lmcore import config as cfg_lib
from lmcore.eval import evaluate
from lmcore.train import sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file and preset the run was trained with.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_PROMPT = flags.DEFINE_string("prompt", "", "If set, sample a continuation of this text.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to sample after --prompt.")
_OUT_DIR = flags.DEFINE_string("out_dir", "", "Where eval_<step>.json goes (default: --workdir).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO.
  sharding.initialize_distributed()
  config = cfg_lib.experiment_config(_CONFIG.value)
  evaluate.evaluate_checkpoint(config, _WORKDIR.value, _STEP.value, _PROMPT.value, _MAX_NEW_TOKENS.value,
                               _OUT_DIR.value)


if __name__ == "__main__":
  app.run(main)
