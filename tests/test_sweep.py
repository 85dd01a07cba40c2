"""Sweeps are grids of overrides: parsing, naming, fixed ``--config.*`` overrides passed to every point
as typed, axes checked against the preset before anything runs, skipping finished points, diverged
points recorded and the grid continued, and a real two-point run from another directory that tabulates
and plots."""

import json
import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from lmcore import cli, sweep
from lmcore.errors import ConfigError, Diverged, WorkdirInUse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_grid_is_the_product_of_the_axes():
  points = sweep.grid(["model.d_model=32,48", "train.learning_rate=1e-3"])
  assert points == [{"model.d_model": "32", "train.learning_rate": "1e-3"},
                    {"model.d_model": "48", "train.learning_rate": "1e-3"}]
  assert sweep.point_name(points[1]) == "d_model=48_learning_rate=1e-3"
  with pytest.raises(ValueError, match="KEY=V1,V2"):
    sweep.parse_axis("model.d_model")


def parsed(argv: list[str]) -> flags.FlagValues:
  """Fresh flags with a ``--config`` flag, parsed from ``argv`` (as scripts/sweep.py's are)."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
  flags.DEFINE_multi_string("sweep", [], "", flag_values=values)
  values(argv)
  return values


def test_fixed_overrides_are_passed_on_as_typed_one_argument_each():
  config = os.path.join(REPO, "configs", "baselines.py") + ":tiny"
  argv = ["sweep.py", f"--config={config}", "--sweep=train.learning_rate=1e-3,3e-3",
          "--config.train.steps=10", "--config.data.seq_len", "32", "--noconfig.model.remat", "--",
          "--config.train.seed=3"]
  values = parsed(argv)
  assert values.config.train.steps == 10 and values.config.data.seq_len == 32
  assert cli.config_overrides(argv[1:], values) == [
      "--config.train.steps=10", "--config.data.seq_len=32", "--noconfig.model.remat"]
  assert [cli.override_key(a) for a in cli.config_overrides(argv[1:], values)] == [
      "train.steps", "data.seq_len", "model.remat"]


def test_an_axis_the_preset_lacks_or_that_is_also_fixed_fails_before_anything_runs():
  values = parsed(["sweep.py", f"--config={os.path.join(REPO, 'configs', 'baselines.py')}:tiny"])
  sweep.check_axes(["train.learning_rate=1e-3,3e-3"], ["--config.train.steps=10"], values.config)
  with pytest.raises(ConfigError, match=r"unknown key 'config.train.learnig_rate'. "
                                        r"Did you mean 'config.train.learning_rate'"):
    sweep.check_axes(["train.learnig_rate=1e-3"], [], values.config)
  with pytest.raises(ConfigError, match=r"--sweep train.steps=... and --config.train.steps both set"):
    sweep.check_axes(["train.steps=5,10"], ["--config.train.steps=10"], values.config)


def fake_train(outcomes: dict[str, int], calls: list[str]):
  """A stand-in for train.py: exit code per learning rate; a successful run writes its eval file."""
  def run(args):
    workdir = next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
    lr = next(a.split("=", 1)[1] for a in args if a.startswith("--config.train.learning_rate="))
    calls.append(lr)
    code = outcomes[lr]
    if code == 0:
      os.makedirs(workdir, exist_ok=True)
      with open(os.path.join(workdir, "eval_3.json"), "w") as f:
        json.dump({"loss": 4.25, "perplexity": 70.1, "step": 3}, f)
    return code, {Diverged.exit_code: "Diverged: loss is nan at step 2.", 1: "Boom: a crash",
                  WorkdirInUse.exit_code: f"WorkdirInUse: {workdir} is in use by pid 1"}.get(code, "")
  return run


def test_finished_and_diverged_points_are_skipped_and_failures_retried(tmp_path, monkeypatch):
  calls = []
  outcomes = {"1e-3": 0, "1e-1": Diverged.exit_code, "1e-2": 1}
  monkeypatch.setattr(sweep, "_run_train", fake_train(outcomes, calls))
  monkeypatch.setattr(sweep, "plot", lambda *_: None)
  text, results = sweep.run_sweep("configs/baselines.py:tiny", ["train.learning_rate=1e-3,1e-1,1e-2"],
                                  str(tmp_path), ["--config.train.steps=3"])
  assert calls == ["1e-3", "1e-1", "1e-2"], "the grid continues past a diverged and a failed point"
  assert [r.status for r in results] == ["done", "diverged", "failed"]
  assert "| 1e-3 | 4.2500 | 70.10 | 3 | ok |" in text
  assert "| 1e-1 | — | — | — | **DIVERGED**: Diverged: loss is nan at step 2. |" in text
  assert "**FAILED**: Boom: a crash" in text
  calls.clear()
  outcomes["1e-2"] = 0
  text, results = sweep.run_sweep("configs/baselines.py:tiny", ["train.learning_rate=1e-3,1e-1,1e-2"],
                                  str(tmp_path), ["--config.train.steps=3"])
  assert calls == ["1e-2"], "finished and diverged points are not run (nor evaluated) again"
  assert [r.skipped for r in results] == [True, True, False] and results[2].status == "done"
  calls.clear()
  sweep.run_sweep("configs/baselines.py:tiny", ["train.learning_rate=1e-3"], str(tmp_path),
                  ["--config.train.steps=6"])
  assert calls == ["1e-3"], "another command (more steps) runs the point again"


def test_a_point_whose_workdir_is_in_use_is_left_to_its_holder(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(sweep, "_run_train", fake_train({"1e-3": WorkdirInUse.exit_code}, calls))
  monkeypatch.setattr(sweep, "plot", lambda *_: None)
  text, results = sweep.run_sweep("configs/baselines.py:tiny", ["train.learning_rate=1e-3"], str(tmp_path),
                                  ["--config.train.steps=3"])
  assert [r.status for r in results] == ["failed"] and "is in use by pid 1" in text
  assert not list(tmp_path.rglob(sweep.POINT_FILE)), "the holder records the point, not this sweep"


@pytest.mark.slow
def test_two_point_sweep_from_another_directory_marks_the_diverged_point(tmp_path):
  root = tmp_path / "sweep"
  cmd = [sys.executable, os.path.join(REPO, "scripts", "sweep.py"),
         f"--config={os.path.join(REPO, 'configs', 'baselines.py')}:tiny", "--root=sweep",
         "--sweep=model.init_std=0.02,1e30",
         "--config.train.steps=3", "--config.model.d_model=32", "--config.model.mlp_hidden=64",
         "--config.model.mixers.softmax.n_heads=2", "--config.data.seq_len", "32",
         "--config.train.batch_size=4", "--config.data.heldout.num_sequences=4",
         "--config.eval.batch_size=4", "--", "--config.wandb.mode=disabled"]
  proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  table = (root / "sweep_results.md").read_text()
  assert "| 0.02 |" in table and "| ok |" in table
  assert "| 1e30 | — | — | — | **DIVERGED**: Diverged: loss is nan" in table
  assert "**DIVERGED**" in proc.stdout
  assert (root / "sweep_results.png").stat().st_size > 1000
  evaluated = root / "init_std=0.02" / "eval_3.json"
  mtime = evaluated.stat().st_mtime_ns
  again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
  assert again.returncode == 0 and again.stdout.count("in an earlier run, skipped") == 2
  assert evaluated.stat().st_mtime_ns == mtime and "step 1/3" not in again.stdout
