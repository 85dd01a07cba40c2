"""The decode benchmark (scripts/bench_decode.py) on CPU: tiny models timed in this process through the
compiled generation loop, the table, JSONL rows, dated markdown block and plot; the targets read off rows;
the paper models' configs; flags checked."""

import json

import pytest

from benchmarks import decode

TINY = ["model.vocab_size=256", "model.d_model=32", "model.mlp_hidden=64", "model.n_layers=1"]


def test_tiny_models_are_timed_on_the_main_and_long_grids_and_reported(tmp_path):
  jsonl, markdown, plot = tmp_path / "out" / "decode.jsonl", tmp_path / "BENCH.md", tmp_path / "d.png"
  rows = decode.run(["sanatan_p1_184m", "softmax_184m"], batches=[1, 2], contexts=[12], long_contexts=[24],
                    decode_tokens=4, repeats=1, tiny=True,
                    overrides=TINY, jsonl=str(jsonl))
  assert [(r.model, r.grid, r.batch, r.context, r.position_table) for r in rows] == [
      ("sanatan_p1_184m", "main", 1, 12, True), ("sanatan_p1_184m", "main", 2, 12, True),
      ("sanatan_p1_184m", "long", 1, 24, False),  # past the table: run without it
      ("softmax_184m", "main", 1, 12, True), ("softmax_184m", "main", 2, 12, True),
      ("softmax_184m", "long", 1, 24, False)]
  for row in rows:
    assert not row.note and row.ms_per_token > 0 and row.compile_s >= 0, row
    assert row.tokens_per_s == pytest.approx(row.batch / row.ms_per_token * 1e3)
    assert row.weight_bytes > 0 and row.floor_ms is None  # CPUs have no listed bandwidth
    assert row.kernels_per_token > 10  # a layer's norm, projections, mixer and MLP, the head, the sample
  state_bytes = {(r.model, r.context): r.state_bytes_per_seq for r in rows}
  assert state_bytes["sanatan_p1_184m", 12] == state_bytes["sanatan_p1_184m", 24]  # a constant state
  assert state_bytes["softmax_184m", 24] > state_bytes["softmax_184m", 12]  # a growing KV cache
  assert [json.loads(line)["context"] for line in jsonl.read_text().splitlines()] == [12, 12, 24, 12, 12, 24]
  table = decode.report(rows, markdown=str(markdown), plot=str(plot), command="python x", decode_tokens=4)
  assert "| sanatan_p1_184m | sanatan |" in table and "| softmax_184m | softmax |" in table
  text = markdown.read_text()
  assert "decode on cpu" in text and "`python x`" in text and table in text
  assert "sanatan_p1_184m, batch 1:" in text  # the target lines
  assert plot.stat().st_size > 1000


def test_each_decode_program_is_a_row_with_its_kernels_by_kind_and_its_hlo(tmp_path):
  """--decode_xla=default,graph_loop: the model runs once per set of XLA options (GPU options, which a
  CPU ignores); each row names its program and carries the kernels per token by kind, whose sum is the
  column; each compiled loop's HLO is written, and the target lines are given per program."""
  rows = decode.run(["sanatan_p1_184m"], batches=[1], contexts=[12], decode_tokens=4, repeats=1, tiny=True,
                    overrides=TINY, xla=["default", "graph_loop"], hlo_dir=str(tmp_path / "hlo"))
  assert [r.xla for r in rows] == ["default", "graph_loop"]
  for r in rows:
    assert not r.note and r.kernels_per_token == sum(r.kernel_kinds.values()) > 10, r
    assert r.kernel_kinds["fusion"] > 0
  assert sorted(p.name for p in (tmp_path / "hlo").iterdir()) == [
      "sanatan_p1_184m_default_b1_c12.hlo.txt", "sanatan_p1_184m_graph_loop_b1_c12.hlo.txt"]
  lines = decode.target_lines(rows)
  assert len(lines) == 4 and lines[2].startswith("- [graph_loop] sanatan_p1_184m, batch 1:")
  assert "| sanatan_p1_184m [graph_loop] | sanatan |" in decode.format_table(rows)


