"""The kernel-benchmark library on CPU: rows, ratios, table, and a stopped run that continues."""

import fcntl
import json

import pytest

from lmcore import bench


def test_rows_are_logged_as_measured_and_not_measured_again(tmp_path, monkeypatch):
  jsonl = tmp_path / "bench" / "kernels.jsonl"
  rows = bench.run_all(ops=["softmax", "gated"], lengths=[64], tokens=128, dtype="float32", repeats=1,
                       fla_ops=["gated"], jsonl=str(jsonl))
  by_impl = {r.impl: r for r in rows}
  assert set(by_impl) == {"softmax (xla)", "pallas", "chunked (xla)", "parallel (reference)"}
  assert by_impl["chunked (xla)"].fwdbwd_ms > 0 and by_impl["chunked (xla)"].batch == 2
  assert by_impl["pallas"].fwdbwd_ms > 0  # interpreted off GPU
  assert by_impl["parallel (reference)"].reference == "gated/chunked (xla)"
  assert by_impl["chunked (xla)"].vs_softmax is not None
  assert len(jsonl.read_text().splitlines()) == 4
  assert json.loads(jsonl.read_text().splitlines()[0])["op"] == "softmax"

  def must_not_run(*args, **kwargs):
    raise AssertionError("a row already in the JSONL was measured again")

  monkeypatch.setattr(bench, "_fwd_and_fwdbwd", must_not_run)
  again = bench.run_all(ops=["softmax", "gated"], lengths=[64], tokens=128, dtype="float32", repeats=1,
                        fla_ops=[], jsonl=str(jsonl))
  assert [(r.impl, r.fwdbwd_ms) for r in again] == [(r.impl, r.fwdbwd_ms) for r in rows]
  table = bench.format_table(again)
  assert table.count("\n") == 1 + len(again) and "| gated | chunked (xla) | 64 | 2 |" in table


def test_a_failed_row_is_tried_again_and_the_last_row_wins(tmp_path):
  jsonl = str(tmp_path / "kernels.jsonl")
  bench.RowLog(jsonl).add(bench.Row("gated", "pallas (split)", 64, 2, None, None, 0.0, note="XlaRuntimeError: OOM"))
  reloaded = bench.RowLog(jsonl)
  assert not reloaded.has("gated", "pallas (split)", 64)
  reloaded.add(bench.Row("gated", "pallas (split)", 64, 2, 1.0, 3.0, 10.0))
  final = bench.RowLog(jsonl)
  assert final.has("gated", "pallas (split)", 64)
  assert [(r.impl, r.fwdbwd_ms, r.note) for r in final.rows] == [("pallas (split)", 3.0, "")]


def test_exclusive_holds_the_lock_only_inside(tmp_path):
  lock = tmp_path / "bench.lock"
  with bench.exclusive(str(lock)), open(lock) as other:
    with pytest.raises(BlockingIOError):  # a second holder (another process) has to wait
      fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
  with open(lock) as other:
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
