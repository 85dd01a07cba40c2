"""The README's main command, shortened: both stages, the unadapted readout, the paired table; then
``eval.py`` on the result (sample from a prompt, p = 2 readout) and a rerun that resumes. The three
processes share a persistent compilation cache of their own (every program, however quick to compile):
the rerun and ``eval.py`` load the evaluation programs the first process compiled."""

import json
import os
import subprocess
import sys

import pytest

from process_cases import compilation_cache_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--stage1_steps=4", "--stage2_steps=2"]


def run(cmd, cache):
  env = {**os.environ, "WANDB_MODE": "disabled", **compilation_cache_env(cache)}
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
  assert proc.returncode == 0, f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"
  return proc.stdout


@pytest.mark.slow
def test_two_stage_quickstart_prints_the_table_and_resumes(tmp_path):
  workdir, cache = tmp_path / "qs", tmp_path / "jax_cache"
  out = run([sys.executable, "scripts/quickstart.py", f"--workdir={workdir}", *SHORT], cache)
  assert "| stage 1 read out at p = 1, no adaptation |" in out
  results = json.load(open(workdir / "results.json"))
  stage2 = results["stage2"]
  assert abs(stage2["paired_diff"]) <= 1e-4 and stage2["max_abs_dlogit"] <= 1e-4
  # Two computations of one function: the recurrent (constant-state) form against the parallel one.
  assert "paired_skipped" not in stage2
  assert stage2["loss_recurrent"] == pytest.approx(stage2["loss_parallel"], abs=1e-4)
  assert stage2["paired_diff"] == pytest.approx(stage2["loss_recurrent"] - stage2["loss_parallel"], abs=1e-7)
  assert os.path.exists(workdir / "stage1_p2" / "eval_4.json")
  assert os.path.exists(workdir / "stage1_p2" / "readout_p1" / "eval_4.json")
  gate_layers = [json.loads(l) for l in open(workdir / "stage2_p1" / "gate_stats_2.jsonl")]
  assert len(gate_layers) == 4 and all(0 <= g["mismatch_fraction"] <= 1 for g in gate_layers)

  again = run([sys.executable, "scripts/quickstart.py", f"--workdir={workdir}", *SHORT], cache)
  assert "Resumed from step 4" in again and "Resumed from step 2" in again

  sample = run([sys.executable, "eval.py", "--config=configs/sanatan.py:tiny_p1_adapt",
                f"--workdir={workdir / 'stage2_p1'}", "--prompt=def ", "--max_new_tokens=8",
                f"--out_dir={tmp_path / 'eval_out'}"], cache)
  assert "--- sample ---" in sample and os.path.exists(tmp_path / "eval_out" / "eval_2.json")
