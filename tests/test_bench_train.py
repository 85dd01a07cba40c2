"""The whole-step benchmark (scripts/bench_train.py) on CPU: two tiny presets timed in this process, the
table with ratios to the softmax reference (Transformer++ where measured) and each row's positions, the
JSONL rows, the plot and the dated markdown block; the long-context presets' shapes; flags checked."""

import json
import types

import pytest

from benchmarks import train_step

TINY = ["model.vocab_size=256", "model.d_model=32", "model.mlp_hidden=64"]


def test_two_tiny_presets_are_timed_and_reported(tmp_path):
  jsonl, markdown = tmp_path / "out" / "train_step.jsonl", tmp_path / "BENCH.md"
  rows = train_step.run(["baselines:softmax_tiny", "sanatan:tiny"], batch=2, seq_len=16, steps=2, warmup=1,
                        overrides=TINY, jsonl=str(jsonl))
  softmax, sanatan = rows
  assert (softmax.mixers, sanatan.mixers) == ("softmax", "sanatan")
  for row in rows:
    assert row.tokens_per_s > 0 and row.step_ms > 0 and row.compile_s > 0, row
    assert row.tokens_per_s == pytest.approx(2 * 16 / row.step_ms * 1e3)
    assert row.params > 0 and row.loss > 0 and not row.note
    assert row.mfu is None and row.peak_memory_gib is None  # CPUs have no peak FLOPs or memory stats
    assert row.xla_memory_gib > 0
  assert softmax.vs_softmax == 1.0
  assert sanatan.vs_softmax == pytest.approx(sanatan.tokens_per_s / softmax.tokens_per_s)
  assert [json.loads(line)["preset"] for line in jsonl.read_text().splitlines()] == [
      "baselines:softmax_tiny", "sanatan:tiny"]
  table = train_step.report(rows, out=str(tmp_path / "out"), markdown=str(markdown), command="python x")
  assert (softmax.positions, sanatan.positions) == ("RoPE", "table") and softmax.reference == "baselines:softmax_tiny"
  assert "| sanatan:tiny |  | sanatan | table | 2 × 16 (1) |" in table and "× baselines:softmax_tiny |" in table
  text = markdown.read_text()
  assert "train step on cpu" in text and "`python x`" in text and table in text
  assert (tmp_path / "out" / "train_step.png").stat().st_size > 1000


def test_a_failing_preset_becomes_a_row_and_a_sweep_runs_each_value(monkeypatch):
  seen = []

  def fake_measure(name, config, *, steps, warmup, variant="", profile="", profile_steps=2):
    seen.append((name, variant, config.train.loss_impl))
    if config.train.loss_impl == "materialized":
      raise MemoryError("RESOURCE_EXHAUSTED: out of memory")
    mixers = "+".join(sorted(set(config.model.layer_kinds())))
    return train_step.TrainRow(name, variant, mixers, 2, 16, 1, 10, step_ms=1.0,
                               tokens_per_s=32e3 if mixers == "softmax" else 16e3)

  monkeypatch.setattr(train_step, "measure", fake_measure)
  monkeypatch.setattr(train_step.jax, "clear_caches", lambda: None)
  rows = train_step.run(["baselines:softmax_tiny"], batch=2, seq_len=16, steps=1,
                        sweep="train.loss_impl=fused,materialized")
  assert seen == [("baselines:softmax_tiny", "train.loss_impl=fused", "fused"),
                  ("baselines:softmax_tiny", "train.loss_impl=materialized", "materialized")]
  assert rows[0].tokens_per_s == 32e3 and rows[1].tokens_per_s is None
  assert rows[1].note == ("out of memory at micro-batch 2 × 16; --presets=baselines:softmax_tiny@"
                          "train.loss_impl=materialized@train.grad_accum=2 halves it. "
                          "MemoryError: RESOURCE_EXHAUSTED: out of memory")
  # A preset without the swept key runs once, and is the softmax reference of every variant.
  seen.clear()
  rows = train_step.run(["baselines:softmax_tiny", "sanatan:tiny"], batch=2, seq_len=16, steps=1,
                        sweep="model.mixers.sanatan.p=1,2")
  assert [(name, variant) for name, variant, _ in seen] == [
      ("baselines:softmax_tiny", ""), ("sanatan:tiny", "model.mixers.sanatan.p=1"),
      ("sanatan:tiny", "model.mixers.sanatan.p=2")]
  assert [row.vs_softmax for row in rows] == [1.0, 0.5, 0.5]
  # NAME@KEY=VALUE: one preset's own overrides, after the sweep's; its rows name them.
  seen.clear()
  rows = train_step.run(["baselines:softmax_tiny", "sanatan:tiny@model.mixers.sanatan.p=2@train.loss_impl=fused"],
                        batch=2, seq_len=16, steps=1, sweep="model.mixers.sanatan.p=1")
  assert seen == [("baselines:softmax_tiny", "", "auto"),
                  ("sanatan:tiny", "model.mixers.sanatan.p=1@model.mixers.sanatan.p=2@train.loss_impl=fused", "fused")]
  assert [row.vs_softmax for row in rows] == [1.0, 0.5]


