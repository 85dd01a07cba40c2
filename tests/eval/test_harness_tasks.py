"""A checkpoint through lm-evaluation-harness end to end, offline: a tiny model trained on the bigram
language of ``fixtures/bigram.py`` scores above chance on the fixture multiple-choice task and completes
the containment-scored generation task, through ``eval.py --tasks``'s function (``lmcore.train.tasks.evaluate_tasks``,
which calls ``lm_eval.simple_evaluate`` with the project's model object); the record and table are written; a
task whose dataset is missing offline is one line naming the task."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm-eval imports the datasets package
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402

import pytest  # noqa: E402

from configs import common  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore import data as data_lib  # noqa: E402
from lmcore import sweep  # noqa: E402
from lmcore.errors import ConfigError, MissingFileError  # noqa: E402
from lmcore.eval import harness  # noqa: E402
from lmcore.train import tasks  # noqa: E402
from lmcore.train import loop as train_lib  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
TASKS = os.path.join(FIXTURES, "tasks")


def bigram_config():
  return cfg_lib.experiment_config(common.experiment(
      model=dict(vocab_size=128, d_model=32, n_layers=1, pattern="softmax*1", mlp_hidden=64, dtype="float32"),
      mixers={"softmax": {"n_heads": 2}},
      train=dict(steps=16, batch_size=8, learning_rate=1e-2, warmup_steps=2, log_every=8, checkpoint_every=16,
                 compilation_cache=False),
      data=dict(seq_len=32), heldout=dict(num_sequences=2),
      sources={"bigram": dict(kind="jsonl", path=os.path.join(FIXTURES, "corpus.jsonl"),
                              heldout_fraction=0.05)},
      tokenizer=dict(kind="hf_json", path=os.path.join(FIXTURES, "char_tokenizer.json")),
      eval=dict(paired=False, batch_size=8), wandb=dict(mode="disabled"), name="bigram"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A checkpoint of the bigram model. The held-out evaluation that ends training skips its unigram
  yardstick (500,000 training tokens through the data pipeline), which these tests do not read."""
  workdir = str(tmp_path_factory.mktemp("bigram"))
  config = bigram_config()
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(data_lib, "unigram_baseline",
                  lambda *args: {"unigram_entropy": 0.0, "unigram_heldout_xent": 0.0})
    train_lib.train_and_evaluate(config, workdir)
  return config, workdir


def test_eval_tasks_scores_a_trained_checkpoint_on_local_tasks(trained, capsys):
  config, workdir = trained
  record = tasks.evaluate_tasks(config, workdir, ["bigram_mc", "bigram_recall"], task_path=TASKS)
  values = {(r["task"], r["metric"]): r for r in record["results"]}
  mc, recall = values[("bigram_mc", "acc")], values[("bigram_recall", "contains")]
  assert (mc["n"], recall["n"]) == (32, 24)
  assert mc["value"] - 3 * mc["stderr"] > 0.25, mc  # 4 choices: chance is 1/4
  assert recall["value"] >= 0.5, recall
  path = os.path.join(workdir, f"eval_{config.train.steps}_bigram_mc+bigram_recall.json")
  with open(path) as f:
    assert json.load(f)["results"] == record["results"]
  assert record["model_card"]["params"] > 0 and record["examples"] == 56
  table = capsys.readouterr().out
  assert "bigram_mc" in table and "acc" in table and path in table
  collected = sweep.task_table({"bigram": workdir, "no_tasks": os.path.dirname(workdir)})
  assert f"| bigram | bigram_mc | acc | {mc['value']:.4f} ± {mc['stderr']:.4f} | 32 | 16 |" in collected


def test_a_task_whose_dataset_is_missing_offline_is_one_line_naming_it(tmp_path):
  (tmp_path / "absent.yaml").write_text("task: absent_recall\ndataset_path: no-such-org/no-such-dataset\n"
                                        "test_split: test\noutput_type: generate_until\n"
                                        "doc_to_text: '{{text}}'\ndoc_to_target: '{{value}}'\n")
  manager = harness.task_manager(str(tmp_path), ["absent_recall"])
  with pytest.raises(MissingFileError, match="task 'absent_recall' cannot read its dataset") as e:
    harness.load_tasks(manager, ["absent_recall"])
  assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="unknown task 'no_such_task'"):
    harness.load_tasks(manager, ["no_such_task"])
