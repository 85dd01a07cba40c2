"""Evaluate a run: ``python eval.py --config=configs/<file>.py:<preset> --workdir=DIR [--step=N]``.

Reports held-out cross-entropy (nats), perplexity and tokens, paired parallel/recurrent losses for
fixed-state models, and writes ``DIR/eval_<step>.json``. ``--prompt`` (one text) or ``--prompt_file``
(one prompt per line, sampled as one batch) also samples continuations (``--max_new_tokens``,
``--temperature`` (0: greedy), ``--top_k``, ``--top_p``, ``--seed``) through the compiled decode loop of
``lmcore/eval/generate.py``, prints the text as it is sampled (every ``--stream_tokens`` loop steps) and
writes one JSON line per prompt to ``--samples_path`` (default ``<out_dir>/samples_<step>.jsonl``).
A p = 2 SANATAN run read out at p = 1 (the paper's unadapted control):
``--config.model.mixers.sanatan.p=1``.
"""

import jax
from absl import flags
from ml_collections import config_flags

from lmcore import cli
from lmcore import config as cfg_lib
from lmcore.eval import generate
from lmcore.train import chain, sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file and preset the run was trained with.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_PROMPT = flags.DEFINE_string("prompt", "", "If set, sample a continuation of this text.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to sample after --prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature for --prompt (0: greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample only from the k most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample only from the smallest set of tokens whose probability "
                            "reaches top_p (1: all).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of the sample (prompt b of --prompt_file: seed + b).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", "", "If set, sample a continuation of every line of this "
                                   "text file, all in one batch.")
_SAMPLES_PATH = flags.DEFINE_string("samples_path", "", "Where the samples go as JSON lines (default: "
                                    "samples_<step>.jsonl next to eval_<step>.json).")
_STREAM_TOKENS = flags.DEFINE_integer("stream_tokens", 8, "Decode loop steps between two prints of the "
                                      "text sampled so far.")
_OUT_DIR = flags.DEFINE_string("out_dir", "", "Where eval_<step>.json goes (default: --workdir).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  cli.show_library_logs()  # absl (and Orbax's per-save logs) at WARNING, lmcore at INFO
  sharding.initialize_distributed()
  config = cfg_lib.experiment_config(_CONFIG.value)
  sampling = generate.Sampling(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  prompts = generate.prompts_of(_PROMPT.value, _PROMPT_FILE.value, _STREAM_TOKENS.value)
  with jax.set_mesh(sharding.make_mesh(config.mesh)):  # the kernels' shard_map reads the mesh from here
    chain.evaluate_checkpoint(config, _WORKDIR.value, _STEP.value, prompts, _MAX_NEW_TOKENS.value,
                              _OUT_DIR.value, sampling=sampling, seed=_SEED.value,
                              samples_path=_SAMPLES_PATH.value, stream_tokens=_STREAM_TOKENS.value)


if __name__ == "__main__":
  cli.run(main)
