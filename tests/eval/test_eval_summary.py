"""The evaluation summary: a paired evaluation that does not apply to the model is not attempted and
prints nothing; a requested one that cannot run says why."""

import dataclasses
import logging

from configs import baselines, sanatan
from lmcore import config as cfg_lib
from lmcore.eval import evaluate

RECORD = {"loss": 5.0, "perplexity": 148.4, "tokens": 256, "unigram_entropy": 6.0,
          "unigram_heldout_xent": 6.3}


def _lines(config, caplog):
  with caplog.at_level(logging.INFO, logger="lmcore"):
    record = {**RECORD, **evaluate.paired_evaluation(config, params=None, rest=None, heldout=None)}
  return record, evaluate.summary_lines(config, record)


def test_no_paired_evaluation_without_a_fixed_state_mixer_or_without_a_constant_size_state(caplog):
  softmax = cfg_lib.experiment_config(baselines.get_config("tiny"))
  p2 = cfg_lib.experiment_config(sanatan.get_config("tiny"))
  assert p2.model.mixers["sanatan"].p == 2 and p2.eval.paired
  for config in (softmax, p2):
    record, lines = _lines(config, caplog)
    assert record == RECORD, "nothing attempted, nothing recorded"
    assert len(lines) == 1 and not any("paired" in line for line in lines)
  reasons = [r.getMessage() for r in caplog.records if r.name == "lmcore.eval.evaluate"]
  assert reasons[0] == "paired evaluation does not apply: no fixed-state mixer in this model"
  assert len(reasons) == 2 and reasons[1].startswith("paired evaluation does not apply: ")  # the mixer's why


def test_a_requested_pair_that_cannot_run_is_printed_with_its_reason(caplog):
  config = cfg_lib.experiment_config(sanatan.get_config("tiny_p1_adapt"))
  config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, paired_b="no_such_form"))
  record, lines = _lines(config, caplog)
  assert record["paired_skipped"].startswith("ConfigError: ") and "no_such_form" in record["paired_skipped"]
  assert lines[-1] == f"paired evaluation skipped: {record['paired_skipped']}"


def test_a_paired_result_is_printed_without_a_skip_line():
  config = cfg_lib.experiment_config(baselines.get_config("tiny"))
  record = {**RECORD, "paired_diff": 1e-8, "max_abs_dlogit": 2e-5}
  lines = evaluate.summary_lines(config, record)
  assert lines[-1].startswith("paired as trained vs recurrent: diff 1.00e-08")
  assert not any("skipped" in line for line in lines)
