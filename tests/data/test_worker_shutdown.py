"""Closing an input pipeline with worker processes stops them together and at once, also when each
worker is in the middle of sending a batch larger than its pipe holds (Grain, left alone, waits for
such a worker until its kill timeout, one worker after another)."""

import json
import multiprocessing
import time

import numpy as np
from absl import flags

from lmcore.data import pipeline
from lmcore.data.config import DataConfig, SourceConfig
from data_cases import CharTokenizer

GRAIN_KILL_TIMEOUT_S = 25  # what Grain waits for a worker that does not exit


def test_closing_stops_workers_blocked_on_a_full_pipe_at_once(tmp_path):
  flags.FLAGS.mark_as_parsed()  # Grain workers read absl flags; the entry points parse them
  rng = np.random.default_rng(0)
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": "".join(rng.choice(list("abcdefgh"), 4000))}) + "\n"
                          for _ in range(200)))
  # 16 windows of 1,024 tokens: three int32 arrays of 196 KiB per batch, over a 64 KiB pipe
  cfg = DataConfig(sources=(SourceConfig(name="docs", kind="jsonl", path=str(path)),), seq_len=1023,
                   worker_count=2)
  iterator = pipeline.make_train_iterator(cfg, CharTokenizer(), batch_size=16, seed=0)
  batches = [next(iterator) for _ in range(4)]  # every worker's iterator in use, as after a few steps
  assert all(b["tokens"].shape == (16, 1024) for b in batches)
  time.sleep(2.0)  # the workers fill their queues and block sending the next batch
  start = time.monotonic()
  iterator.close()
  assert time.monotonic() - start < GRAIN_KILL_TIMEOUT_S
  assert not multiprocessing.active_children()