def test_profile_breaks_down_the_traced_steps_of_a_tiny_preset(tmp_path, capsys):
  row, = train_step.run(["sanatan:tiny"], batch=2, seq_len=16, steps=1, warmup=1, overrides=TINY,
                        profile=str(tmp_path), profile_steps=2)
  assert row.tokens_per_s > 0 and not row.note, row.note
  assert row.profile == str(tmp_path / "sanatan_tiny_breakdown.md")
  assert list((tmp_path / "trace" / "sanatan_tiny" / "plugins" / "profile").glob("*/perfetto_trace.json.gz"))
  assert (tmp_path / "trace" / "sanatan_tiny" / "compiled_hlo.txt.gz").stat().st_size > 0
  data = json.loads((tmp_path / "sanatan_tiny_breakdown.json").read_text())
  assert data["steps"] == 2 and "CPU backend" in data["source"]
  assert 0 < data["busy_ms"] <= data["op_ms"] * (1 + 1e-9)  # the union of the ops' intervals
  categories = {c["category"]: c["ms"] for c in data["categories"]}
  assert {"matmul", "loss", "optimizer", "elementwise/reduction"} <= set(categories), categories
  assert sum(categories.values()) == pytest.approx(data["op_ms"])
  scopes = {s["scope"]: s for s in data["scopes"]}
  assert {"mixer", "mlp", "loss", "optimizer"} <= set(scopes), scopes
  assert scopes["mixer"]["forward_ms"] > 0 and scopes["mixer"]["backward_ms"] > 0
  assert scopes["optimizer"]["ms"] == pytest.approx(scopes["optimizer"]["outside_ms"])
  assert 0 < len(data["top"]) <= 30
  out = capsys.readouterr().out
  assert "### Kernel time per train step: sanatan:tiny" in out and "| category | ms/step |" in out
  with pytest.raises(train_step.BenchError, match="--profile_steps=0"):
    train_step.run(["sanatan:tiny"], batch=2, seq_len=16, steps=1, profile=str(tmp_path), profile_steps=0)


def test_each_preset_keeps_its_micro_batch_at_the_common_batch():
  configs = {name: train_step.bench_config(name, batch=64, seq_len=2048, overrides=[])[0]
             for name in ("softmax_184m", "sanatan_p2_184m", "based_360m")}
  assert configs["sanatan_p2_184m"].train.grad_accum == 2  # micro-batches of 32, as the preset trains
  assert configs["based_360m"].train.grad_accum == 2
  softmax = configs["softmax_184m"].model
  assert softmax.layer_kinds() == ("softmax",) * 12 and softmax.vocab_size == 126_349
  assert softmax.mixers["softmax"].n_heads == 12 and not softmax.mixers["softmax"].rope


