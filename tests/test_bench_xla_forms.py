"""scripts/bench_xla_forms.py's library on CPU at toy sizes: every form of every op runs (through the
harness's one timer) and is compared with its reference row, a form that cannot run here (no Taylor
kernel on a CPU, no flash-linear-attention) is a row that says why, and a stopped run continues from its
JSONL without timing a row again."""

import json

from benchmarks import harness, xla_forms


def test_every_form_runs_beside_its_reference_and_a_rerun_times_nothing_again(tmp_path, monkeypatch):
  monkeypatch.setattr(xla_forms, "SANATAN_CHUNKS", (64,))  # one chunk keeps the test short
  jsonl = tmp_path / "bench" / "xla_forms.jsonl"
  T = xla_forms.TINY_LENGTH
  found = xla_forms.run(lengths=(T,), tokens=2 * T, dtype="float32", repeats=1, queue=1, tiny=True,
                        jsonl=str(jsonl), command="python scripts/bench_xla_forms.py --tiny")
  by_form = {(r.op, r.form): r for r in found}
  assert list(by_form) == [
      ("sanatan_p1", xla_forms.plain_name(64)), ("sanatan_p1", "chunked (C=64, remat)"),
      ("sanatan_p1", "chunked (C=64, no remat)"), ("taylor", "kernel"), ("taylor", "chunked (C=128, remat)"),
      ("taylor", "chunked (C=128, no remat)"), ("gla", xla_forms.FLA_GLA), ("gla", "chunked")]
  for remat in ("remat", "no remat"):
    row = by_form["sanatan_p1", f"chunked (C=64, {remat})"]
    assert row.fwdbwd_ms > 0 and row.vs_reference > 0 and row.batch == 2
    assert row.reference == xla_forms.plain_name(64)
  assert by_form["taylor", "kernel"].note == "no kernel on cpu: 'auto' runs chunked"
  assert by_form["taylor", "chunked (C=128, no remat)"].fwdbwd_ms > 0
  assert by_form["gla", xla_forms.FLA_GLA].note.startswith("skipped: ")
  assert by_form["gla", "chunked"].fwdbwd_ms > 0 and by_form["gla", "chunked"].vs_reference is None
  logged = [json.loads(line) for line in jsonl.read_text().splitlines()]
  assert len(logged) == len(found) and {r["device"] for r in logged} == {"cpu: cpu"}
  assert logged[0]["command"] == "python scripts/bench_xla_forms.py --tiny"

  def must_not_run(*args, **kwargs):
    raise AssertionError("a row already timed in the JSONL was timed again")

  monkeypatch.setattr(harness, "time_fwd_bwd", must_not_run)
  again = xla_forms.run(ops=("sanatan_p1",), lengths=(T,), tokens=2 * T, dtype="float32", repeats=1, queue=1,
                        tiny=True, jsonl=str(jsonl))
  assert [r.fwdbwd_ms for r in again] == [r.fwdbwd_ms for r in found[:3]]
  table = xla_forms.format_table(found)
  assert table.count("\n") == 1 + len(found) and "× plain einsum (C=64) |" in table
