"""The training loop end to end: falling loss, exact resume after SIGKILL, SIGTERM saves, bad inputs.

Runs go through ``train.py`` in subprocesses, as a user would launch them. They compile without most of
XLA's optimisations, as this process does, and share one persistent compilation cache of this module's
own (every program, however quick to compile): the runs here train the same small model, and a later
process loads what an earlier one compiled, as train.py's compilation cache does when a run restarts.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from process_cases import compilation_cache_env, fast_compile_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.model.d_model=32", "--config.model.n_layers=2", "--config.model.pattern=softmax*2",
         "--config.model.mlp_hidden=64", "--config.model.mixers.softmax.n_heads=2", "--config.data.seq_len=32",
         "--config.train.batch_size=4", "--config.train.warmup_steps=2", "--config.train.log_every=1",
         "--config.data.heldout.num_sequences=8", "--config.eval.batch_size=8", "--config.wandb.mode=disabled"]


def train_cmd(workdir, *overrides, preset="configs/baselines.py:tiny", script="train.py"):
  return [sys.executable, os.path.join(REPO, script), f"--config={os.path.join(REPO, preset)}",
          f"--workdir={workdir}", *SMALL, *overrides]


@pytest.fixture(scope="module")
def process_env(tmp_path_factory) -> dict:
  """The environment of this module's processes: fast compilation and the module's compilation cache."""
  return {**os.environ, **fast_compile_env(), **compilation_cache_env(tmp_path_factory.mktemp("jax_cache"))}


def run(cmd, env, check=True):
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
  if check and proc.returncode != 0:
    raise AssertionError(f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}")
  return proc


def losses(workdir):
  """step -> loss, the last row written for each step (a killed run may have logged a step twice)."""
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if "loss" in row:
        rows[row["step"]] = row["loss"]
  return rows


def final_params(workdir):
  from flax import nnx  # noqa: F401  (import jax lazily in the test process only)
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  step = manager.latest_step()
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  import jax
  return step, {"/".join(map(str, p)): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}


@pytest.mark.slow
def test_loss_falls_and_eval_json_is_written(tmp_path, process_env):
  workdir = tmp_path / "run"
  proc = run(train_cmd(workdir, "--config.train.steps=40", "--config.train.learning_rate=1e-2",
                       "--config.train.checkpoint_every=20", "--config.train.log_every=10",
                       "--config.model.remat=True"), process_env)  # the other runs here train without remat
  assert "tok/s" in proc.stdout and "ETA" in proc.stdout
  rows = losses(workdir)
  assert np.mean([rows[s] for s in range(36, 41)]) < rows[1] - 1.0
  record = json.load(open(workdir / "eval_40.json"))
  assert record["loss"] < np.log(8192) - 0.3 and record["tokens"] == 8 * 32
  assert record["perplexity"] == pytest.approx(np.exp(record["loss"]), rel=1e-6)
  # The yardstick printed next to the loss: the training corpus's unigram entropy, and the held-out
  # loss of that unigram model (which cannot be lower than the corpus entropy by much).
  assert 4.0 < record["unigram_entropy"] < np.log(8192)
  assert record["unigram_heldout_xent"] > record["unigram_entropy"] - 0.5
  assert sorted(os.listdir(workdir / "checkpoints")) == ["20", "40"]


@pytest.mark.slow
def test_exact_resume_after_sigkill(tmp_path, process_env):
  """2N steps in one run == N steps, SIGKILL, resume for N more: same losses, bitwise-equal params (and
  the killed run's workdir lock is gone with it). The later processes load the programs the first
  compiled from the module's compilation cache."""
  n = 4
  common = ["--config.train.steps=8", f"--config.train.checkpoint_every={n}"]
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  run(train_cmd(straight, *common), process_env)
  killed = run(train_cmd(resumed, *common, script="tests/fault_train.py"),
               {**process_env, "KILL_AFTER_STEP": str(n)}, check=False)
  assert killed.returncode == -signal.SIGKILL
  assert sorted(os.listdir(resumed / "checkpoints")) == [str(n)]
  assert "pid" in (resumed / ".lock").read_text()  # the killed holder's record stays; its lock does not
  second = run(train_cmd(resumed, *common), process_env)
  assert f"Resumed from step {n}" in second.stdout
  assert losses(straight) == losses(resumed)
  step_a, params_a = final_params(straight)
  step_b, params_b = final_params(resumed)
  assert step_a == step_b == 2 * n
  for name, value in params_a.items():
    np.testing.assert_array_equal(value, params_b[name], err_msg=name)


def _group_alive(pgid: int) -> bool:
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  return True


def _signalled_run(workdir, steps: int, env: dict) -> tuple[subprocess.CompletedProcess, bool]:
  """train.py with two Grain worker processes in a process group of its own, signalled by
  ``tests/fault_train.py``'s fault named in ``env``; returns the finished process and whether any process of the
  group (a worker) was still alive a few seconds after train.py exited."""
  cmd = train_cmd(workdir, f"--config.train.steps={steps}", "--config.train.checkpoint_every=2",
                  "--config.data.worker_count=2", script="tests/fault_train.py")
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True)
  out, err = proc.communicate(timeout=600)
  deadline = time.time() + 10
  while _group_alive(proc.pid) and time.time() < deadline:
    time.sleep(0.2)
  left = _group_alive(proc.pid)
  if left:
    os.killpg(proc.pid, signal.SIGKILL)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), left


