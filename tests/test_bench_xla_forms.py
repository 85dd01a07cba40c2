"""scripts/bench_xla_forms.py's library on CPU at toy sizes: every form of every op runs and is compared
with its reference row, a form that cannot run here (no Taylor kernel on a CPU, no flash-linear-attention)
is a row that says why, and a stopped run continues from its JSONL without timing a row again."""

import json

from benchmarks import xla_forms


def test_every_form_runs_beside_its_reference_and_a_rerun_times_nothing_again(tmp_path, monkeypatch):
  jsonl = tmp_path / "bench" / "xla_forms.jsonl"
  found = xla_forms.run(lengths=(64,), tokens=128, dtype="float32", repeats=1, queue=1, tiny=True,
                        jsonl=str(jsonl), command="python scripts/bench_xla_forms.py --tiny")
  by_form = {(r.op, r.form): r for r in found}
  assert list(by_form) == [("sanatan_p1", xla_forms.PLAIN), ("sanatan_p1", "chunked (C=128, remat)"),
                           ("sanatan_p1", "chunked (C=128, no remat)"), ("taylor", "kernel"),
                           ("taylor", "chunked (C=64)"), ("gla", xla_forms.FLA_GLA), ("gla", "chunked")]
  for key in [("sanatan_p1", "chunked (C=128, remat)"), ("sanatan_p1", "chunked (C=128, no remat)")]:
    assert by_form[key].fwdbwd_ms > 0 and by_form[key].vs_reference > 0 and by_form[key].batch == 2
  assert by_form["taylor", "kernel"].note == "no kernel on cpu: 'auto' runs chunked"
  assert by_form["gla", xla_forms.FLA_GLA].note.startswith("skipped: ")
  assert by_form["gla", "chunked"].fwdbwd_ms > 0 and by_form["gla", "chunked"].vs_reference is None
  logged = [json.loads(line) for line in jsonl.read_text().splitlines()]
  assert len(logged) == 7 and {r["device"] for r in logged} == {"cpu: cpu"}
  assert logged[0]["command"] == "python scripts/bench_xla_forms.py --tiny"

  def must_not_run(*args, **kwargs):
    raise AssertionError("a row already timed in the JSONL was timed again")

  monkeypatch.setattr(xla_forms, "jax_times", must_not_run)
  again = xla_forms.run(ops=("sanatan_p1",), lengths=(64,), tokens=128, dtype="float32", repeats=1, queue=1,
                        tiny=True, jsonl=str(jsonl))
  assert [r.fwdbwd_ms for r in again] == [r.fwdbwd_ms for r in found[:3]]
  table = xla_forms.format_table(found)
  assert table.count("\n") == 1 + len(found) and "× plain einsum (C=64) |" in table