def test_long_context_presets_time_their_own_shape_without_a_table_unless_the_flags_say_otherwise():
  """8 × 8192 and 2 × 32768: the 184M recipe's 65,536 tokens per step in one micro-batch, no table."""
  for length, (batch, seq_len) in (("8k", (8, 8192)), ("32k", (2, 32768))):
    for model in ("sanatan_p1_184m", "transformer_pp_184m", "gla_182m"):
      config, _ = train_step.bench_config(f"{model}_{length}", batch=None, seq_len=None, overrides=[])
      assert (config.train.batch_size, config.data.seq_len, config.train.grad_accum) == (batch, seq_len, 1)
      assert batch * seq_len == 32 * 2048 and config.model.max_positions == 0
      assert train_step.positions(config.model) == ("RoPE" if model == "transformer_pp_184m" else "none")
  config, _ = train_step.bench_config("sanatan_p1_184m_8k", batch=4, seq_len=None, overrides=[])
  assert (config.train.batch_size, config.data.seq_len) == (4, 8192)
  config, _ = train_step.bench_config("sanatan_p1_184m", batch=None, seq_len=None, overrides=[])
  assert (config.train.batch_size, config.data.seq_len, config.model.max_positions) == (32, 2048, 2048)
  assert not set(train_step.DEFAULT_PRESETS) & train_step.OWN_SHAPE


def test_the_ratio_is_to_transformer_pp_at_the_same_length_and_the_table_row_is_labelled():
  def row(preset, mixers, positions, seq_len, tokens_per_s):
    return train_step.TrainRow(preset, "", mixers, 32, seq_len, 1, 10, tokens_per_s=tokens_per_s,
                               positions=positions)
  rows = train_step.with_ratios([
      row("softmax_184m", "softmax", "table", 2048, 300.0), row("transformer_pp_184m", "softmax", "RoPE", 2048, 200.0),
      row("sanatan_p1_184m", "sanatan", "table", 2048, 100.0), row("sanatan_p1_184m_8k", "sanatan", "none", 8192, 90.0),
      row("transformer_pp_184m_8k", "softmax", "RoPE", 8192, 60.0)])
  assert [(r.vs_softmax, r.reference) for r in rows] == [
      (1.5, "transformer_pp_184m"), (1.0, "transformer_pp_184m"), (0.5, "transformer_pp_184m"),
      (1.5, "transformer_pp_184m_8k"), (1.0, "transformer_pp_184m_8k")]
  # Without a Transformer++ row the table softmax is the reference, and the table says which it is.
  rows = train_step.with_ratios([row("softmax_184m", "softmax", "table", 2048, 300.0),
                                 row("sanatan_p1_184m", "sanatan", "table", 2048, 150.0)])
  assert rows[1].vs_softmax == 0.5 and rows[1].reference == "softmax_184m"
  assert "| softmax_184m |  | softmax | table | 32 × 2048 (1) |" in train_step.format_table(rows)


def test_bad_flags_say_what_to_fix():
  with pytest.raises(train_step.BenchError, match="unknown preset 'nope'; use one of transformer_pp_184m"):
    train_step.run(["nope"], batch=2, seq_len=16, steps=1)
  with pytest.raises(train_step.BenchError, match="configs/sanatan.py has no preset 'huge'"):
    train_step.run(["sanatan:huge"], batch=2, seq_len=16, steps=1)
  with pytest.raises(train_step.BenchError, match="no selected preset has train.los_impl"):
    train_step.run(["baselines:softmax_tiny"], batch=2, seq_len=16, steps=1, overrides=["train.los_impl=fused"])
  with pytest.raises(train_step.BenchError, match="preset sanatan:tiny has no model.mixers.sanatan.q"):
    train_step.run(["sanatan:tiny@model.mixers.sanatan.q=2"], batch=2, seq_len=16, steps=1)
  with pytest.raises(train_step.BenchError, match="give KEY=VALUE"):
    train_step.run(["baselines:softmax_tiny"], batch=2, seq_len=16, steps=1, overrides=["train.steps"])
  with pytest.raises(train_step.BenchError, match="train.loss_impl='fast'; valid"):
    train_step.run(["baselines:softmax_tiny"], batch=2, seq_len=16, steps=1, overrides=["train.loss_impl=fast"])


def test_the_out_of_memory_hint_replaces_a_grad_accum_the_variant_set():
  config = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=32, grad_accum=2),
                                 data=types.SimpleNamespace(seq_len=2048))
  error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
  note = train_step.failure_note(error, "based_1p3b", "train.loss_impl=fused@train.grad_accum=2", config)
  assert note.startswith("out of memory at micro-batch 16 × 2048; "
                         "--presets=based_1p3b@train.loss_impl=fused@train.grad_accum=4 halves it.")
