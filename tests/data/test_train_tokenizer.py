"""``scripts/train_tokenizer.py``: a BPE tokenizer trained on a corpus of one's own, sampled under caps,
with the held-out documents left out, loadable as ``data.tokenizer.kind=sentencepiece``."""

from __future__ import annotations

import json
import pathlib
import random
import sys

import numpy as np
import pytest

from lmcore.data import pipeline, spm_training, tokenizers
from lmcore.data.config import SourceConfig, TokenizerConfig
from lmcore.data.corpus_tokenizer import train_corpus_tokenizer
from lmcore.data.sources import make_source

REPO = pathlib.Path(__file__).resolve().parents[2]
WORDS = ("river bridge lantern harbour winter market orchard letter quiet distant northern island "
         "morning evening garden village stone window").split()


def write_prose(folder: pathlib.Path, n: int, seed: int = 0) -> str:
  rng = random.Random(seed)
  folder.mkdir(parents=True, exist_ok=True)
  for i in range(n):
    sentences = [" ".join(rng.choices(WORDS, k=rng.randint(5, 12))).capitalize() + "." for _ in range(6)]
    (folder / f"p{i:03d}.txt").write_text(" ".join(sentences) + f"\n\nNote {i}: ünïcödé ✓\n")
  return str(folder / "*.txt")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
  return write_prose(tmp_path_factory.mktemp("prose"), 80)


def test_script_writes_a_tokenizer_that_loads_as_sentencepiece(corpus, tmp_path, capsys):
  sys.path.insert(0, str(REPO / "scripts"))
  try:
    import train_tokenizer
  finally:
    sys.path.remove(str(REPO / "scripts"))
  output = tmp_path / "tok" / "corpus.model"
  train_tokenizer.main([f"--input={corpus}", "--kind=text", "--vocab_size=400", f"--output={output}",
                        "--heldout_fraction=0.1", "--num_threads=1"])
  out = capsys.readouterr().out
  assert f"Wrote {output}: 400 pieces" in out and "tokens per character" in out
  assert f"--config.data.tokenizer.kind=sentencepiece --config.data.tokenizer.path={output}" in out
  tokenizer = tokenizers.load_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(output)))
  assert tokenizer.vocab_size == 400 and tokenizer.eos_id == spm_training.EOS_ID
  text = "The river bridge.\n\n  Ünknown wörds 漢字 🙂 stay exact.\n"
  ids = tokenizer.encode(text)
  assert tokenizer.decode(ids) == text, "byte fallback and identity normalisation round-trip any text"
  assert spm_training.EOS_ID not in ids and max(ids) < 400
  held = make_source(SourceConfig(kind="text", path=corpus), "train")
  mask = pipeline.heldout_mask(held, 0.1)
  assert f"Trained on {int((~mask).sum())} documents" in out, "held-out documents are left out"
  assert f"on {int(mask.sum())} held-out documents" in out


def test_sampling_stops_at_the_document_and_character_caps(corpus, tmp_path):
  few = train_corpus_tokenizer(corpus, str(tmp_path / "a.model"), kind="text", vocab_size=400, max_documents=7,
                               heldout_fraction=0.0)
  assert few.documents == 7 and few.measured_on == "unused"
  capped = train_corpus_tokenizer(corpus, str(tmp_path / "b.model"), kind="text", vocab_size=400,
                                  max_chars=2_000, heldout_fraction=0.0)
  assert 2_000 <= capped.chars < 2_000 + 1_000 and capped.documents < 10
  # The vocabulary is at most what the text supports, and the report says so.
  small = train_corpus_tokenizer(corpus, str(tmp_path / "c.model"), kind="text", vocab_size=60_000,
                                 max_documents=3, heldout_fraction=0.0)
  assert small.vocab_size < 60_000 and "fewer than --vocab_size=60000" in small.lines()[0]


def test_jsonl_corpus_and_long_lines(tmp_path):
  line = " ".join(["paragraph"] * 2_000)  # 20 kB on one line: cut at spaces, not dropped
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"body": f"{line} {i}"}) + "\n" for i in range(5)))
  report = train_corpus_tokenizer(str(path), str(tmp_path / "j.model"), kind="jsonl", text_key="body",
                                  vocab_size=300, heldout_fraction=0.0)
  assert report.documents == 5 and report.tokens_per_char < 0.2
  pieces = list(spm_training.document_lines([line], split_long=True))
  assert "".join(pieces).replace(" ", "") == line.replace(" ", "")
  assert all(len(p.encode()) <= spm_training.MAX_LINE_BYTES for p in pieces)


@pytest.mark.parametrize("args,message", [
    (["--input={missing}", "--kind=text"], "no files match --input="),
    (["--input={corpus}", "--kind=text", "--vocab_size=100"], "--vocab_size=100 is too small"),
    (["--input={jsonl}", "--kind=jsonl", "--text_key=body"], "no key 'body'"),
    (["--input={corpus}", "--kind=text", "--vocab_size=300"], "vocab_size=300 cannot hold the text's characters"),
])
def test_bad_arguments_end_in_one_line(corpus, tmp_path, capsys, args, message):
  sys.path.insert(0, str(REPO / "scripts"))
  try:
    import train_tokenizer
  finally:
    sys.path.remove(str(REPO / "scripts"))
  (tmp_path / "x.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
  paths = dict(missing=f"{tmp_path}/none/*.txt", corpus=corpus, jsonl=str(tmp_path / "x.jsonl"))
  with pytest.raises(SystemExit) as exit_info:
    train_tokenizer.main([a.format(**paths) for a in args] + [f"--output={tmp_path}/t.model"])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and message in err and "\n" not in err and "Traceback" not in err
  assert not (tmp_path / "t.model").exists()
  np.testing.assert_equal(list(tmp_path.glob(".t.model*")), [])
