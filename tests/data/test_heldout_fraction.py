"""The hashed held-out split (``data.sources.<name>.heldout_fraction``): training never reads a held-out
document, the split is stable, and it is the default only where no other held-out rule applies."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmcore.data import heldout, pipeline, sources
from lmcore.data.config import DataConfig, HeldoutConfig, SourceConfig
from lmcore.data.convert import convert_to_array_record
from lmcore.errors import ConfigError, DataError
from data_cases import CharTokenizer


def texts(n: int) -> list[str]:
  return [f"<doc{i:03d}>" for i in range(n)]


def write_corpus(folder: pathlib.Path, kind: str, docs: list[str]) -> str:
  """``docs`` as 3 files of ``kind`` (one file per document for text); returns the glob."""
  folder.mkdir(parents=True, exist_ok=True)
  if kind == "text":
    for i, doc in enumerate(docs):
      (folder / f"{i:03d}.txt").write_text(doc)
    return str(folder / "*.txt")
  parts = np.array_split(np.arange(len(docs)), 3)
  for p, part in enumerate(parts):
    chunk = [docs[i] for i in part]
    if kind in ("jsonl", "array_record"):
      (folder / f"part{p}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunk))
    else:
      pq.write_table(pa.table({"text": chunk}), folder / f"part{p}.parquet", row_group_size=7)
  if kind == "array_record":
    convert_to_array_record(str(folder / "*.jsonl"), str(folder / "ar"), kind="jsonl", docs_per_shard=40,
                            show_progress=False)
    return str(folder / "ar" / "*.array_record")
  return str(folder / f"*.{kind}")


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "array_record"])
def test_the_training_iterator_never_yields_a_heldout_document(tmp_path, kind, caplog):
  docs = texts(120)
  source = SourceConfig(name="web", kind=kind, path=write_corpus(tmp_path / "corpus", kind, docs),
                        heldout_fraction=0.2)
  cfg = DataConfig(sources=(source,), seq_len=15, heldout=HeldoutConfig(num_sequences=1000))
  held = set(pipeline.source_documents(cfg, 0, heldout=True))
  with caplog.at_level(logging.INFO, logger="lmcore"):
    trained = set(pipeline.training_documents(cfg, seed=0)[:3 * (len(docs) - len(held))])
  assert held and trained and held.isdisjoint(trained) and held | trained == set(docs)
  assert 0.1 < len(held) / len(docs) < 0.3
  assert f"data.sources.web: {len(trained)} training and {len(held)} held-out documents" in caplog.text
  # Through tokenization and packing too: the text of every training window.
  iterator = pipeline.make_train_iterator(cfg, CharTokenizer(), batch_size=4, seed=3)
  stream = "".join(CharTokenizer().decode(w) for batch in pipeline.take_batches(iterator, 30)
                   for w in batch["tokens"])
  assert not any(doc in stream for doc in held)
  # The held-out set is built from exactly those documents, without the overlap warning.
  caplog.clear()
  with pytest.warns(UserWarning, match="only"):
    built = heldout.build_heldout(cfg, CharTokenizer())
  assert "training also reads them" not in caplog.text
  heldout_text = "".join(CharTokenizer().decode(w) for w in built["tokens"])
  assert {d for d in docs if d in heldout_text} <= held


def test_split_is_stable_and_follows_paths_relative_to_the_glob(tmp_path):
  # Golden keys: the rule (splitmix64 of sha256 of the relative path, plus index) never changes.
  np.testing.assert_array_equal(sources.document_keys("a/b.txt", 3),
                                np.array([4149903857170572695, 2940549586846438155, 8099857773299900020],
                                         dtype=np.uint64))
  docs = texts(60)
  first = write_corpus(tmp_path / "one", "jsonl", docs)
  shutil.copytree(tmp_path / "one", tmp_path / "elsewhere" / "two")
  held = [set(pipeline.source_documents(DataConfig(sources=(SourceConfig(
      name="a", kind="jsonl", path=path, heldout_fraction=0.3),)), 0, heldout=True))
      for path in (first, str(tmp_path / "elsewhere" / "two" / "*.jsonl"))]
  assert held[0] and held[0] == held[1], "moving the corpus must not change the split"


def test_default_fraction_applies_only_where_no_other_heldout_rule_does():
  assert SourceConfig(kind="text").effective_heldout_fraction() == 0.01
  assert SourceConfig(kind="array_record", heldout_split="train").effective_heldout_fraction() == 0.01
  assert SourceConfig(kind="jsonl", heldout_skip=100).effective_heldout_fraction() == 0.0
  assert SourceConfig(kind="parquet", heldout_split="validation").effective_heldout_fraction() == 0.0
  assert SourceConfig(kind="embedded").effective_heldout_fraction() == 0.0
  assert SourceConfig(kind="tfds", path="x").effective_heldout_fraction() == 0.0
  assert SourceConfig(kind="jsonl", heldout_fraction=0.0).effective_heldout_fraction() == 0.0
  assert SourceConfig(kind="tfds", path="x", heldout_fraction=0.05).effective_heldout_fraction() == 0.05
  with pytest.raises(ConfigError, match=r"heldout_fraction=0.1 and a held-out skip"):
    SourceConfig(name="w", kind="jsonl", heldout_fraction=0.1, heldout_skip=5)
  with pytest.raises(ConfigError, match="embedded corpus has its own held-out split"):
    SourceConfig(kind="embedded", heldout_fraction=0.1)
  with pytest.raises(ConfigError, match=r"data\.sources\.w\.heldout_fraction=1.5"):
    SourceConfig(name="w", kind="text", heldout_fraction=1.5)


def test_paper_presets_keep_their_heldout_rules():
  from configs import sanatan
  from lmcore import config as cfg_lib
  for source in cfg_lib.experiment_config(sanatan.get_config("184m_p2")).data.sources:
    assert source.heldout_skip > 0 and source.effective_heldout_fraction() == 0.0


def test_a_fraction_that_leaves_nothing_names_the_setting(tmp_path):
  cfg = DataConfig(sources=(SourceConfig(name="small", kind="jsonl", path=write_corpus(tmp_path, "jsonl", texts(3)),
                                         heldout_fraction=0.001),))
  with pytest.raises(DataError, match=r"data\.sources\.small\.heldout_fraction"):
    pipeline.source_documents(cfg, 0, heldout=True)
