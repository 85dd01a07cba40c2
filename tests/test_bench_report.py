"""scripts/bench_report.py: docs/BENCHMARKS.md is what the records give, every record is cited, each kind
of row renders from a few synthetic rows (references within the run: Transformer++ for the train step
and decode), and a new run directory prints in the same layout."""

import importlib.util
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_report.py")


def _report():
  spec = importlib.util.spec_from_file_location("bench_report", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules["bench_report"] = module  # dataclasses look their module up while the class is made
  spec.loader.exec_module(module)
  return module


report = _report()


def test_committed_benchmarks_md_is_what_the_records_generate():
  with open(report.OUT) as f:
    committed = f.read()
  assert committed == report.generate(), (
      "docs/BENCHMARKS.md differs from its records: run `python scripts/bench_report.py` (numbers are never "
      "edited by hand)")


def test_every_file_in_docs_bench_is_a_cited_record_or_a_readme_with_its_device():
  cited = {os.path.relpath(p, report.BENCH) for pattern in report.OTHER_RECORDS
           for p in report.glob.glob(os.path.join(report.BENCH, pattern))}
  for table in report.TABLES:
    for source in table.sources:
      for pattern in source.files:
        paths = report.glob.glob(os.path.join(report.BENCH, source.directory, pattern))
        assert paths, f"{source.directory}/{pattern} is cited but missing"
        cited |= {os.path.relpath(p, report.BENCH) for p in paths}
      source.device(report.BENCH)  # raises without a README naming the device
  files = {os.path.relpath(os.path.join(d, f), report.BENCH)
           for d, _, names in os.walk(report.BENCH) for f in names}
  readmes = {f for f in files if os.path.basename(f) == "README.md"}
  assert files - readmes == cited, f"records no table cites: {sorted(files - readmes - cited)}"
  directories = {f.split(os.sep)[0] for f in files}
  assert {r.split(os.sep)[0] for r in readmes if r.count(os.sep) == 1} == directories


def test_a_table_without_a_record_is_listed_with_its_command_and_one_source_publishes_it(tmp_path, monkeypatch):
  (tmp_path / "2027-01-01-h100-xla").mkdir()
  (tmp_path / "2027-01-01-h100-xla" / "README.md").write_text("# XLA forms\n\nDevice: gpu: NVIDIA H100\n")
  (tmp_path / "2027-01-01-h100-xla" / "xla_forms.jsonl").write_text(json.dumps(
      {"op": "taylor", "form": "chunked (C=64)", "length": 2048, "batch": 8, "heads": "H=16 K=16 V=64",
       "fwd_ms": 1.0, "fwdbwd_ms": 3.0, "reference": "kernel", "note": ""}) + "\n")
  xla = report.dataclasses.replace(next(t for t in report.TABLES if t.title == "XLA forms"), sources=())
  monkeypatch.setattr(report, "TABLES", (xla,))
  before = report.generate(str(tmp_path))
  assert f"- **XLA forms**: `{xla.command}`" in before and "### XLA forms" not in before
  monkeypatch.setattr(report, "TABLES", (report.dataclasses.replace(xla, sources=(report.Source(
      "2027-01-01-h100-xla", ("xla_forms.jsonl",), "python scripts/bench_xla_forms.py"),)),))
  after = report.generate(str(tmp_path))
  assert "### XLA forms" in after and "Not run on the current code" not in after
  assert "gpu: NVIDIA H100, 2027-01-01: `python scripts/bench_xla_forms.py`" in after
  assert "| Taylor (BASED) | `chunked (C=64)` | H=16 K=16 V=64 | 1.00 / **3.00** |" in after


def _train(preset, params, tokens_per_s, seq_len=2048, mixers="softmax", positions="RoPE", **extra):
  return {"preset": preset, "variant": "", "mixers": mixers, "batch": 32, "seq_len": seq_len, "grad_accum": 1,
          "params": params, "step_ms": 32 * seq_len / tokens_per_s * 1e3 if tokens_per_s else None,
          "tokens_per_s": tokens_per_s, "mfu": 0.4, "compile_s": 30.0, "xla_memory_gib": 20.0,
          "peak_memory_gib": 25.0, "positions": positions, "note": "", **extra}


def test_train_step_divides_by_the_transformer_pp_row_of_its_size_and_length_not_the_table_softmax():
  rows = [_train("softmax_184m", 184e6, 400_000, positions="table"),
          _train("transformer_pp_184m", 182e6, 200_000),
          _train("sanatan_p1_184m", 184e6, 100_000, mixers="sanatan"),
          _train("transformer_pp_360m", 360e6, 80_000),
          _train("based_360m", 362e6, 120_000, mixers="based+softmax"),
          _train("transformer_pp_184m_8k", 182e6, 50_000, seq_len=8192),
          _train("sanatan_p1_184m_8k", 184e6, 100_000, seq_len=8192, mixers="sanatan"),
          _train("based_1p3b", 0, None, mixers="based+softmax",
                 note="XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory")]
  header, table = report.train(rows)
  ratio = {row[0]: row[header.index("vs Transformer++")] for row in table}
  assert ratio == {"softmax_184m": "2.000× transformer_pp_184m", "transformer_pp_184m": "reference",
                   "sanatan_p1_184m": "0.500× transformer_pp_184m", "transformer_pp_360m": "reference",
                   "based_360m": "1.500× transformer_pp_360m", "transformer_pp_184m_8k": "reference",
                   "sanatan_p1_184m_8k": "2.000× transformer_pp_184m_8k", "based_1p3b": ""}
  assert table[-1][header.index("note")] == "out of memory"
  assert "variant" not in header  # no row has one


def test_kernel_table_compares_with_the_ops_xla_form_in_the_run_and_notes_failures():
  def row(op, impl, length, batch, fwd, fwdbwd, note=""):
    return {"op": op, "impl": impl, "length": length, "batch": batch, "fwd_ms": fwd, "fwdbwd_ms": fwdbwd,
            "flops_fwd": 1e9, "note": note, "shape": "", "queue": 8}
  rows = [row("softmax", "softmax (cudnn)", 2048, 8, 0.2, 0.8), row("gated", "chunked (xla)", 2048, 8, 1.0, 4.0),
          row("gated", "pallas_triton", 2048, 8, 0.5, 2.0),
          row("gated", "pallas_triton", 2048, 8, 0.4, 1.0),  # a rerun: the last row of a key wins
          row("gated", "pallas_triton", 8192, 2, None, None, "XlaRuntimeError: RESOURCE_EXHAUSTED: OOM")]
  header, table = report.kernels(rows)
  assert header == ["op", "implementation", "8 × 2048 fwd / fwd+bwd", "2 × 8192 fwd / fwd+bwd"]
  assert table == [["softmax", "`softmax (cudnn)`", "0.20 / **0.80**", ""],
                   ["gated linear attention", "`chunked (xla)`", "1.00 / **4.00**", ""],
                   ["gated linear attention", "`pallas_triton`", "0.40 / **1.00** (4.00×)", "out of memory"]]


def test_references_are_those_of_the_row_writers():
  from benchmarks import harness, tpu_aot

  assert report.KERNEL_REFERENCE == {op: (harness.REFERENCE[op], harness.AUTO_CASES[op][0])
                                     for op in harness.REFERENCE}
  assert report.TPU_REFERENCE == tpu_aot.REFERENCE


def test_agreement_fails_a_kernel_past_both_limits():
  def check(impl, dtype, output, grad, xla_worst=None):
    return {"op": "sanatan_p2", "impl": impl, "reference": "parallel (xla)", "dtype": dtype, "length": 1000,
            "batch": 2, "output_rel": output, "grad_rel": {"d_arg0": grad},
            "limit": {"float32": 1e-5, "bfloat16": 2e-3}[dtype], "xla_worst": xla_worst, "note": ""}
  rows = [check("pallas_flash", "float32", 1e-7, 2e-6), check("pallas_flash", "bfloat16", 2e-3, 5e-3, 9e-3),
          check("pallas_flash (float32)", "bfloat16", 2e-3, 1e-2, 9e-3)]
  _, table = report.agreement(rows)
  assert table == [
      ["SANATAN p = 2", "`pallas_flash`", "`parallel (xla)`", "1.0e-07 / 2.0e-06", "2.0e-03 / 5.0e-03", "9.0e-03",
       "yes"],
      ["SANATAN p = 2", "`pallas_flash (float32)`", "`parallel (xla)`", "", "2.0e-03 / 1.0e-02", "9.0e-03",
       "**no**"]]


def _decode(model, params, tokens_per_s, **extra):
  return {"model": model, "mixers": "", "params": params, "batch": 64, "context": 2048, "position_table": True,
          "grid": "main", "ms_per_token": 64e3 / tokens_per_s, "tokens_per_s": tokens_per_s,
          "state_bytes_per_seq": 2_000_000, "floor_ms": 0.1, "kernels_per_token": 300, "xla": "default",
          "note": "", **extra}


def test_decode_compares_with_the_transformer_pp_of_the_same_size_case_and_program():
  rows = [_decode("transformer_pp_184m", 182e6, 1000), _decode("sanatan_p1_184m", 184e6, 4000),
          _decode("sanatan_p1_184m", 184e6, 5000, xla="graph_loop"),  # no Transformer++ of its program
          _decode("sanatan_p1_184m", 184e6, 900, batch=1),  # nor of its batch
          _decode("transformer_pp_360m", 360e6, 500), _decode("based_360m", 362e6, 2000)]
  header, table = report.decode(rows)
  assert "prefill tokens/ms" not in header and "note" not in header
  ratio = [row[header.index("vs Transformer++")] for row in table]
  assert ratio == ["reference", "4.00× transformer_pp_184m", "", "", "reference", "4.00× transformer_pp_360m"]
  assert table[2][0] == "sanatan_p1_184m [graph_loop]"
  assert table[1][header.index("ms/token (floor)")] == "16.000 (0.100)"


def test_decode_in_the_papers_setting_shows_prefill_and_both_ratios():
  def paper(model, params, tokens_per_s, prefill):
    row = _decode(model, params, tokens_per_s, batch=128, prompt=4096, tokens=1024,
                  prefill_tokens_per_ms=prefill, kernels_per_token=None)
    del row["context"]
    return row
  header, table = report.decode([paper("transformer_pp_1p3b", 1.3e9, 100, 50.0),
                                 paper("based_1p3b", 1.35e9, 2400, 160.0)])
  assert "kernels / token" not in header
  assert table[1][:2] == ["based_1p3b", "128 × 4,096 + 1,024"]
  assert table[1][header.index("prefill tokens/ms")] == "160.0"
  assert table[1][header.index("vs Transformer++")] == "24.00×, prefill 3.20× transformer_pp_1p3b"


def test_xla_forms_and_tpu_rows_compare_with_their_reference():
  form = {"op": "sanatan_p1", "length": 2048, "batch": 8, "heads": "H=12 K=64 V=64", "note": ""}
  _, table = report.xla_forms([{**form, "form": "plain einsum (C=64)", "fwd_ms": 1.0, "fwdbwd_ms": 2.0,
                                "reference": ""},
                               {**form, "form": "chunked (C=128, remat)", "fwd_ms": 1.0, "fwdbwd_ms": 4.0,
                                "reference": "plain einsum (C=64)"}])
  assert table[1][-1] == "1.00 / **4.00** (0.50× `plain einsum (C=64)`)"
  aot = {"op": "taylor", "length": 2048, "batch": 8, "topology": "v4-8", "bound": "memory", "note": "",
         "compile_s": 10.0, "bytes_accessed": 2e9, "temp_bytes": 2 ** 20}
  header, table = report.tpu([{**aot, "impl": "chunked (XLA, C=128)", "roofline_s": 4e-3},
                              {**aot, "impl": "pallas_tpu (Mosaic, C=128)", "roofline_s": 1e-3},
                              {**aot, "impl": "broken", "roofline_s": None, "compile_s": None,
                               "note": "ValueError: no"}])
  assert table == [["Taylor (BASED)", "`chunked (XLA, C=128)`", "4.0 (memory), 2.0, –, 1", "10"],
                   ["Taylor (BASED)", "`pallas_tpu (Mosaic, C=128)`", "1.0 (memory), 2.0, 4.00×, 1", "10"],
                   ["Taylor (BASED)", "`broken`", "not supported", "—"]]


def test_goodput_shows_each_phase_with_its_parts():
  row = {"control": "transformer_pp", "corpus": "embedded", "steps": 1272, "tokens_per_step": 65536,
         "wall_s": 100.0, "goodput": 0.8,
         "phases": {"startup": 5.0, "compile": 6.0, "steps": 80.0, "eval": 9.0},
         "parts": {"eval": {"heldout": 7.0, "plot_writes": 2.0}}}
  header, table = report.goodput([row])
  assert dict(zip(header, table[0])) == {
      "control": "transformer_pp", "corpus": "embedded", "steps": "1,272", "tokens/step": "65,536",
      "wall s": "100", "goodput": "80 %", "startup s": "5.0", "compile s": "6.0", "steps s": "80.0",
      "data wait s": "0.0", "checkpoint s": "0.0", "eval s": "9.0 (heldout 7.0, plot writes 2.0)",
      "shutdown s": "0.0"}


def test_new_run_directory_prints_its_agreement_and_kernel_tables(tmp_path):
  rows = [{"op": "gated", "impl": impl, "length": 2048, "batch": 8, "fwd_ms": fwd, "fwdbwd_ms": fwdbwd,
           "flops_fwd": 1e9, "note": "", "shape": "", "queue": 8}
          for impl, fwd, fwdbwd in (("chunked (xla)", 1.0, 4.0), ("pallas_triton", 0.5, 2.0))]
  (tmp_path / "kernels_2048.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "agreement.jsonl").write_text(json.dumps(
      {"op": "gated", "impl": "pallas_triton", "reference": "chunked (xla)", "dtype": "bfloat16",
       "length": 1000, "batch": 2, "output_rel": 1e-3, "grad_rel": {"d_arg0": 1.5e-3}, "limit": 2e-3,
       "xla_worst": 4e-3, "rounding_floor": 1.7e-3, "note": ""}) + "\n")
  result = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
  assert result.returncode == 0, result.stderr
  assert ("| gated linear attention | `pallas_triton` | `chunked (xla)` |  | 1.0e-03 / 1.5e-03 | 4.0e-03 | yes |"
          in result.stdout)
  assert "| gated linear attention | `pallas_triton` | 0.50 / **2.00** (2.00×) |" in result.stdout


