"""benchmarks/memory_plan.py reads the buffers live at a compiled program's peak from XLA's dumps."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_peak_groups_buffers_by_the_op_that_made_them_and_their_shape(tmp_path):
  """A jitted gradient of sum(tanh(x @ w)) over [512, 256] x [256, 1024]: at its peak the [512, 1024]
  product (kept for tanh's derivative) is live, named by its JAX op, and both arguments, as one group;
  the groups add up to the peak."""
  code = textwrap.dedent(f"""
      import os
      os.environ["XLA_FLAGS"] = "--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=.*step.*"
      import jax, jax.numpy as jnp
      from benchmarks import memory_plan

      def step(x, w):
        return jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)

      jax.jit(step).lower(jax.ShapeDtypeStruct((512, 256), jnp.float32),
                          jax.ShapeDtypeStruct((256, 1024), jnp.float32)).compile()
      total, groups = memory_plan.peak_buffers("{tmp_path}", "step")
      assert total == sum(g.bytes for g in groups), (total, groups)
      big = [g for g in groups if g.shape == "f32[512,1024]"]
      assert big and big[0].bytes >= 512 * 1024 * 4 and big[0].op, groups
      arguments = [g for g in groups if g.op == memory_plan.ARGUMENTS]
      assert [(g.count, g.bytes) for g in arguments] == [(2, (512 * 256 + 256 * 1024) * 4)], groups
      print(memory_plan.table(total, groups, top=3))
  """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("peak: ") and lines[2] == "| GiB | share | buffers | shape | op |", proc.stdout
