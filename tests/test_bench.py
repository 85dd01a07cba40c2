"""The kernel-benchmark library on CPU: rows, ratios, table, and a stopped run that continues."""

import fcntl
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from benchmarks import harness as bench


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


def test_tuning_settings_compute_the_default_kernels_function():
  """Every TUNING setting is a valid call of its kernel (chunk, value tile and warps change only how
  it runs), named by its setting and credited FLOPs at its own chunk; checked on one length-64 case per
  op against the defaults (interpreted off GPU)."""
  for op_name in bench.TUNING:
    args, cases, flops = bench.tuning_cases(op_name, 1, 64, "float32")
    _, defaults, _ = bench.OPS[op_name](1, 64, "float32")
    want = defaults["pallas"](*args)
    assert len(cases) == len(bench.TUNING[op_name])
    for (name, fn), setting in zip(cases.items(), bench.TUNING[op_name]):
      assert name.startswith(f"pallas (C={setting['chunk_size']}, {setting['num_warps']} warps")
      assert flops[name] == bench.chunked_flops(
          1, 64, bench.HEADS, 6 * bench.HEAD_DIM if op_name == "sanatan_p1" else bench.HEAD_DIM,
          bench.HEAD_DIM, chunk=setting["chunk_size"])
      got = fn(*args)
      assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5, (op_name, name)
  with pytest.raises(ValueError, match="no tuning settings for op 'taylor'"):
    bench.tuning_cases("taylor", 1, 64, "float32")


def test_chunk_scan_benchmark_times_every_setting_and_appends_its_table(tmp_path):
  """scripts/bench_chunk_scan.py on CPU (interpreted): one row per setting, timed, then one dated block."""
  out = tmp_path / "BENCH.md"
  script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "bench_chunk_scan.py")
  subprocess.run([sys.executable, script, "--stacks=gated", "--lengths=32", "--tokens=32", "--repeats=1",
                  f"--out={out}"], check=True, capture_output=True, text=True)
  rows = [line for line in out.read_text().splitlines() if line.startswith("| gated | 32 | 1 |")]
  assert len(rows) == 8
  assert all(" — " not in row and row.split(" | ")[4] != "—" for row in rows), rows
  assert "(chunk scan)" in out.read_text()


def test_sanatan_xla_cases_compute_the_reference_function():
  """The XLA cases of the SANATAN benchmarks (chunked at two chunk sizes, chunk_scan, the parallel form
  with its custom VJP, XLA blocked) equal the materialised reference on one fp32 case of 64 tokens."""
  for op_name, names in (("sanatan_p1", ("chunked (xla)", "chunked (xla, C=128)", "chunked_scan (xla)")),
                         ("sanatan_p2", ("parallel (xla)", "blocked (xla)"))):
    args, cases, _ = bench.OPS[op_name](1, 64, "float32")
    want = cases["parallel (reference)"](*args)
    for name in names:
      got = cases[name](*args)
      assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5, (op_name, name)