def test_every_pointer_of_the_code_names_a_table_of_the_benchmarks():
  """A comment or docstring citing "(docs/BENCHMARKS.md, <table>)" names a heading that exists, a table
  listed as not run or one listed as measured on earlier code, so the evidence behind a default can be
  found."""
  text = open(report.OUT).read()
  titles = [line[4:].strip() for line in text.splitlines() if line.startswith("### ")]
  titles += [t.title for t in report.TABLES] + [t for ts in report.EARLIER.values() for t in ts]
  titles += list(report.EARLIER)
  pointer = re.compile(r"[(;] ?docs/BENCHMARKS\.md, ([^);]+)[);]")
  missing = []
  for package in ("lmcore", "sanatan_jax", "based_jax", "configs", "benchmarks", "scripts"):
    for root, _, files in os.walk(os.path.join(REPO, package)):
      for name in (f for f in files if f.endswith(".py")):
        path = os.path.join(root, name)
        joined = re.sub(r"\s*\n\s*(#\s*)?", " ", open(path).read())  # comments and docstrings joined
        for title in pointer.findall(joined):
          if not any(t.startswith(title.strip()) for t in titles):
            missing.append(f"{os.path.relpath(path, REPO)}: {title.strip()!r}")
  assert not missing, "pointers to no table of docs/BENCHMARKS.md:\n" + "\n".join(missing)
