"""scripts/aot_compile.py compiles train steps for a TPU v4-8 (4 chips) on this CPU host with libtpu:
every Mosaic kernel inside its shard_map on a (data 2, fsdp 2) mesh, no activation gathered over the
batch, a clear verdict on memory, the v4 roofline step time, and its records as a Markdown table."""

import os
import re
import subprocess
import sys

import pytest

from lmcore import tpu_slices

if tpu_slices.libtpu_path() is None:
  pytest.skip(tpu_slices.MISSING_LIBTPU, allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def aot(*args):
  return subprocess.run([sys.executable, "scripts/aot_compile.py", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=900)


def batch_all_gathers(hlo: str, seq_len: int) -> list[str]:
  """Floating-point all-gathers along dimension 0 (the batch) of arrays with a sequence dimension."""
  found = []
  for line in hlo.splitlines():
    match = re.search(r"=\s*(\w+)\[([\d,]*)\]\S*\s+all-gather(?:-start)?\(.*dimensions=\{0\}", line)
    dims = set(match.group(2).split(",")) if match else set()
    if match and match.group(1).startswith(("f", "bf")) and {str(seq_len), str(seq_len + 1)} & dims:
      found.append(line.strip()[:160])
  return found


@pytest.mark.slow
def test_every_mosaic_kernel_compiles_for_a_v4_slice_under_shard_map(tmp_path):
  hlo, record = tmp_path / "step.hlo", tmp_path / "aot.jsonl"
  proc = aot("--config=tests/scale/aot_presets.py:kernels", "--topology=v4:2x2x1", f"--hlo={hlo}",
             f"--json={record}", "--peak_buffers=3")
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert re.search(r"4 x TPU v4 \(30.75 GiB each\), mesh data=2 fsdp=2 tensor=1, batch 8 x 384",
                   proc.stdout), proc.stdout
  assert re.search(r"fits with \d+% headroom", proc.stdout) and "FLOPs per device per step" in proc.stdout
  assert "buffers live at the step's peak" in proc.stdout and "| GiB | share | buffers | shape | op |" in proc.stdout
  # The roofline of the v4 chip's peaks, the grad-accumulation loop's body counted per iteration.
  assert re.search(r"roofline step time: [\d.]+ ms per step \((compute|memory)-bound; .* at 275 TFLOP/s and "
                   r"1.20 TB/s", proc.stdout), proc.stdout
  table = aot(f"--table={record}")
  assert table.returncode == 0, table.stderr[-2000:]
  assert re.search(r"\| kernels \| v4:2x2x1 \| .* \| 2 × 4 × 384 \| False \| [\d.]+ / 30.75 GiB \| fits "
                   r"with \d+% headroom \| [\d.]+ \((compute|memory)\) \| [\d,]+ \|", table.stdout), table.stdout
  text = hlo.read_text()
  assert "tpu_custom_call" in text  # the Mosaic kernels themselves, not an XLA stand-in
  assert batch_all_gathers(text, 384) == []


@pytest.mark.slow
def test_a_step_too_large_for_the_slice_does_not_fit_and_exits_1():
  # 2^22 hidden units: over a v4 chip's 30.75 GiB by about 23 GiB (2^21 fits with room to spare).
  proc = aot("--config=tests/scale/aot_presets.py:p2", "--topology=v4-8", "--config.model.mlp_hidden=4194304",
             "--config.mesh.data=4", "--config.mesh.fsdp=1")
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert re.search(r"does not fit by [\d.]+ GiB", proc.stdout), proc.stdout