HLO = """HloModule jit__decode

%body.1 (arg: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %arg = (s32[], f32[2,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[2,4]{1,0} get-tuple-element(%arg), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %dot = f32[2,4]{1,0} custom-call(%x), custom_call_target="__cublas$gemm"
  %fused = f32[2,4]{1,0} fusion(%dot), kind=kLoop, calls=%fused_computation
  %start = ((f32[2,4]{1,0}), f32[2,4]{1,0}, u32[]) copy-start(%fused)
  %done = f32[2,4]{1,0} copy-done(%start)
  %b = f32[2,4]{1,0} bitcast(%done)
  ROOT %out = (s32[], f32[2,4]{1,0}) tuple(%next, %b)
}

%cond.1 (arg: (s32[], f32[2,4])) -> pred[] {
  %arg = (s32[], f32[2,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[2,4]) -> f32[2,4] {
  %x = f32[2,4]{1,0} parameter(0)
  %pre = f32[2,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_computation.2
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,4]{1,0}) tuple(%zero, %pre)
  %loop = (s32[], f32[2,4]{1,0}) while(%init), condition=%cond.1, body=%body.1
  ROOT %y = f32[2,4]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_kernels_per_token_counts_the_work_of_the_loop_body_and_condition():
  """The body's add, library call, fusion and copy (the async pair once) and the condition's compare:
  5; parameters, constants, tuples, bitcasts and the work before the loop launch nothing per token."""
  assert decode.kernels_per_token(HLO) == 5
  assert decode.loop_kernel_kinds(HLO) == {"add": 1, "custom-call": 1, "fusion": 1, "copy": 1, "compare": 1}
  with pytest.raises(ValueError, match="no while loop"):
    decode.kernels_per_token(HLO.replace("while(%init), condition=%cond.1, body=%body.1", "tuple(%init)"))


# The loop of HLO run from a command buffer (a call) holding the whole loop; its body calls a command
# buffer of two fusions and a conditional whose larger branch holds a GEMM and a fusion.
GRAPHED = HLO.replace("""  %dot = f32[2,4]{1,0} custom-call(%x), custom_call_target="__cublas$gemm"
  %fused = f32[2,4]{1,0} fusion(%dot), kind=kLoop, calls=%fused_computation""",
                      """  %graph = f32[2,4]{1,0} call(%x), to_apply=%command_buffer.3
  %p = pred[] constant(true)
  %fused = f32[2,4]{1,0} conditional(%p, %graph, %graph), true_computation=%big, false_computation=%small""")
GRAPHED = GRAPHED.replace("  %loop = (s32[], f32[2,4]{1,0}) while(%init), condition=%cond.1, body=%body.1",
                          "  %loop = (s32[], f32[2,4]{1,0}) call(%init), to_apply=%command_buffer.9")
GRAPHED = GRAPHED.replace("ENTRY %main", """%command_buffer.3 (a: f32[2,4]) -> f32[2,4] {
  %a = f32[2,4]{1,0} parameter(0)
  %f1 = f32[2,4]{1,0} fusion(%a), kind=kLoop, calls=%fused_computation.4
  ROOT %f2 = f32[2,4]{1,0} fusion(%f1), kind=kLoop, calls=%fused_computation.5
}

%big (a: f32[2,4]) -> f32[2,4] {
  %a = f32[2,4]{1,0} parameter(0)
  %g = f32[2,4]{1,0} custom-call(%a), custom_call_target="__cublas$gemm"
  ROOT %f = f32[2,4]{1,0} fusion(%g), kind=kLoop, calls=%fused_computation.6
}

%small (a: f32[2,4]) -> f32[2,4] {
  ROOT %a = f32[2,4]{1,0} parameter(0)
}

%command_buffer.9 (i: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %i = (s32[], f32[2,4]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[2,4]{1,0}) while(%i), condition=%cond.1, body=%body.1
}

