"""The backend probe on CPU: both Pallas kernels interpreted against the fp32 reference, both lowered for
a CUDA GPU, and scripts/bench_backends.py's rows (interpreted run, errors and hung children as rows)."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import backend_probe as probe
from lmcore.ops.common import pallas_utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_backends.py")
_spec = importlib.util.spec_from_file_location("bench_backends", SCRIPT)
bench_backends = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_backends)

BH, T = 3, 128  # an odd batch·heads, two chunks


def _rel_l2(o, ref):
  return float(jnp.linalg.norm(o.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


@pytest.fixture(scope="module")
def qkv_and_reference():
  args = bench_backends.inputs(BH, T)
  return args, probe.intra_chunk_reference(*args)


def test_reference_is_causal_within_chunks_only():
  q, k, v = (jnp.ones((1, 2 * probe.CHUNK, 64), jnp.float32) for _ in range(3))
  o = probe.intra_chunk_reference(q, k, v)
  rows_seen = o[0, :, 0] / 64  # row i of a chunk sums i + 1 value rows, each scored 64
  assert jnp.array_equal(rows_seen, jnp.tile(jnp.arange(1, probe.CHUNK + 1), 2))


@pytest.mark.parametrize("op", [probe.intra_chunk_xla,
                                lambda q, k, v: probe.intra_chunk_triton(q, k, v, interpret=True),
                                lambda q, k, v: probe.intra_chunk_mosaic(q, k, v, interpret=True)],
                         ids=["xla", "triton", "mosaic_gpu"])
def test_interpreted_kernels_agree_with_the_reference(op, qkv_and_reference):
  args, ref = qkv_and_reference
  o = op(*args)
  assert o.shape == args[2].shape and o.dtype == jnp.bfloat16
  assert _rel_l2(o, ref) < 5e-3  # bf16 rounding of the scores and the output only
  assert _rel_l2(o, ref) == pytest.approx(_rel_l2(probe.intra_chunk_xla(*args), ref), rel=0.05)


@pytest.mark.parametrize("scores_in_smem", [True, False])
def test_mosaic_kernel_lowers_for_a_cuda_gpu(scores_in_smem):
  """Pallas -> Mosaic GPU, layout inference and the MGPU dialect lowering run on the host (sm_90 assumed);
  the passes to PTX run only in the GPU's XLA compiler."""
  arg = jax.ShapeDtypeStruct((BH, T, 64), jnp.bfloat16)
  fn = lambda q, k, v: probe.intra_chunk_mosaic(q, k, v, scores_in_smem=scores_in_smem)
  assert "mosaic_gpu_v2" in pallas_utils.lower_for_gpu(fn, arg, arg, arg).as_text()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_triton_kernel_lowers_for_a_cuda_gpu():
  arg = jax.ShapeDtypeStruct((BH, T, 64), jnp.bfloat16)
  assert "xla.gpu.triton" in pallas_utils.lower_for_gpu(probe.intra_chunk_triton, arg, arg, arg).as_text()


def test_interpreted_run_writes_a_row_per_backend(tmp_path):
  jsonl = tmp_path / "rows.jsonl"
  result = subprocess.run([sys.executable, SCRIPT, "--interpret", "--repeats=1", f"--jsonl={jsonl}"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
  assert result.returncode == 0, result.stderr[-2000:]
  rows = {r["backend"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
  assert list(rows) == bench_backends.BACKENDS
  for name in ("xla", "triton", "mosaic_gpu"):
    assert rows[name]["status"] == "ok" and rows[name]["ms"] > 0 and rows[name]["rel_l2"] < 5e-3, rows[name]
    assert (rows[name]["length"], rows[name]["bh"]) == (T, BH)
  assert rows["mosaic_gpu_regs"]["status"] == "skipped" and "SMEM" in rows["mosaic_gpu_regs"]["note"]
  assert "| mosaic_gpu | 128 | 3 |" in result.stdout


def test_failures_become_rows(qkv_and_reference):
  args, ref = qkv_and_reference
  bad_chunk = lambda q, k, v: probe.intra_chunk_triton(q, k, v, chunk=48, interpret=True)
  row = bench_backends.measure("triton", bad_chunk, args, ref, T, BH, repeats=1)
  assert row.status == "error" and row.note.startswith("ValueError: need q, k") and "\n" not in row.note
  hung = bench_backends.run_isolated(["xla"], [T, 2 * T], BH * T, 1, True, timeout=0.01)
  assert [(r.length, r.status) for r in hung] == [(T, "error"), (2 * T, "error")]
  assert all("killed after 0.01 s" in r.note for r in hung)
