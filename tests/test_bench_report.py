"""scripts/bench_report.py on synthetic JSONL: merged rows (last wins), ratios, one markdown block, a PNG."""

import dataclasses
import json
import os
import subprocess
import sys

from benchmarks import harness as bench

from benchmarks import kernel_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, rows):
  path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))


def _bench_dir(tmp_path):
  tmp_path.mkdir(exist_ok=True)
  Row = bench.Row
  for length, batch in ((2048, 8), (8192, 2)):
    _write(tmp_path / f"kernels_{length}.jsonl", [
        Row("gated", "pallas (split)", length, batch, None, None, 0.0, note="TimeoutError"),
        Row("gated", "chunked (xla)", length, batch, 1.0, 4.0, 1e9),
        Row("softmax", "softmax (cudnn)", length, batch, 0.5, 2.0, 1e9),
        Row("gated", "pallas (split)", length, batch, 0.5, 2.0, 1e9) if length == 2048 else  # a retry: last wins
        Row("gated", "pallas (split)", length, batch, None, None, 0.0, note="XlaRuntimeError: OOM"),
    ])
  _write(tmp_path / "fla.jsonl", [Row("gated", "FLA chunk_gla", 2048, 8, 0.2, 1.0, 1e9)])
  agreement = [kernel_check.Agreement("gated", "pallas (split)", "chunked (xla)", "bfloat16", 1000, 2, 1.0,
                                      {"d_arg0": 1.0}, 2e-3, note="old"),
               kernel_check.Agreement("gated", "pallas (fused)", "chunked (xla)", "bfloat16", 1000, 2, 1e-4,
                                      {"d_arg0": 2e-4}, 2e-3, xla_worst=3e-3),
               kernel_check.Agreement("gated", "pallas (split)", "chunked (xla)", "bfloat16", 1000, 2, 1e-4,
                                      {"d_arg0": 5e-4}, 2e-3, xla_worst=3e-3)]
  _write(tmp_path / "agreement.jsonl", agreement)
  (tmp_path / "train_step.jsonl").write_text(json.dumps({"preset": "softmax_184m", "tok_s": 1.0}) + "\n")
  return tmp_path


def test_rows_merge_last_wins_sorted_with_ratios(tmp_path):
  rows = bench.with_ratios(bench.load_rows(str(_bench_dir(tmp_path))))
  assert [(r.length, r.op, r.impl) for r in rows] == [
      (2048, "softmax", "softmax (cudnn)"), (2048, "gated", "pallas (split)"), (2048, "gated", "chunked (xla)"),
      (2048, "gated", "FLA chunk_gla"),
      (8192, "softmax", "softmax (cudnn)"), (8192, "gated", "pallas (split)"), (8192, "gated", "chunked (xla)")]
  by_key = {(r.impl, r.length): r for r in rows}
  pallas = by_key["pallas (split)", 2048]
  assert pallas.fwdbwd_ms == 2.0 and pallas.note == ""
  assert pallas.reference == "gated/chunked (xla)" and pallas.ratio_fwdbwd == 2.0 and pallas.vs_softmax == 1.0
  assert by_key["FLA chunk_gla", 2048].ratio_fwdbwd == 4.0
  failed = by_key["pallas (split)", 8192]
  assert failed.fwdbwd_ms is None and failed.ratio_fwdbwd is None and failed.note == "XlaRuntimeError: OOM"
  agreement = kernel_check.load_latest(str(tmp_path / "agreement.jsonl"))
  assert [(r.impl, r.note, r.passed) for r in agreement] == [("pallas (split)", "", True), ("pallas (fused)", "", True)]


def test_script_appends_one_block_with_both_tables_and_writes_the_plot(tmp_path):
  directory = _bench_dir(tmp_path / "run")
  out = tmp_path / "docs" / "BENCHMARKS.md"
  out.parent.mkdir()
  out.write_text("# Benchmarks\n\nearlier blocks\n")
  result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_report.py"), str(directory),
                           f"--out={out}", "--date=2030-01-02", "--device=NVIDIA H200"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 0, result.stderr
  assert f"skipped {directory / 'train_step.jsonl'}: not kernel timing rows" in result.stdout
  text = out.read_text()
  assert text.startswith("# Benchmarks\n\nearlier blocks\n") and text.count("\n## ") == 1
  block = text.split("\n## ", 1)[1]
  assert block.startswith("2030-01-02 — kernels on NVIDIA H200 (scripts/bench_gpu.sh)\n")
  assert f"`bash scripts/bench_gpu.sh {directory}`" in block and "bench_report.py" in block
  assert block.index("| op | kernel | vs (fp32) |") < block.index("| op | implementation | T |")
  assert "| gated | pallas (split) | chunked (xla) | bfloat16 | 1000 | 2 | 1.0e-04 | 5.0e-04 |" in block
  assert "| gated | pallas (split) | 2048 | 8 | 0.500 | 2.000 | 8,192,000 | 1.5 | 2.00× gated/chunked (xla) | 1.00× |" in block
  assert "| gated | pallas (split) | 8192 | 2 | — | — | — | — |  |  | XlaRuntimeError: OOM |" in block
  assert block.count("| softmax | softmax (cudnn) |") == 2 and "old" not in block and "TimeoutError" not in block
  png = out.parent / "bench_kernels.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
