"""The evaluation summary says when a requested paired evaluation could not run."""

from configs import baselines
from lmcore import config as cfg_lib
from lmcore.eval import evaluate

RECORD = {"loss": 5.0, "perplexity": 148.4, "tokens": 256, "unigram_entropy": 6.0,
          "unigram_heldout_xent": 6.3}


def test_a_skipped_paired_evaluation_is_printed_with_its_reason():
  config = cfg_lib.experiment_config(baselines.get_config("tiny"))
  record = {**RECORD, **evaluate.paired_evaluation(config, params=None, rest=None, heldout=None)}
  assert record["paired_skipped"] == "no fixed-state mixer in this model"
  lines = evaluate.summary_lines(config, record)
  assert lines[-1] == "paired evaluation skipped: no fixed-state mixer in this model"


def test_a_paired_result_is_printed_without_a_skip_line():
  config = cfg_lib.experiment_config(baselines.get_config("tiny"))
  record = {**RECORD, "paired_diff": 1e-8, "max_abs_dlogit": 2e-5}
  lines = evaluate.summary_lines(config, record)
  assert lines[-1].startswith("paired as trained vs recurrent: diff 1.00e-08")
  assert not any("skipped" in line for line in lines)
