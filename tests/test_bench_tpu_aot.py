"""scripts/bench_tpu_aot.py compiles the attention ops for a TPU v4-8 on this CPU host with libtpu and
reports the compiler's costs: the Mosaic kernels' own estimates reach the compiled program, loop
bodies are counted once per iteration, and a stopped run continues from its JSONL."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from benchmarks import tpu_aot
from lmcore.errors import UserError
from lmcore import tpu_slices
from lmcore.ops.common import pallas_utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# libtpu takes a machine-wide lock when it loads; other JAX processes would make the compile fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _needs_libtpu():
  if tpu_slices.libtpu_path() is None:
    pytest.skip(tpu_slices.MISSING_LIBTPU)


def test_pipeline_bytes_counts_a_block_each_time_its_index_moves():
  grid = (3, 2, 4)  # (batch·head, value tile, chunk)
  x = jax.ShapeDtypeStruct((3, 512, 256), jnp.bfloat16)
  per_chunk = pl.BlockSpec((None, 128, 128), lambda bh, j, n: (bh, 3 - n, j))  # reversed sweep too
  per_tile = pl.BlockSpec((None, 128, 128), lambda bh, j, n: (bh, 0, j))  # a carried state
  whole = pl.BlockSpec((512, 256), lambda bh, j, n: (0, 0))
  block = 128 * 128 * 2
  assert pallas_utils.pipeline_bytes(grid, [per_chunk], [x]) == 24 * block
  assert pallas_utils.pipeline_bytes(grid, [per_tile], [x]) == 6 * block
  assert pallas_utils.pipeline_bytes(grid, [whole], [x]) == 512 * 256 * 2


def test_bad_options_are_one_line_user_errors():
  with pytest.raises(UserError, match="--ops: unknown op.*choose from sanatan_p1"):
    tpu_aot.check_options(ops=["softmax"], batch=8, dtype="bfloat16")
  with pytest.raises(UserError, match="--batch=0"):
    tpu_aot.check_options(ops=["gated"], batch=0, dtype="bfloat16")
  with pytest.raises(UserError, match="--lengths=2k"):
    tpu_aot.parse_lengths(["2k"])


def test_a_scan_of_n_matmuls_is_counted_as_n_matmuls():
  """XLA's cost analysis counts a while body once; ``analyse`` multiplies it by the trip count."""
  _needs_libtpu()
  mesh = jax.sharding.Mesh(tpu_slices.tpu_devices("v4-8")[:1], (tpu_aot.DATA,))
  x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)

  def scanned(a, b):
    return jax.lax.scan(lambda c, _: ((c @ b).astype(c.dtype), None), a, None, length=12)[0]

  case = tpu_aot.Case("scan", "matmuls", scanned, (x, x), (False, False))
  compiled, _ = tpu_aot.compile_fwdbwd(case, mesh)
  row = tpu_aot.analyse(tpu_aot.Result("scan", "matmuls", 0, 1, "v4-8", 1), compiled, tpu_aot.CHIPS["TPU v4"])
  assert row.loops and all(n == 12 for n in row.loops) and row.loops_counted
  # Forward: 12 matmuls; backward: 2 per step (with respect to c and to b).
  matmul = 2 * 256 ** 3
  assert row.xla_flops < 12 * matmul < 36 * matmul <= row.flops < 37 * matmul


def test_script_reports_kernel_estimates_and_xla_forms_and_a_rerun_compiles_nothing(tmp_path, monkeypatch):
  _needs_libtpu()
  jsonl, out = tmp_path / "tpu_aot.jsonl", tmp_path / "BENCHMARKS.md"
  command = [sys.executable, "scripts/bench_tpu_aot.py", "--ops=gated", "--lengths=256", "--batch=1",
             f"--jsonl={jsonl}", f"--out={out}"]
  proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {row["impl"]: row for row in map(json.loads, jsonl.read_text().splitlines())}
  kernel, xla = rows["pallas_tpu (Mosaic, C=128)"], rows["chunked (XLA, C=64)"]
  assert kernel["devices"] == 4 and kernel["device_kind"] == "TPU v4" and not kernel["note"]
  # The Mosaic kernels' estimate: 12 heads x 2 chunks of 128 per chip, K and V padded to 128 lanes;
  # per step 4, 6 and 11 dots of 2·128³ (forward, dq, dk/dv; the backward's state products in two
  # bf16 parts: two dots each, three for dv's); the compiler's count includes it.
  assert kernel["kernel_flops"] == 12 * 2 * 21 * 2 * 128 ** 3 <= kernel["xla_flops"]
  assert 0 < kernel["kernel_bytes"] < kernel["bytes_accessed"] and kernel["loops"] == []
  # XLA chunked scans over 4 chunks of 64 (the forward, its recomputation in the backward and the
  # backward): those bodies count 4 times.
  assert xla["kernel_flops"] == 0 and xla["loops"] == [4, 4, 4] and xla["loops_counted"]
  assert xla["flops"] > xla["xla_flops"] and xla["roofline_s"] > 0
  text = out.read_text()
  assert "compile-time cost of the attention ops on 4 × TPU v4 (v4-8) (AOT on a CPU host)" in text
  assert "| gated | pallas_tpu (Mosaic, C=128) | 256 | 1 |" in text and "kernel estimate (" in text
  assert "| gated | chunked (XLA, C=64) | 256 | 1 |" in text and "| 1.00× |" in text

  def must_not_compile(*args, **kwargs):
    raise AssertionError("a row already in the JSONL was compiled again")

  monkeypatch.setattr(tpu_aot, "measure", must_not_compile)
  again = tpu_aot.run(ops=["gated"], lengths=[256], batch=1, devices=[_FakeV4()] * 4, topology="v4-8",
                      jsonl=str(jsonl))
  assert [r.impl for r in again] == list(rows)


class _FakeV4:
  """Stands in for a TPU v4 device where nothing is compiled."""

  device_kind = "TPU v4"
