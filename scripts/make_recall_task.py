"""Builds a recall task from the held-out files of a corpus of C sources, as an lm-eval local-file task.

  python scripts/make_recall_task.py --input='runs/linux/shards/*.array_record' --kind=array_record \\
      --tokenizer=runs/linux/tokenizer.model --max_tokens=1000 --output_dir=runs/linux/recall_task
  python eval.py --config=configs/sanatan.py:repro_p1_scratch --workdir=runs/reproduce/s0/p1_scratch \\
      --tasks=code_recall --task_path=runs/linux/recall_task

(``scripts/reproduce.py --recall_task=runs/linux/recall_task`` scores its runs on it as they finish.)

Each example is a window of one held-out file that holds a whole function definition, followed by a
query: a line of that function's body (unique in the window) in a comment, then the function's return
type and qualifiers, as a new declaration of it starts. The answer is the function's name, which
appears only in the definition earlier in the window; a generation is scored by containment of the
name (as FDA and SWDE are). Only documents the training run holds out are used: the same hash of file path and
index as ``data.sources.<name>.heldout_fraction`` (give the training config's glob and fraction; 0 uses
every document, for corpora no run trained on). With ``--tokenizer``, a window is cut on the right
(never into the definition) until the prompt fits ``--max_tokens``, so that the model's left truncation
never drops the definition. The folder gets ``<task>.yaml``, ``<task>.jsonl`` and the ``utils.py``
they read (the folder can be moved).
"""

import argparse
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmcore import cli  # noqa: E402
from lmcore.data import TokenizerConfig, load_tokenizer  # noqa: E402
from lmcore.data.pipeline import heldout_mask  # noqa: E402
from lmcore.data.sources import file_source, glob_root, resolve_files  # noqa: E402
from lmcore.errors import ConfigError  # noqa: E402

KINDS = ("text", "jsonl", "parquet", "array_record")
# A definition starts at column 0: qualifiers and return type, the name, "(", parameters, ")" and "{" at the
# end of the header's last line; its body ends at the first "}" at column 0.
DEFINITION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*[ \t*]+)+?\**)(?P<name>[A-Za-z_]\w*)\("
                        r"(?P<params>[^;{}]*?)\)[ \t]*\n?\{[ \t]*$", re.MULTILINE)
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "else", "do"}

YAML = """task: {task}
custom_dataset: !function utils.load
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["(", "\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
process_results: !function utils.contains
metric_list:
  - metric: contains
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

UTILS = '''"""The data of the task YAML next to this file and its containment score (written by
scripts/make_recall_task.py)."""

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def load(**kwargs):
  with open(os.path.join(HERE, "{task}.jsonl")) as f:
    return datasets.DatasetDict({{"test": datasets.Dataset.from_list([json.loads(line) for line in f])}})


def contains(doc, results):
  """1 when the generation contains the function's name, else 0."""
  return {{"contains": float(doc["answer"] in results[0])}}
