"""The kernel agreement check on CPU (kernels interpreted): rows, limits, resumable JSONL, table."""

import os
import subprocess
import sys

from benchmarks import kernel_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gated_kernels_agree_with_xla_and_rows_are_not_checked_twice(tmp_path, monkeypatch):
  jsonl = tmp_path / "agreement.jsonl"
  rows = kernel_check.run(ops=["gated"], dtypes=["float32"], length=40, batch=1, jsonl=str(jsonl))
  assert [r.impl for r in rows] == ["pallas_triton"]
  for r in rows:
    assert r.reference == "chunked (xla)" and set(r.grad_rel) == {"d_arg0", "d_arg1", "d_arg2", "d_arg3"}
    assert r.passed and r.worst <= kernel_check.LIMITS["float32"], r

  def must_not_run(*args, **kwargs):
    raise AssertionError("an (op, dtype) already in the JSONL was checked again")

  monkeypatch.setattr(kernel_check, "check_op", must_not_run)
  again = kernel_check.run(ops=["gated"], dtypes=["float32"], length=40, batch=1, jsonl=str(jsonl))
  assert [(r.impl, r.worst) for r in again] == [(r.impl, r.worst) for r in rows]
  assert "| gated | pallas_triton | chunked (xla) | float32 | 40 | 1 |" in kernel_check.format_table(again)
  assert all(r.xla_worst is None for r in again)  # only bf16 rows measure the XLA path's own error


def test_a_kernel_that_disagrees_fails_its_row():
  wrong = kernel_check.Agreement("op", "pallas", "xla", "bfloat16", 8, 1, 1e-3, {"d_arg0": 5e-3},
                                 kernel_check.LIMITS["bfloat16"], xla_worst=4e-3)
  assert wrong.worst == 5e-3 and not wrong.passed
  as_good_as_xla = kernel_check.Agreement("op", "pallas", "xla", "bfloat16", 8, 1, 1e-3, {"d_arg0": 5e-3},
                                          kernel_check.LIMITS["bfloat16"], xla_worst=6e-3)
  assert as_good_as_xla.passed  # over 2e-3, but below XLA's own bf16 error
  failed = kernel_check.Agreement("op", "pallas", "xla", "float32", 8, 1, None, None, 1e-5, note="boom")
  assert failed.worst is None and not failed.passed


def test_the_rounding_floor_is_what_bf16_rounding_alone_costs():
  import jax
  import jax.numpy as jnp

  exact = jnp.array([1.0, 0.5, -2.0, 3.0])  # representable in bf16: no rounding error
  assert kernel_check.rounding_floor(exact, (exact,), "bfloat16") == 0.0
  x = jax.random.normal(jax.random.key(0), (4096,))
  floor = kernel_check.rounding_floor(exact, (x,), "bfloat16")
  assert 1e-3 < floor < 2.5e-3  # bf16 keeps 8 significant bits: about 2^-9 relative, on average


def test_an_unknown_dtype_is_one_line_not_a_traceback():
  result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "check_kernels.py"), "--ops=taylor",
                           "--dtypes=bfloat16,float16"], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
  assert result.stderr.strip().splitlines()[-1] == ("error: --dtypes: unknown 'float16'; use some of float32, "
                                                   "bfloat16"), result.stderr
