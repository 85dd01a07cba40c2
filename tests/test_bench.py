"""The kernel-benchmark library on CPU: rows, ratios, table, and a stopped run that continues."""

import json

from lmcore import bench


def test_rows_are_logged_as_measured_and_not_measured_again(tmp_path, monkeypatch):
  jsonl = tmp_path / "bench" / "kernels.jsonl"
  rows = bench.run_all(ops=["softmax", "gated"], lengths=[64], tokens=128, dtype="float32", repeats=1,
                       fla_ops=["gated"], jsonl=str(jsonl))
  by_impl = {r.impl: r for r in rows}
  assert set(by_impl) == {"softmax (xla)", "pallas (split)", "pallas (fused)", "chunked (xla)",
                          "parallel (reference)"}
  assert by_impl["chunked (xla)"].fwdbwd_ms > 0 and by_impl["chunked (xla)"].batch == 2
  assert by_impl["pallas (split)"].fwdbwd_ms > 0  # interpreted off GPU
  assert by_impl["parallel (reference)"].reference == "gated/chunked (xla)"
  assert by_impl["chunked (xla)"].vs_softmax is not None
  assert len(jsonl.read_text().splitlines()) == 5
  assert json.loads(jsonl.read_text().splitlines()[0])["op"] == "softmax"

  def must_not_run(*args, **kwargs):
    raise AssertionError("a row already in the JSONL was measured again")

  monkeypatch.setattr(bench, "_fwd_and_fwdbwd", must_not_run)
  again = bench.run_all(ops=["softmax", "gated"], lengths=[64], tokens=128, dtype="float32", repeats=1,
                        fla_ops=[], jsonl=str(jsonl))
  assert [(r.impl, r.fwdbwd_ms) for r in again] == [(r.impl, r.fwdbwd_ms) for r in rows]
  table = bench.format_table(again)
  assert table.count("\n") == 1 + len(again) and "| gated | chunked (xla) | 64 | 2 |" in table