'''


def definitions(text: str):
  """(return type and qualifiers, name, start, end of the closing brace's line) of every function
  definition whose body closes with a "}" at column 0."""
  for match in DEFINITION.finditer(text):
    name, kind = match["name"], " ".join(match["type"].split())
    if name in KEYWORDS or kind.split()[0] in KEYWORDS or kind.startswith(("return", "else")):
      continue
    close = re.compile(r"^\}", re.MULTILINE).search(text, match.end())
    if close is not None:
      yield kind, name, match.start(), close.end(), match.end()


def fit(prompt_parts: tuple[str, str], definition_end: int, tokenizer, max_tokens: int) -> str | None:
  """``window + query`` with the window cut on the right (never before the definition's end, at a line
  end) until it encodes to at most ``max_tokens`` tokens; None when it cannot."""
  window, query = prompt_parts
  while len(tokenizer.encode(window + query)) > max_tokens:
    cut = window.rfind("\n", definition_end, definition_end + int(0.9 * (len(window) - definition_end)))
    if cut < 0:
      return None
    window = window[:cut]
  return window + query


def example(text: str, kind: str, name: str, start: int, end: int, body_start: int, *, max_chars: int,
            rng: random.Random, tokenizer=None, max_tokens: int = 0) -> dict | None:
  """The example of one definition, or None when the definition is longer than ``max_chars`` / 2, the
  name is short, ``main`` or a macro's (all capitals) or appears elsewhere in the window, or the body
  has no code line unique to the window."""
  if end - start > max_chars // 2 or len(name) < 4 or name == "main" or name.isupper():
    return None
  left = text.rfind("\n", 0, max(0, start - rng.randint(0, max_chars // 4))) + 1  # whole lines
  right = left + max_chars if left + max_chars < len(text) else len(text)
  window = text[left:max(end, text.rfind("\n", left, right))]
  if len(re.findall(rf"\b{re.escape(name)}\b", window)) != 1:
    return None
  lines = [line.strip() for line in text[body_start:end].splitlines()]
  unique = [line for line in lines if len(line) >= 12 and not line.startswith(("*", "/*", "//"))
            and "*/" not in line and window.count(line) == 1]
  if not unique:
    return None
  cue = max(unique, key=len)
  # No trailing space: tokenizers write a word's leading space into its first piece.
  prompt = f"{window}\n\n/* {cue} */\n{kind}"
  if tokenizer is not None:
    prompt = fit((window, f"\n\n/* {cue} */\n{kind}"), end - left, tokenizer, max_tokens)
  return None if prompt is None else {"prompt": prompt, "answer": name}


def build(documents, *, examples: int, max_chars: int, seed: int, tokenizer=None,
          max_tokens: int = 0) -> list[dict]:
  """Up to ``examples`` examples, at most one per document, from the documents in a seeded order."""
  rng = random.Random(seed)
  order = list(range(len(documents)))
  rng.shuffle(order)
  out = []
  for index in order:
    text = documents[index]
    candidates = list(definitions(text))
    rng.shuffle(candidates)
    for candidate in candidates:
      found = example(text, *candidate, max_chars=max_chars, rng=rng, tokenizer=tokenizer,
                      max_tokens=max_tokens)
      if found is not None:
        out.append(found)
        break
    if len(out) == examples:
      break
  return out


def heldout_documents(input_glob: str, kind: str, text_key: str, heldout_fraction: float) -> list[str]:
  """The texts of the documents the training run holds out (all of them when ``heldout_fraction`` is 0)."""
  files = resolve_files(input_glob, source=f"The {kind} corpus", key="--input")
  source = file_source(kind, files, text_key=text_key, key="--text_key", root=glob_root(input_glob),
                       path_key="--input")
  held = heldout_mask(source, heldout_fraction) if heldout_fraction else [True] * len(source)
  return [source[i] for i in range(len(source)) if held[i]]


def write(output_dir: str, task: str, rows: list[dict], max_gen_toks: int) -> None:
  os.makedirs(output_dir, exist_ok=True)
  with open(os.path.join(output_dir, f"{task}.jsonl"), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  with open(os.path.join(output_dir, f"{task}.yaml"), "w") as f:
    f.write(YAML.format(task=task, max_gen_toks=max_gen_toks))
  with open(os.path.join(output_dir, "utils.py"), "w") as f:
    f.write(UTILS.format(task=task))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", required=True,
                      help="glob of the corpus files (quote it), as in the training config")
  parser.add_argument("--kind", required=True, choices=KINDS,
                      help="text: a document per file; jsonl: per line; parquet: per row; array_record: "
                      "per record")
  parser.add_argument("--output_dir", required=True, help="the folder of the task (pass it as --task_path)")
  parser.add_argument("--heldout_fraction", type=float, default=0.01,
                      help="the training source's heldout_fraction (0: every document)")
  parser.add_argument("--text_key", default="text", help="jsonl key or parquet column holding the text")
  parser.add_argument("--task", default="code_recall", help="the task's name")
  parser.add_argument("--examples", type=int, default=500, help="examples at most (one per document)")
  parser.add_argument("--max_chars", type=int, default=3000,
                      help="characters of file per prompt; keep the prompt within the model's window")
  parser.add_argument("--max_gen_toks", type=int, default=24, help="tokens generated per example at most")
  parser.add_argument("--tokenizer", default="",
                      help="the run's tokenizer (.model or tokenizer.json): prompts are cut to --max_tokens")
  parser.add_argument("--max_tokens", type=int, default=1000,
                      help="tokens per prompt at most (with --tokenizer): the window less --max_gen_toks")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if not 0 <= args.heldout_fraction < 1:
    raise ConfigError(f"--heldout_fraction={args.heldout_fraction}; give the training source's share in "
                      "[0, 1).")
  documents = heldout_documents(args.input, args.kind, args.text_key, args.heldout_fraction)
  tokenizer = None
  if args.tokenizer:
    kind = "sentencepiece" if args.tokenizer.endswith(".model") else "hf_json"
    tokenizer = load_tokenizer(TokenizerConfig(kind=kind, path=args.tokenizer))
  rows = build(documents, examples=args.examples, max_chars=args.max_chars, seed=args.seed,
               tokenizer=tokenizer, max_tokens=args.max_tokens)
  if not rows:
    raise ConfigError(f"no example in the {len(documents)} held-out documents of {args.input!r}: it needs C "
                      "function definitions whose closing brace is at column 0.")
  write(args.output_dir, args.task, rows, args.max_gen_toks)
  print(f"{len(rows)} examples from {len(documents)} held-out documents: "
        f"{os.path.join(args.output_dir, args.task)}.yaml")


if __name__ == "__main__":
  with cli.user_errors():
    main()
