"""Tests of lmcore.data: corpus, tokenizers, sources, mixture, packing, exact resume, held-out set."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import pickle
import subprocess
import sys

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmcore import errors
from lmcore.data import embedded, heldout, pipeline, sources, tokenizers
from lmcore.data.config import DataConfig, HeldoutConfig, SourceConfig, TokenizerConfig
from data_cases import CharTokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["first document", "second one\nwith two lines", "third: ünïcödé ✓", "fourth", "fifth and last"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp("fslm_cache"))


@pytest.fixture(scope="session")
def stdlib_tokenizer(cache_dir):
  """The embedded tokenizer at its default 8k vocabulary, trained once per test run (~5 s)."""
  return tokenizers.load_tokenizer(TokenizerConfig(), cache_dir)


def write_jsonl(path: pathlib.Path, texts: list[str], key: str = "text") -> str:
  path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
  return str(path)


def jsonl_source(tmp_path, name: str, texts: list[str], **kwargs) -> SourceConfig:
  """A jsonl source of ``texts``; no hashed held-out split unless asked (these tests count documents)."""
  if "heldout_skip" not in kwargs and "heldout_split" not in kwargs:
    kwargs.setdefault("heldout_fraction", 0.0)
  return SourceConfig(name=name, kind="jsonl", path=write_jsonl(tmp_path / f"{name}.jsonl", texts), **kwargs)


def documents_of(ds, n: int) -> list[str]:
  return [ds[i] for i in range(n)]


# ----------------------------------------------------------------------------------------- corpus


def test_embedded_corpus_excludes_test_folders_and_holds_about_ten_megabytes():
  files = embedded.corpus_files("train") + embedded.corpus_files("heldout")
  relative = [p.relative_to(embedded.stdlib_root()) for p in files]
  assert all(embedded.EXCLUDED_DIRS.isdisjoint(r.parts[:-1]) for r in relative)
  assert all(r.suffix == ".py" for r in relative)
  fp = embedded.fingerprint()
  assert fp.num_files == len(files)
  assert fp.num_bytes > 10e6, "the quick-start corpus should be ~11.6 MB of real text"


def test_embedded_split_is_stable_disjoint_and_about_three_percent():
  # Golden values: the rule hashes the relative path only, so these never change.
  assert embedded.split_of("heapq.py") == "heldout"
  assert embedded.split_of("random.py") == "heldout"
  assert embedded.split_of("os.py") == "train"
  assert embedded.split_of("json/decoder.py") == "train"
  train, held = embedded.corpus_files("train"), embedded.corpus_files("heldout")
  assert not set(train) & set(held)
  assert 0.01 < len(held) / (len(train) + len(held)) < 0.06


def test_fingerprint_is_stable_and_hashes_the_sorted_listing():
  root = embedded.stdlib_root()
  files = sorted(p.relative_to(root).as_posix() for p in embedded.corpus_files("train")
                 + embedded.corpus_files("heldout"))
  listing = "\n".join(f"{f}\t{(root / f).stat().st_size}" for f in files)
  assert embedded.fingerprint() == embedded.fingerprint()
  assert embedded.fingerprint().sha256 == hashlib.sha256(listing.encode()).hexdigest()


# ------------------------------------------------------------------------------------- tokenizers

CODE = "def f(x):\n\tif x:  # ünïcödé 漢字 🙂\n        return {'a': 1_000}\n\n\nclass A: pass\n"


def test_embedded_tokenizer_round_trips_code_and_unicode(stdlib_tokenizer):
  ids = stdlib_tokenizer.encode(CODE)
  assert stdlib_tokenizer.decode(ids) == CODE
  assert stdlib_tokenizer.vocab_size == 8192 and stdlib_tokenizer.eos_id == embedded.EOS_ID
  assert max(ids) < stdlib_tokenizer.vocab_size and stdlib_tokenizer.eos_id not in ids
  text = embedded.read_document(embedded.corpus_files("train")[0])
  assert len(stdlib_tokenizer.encode(text)) < len(text) / 2, "BPE should compress Python source"


def test_embedded_tokenizer_is_cached_and_picklable(stdlib_tokenizer, cache_dir):
  model = embedded.tokenizer_model_path(8192, cache_dir)
  mtime = model.stat().st_mtime_ns
  again = tokenizers.load_tokenizer(TokenizerConfig(), cache_dir)
  assert model.stat().st_mtime_ns == mtime and again.name == stdlib_tokenizer.name
  assert not list(model.parent.glob("*.tmp"))
  copy = pickle.loads(pickle.dumps(stdlib_tokenizer))
  assert copy.encode(CODE) == stdlib_tokenizer.encode(CODE)


def test_sentencepiece_model_file_loads_like_the_embedded_one(stdlib_tokenizer, cache_dir):
  path = embedded.tokenizer_model_path(8192, cache_dir)
  loaded = tokenizers.load_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(path)))
  assert loaded.encode(CODE) == stdlib_tokenizer.encode(CODE)
  assert loaded.eos_id == embedded.EOS_ID
  override = TokenizerConfig(kind="sentencepiece", path=str(path), eos_id=5)
  assert tokenizers.load_tokenizer(override).eos_id == 5


def test_hf_json_tokenizer_round_trips_and_finds_endoftext(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  hf.train_from_iterator(DOCS * 20, trainer)
  hf.save(str(tmp_path / "tokenizer.json"))
  tok = tokenizers.load_tokenizer(TokenizerConfig(kind="hf_json", path=str(tmp_path / "tokenizer.json")))
  assert tok.decode(tok.encode(CODE)) == CODE
  assert tok.eos_id == hf.token_to_id("<|endoftext|>")
  assert pickle.loads(pickle.dumps(tok)).encode(CODE) == tok.encode(CODE)
  override = TokenizerConfig(kind="hf_json", path=str(tmp_path / "tokenizer.json"), eos_id=7)
  assert tokenizers.load_tokenizer(override).eos_id == 7


def test_missing_tokenizer_file_names_the_config_key(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"data\.tokenizer\.path"):
    tokenizers.load_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(tmp_path / "nope.model")))
  with pytest.raises(FileNotFoundError, match=r"data\.tokenizer\.path"):
    tokenizers.load_tokenizer(TokenizerConfig(kind="hf_json"))


def test_check_vocab_names_both_sizes_and_the_config_keys():
  tokenizers.check_vocab(CharTokenizer(), 128)
  with pytest.raises(ValueError, match=r"127.*model\.vocab_size=100.*data\.tokenizer"):
    tokenizers.check_vocab(CharTokenizer(), 100)


# ---------------------------------------------------------------------------------------- sources


def make_tfds_dataset(data_dir: pathlib.Path) -> None:
  """A two-split TFDS dataset in ArrayRecord format, built without TensorFlow."""
  import tensorflow_datasets as tfds

  class TinyDocs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
      return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(DOCS), "validation": self._generate_examples(DOCS[:2])}

    def _generate_examples(self, texts):
      for i, text in enumerate(texts):
        yield i, {"text": text}

  TinyDocs(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


@pytest.fixture(scope="module")
def source_files(tmp_path_factory) -> dict[str, SourceConfig]:
  """The five DOCS stored in every file kind."""
  root = tmp_path_factory.mktemp("sources")
  (root / "text").mkdir()
  for i, doc in enumerate(DOCS):
    (root / "text" / f"doc{i}.txt").write_text(doc)
  write_jsonl(root / "a.jsonl", DOCS[:3], key="body")
  write_jsonl(root / "b.jsonl", DOCS[3:], key="body")
  pq.write_table(pa.table({"content": DOCS}), root / "docs.parquet", row_group_size=2)
  from lmcore.data.convert import convert_to_array_record
  convert_to_array_record(str(root / "*.jsonl"), str(root / "ar"), kind="jsonl", text_key="body",
                          docs_per_shard=2, show_progress=False)
  make_tfds_dataset(root / "tfds")
  return {
      "text": SourceConfig(name="t", kind="text", path=str(root / "text" / "*.txt")),
      "jsonl": SourceConfig(name="j", kind="jsonl", path=str(root / "*.jsonl"), text_key="body"),
      "parquet": SourceConfig(name="p", kind="parquet", path=str(root / "*.parquet"), text_key="content"),
      "array_record": SourceConfig(name="a", kind="array_record", path=str(root / "ar" / "*.array_record")),
      "tfds": SourceConfig(name="f", kind="tfds", path="tiny_docs", data_dir=str(root / "tfds")),
  }


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "array_record", "tfds"])
def test_each_source_kind_reads_every_document(source_files, kind):
  source = sources.make_source(source_files[kind], "train")
  read = documents_of(source, len(source))
  # tfds shuffles records when it prepares a split; the other kinds keep file / line / row order.
  assert (sorted(read) if kind == "tfds" else read) == (sorted(DOCS) if kind == "tfds" else DOCS)
  copy = pickle.loads(pickle.dumps(source))
  assert copy[len(source) - 1] == read[-1]


def test_tfds_source_reads_the_named_split(source_files):
  assert sorted(documents_of(sources.make_source(source_files["tfds"], "validation"), 2)) == sorted(DOCS[:2])


def test_embedded_source_reads_whole_files():
  source = sources.make_source(SourceConfig(), "heldout")
  assert len(source) == len(embedded.corpus_files("heldout"))
  assert source[0] == embedded.corpus_files("heldout")[0].read_text()


def test_glob_matching_nothing_names_the_source_and_the_config_key(tmp_path):
  missing = SourceConfig(name="web", kind="jsonl", path=str(tmp_path / "*.jsonl"))
  with pytest.raises(FileNotFoundError, match=r"'web'.*data\.sources\.web\.path"):
    sources.make_source(missing, "train")


def test_wrong_text_key_names_the_config_key(source_files):
  wrong = SourceConfig(name="j", kind="jsonl", path=source_files["jsonl"].path, text_key="text")
  with pytest.raises(KeyError, match=r"data\.sources\.j\.text_key"):
    sources.make_source(wrong, "train")[0]


def test_prepare_data_script_writes_shards_that_read_back(tmp_path, capsys, monkeypatch):
  for i, doc in enumerate(DOCS):
    (tmp_path / f"in{i}.txt").write_text(doc)
  monkeypatch.syspath_prepend(str(REPO / "scripts"))
  import prepare_data
  prepare_data.main([f"--input={tmp_path}/in*.txt", f"--output_dir={tmp_path}/out", "--kind=text",
                     "--docs_per_shard=2"])
  assert len(list((tmp_path / "out").glob("*.array_record"))) == 3
  assert "5/5 docs" in capsys.readouterr().err
  shards = SourceConfig(name="out", kind="array_record", path=f"{tmp_path}/out/*.array_record")
  assert documents_of(sources.make_source(shards, "train"), 5) == DOCS
  with pytest.raises(SystemExit) as exit_info:  # a glob that matches nothing: one line, no folder made
    prepare_data.main([f"--input={tmp_path}/nothing*.txt", f"--output_dir={tmp_path}/none", "--kind=text"])
  assert exit_info.value.code == 2 and not (tmp_path / "none").exists()
  assert capsys.readouterr().err.strip().startswith("MissingFileError: Conversion of text files: no files match")


def test_prepare_data_shuffle_seed_spreads_files_over_shards_in_a_fixed_order(tmp_path):
  from lmcore.data.convert import convert_to_array_record
  for i in range(12):
    (tmp_path / f"in{i:02d}.txt").write_text(f"doc {i}")
  def shard_docs(seed, out):
    paths = convert_to_array_record(f"{tmp_path}/in*.txt", str(tmp_path / out), kind="text", docs_per_shard=4,
                                    shuffle_seed=seed, show_progress=False)
    return [documents_of(sources.make_source(SourceConfig(name="s", kind="array_record", path=p), "train"), 4)
            for p in paths]
  sorted_order = [d for shard in shard_docs(None, "sorted") for d in shard]
  first, again = shard_docs(7, "a"), shard_docs(7, "b")
  assert sorted_order == [f"doc {i}" for i in range(12)]
  assert first == again, "the same seed gives the same shards"
  assert sorted(d for shard in first for d in shard) == sorted(sorted_order)
  assert [d for shard in first for d in shard] != sorted_order


def test_prepare_data_uncompressed_shards_hold_the_same_records(tmp_path):
  from lmcore.data.convert import convert_to_array_record
  for i, doc in enumerate(DOCS):
    (tmp_path / f"in{i}.txt").write_text(doc * 50)
  def read(out, options):
    convert_to_array_record(f"{tmp_path}/in*.txt", str(tmp_path / out), kind="text", writer_options=options,
                            show_progress=False)
    source = sources.make_source(SourceConfig(name="s", kind="array_record", path=f"{tmp_path}/{out}/*"), "train")
    return documents_of(source, len(DOCS)), source.document_keys()
  zstd_docs, zstd_keys = read("zstd", "group_size:1")
  raw_docs, raw_keys = read("raw", "group_size:1,uncompressed")
  assert raw_docs == zstd_docs == [d * 50 for d in DOCS]
  assert (raw_keys == zstd_keys).all(), "the held-out split does not depend on the writer options"


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_an_empty_or_truncated_shard_is_named_when_the_source_opens(tmp_path, stdlib_tokenizer, damage):
  """Before any data worker starts (``worker_count`` 2): one ``DataError`` naming the shard, its size,
  the config key of its glob and how to fix it."""
  from lmcore.data.convert import convert_to_array_record
  for i, doc in enumerate(DOCS):
    (tmp_path / f"in{i}.txt").write_text(doc * 50)
  good, = convert_to_array_record(f"{tmp_path}/in*.txt", str(tmp_path / "shards"), kind="text",
                                  show_progress=False)
  bad = tmp_path / "shards" / "z_bad.array_record"
  data = pathlib.Path(good).read_bytes()
  bad.write_bytes(b"" if damage == "empty" else data[:len(data) // 2])
  cfg = DataConfig(sources=(SourceConfig(name="web", kind="array_record", path=f"{tmp_path}/shards/*"),),
                   seq_len=16, worker_count=2)
  with pytest.raises(errors.DataError) as error:
    pipeline.make_train_iterator(cfg, stdlib_tokenizer, batch_size=2, seed=0)
  message = str(error.value)
  assert message.startswith(f"{bad} ({bad.stat().st_size:,} bytes) is not a complete ArrayRecord shard")
  assert "scripts/prepare_data.py" in message and "data.sources.web.path" in message
  assert "\n" not in message


# ------------------------------------------------------------------------------- mixture and order


def test_mixture_proportions_match_weights(tmp_path):
  cfg = DataConfig(sources=(jsonl_source(tmp_path, "a", [f"a{i}" for i in range(50)], weight=3.0),
                            jsonl_source(tmp_path, "b", [f"b{i}" for i in range(7)], weight=1.0)))
  docs = documents_of(pipeline.training_documents(cfg, seed=0), 400)
  assert abs(sum(d.startswith("a") for d in docs) / 400 - 0.75) < 0.02
  assert len({d for d in docs if d.startswith("b")}) == 7, "the small source repeats, each epoch whole"


def test_skip_skips_and_each_epoch_is_a_fresh_permutation(tmp_path):
  texts = [f"d{i}" for i in range(10)]
  cfg = DataConfig(sources=(jsonl_source(tmp_path, "a", texts, skip=3),))
  docs = documents_of(pipeline.training_documents(cfg, seed=1), 21)
  epochs = [docs[0:7], docs[7:14], docs[14:21]]
  assert all(sorted(e) == sorted(texts[3:]) for e in epochs)
  assert epochs[0] != epochs[1] or epochs[1] != epochs[2]


def test_training_stops_where_the_heldout_region_of_the_same_split_starts(tmp_path):
  texts = [f"d{i}" for i in range(10)]
  cfg = DataConfig(sources=(jsonl_source(tmp_path, "a", texts, skip=1, heldout_skip=6),))
  assert sorted(documents_of(pipeline.training_documents(cfg, seed=0), 5)) == sorted(texts[1:6])
  assert sorted(documents_of(pipeline.source_documents(cfg, 0, heldout=True), 4)) == sorted(texts[6:])


def test_process_shards_partition_the_document_stream(tmp_path):
  cfg = DataConfig(sources=(jsonl_source(tmp_path, "a", [f"d{i}" for i in range(9)]),))
  whole = documents_of(pipeline.training_documents(cfg, seed=0), 20)
  shards = [documents_of(pipeline.training_documents(cfg, seed=0, process_index=p, process_count=2), 10)
            for p in range(2)]
  assert shards[0] == whole[0::2] and shards[1] == whole[1::2]


# ------------------------------------------------------------------------------------------ packing


def char_config(tmp_path, texts, **kwargs) -> DataConfig:
  return DataConfig(sources=(jsonl_source(tmp_path, "a", texts),), **kwargs)


@pytest.mark.parametrize("segment_ids", [False, True])
def test_packing_cuts_one_eos_separated_stream_into_exact_windows(tmp_path, segment_ids):
  texts = ["abc", "defghijklmnop", "q", "rstuvwxyzABCDEFGHIJ"]
  cfg = char_config(tmp_path, texts, seq_len=6, segment_ids=segment_ids)
  it = pipeline.make_train_iterator(cfg, CharTokenizer(), batch_size=2, seed=0)
  batches = pipeline.take_batches(it, 6)
  assert all(b["tokens"].shape == (2, 7) and all(v.dtype == np.int32 for v in b.values()) for b in batches)
  windows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  stream = "".join(CharTokenizer().decode(w) for w in windows["tokens"]).split("\0")
  epoch_order = documents_of(pipeline.training_documents(cfg, seed=0), 8)
  complete = stream[:-1]  # the last piece continues in the next window
  assert len(complete) >= 6 and complete == epoch_order[:len(complete)], "one stream, EOS between documents"
  for tokens, seg, pos in zip(windows["tokens"], windows["segment_ids"], windows["positions"]):
    starts = np.r_[True, tokens[:-1] == 0]  # a new document starts after each EOS
    np.testing.assert_array_equal(seg, np.cumsum(starts))
    if segment_ids:
      expected = np.arange(7) - np.maximum.accumulate(np.where(starts, np.arange(7), 0))
      np.testing.assert_array_equal(pos, expected)
    else:
      np.testing.assert_array_equal(pos, np.arange(7))


def test_same_seed_gives_same_batches_and_another_seed_differs(stdlib_tokenizer):
  cfg = DataConfig(seq_len=32)

  def first(seed):
    it = pipeline.make_train_iterator(cfg, stdlib_tokenizer, batch_size=2, seed=seed)
    return pipeline.take_batches(it, 3)

  a, b, c = first(0), first(0), first(1)
  assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
  assert not np.array_equal(a[0]["tokens"], c[0]["tokens"])


def test_global_batch_must_divide_over_processes(stdlib_tokenizer):
  with pytest.raises(ValueError, match="not divisible"):
    pipeline.make_train_iterator(DataConfig(), stdlib_tokenizer, batch_size=5, seed=0, process_count=2)


# ------------------------------------------------------------------------------------------- resume


def assert_same_batches(xs, ys):
  assert len(xs) == len(ys)
  for x, y in zip(xs, ys):
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("n", [0, 1, 5, 13])
def test_restored_iterator_continues_exactly(stdlib_tokenizer, n):
  cfg = DataConfig(seq_len=24, segment_ids=True)
  make = lambda: pipeline.make_train_iterator(cfg, stdlib_tokenizer, batch_size=3, seed=4)  # noqa: E731
  it = make()
  pipeline.take_batches(it, n)
  state = json.loads(json.dumps(it.get_state()))  # the Orbax handler stores JSON
  expected = pipeline.take_batches(it, 4)
  restored = make()
  restored.set_state(state)
  assert_same_batches(pipeline.take_batches(restored, 4), expected)


def test_resume_is_exact_when_windows_end_at_document_boundaries(tmp_path):
  # Documents of exactly seq_len characters + EOS fill one window each, so every saved state has no
  # partial document: the case Grain's packer restores wrongly from JSON without JsonSafeIterator.
  cfg = char_config(tmp_path, [c * 7 for c in "abcdefghij"], seq_len=7)
  make = lambda: pipeline.make_train_iterator(cfg, CharTokenizer(), batch_size=2, seed=0)  # noqa: E731
  it = make()
  pipeline.take_batches(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = pipeline.take_batches(it, 6)
  restored = make()
  restored.set_state(state)
  assert_same_batches(pipeline.take_batches(restored, 6), expected)


def test_orbax_checkpoint_restores_the_data_iterator_exactly(stdlib_tokenizer, tmp_path):
  import orbax.checkpoint as ocp
  cfg = DataConfig(seq_len=16)
  make = lambda: pipeline.make_train_iterator(cfg, stdlib_tokenizer, batch_size=2, seed=3)  # noqa: E731
  it = make()
  pipeline.take_batches(it, 7)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave({"step": np.asarray(7)}),
                                            data=grain.checkpoint.CheckpointSave(it)))
    manager.wait_until_finished()
  expected = pipeline.take_batches(it, 5)
  restored = make()
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    out = manager.restore(7, args=ocp.args.Composite(state=ocp.args.StandardRestore({"step": np.asarray(0)}),
                                                     data=grain.checkpoint.CheckpointRestore(restored)))
  assert int(out["state"]["step"]) == 7
  assert_same_batches(pipeline.take_batches(restored, 5), expected)


def test_worker_processes_give_the_same_resumable_stream(tmp_path):
  from absl import flags
  flags.FLAGS.mark_as_parsed()  # Grain workers read absl flags; train.py parses them via absl.app.
  cfg = char_config(tmp_path, [f"document {i} " * (i % 5 + 1) for i in range(30)], seq_len=8, worker_count=1)
  make = lambda: pipeline.make_train_iterator(cfg, CharTokenizer(), batch_size=2, seed=0)  # noqa: E731
  it = make()
  first = pipeline.take_batches(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = pipeline.take_batches(it, 3)
  it.close()
  inline = pipeline.make_train_iterator(dataclasses.replace(cfg, worker_count=0), CharTokenizer(),
                                        batch_size=2, seed=0)
  assert_same_batches(pipeline.take_batches(inline, 6), first + expected)
  restored = make()
  restored.set_state(state)
  assert_same_batches(pipeline.take_batches(restored, 3), expected)
  restored.close()


def test_worker_threads_and_processes_give_one_stream_and_take_each_others_states(tmp_path):
  from absl import flags
  flags.FLAGS.mark_as_parsed()
  cfg = char_config(tmp_path, [f"document {i} " * (i % 5 + 1) for i in range(30)], seq_len=8, worker_count=2)
  kinds = {kind: dataclasses.replace(cfg, worker_kind=kind) for kind in ("threads", "processes")}
  assert kinds["threads"].worker_threads and not kinds["processes"].worker_threads
  assert not cfg.worker_threads and dataclasses.replace(cfg, token_cache=True).worker_threads  # "auto"
  with pytest.raises(errors.ConfigError, match="data.worker_kind='fork': give one of auto, threads, processes"):
    dataclasses.replace(cfg, worker_kind="fork")
  make = lambda kind: pipeline.make_train_iterator(kinds[kind], CharTokenizer(), batch_size=2, seed=0)  # noqa: E731
  streams, states = {}, {}
  for kind in kinds:
    it = make(kind)
    first = pipeline.take_batches(it, 3)
    states[kind] = json.loads(json.dumps(it.get_state()))
    streams[kind] = first + pipeline.take_batches(it, 4)
    it.close()
  assert_same_batches(streams["threads"], streams["processes"])
  assert states["threads"] == states["processes"]
  restored = make("threads")
  restored.set_state(states["processes"])
  assert_same_batches(pipeline.take_batches(restored, 4), streams["processes"][3:])
  restored.close()
  # two shards pack their own documents: not the stream of one
  inline = pipeline.make_train_iterator(dataclasses.replace(cfg, worker_count=0), CharTokenizer(),
                                        batch_size=2, seed=0)
  assert any(not np.array_equal(a["tokens"], b["tokens"])
             for a, b in zip(pipeline.take_batches(inline, 7), streams["threads"]))


def test_state_restores_in_another_process(stdlib_tokenizer, cache_dir):
  # What stage chaining relies on: a saved state continues the same stream in a new process.
  program = f"""