ENTRY %main""")


def test_kernels_per_token_counts_inside_command_buffers_and_the_branch_that_runs():
  """A call counts the kernels it calls (two fusions), a conditional its larger branch (a GEMM and a
  fusion), and the loop is found inside the call that runs it: the add, 2 + 2, the copy and the
  compare, 7."""
  assert decode.loop_kernel_kinds(GRAPHED) == {"fusion": 3, "add": 1, "custom-call": 1, "copy": 1,
                                               "compare": 1}


def _row(model, batch, context, ms):
  return decode.DecodeRow(model, "x", 1, batch, context, 128, True, ms_per_token=ms,
                          tokens_per_s=batch * 1e3 / ms)


def test_targets_are_read_off_the_rows():
  rows = [_row("sanatan_p1_184m", 1, 1024, 0.25), _row("sanatan_p1_184m", 1, 32768, 0.26),
          _row("sanatan_p1_184m", 64, 2048, 1.0), _row("softmax_184m", 64, 2048, 5.0)]
  lines = decode.target_lines(rows)
  assert lines[0].endswith("0.260 ms/token at worst over contexts 1,024–32,768 (target ≤ 0.3: met).")
  assert "(target ± 10 %: met)" in lines[1]
  assert lines[2].endswith("5.00× (target ≥ 4×: met).")
  slow = decode.target_lines([_row("sanatan_p1_184m", 1, 1024, 0.25), _row("sanatan_p1_184m", 1, 8192, 0.4)])
  assert "not met" in slow[0] and "not met" in slow[1] and len(slow) == 2


def test_the_paper_models_and_their_long_context_variants():
  configs = {name: decode.model_config(name) for name in decode.GRID_MODELS + ("based_1p3b",)}
  assert configs["softmax_184m"].layer_kinds() == ("softmax",) * 12
  assert configs["softmax_184m"].mixers["softmax"].cache_dtype == "float32"
  assert configs["softmax_184m_bf16_cache"].mixers["softmax"].cache_dtype == "bfloat16"
  assert configs["sanatan_p1_184m"].mixers["sanatan"].p == 1
  assert configs["sanatan_p1_184m"].max_positions == 2048
  assert decode.model_config("sanatan_p1_184m", overrides=decode.NO_POSITION_TABLE).max_positions == 0
  assert configs["based_360m"].max_positions == 0 and configs["gla_182m"].max_positions == 0
  assert decode.model_config("softmax_184m", tiny=True).layer_kinds() == ("softmax",) * 4
  assert decode.model_config("sanatan_p1_184m", tiny=True,
                             overrides=[("model.n_layers", 1)]).layer_kinds() == ("sanatan",)
  assert configs["based_1p3b"].d_model > configs["based_360m"].d_model


def test_the_papers_setting_times_prefill_and_decode_and_divides_by_transformer_pp(tmp_path):
  """--setting=paper on the tiny presets: prefill (two calls of 35 tokens) and decode timed per model,
  SANATAN's ratios to the Transformer++ of its size filled in, its position table dropped where prompt
  + tokens pass it, the table (the paper's reported ratios beside BASED 1.3B) and its notes appended
  as a dated block."""
  jsonl, markdown = tmp_path / "paper.jsonl", tmp_path / "BENCH.md"
  rows = decode.run_paper(["sanatan_p1_184m", "transformer_pp_184m"], batch=2, prompt=70, tokens=4,
                          prefill_chunk=35, tiny=True, overrides=TINY + ["model.max_positions=64"],
                          jsonl=str(jsonl))
  sanatan, tpp = rows
  for r in rows:
    assert not r.note and r.prefill_ms > 0 and r.ms_per_token > 0 and r.kernels_per_token > 10, r
    assert r.prefill_tokens_per_ms == pytest.approx(2 * 70 / r.prefill_ms)
    assert r.tokens_per_s == pytest.approx(2 / r.ms_per_token * 1e3)
  assert sanatan.reference == "transformer_pp_184m" and tpp.decode_ratio is None and tpp.prefill_chunk == 35
  assert sanatan.decode_ratio == pytest.approx(sanatan.tokens_per_s / tpp.tokens_per_s)
  assert sanatan.prefill_ratio == pytest.approx(sanatan.prefill_tokens_per_ms / tpp.prefill_tokens_per_ms)
  assert not sanatan.position_table  # its table of 64 < 70 + 4
  assert len(jsonl.read_text().splitlines()) == 2
  rows.append(decode.PaperRow("based_1p3b", "x", 1, 2, 70, 4, False, note="skipped"))
  table = decode.report_paper(rows, markdown=str(markdown), command="python y")
  assert "(transformer_pp_184m) |  |" in table and "| 24×, 161.7 tokens/ms | skipped |" in table
  text = markdown.read_text()
  assert "decode in the papers' setting on cpu" in text and "`python y`" in text


def test_transformer_pp_presets_are_looked_up_in_configs_baselines_when_they_run():
  """The Transformer++ names resolve to ``configs/baselines.py:transformer_pp_<size>`` at run time: a
  softmax model with a bf16 KV cache where the preset exists, else one line naming the file and preset."""
  for size in ("184m", "360m", "1p3b"):
    assert decode.PRESETS[f"transformer_pp_{size}"] == (f"baselines:transformer_pp_{size}", decode.BF16_CACHE)
    try:
      config = decode.model_config(f"transformer_pp_{size}")
    except decode.BenchError as e:
      assert f"configs/baselines.py has no preset 'transformer_pp_{size}'" in str(e)
    else:
      assert set(config.layer_kinds()) == {"softmax"} and config.mixers["softmax"].cache_dtype == "bfloat16"


def test_bad_flags_say_what_to_fix():
  with pytest.raises(decode.BenchError, match="unknown model 'nope'; use some of sanatan_p1_184m"):
    decode.run(["nope"], batches=[1], contexts=[16], decode_tokens=4)
  with pytest.raises(decode.BenchError, match="8 must exceed --decode_tokens=8"):
    decode.run(["cyfa"], batches=[1], contexts=[8], decode_tokens=8)
  with pytest.raises(decode.BenchError, match=r"--paper_batch=0, .* must all be >= 1, --paper_prefill_chunk"):
    decode.run_paper(["based_1p3b"], batch=0, prompt=8, tokens=4, tiny=True)
  with pytest.raises(decode.BenchError, match="--batches='1,x'"):
    decode.parse_ints("1,x", "batches")
  with pytest.raises(decode.BenchError, match="--decode_xla: unknown 'graphs'; use some of default"):
    decode.run(["cyfa"], batches=[1], contexts=[16], decode_tokens=4, xla=["graphs"])
