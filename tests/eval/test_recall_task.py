"""scripts/make_recall_task.py: examples come only from the documents the training run holds out, each
asks for the name of a function whose definition (the name's only occurrence) is earlier in the
prompt, and the written folder is an lm-eval task that loads offline and scores by containment."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm-eval imports the datasets package
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

from lmcore.data.pipeline import heldout_mask  # noqa: E402
from lmcore.data.sources import file_source, glob_root, resolve_files  # noqa: E402
from lmcore.eval import harness  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "make_recall_task", os.path.join(REPO, "scripts", "make_recall_task.py"))
make_recall_task = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_recall_task)

C_FILE = """#include <stdio.h>

static int helper_{i}(int x)
{{
\tint scaled_value_{i} = x * {i} + 7;
\treturn scaled_value_{i};
}}

/* A comment between the definitions. */
struct node *make_node_{i}(struct pool *pool,
\t\t\t  int key)
{{
\tstruct node *n = pool_alloc(pool, sizeof(*n));
\tn->key = key + {i};
\treturn n;
}}
"""


def write_corpus(folder, n):
  for i in range(n):
    (folder / f"file_{i}.c").write_text(C_FILE.format(i=i))
  return str(folder / "*.c")


def test_examples_come_from_heldout_files_and_ask_for_a_name_defined_once_earlier(tmp_path):
  (tmp_path / "corpus").mkdir()
  pattern = write_corpus(tmp_path / "corpus", 12)
  out = tmp_path / "task"
  make_recall_task.main([f"--input={pattern}", "--kind=text", "--heldout_fraction=0.5",
                         f"--output_dir={out}", "--max_chars=400"])
  source = file_source("text", resolve_files(pattern, source="corpus", key="input"), root=glob_root(pattern))
  held = {re.search(r"helper_(\d+)", source[i])[1] for i, h in enumerate(heldout_mask(source, 0.5)) if h}
  rows = [json.loads(line) for line in (out / "code_recall.jsonl").read_text().splitlines()]
  assert 0 < len(rows) == len(held) < 12
  assert {re.search(r"\d+", r["answer"])[0] for r in rows} == held
  for r in rows:
    prompt = r["prompt"]
    definition = re.search(rf"^(static int |struct node \*){r['answer']}\(", prompt, re.MULTILINE)
    assert definition and prompt.count(r["answer"]) == 1
    assert prompt.endswith("\n" + definition[1].rstrip())
    cue = re.search(r"/\* (.*) \*/\n[^\n]*$", prompt)[1]
    assert prompt.count(cue) == 2 and prompt.index(cue) > definition.start()


def test_the_written_folder_is_an_lm_eval_task_scored_by_containment(tmp_path):
  (tmp_path / "corpus").mkdir()
  make_recall_task.main([f"--input={write_corpus(tmp_path / 'corpus', 3)}", "--kind=text",
                         "--heldout_fraction=0", f"--output_dir={tmp_path / 'task'}", "--task=c_recall"])
  manager = harness.task_manager(str(tmp_path / "task"), ["c_recall"])
  task, = harness.load_tasks(manager, ["c_recall"])
  docs = list(task.test_docs())
  assert len(docs) == 3 and task.config.generation_kwargs["until"] == ["(", "\n"]
  assert task.process_results(docs[0], [f" {docs[0]['answer']}"]) == {"contains": 1.0}
  assert task.process_results(docs[0], [" something_else"]) == {"contains": 0.0}


def test_with_the_tokenizer_prompts_fit_the_token_budget_and_keep_the_definition(tmp_path):
  (tmp_path / "corpus").mkdir()
  filler = "\n".join(f"int filler_{k};" for k in range(60))
  (tmp_path / "corpus" / "long.c").write_text(C_FILE.format(i=1) + filler)
  tokenizer = os.path.join(REPO, "tests", "eval", "fixtures", "char_tokenizer.json")
  make_recall_task.main([f"--input={tmp_path / 'corpus' / '*.c'}", "--kind=text", "--heldout_fraction=0",
                         f"--output_dir={tmp_path / 'task'}", f"--tokenizer={tokenizer}", "--max_tokens=420"])
  row, = [json.loads(line) for line in (tmp_path / "task" / "code_recall.jsonl").read_text().splitlines()]
  assert 300 < len(row["prompt"]) <= 420  # one token per character
  assert f"{row['answer']}(" in row["prompt"] and "filler_59" not in row["prompt"]
