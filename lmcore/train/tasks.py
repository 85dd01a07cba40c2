"""Downstream tasks on a run's checkpoint through lm-evaluation-harness (``eval.py --tasks``, the
reproduction's recall scores). Importing this module imports lm-eval, an optional dependency: entry
points import it where tasks are asked for (``lmcore.cli.import_tasks`` says how to install it when it
is missing).
HF_DATASETS_OFFLINE / HF_HUB_OFFLINE default to 1 before the datasets package is imported.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lmcore import data as data_lib  # noqa: E402
from lmcore.config import ExperimentConfig  # noqa: E402
from lmcore.eval import harness  # noqa: E402
from lmcore.model_card import card  # noqa: E402
from lmcore.train import chain  # noqa: E402


def evaluate_tasks(config: ExperimentConfig, workdir: str, tasks: list[str], *, step: int | None = None,
                   task_path: str = "", limit: int = 0, batch_size: int = 0, num_fewshot: int = -1,
                   long_context: str = "truncate", out_dir: str = "") -> dict[str, Any]:
  """``eval.py --tasks``: the checkpoint (latest unless ``step``) through lm-evaluation-harness
  (``lmcore.eval.harness``), offline unless HF_DATASETS_OFFLINE / HF_HUB_OFFLINE say otherwise; the
  record written to ``<out_dir>/eval_<step>_<tasks>.json`` (default: the workdir). Call it inside
  ``jax.set_mesh``."""
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer, data_lib.cache_dir(config.data))
  data_lib.check_vocab(tokenizer, config.model.vocab_size)
  graphdef, params, rest, step = chain.restore_checkpoint(config, workdir, step)
  lm = harness.HarnessLM(graphdef, params, rest, tokenizer, window=config.data.seq_len,
                         batch_size=batch_size or config.eval.batch_size, long_context=long_context)
  return harness.evaluate_tasks(lm, tasks, out_dir=out_dir or workdir, step=step, name=config.name,
                                card=card(config.model, config.data.seq_len), task_path=task_path,
                                limit=limit or None, num_fewshot=None if num_fewshot < 0 else num_fewshot)
