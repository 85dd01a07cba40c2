"""Sweeps are grids of overrides: parsing, naming, and a two-point run that tabulates and plots."""

import os
import subprocess
import sys

import pytest

from lmcore import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_grid_is_the_product_of_the_axes():
  points = sweep.grid(["model.d_model=32,48", "train.learning_rate=1e-3"])
  assert points == [{"model.d_model": "32", "train.learning_rate": "1e-3"},
                    {"model.d_model": "48", "train.learning_rate": "1e-3"}]
  assert sweep.point_name(points[1]) == "d_model=48_learning_rate=1e-3"
  with pytest.raises(ValueError, match="KEY=V1,V2"):
    sweep.parse_axis("model.d_model")


@pytest.mark.slow
def test_two_point_sweep_writes_table_and_plot(tmp_path):
  root = tmp_path / "sweep"
  cmd = [sys.executable, "scripts/sweep.py", "--config=configs/baselines.py:tiny", f"--root={root}",
         "--sweep=train.learning_rate=1e-3,1e-2", "--",
         "--config.train.steps=3", "--config.model.d_model=32", "--config.model.mlp_hidden=64",
         "--config.model.mixers.softmax.n_heads=2", "--config.data.seq_len=32",
         "--config.train.batch_size=4", "--config.data.heldout.num_sequences=4",
         "--config.eval.batch_size=4", "--config.wandb.mode=disabled"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  table = (root / "sweep_results.md").read_text()
  assert "| 1e-3 |" in table and "| 1e-2 |" in table
  assert (root / "sweep_results.png").stat().st_size > 1000
  assert (root / "learning_rate=1e-2" / "eval_3.json").exists()
