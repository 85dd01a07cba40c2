"""The entry points' default XLA flags: added once, never over a user's own setting."""

import os
import subprocess
import sys

from lmcore import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_are_added_once_and_a_users_flag_wins():
  env = {}
  xla_flags.apply_defaults(env)
  assert env["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
  xla_flags.apply_defaults(env)  # idempotent
  assert env["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true"}
  xla_flags.apply_defaults(env)
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true"


def test_the_entry_points_runner_sets_them_before_main():
  """``cli.run`` (train.py, eval.py, ...) sets them before main, where JAX starts (a CPU backend
  accepts the GPU flag)."""
  code = ("import os, jax; from lmcore import cli;"
          "cli.run(lambda argv: print('FLAGS=' + os.environ['XLA_FLAGS'], jax.numpy.ones(2).sum()))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert "FLAGS=--xla_gpu_enable_triton_gemm=false 2.0" in proc.stdout, proc.stderr[-2000:]
