"""Evaluate a run: ``python eval.py --config=configs/<file>.py:<preset> --workdir=DIR [--step=N]``.

Reports held-out cross-entropy (nats), perplexity and tokens, paired parallel/recurrent losses for
fixed-state models, and writes ``DIR/eval_<step>.json``. ``--prompt`` (one text) or ``--prompt_file``
(one prompt per line, sampled as one batch) also samples continuations (``--max_new_tokens``,
``--temperature`` (0: greedy), ``--top_k``, ``--top_p``, ``--seed``) through the compiled decode loop of
``lmcore/eval/generate.py``, prints the text as it is sampled (every ``--stream_tokens`` loop steps) and
writes one JSON line per prompt to ``--samples_path`` (default ``<out_dir>/samples_<step>.jsonl``).
A p = 2 SANATAN run read out at p = 1 (the paper's unadapted control):
``--config.model.mixers.sanatan.p=1``.

``--tasks=swde,fda,...`` scores the checkpoint on lm-evaluation-harness tasks instead (``lmcore/eval/
harness.py``; ``--task_path`` a folder of task YAMLs, ``--limit``, ``--batch_size``, ``--num_fewshot``,
``--long_context``), offline: datasets come from the local Hugging Face cache or local files. The
table is printed and written to ``DIR/eval_<step>_<tasks>.json``.
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
_OUT_DIR = flags.DEFINE_string("out_dir", "", "Where eval_<step>.json and eval_<step>_<tasks>.json go "
                              "(default: --workdir).")
_TASKS = flags.DEFINE_list("tasks", [], "lm-eval tasks or groups to score the checkpoint on, e.g. swde,fda "
                           "(instead of the held-out evaluation).")
_TASK_PATH = flags.DEFINE_string("task_path", "", "A folder of lm-eval task YAMLs (local-file tasks).")
_LIMIT = flags.DEFINE_integer("limit", 0, "Score at most this many examples per task (0: all).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Sequences per scored batch (0: eval.batch_size).")
_NUM_FEWSHOT = flags.DEFINE_integer("num_fewshot", -1, "Few-shot examples per prompt (-1: the task's own).")
_LONG_CONTEXT = flags.DEFINE_enum("long_context", "truncate", ["truncate", "stream"],
                                  "Contexts longer than data.seq_len: keep the last seq_len tokens, or "
                                  "stream them through a fixed-size decode state.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  cli.show_library_logs()  # absl (and Orbax's per-save logs) at WARNING, lmcore at INFO
  sharding.initialize_distributed()
  config = cfg_lib.experiment_config(_CONFIG.value)
  sampling = generate.Sampling(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  prompts = generate.prompts_of(_PROMPT.value, _PROMPT_FILE.value, _STREAM_TOKENS.value)
  with jax.set_mesh(sharding.make_mesh(config.mesh)):  # the kernels' shard_map reads the mesh from here
    if _TASKS.value:
      cli.import_tasks().evaluate_tasks(config, _WORKDIR.value, _TASKS.value, step=_STEP.value, task_path=_TASK_PATH.value,
                           limit=_LIMIT.value, batch_size=_BATCH_SIZE.value, num_fewshot=_NUM_FEWSHOT.value,
                           long_context=_LONG_CONTEXT.value, out_dir=_OUT_DIR.value)
      return
    chain.evaluate_checkpoint(config, _WORKDIR.value, _STEP.value, prompts, _MAX_NEW_TOKENS.value,
                              _OUT_DIR.value, sampling=sampling, seed=_SEED.value,
                              samples_path=_SAMPLES_PATH.value, stream_tokens=_STREAM_TOKENS.value)


if __name__ == "__main__":
  cli.run(main)
