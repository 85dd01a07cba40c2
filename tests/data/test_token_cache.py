"""The token cache (``data.token_cache``): the same batches and resume states as tokenizing in the
stream, built once per source and tokenizer, rebuilt when a file changes, the same from several builders."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np
import pytest

from lmcore.data import pipeline, token_cache
from lmcore.data.config import DataConfig, SourceConfig
from lmcore.data.convert import convert_to_array_record
from data_cases import CharTokenizer


def write_shards(folder: pathlib.Path, name: str, docs: list[str]) -> str:
  folder.mkdir(parents=True, exist_ok=True)
  (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  convert_to_array_record(str(folder / f"{name}.jsonl"), str(folder / name), kind="jsonl", docs_per_shard=7,
                          show_progress=False)
  return str(folder / name / "*.array_record")


def docs(prefix: str, n: int) -> list[str]:
  return [f"{prefix}{i} " * (i % 4 + 1) for i in range(n)]


def mixture(tmp_path) -> DataConfig:
  """Two ArrayRecord sources (one with a hashed held-out share) mixed 2 : 1, cached under tmp_path."""
  a = SourceConfig(name="a", kind="array_record", path=write_shards(tmp_path, "a", docs("alpha", 40)),
                   heldout_fraction=0.2, weight=2.0)
  b = SourceConfig(name="b", kind="array_record", path=write_shards(tmp_path, "b", docs("beta", 25)))
  return DataConfig(sources=(a, b), seq_len=12, cache_dir=str(tmp_path / "cache"), token_cache_processes=1)


def batches(cfg: DataConfig, n: int, state=None):
  it = pipeline.make_train_iterator(cfg, CharTokenizer(), batch_size=3, seed=5)
  if state is not None:
    it.set_state(state)
  return it, pipeline.take_batches(it, n)


def assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


def test_cached_tokens_give_the_same_batches_and_resume_states(tmp_path):
  streamed_cfg = mixture(tmp_path)
  cached_cfg = dataclasses.replace(streamed_cfg, token_cache=True)
  streamed_it, streamed = batches(streamed_cfg, 30)
  cached_it, cached = batches(cached_cfg, 30)
  assert_same(cached, streamed)
  assert streamed_it.get_state() == cached_it.get_state()
  _, resumed = batches(cached_cfg, 5, state=streamed_it.get_state())  # a state crosses either way
  _, expected = batches(streamed_cfg, 35)
  assert_same(resumed, expected[30:])
  folders = sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir())
  assert [f.split("-")[0] for f in folders] == ["a", "b"]
  meta = token_cache.read_meta(str(tmp_path / "cache" / "tokens" / folders[0]))
  assert meta["documents"] == 40 and meta["dtype"] == np.dtype(np.uint16).str


def test_a_cache_is_built_once_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
  cfg = dataclasses.replace(mixture(tmp_path), token_cache=True)
  batches(cfg, 2)
  built = []
  monkeypatch.setattr(token_cache, "build", lambda *args: built.append(args) or pytest.fail("rebuilt"))
  batches(cfg, 2)
  assert not built
  monkeypatch.undo()
  shard = sorted((tmp_path / "b").glob("*.array_record"))[0]
  os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
  batches(cfg, 2)
  assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 3


def test_several_builders_write_the_same_cache(tmp_path):
  cfg = mixture(tmp_path)
  source_cfg, split = cfg.sources[0], cfg.sources[0].split
  text_source = pipeline.make_source(source_cfg, split)
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  token_cache.DOCUMENTS_PER_TASK, saved = 6, token_cache.DOCUMENTS_PER_TASK
  try:
    token_cache.build(one, source_cfg, split, CharTokenizer(), len(text_source), processes=1)
    token_cache.build(two, source_cfg, split, CharTokenizer(), len(text_source), processes=2)
  finally:
    token_cache.DOCUMENTS_PER_TASK = saved
  for name in ("tokens.bin", "offsets.npy", "meta.json"):
    assert (pathlib.Path(one) / name).read_bytes() == (pathlib.Path(two) / name).read_bytes()
  cached = token_cache.CachedTokens(one, text_source)
  assert [cached[i]["tokens"].tolist() for i in range(len(text_source))] == [
      [*CharTokenizer().encode(text_source[i]), 0] for i in range(len(text_source))]
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building-")]