import json, sys
from lmcore.data import DataConfig, load_tokenizer, make_train_iterator, take_batches
cfg = DataConfig(seq_len=16)
it = make_train_iterator(cfg, load_tokenizer(cfg.tokenizer, {cache_dir!r}), batch_size=2, seed=9)
take_batches(it, 5)
state = it.get_state()
print(json.dumps({{"state": state, "next": [b["tokens"].tolist() for b in take_batches(it, 3)]}}))
"""
  env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
  out = json.loads(subprocess.run([sys.executable, "-c", program], env=env, check=True, capture_output=True,
                                  text=True).stdout)
  restored = pipeline.make_train_iterator(DataConfig(seq_len=16), stdlib_tokenizer, batch_size=2, seed=9)
  restored.set_state(out["state"])
  assert [b["tokens"].tolist() for b in pipeline.take_batches(restored, 3)] == out["next"]


# ----------------------------------------------------------------------------------------- held-out


def test_heldout_set_is_built_once_reused_and_guarded(stdlib_tokenizer, tmp_path, monkeypatch):
  cfg = DataConfig(seq_len=32, heldout=HeldoutConfig(num_sequences=8))
  path = tmp_path / "heldout.npz"
  built = heldout.load_or_build_heldout(cfg, stdlib_tokenizer, path)
  assert built["tokens"].shape == built["segment_ids"].shape == built["positions"].shape == (8, 33)
  np.testing.assert_array_equal(built["positions"], np.broadcast_to(np.arange(33), (8, 33)))
  heldout_text = "".join(stdlib_tokenizer.decode(t) for t in built["tokens"])
  held_files = [embedded.read_document(p) for p in embedded.corpus_files("heldout")]
  assert any(heldout_text[:200] in f for f in held_files), "drawn from the held-out split"

  def no_rebuild(*_):
    raise AssertionError("the stored held-out set must be reused")

  monkeypatch.setattr(heldout, "build_heldout", no_rebuild)
  again = heldout.load_or_build_heldout(cfg, stdlib_tokenizer, path)
  np.testing.assert_array_equal(again["tokens"], built["tokens"])
  with_segments = heldout.load_or_build_heldout(DataConfig(seq_len=32, segment_ids=True,
                                                           heldout=HeldoutConfig(num_sequences=8)),
                                                stdlib_tokenizer, path)
  assert (with_segments["positions"][:, 0] == 0).all() and with_segments["positions"].max() == 32
  with pytest.raises(ValueError, match=r"seq_len: stored 32, config 48.*data\.heldout\.path"):
    heldout.load_or_build_heldout(DataConfig(seq_len=48, heldout=HeldoutConfig(num_sequences=8)),
                                  stdlib_tokenizer, path)
  with pytest.raises(ValueError, match=r"tokenizer: stored"):
    heldout.load_or_build_heldout(cfg, CharTokenizer(), path)


def test_heldout_takes_what_exists_without_repeating_and_warns(stdlib_tokenizer, tmp_path):
  cfg = DataConfig(seq_len=255, heldout=HeldoutConfig(num_sequences=100_000, path=str(tmp_path / "h.npz")))
  with pytest.warns(UserWarning, match="never repeated"):
    built = heldout.load_or_build_heldout(cfg, stdlib_tokenizer, "unused")
  total = sum(len(stdlib_tokenizer.encode(embedded.read_document(p))) + 1
              for p in embedded.corpus_files("heldout"))
  assert built["tokens"].shape[0] == total // 256
  assert (tmp_path / "h.npz").exists()


def test_heldout_mixes_only_the_documents_past_heldout_skip(tmp_path):
  sources_ = tuple(jsonl_source(tmp_path, name, [f"{name}{i:02d}" for i in range(20)], heldout_skip=15)
                   for name in "ab")
  cfg = DataConfig(sources=sources_, seq_len=3, heldout=HeldoutConfig(num_sequences=100))
  with pytest.warns(UserWarning, match="only 10 windows"):
    built = heldout.build_heldout(cfg, CharTokenizer())
  documents = [CharTokenizer().decode(t[:-1]) for t in built["tokens"]]  # one "x15" + EOS per window
  assert sorted(documents) == sorted(f"{n}{i}" for n in "ab" for i in range(15, 20))


def test_unigram_entropy_matches_the_direct_formula():
  assert heldout.unigram_entropy(np.array([[0, 1], [2, 3]]), vocab_size=4) == pytest.approx(np.log(4))
  with pytest.raises(ValueError, match="vocabulary of 3"):
    heldout.unigram_entropy(np.array([0, 3]), vocab_size=3)
  tokens = np.random.default_rng(0).integers(0, 50, size=(8, 33))
  p = np.bincount(tokens.ravel()) / tokens.size
  p = p[p > 0]
  assert heldout.unigram_entropy(tokens) == pytest.approx(-(p * np.log(p)).sum())


def test_data_fingerprint_records_the_embedded_corpus(tmp_path):
  recorded = json.loads(json.dumps(pipeline.fingerprint(DataConfig())))
  assert recorded["embedded_corpus"]["sha256"] == embedded.fingerprint().sha256
  jsonl_only = DataConfig(sources=(jsonl_source(tmp_path, "a", ["x"]),))
  assert pipeline.fingerprint(jsonl_only)["embedded_corpus"] is None


def test_config_rejects_unknown_kinds_and_zero_weights():
  with pytest.raises(ValueError, match="array_record"):
    SourceConfig(kind="csv")
  with pytest.raises(ValueError, match="weight"):
    SourceConfig(weight=0.0)
  with pytest.raises(ValueError, match="unique"):
    DataConfig(sources=(SourceConfig(), SourceConfig()))