@pytest.mark.slow
def test_sigterm_to_the_process_group_saves_and_every_process_exits_quietly(tmp_path, process_env):
  """SIGTERM to train.py and its data workers at once (a job scheduler, or Ctrl-C's SIGINT alike): during
  training the run saves the step and exits 0; during the final evaluation it exits 143. Either way
  one line says so, no process (worker) prints anything else, and none is left."""
  training, left = _signalled_run(tmp_path / "train", 100, {**process_env, "TERM_GROUP_AFTER_STEP": "2"})
  assert training.returncode == 0, training.stderr[-3000:]
  assert "SIGTERM received: saved step 2 and stopped." in training.stdout
  evaluating, left_eval = _signalled_run(tmp_path / "eval", 4, {**process_env, "TERM_GROUP_AT_EVAL": "1"})
  assert evaluating.returncode == 143, evaluating.stderr[-3000:]
  assert evaluating.stderr.strip().splitlines()[-1].startswith(
      "SIGTERM received: stopped. The evaluation was interrupted; step 4 is saved")
  for proc in (training, evaluating):
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]  # shared memory of batches in flight
  assert not left and not left_eval


@pytest.mark.slow
def test_unknown_override_key_fails_with_valid_keys(tmp_path, process_env):
  proc = run(train_cmd(tmp_path / "run", "--config.train.stepz=3"), process_env, check=False)
  assert proc.returncode != 0
  assert "stepz" in proc.stderr and "steps" in proc.stderr


@pytest.mark.slow
def test_bad_inputs_fail_clearly_and_keep_checkpoints(tmp_path, process_env):
  workdir = tmp_path / "run"
  run(train_cmd(workdir, "--config.train.steps=2", "--config.train.checkpoint_every=2"), process_env)
  before = sorted(os.listdir(workdir / "checkpoints"))

  foreign = run(train_cmd(workdir, "--config.train.steps=4", "--config.model.d_model=48"), process_env,
                check=False)
  assert foreign.returncode != 0 and "different model" in foreign.stderr

  vocab = run(train_cmd(workdir, "--config.train.steps=4", "--config.model.vocab_size=100"), process_env,
              check=False)
  assert vocab.returncode != 0 and "model.vocab_size" in vocab.stderr

  missing = run(train_cmd(tmp_path / "other", "--config.data.sources.embedded.kind=jsonl",
                          f"--config.data.sources.embedded.path={tmp_path}/nothing/*.jsonl"), process_env, check=False)
  assert missing.returncode != 0 and "data.sources" in missing.stderr

  step_dir = workdir / "checkpoints" / before[-1]
  corrupted = tmp_path / "corrupted"
  shutil.copytree(workdir, corrupted)
  for root, _, files in os.walk(corrupted / "checkpoints" / before[-1]):
    for name in files:
      if name != "_CHECKPOINT_METADATA":
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"garbage")
  broken = run(train_cmd(corrupted, "--config.train.steps=4"), process_env, check=False)
  assert broken.returncode != 0 and "Nothing was deleted" in broken.stderr
  assert sorted(os.listdir(corrupted / "checkpoints")) == before
  assert sorted(os.listdir(workdir / "checkpoints")) == before and step_dir.exists()


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_message_and_saves_nothing(tmp_path, process_env):
  workdir = tmp_path / "run"
  proc = run(train_cmd(workdir, "--config.train.steps=4", "--config.model.init_std=1e30"), process_env,
             check=False)
  assert proc.returncode != 0 and "loss is nan" in proc.stderr.lower()
  assert "train.learning_rate" in proc.stderr
  assert not [s for s in os.listdir(workdir / "checkpoints") if s.isdigit()]
