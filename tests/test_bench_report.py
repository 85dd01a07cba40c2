"""scripts/bench_report.py: docs/BENCHMARKS.md is what the records give, every record is cited, old
implementation names are mapped, and a new run directory prints in the same layout."""

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
  cited = set(report.OTHER_RECORDS)
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


def _row(op, impl, length, batch, fwd, fwdbwd, **extra):
  return {"op": op, "impl": impl, "length": length, "batch": batch, "fwd_ms": fwd, "fwdbwd_ms": fwdbwd,
          "flops_fwd": 1e9, "note": "", "shape": "", "queue": 8, **extra}


def test_kernel_table_maps_old_names_drops_deleted_kernels_and_compares_within_the_run():
  rows = [_row("softmax", "softmax (cudnn)", 2048, 8, 0.2, 0.8),
          _row("gated", "chunked (xla)", 2048, 8, 1.0, 4.0),
          _row("gated", "pallas", 2048, 8, 0.5, 2.0),
          _row("gated", "pallas", 2048, 8, 0.4, 1.0),  # a rerun: the last row of a key wins
          _row("taylor", "pallas", 2048, 8, 0.5, 2.0),  # the deleted Triton chunked kernel
          _row("taylor", "chunked (xla)", 2048, 8, 1.0, 3.0),
          _row("gated", "pallas", 8192, 2, None, None, note="XlaRuntimeError: RESOURCE_EXHAUSTED: OOM")]
  header, table = report.kernel_table(report.kernel_rows(rows))
  assert header == ["op", "implementation", "8 × 2048 fwd / fwd+bwd", "2 × 8192 fwd / fwd+bwd"]
  assert table == [["softmax", "`cuDNN`", "0.20 / **0.80**", ""],
                   ["gated linear attention", "`chunked`", "1.00 / **4.00**", ""],
                   ["gated linear attention", "`pallas_triton`", "0.40 / **1.00** (4.00×)", "out of memory"],
                   ["Taylor (BASED)", "`chunked`", "1.00 / **3.00**", ""]]


def test_agreement_keeps_a_deleted_reference_and_fails_a_kernel_past_both_limits():
  def check(impl, dtype, output, grad, xla_worst=None):
    return {"op": "sanatan_p2", "impl": impl, "reference": "blocked (xla)", "dtype": dtype, "length": 1000,
            "batch": 2, "output_rel": output, "grad_rel": {"d_arg0": grad},
            "limit": {"float32": 1e-5, "bfloat16": 2e-3}[dtype],
            "xla_worst": xla_worst, "rounding_floor": None, "note": ""}
  rows = [check("pallas_flash", "float32", 1e-7, 2e-6), check("pallas_flash", "bfloat16", 2e-3, 5e-3, 9e-3),
          check("pallas", "bfloat16", 1e-3, 1e-3, 9e-3),  # the deleted blocked Triton kernel
          check("pallas_flash (xla features)", "bfloat16", 2e-3, 1e-2, 9e-3)]
  _, table = report.agreement((("sanatan_p2",),))([rows])
  reference = f"`{report.REFERENCE_NAMES['sanatan_p2', 'blocked (xla)']}`"
  assert table == [
      ["SANATAN p = 2", "`pallas_flash`", reference, "1.0e-07 / 2.0e-06", "2.0e-03 / 5.0e-03", "9.0e-03",
       "yes"],
      ["SANATAN p = 2", "`pallas_flash, XLA's features`", reference, "", "2.0e-03 / 1.0e-02", "9.0e-03",
       "**no**"]]


def test_new_run_directory_prints_its_agreement_and_kernel_tables(tmp_path):
  (tmp_path / "kernels_2048.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
      _row("softmax", "softmax (cudnn)", 2048, 8, 0.2, 0.8), _row("gated", "chunked", 2048, 8, 1.0, 4.0),
      _row("gated", "pallas_triton", 2048, 8, 0.5, 2.0))))
  (tmp_path / "agreement.jsonl").write_text(json.dumps(
      {"op": "gated", "impl": "pallas_triton", "reference": "chunked", "dtype": "bfloat16", "length": 1000,
       "batch": 2, "output_rel": 1e-3, "grad_rel": {"d_arg0": 1.5e-3}, "limit": 2e-3, "xla_worst": 4e-3,
       "rounding_floor": 1.7e-3, "note": ""}) + "\n")
  result = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
  assert result.returncode == 0, result.stderr
  assert "| gated linear attention | `pallas_triton` | `chunked` |  | 1.0e-03 / 1.5e-03 | 4.0e-03 | yes |" \
      in result.stdout
  assert "| gated linear attention | `pallas_triton` | 0.50 / **2.00** (2.00×) |" in result.stdout


def test_every_pointer_of_the_code_names_a_table_of_the_benchmarks():
  """A comment or docstring citing "(docs/BENCHMARKS.md, <table>)" names a heading that exists, so the
  evidence behind a default can be found."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  headings = [line[4:].strip() for line in open(os.path.join(repo, "docs", "BENCHMARKS.md"))
              if line.startswith("### ")]
  pointer = re.compile(r"[(;] ?docs/BENCHMARKS\.md, ([^);]+)[);]")
  missing = []
  for package in ("lmcore", "sanatan_jax", "based_jax", "configs", "benchmarks", "scripts"):
    for root, _, files in os.walk(os.path.join(repo, package)):
      for name in (f for f in files if f.endswith(".py")):
        path = os.path.join(root, name)
        text = re.sub(r"\s*\n\s*(#\s*)?", " ", open(path).read())  # comments and docstrings joined
        for title in pointer.findall(text):
          if not any(h.startswith(title.strip()) for h in headings):
            missing.append(f"{os.path.relpath(path, repo)}: {title.strip()!r}")
  assert not missing, "pointers to no table of docs/BENCHMARKS.md:\n" + "\n".join(missing)
