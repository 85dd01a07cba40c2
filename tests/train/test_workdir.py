"""A workdir is one run: one writer at a time (an OS lock that a killed holder never leaves behind), and a
resume that changes the config says so, and keeps the record of how the checkpoints were trained.

The lock is tested across forked processes and once through ``train.py``; the config checks resume, in
this process, copies of one run trained for two steps."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from configs import baselines
from lmcore import config as cfg_lib
from lmcore import data as data_lib
from lmcore.data import spm_training
from lmcore.errors import ConfigChanged, ConfigError, WorkdirInUse
from lmcore.train import chain
from lmcore.train import loop as train_lib
from lmcore.train import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2


def in_use_line(workdir) -> str:
  """The refusal for ``workdir`` held by this process (its record as ``.lock`` holds it)."""
  with open(os.path.join(workdir, ".lock")) as f:
    since = json.load(f)["since"]
  return (f"{workdir} is in use by pid {os.getpid()} on host {socket.gethostname()} since {since}; stop it "
          "first, or use another --workdir")


def snapshot(folder) -> dict[str, tuple[int, int, bytes]]:
  """Every file and folder below ``folder``: (size, mtime in ns, contents)."""
  found = {}
  for root, dirs, files in os.walk(folder):
    for name in dirs + files:
      path = os.path.join(root, name)
      stat = os.stat(path)
      data = open(path, "rb").read() if os.path.isfile(path) else b""
      found[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns, data)
  return found


# The forked children below only lock files and exit (os._exit): they need none of the threads (Python's,
# JAX's) that a fork leaves behind.
FORK_WARNINGS = ("ignore:This process .* is multi-threaded:DeprecationWarning",
                 "ignore:os.fork\\(\\) was called:RuntimeWarning")


def in_child(fn) -> int:
  """Forks; the child runs ``fn`` (which returns an exit code) and exits; returns the child's pid."""
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      code = fn()
    finally:
      os._exit(code)
  return pid


def exit_code(pid: int) -> int:
  _, status = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(status)


@pytest.mark.filterwarnings(FORK_WARNINGS[0])
@pytest.mark.filterwarnings(FORK_WARNINGS[1])
def test_a_held_workdir_refuses_a_forked_process_with_one_line_and_changes_nothing(tmp_path):
  workdir = str(tmp_path / "run")
  read_end, write_end = os.pipe()
  with workdir_lib.WorkdirLock(workdir):
    before = snapshot(workdir)

    def second_writer():
      try:
        workdir_lib.WorkdirLock(workdir).acquire()
      except WorkdirInUse as e:
        os.write(write_end, str(e).encode())
        return 0
      return 1

    assert exit_code(in_child(second_writer)) == 0
    os.close(write_end)
    assert os.read(read_end, 4096).decode() == in_use_line(workdir)
    assert snapshot(workdir) == before
  assert open(os.path.join(workdir, ".lock")).read() == ""  # released: the record is emptied
  assert exit_code(in_child(lambda: workdir_lib.WorkdirLock(workdir).acquire() and 0)) == 0


@pytest.mark.filterwarnings(FORK_WARNINGS[0])
@pytest.mark.filterwarnings(FORK_WARNINGS[1])
def test_a_killed_lock_holder_leaves_nothing_that_blocks_a_restart(tmp_path):
  workdir = str(tmp_path / "run")
  read_end, write_end = os.pipe()

  def holder():
    workdir_lib.WorkdirLock(workdir).acquire()
    os.write(write_end, b"held")
    signal.pause()
    return 0

  pid = in_child(holder)
  assert os.read(read_end, 4) == b"held"
  with pytest.raises(WorkdirInUse, match=f"in use by pid {pid} on host"):
    workdir_lib.WorkdirLock(workdir).acquire()
  os.kill(pid, signal.SIGKILL)
  assert exit_code(pid) == -signal.SIGKILL
  with workdir_lib.WorkdirLock(workdir):  # the kernel dropped the lock; its stale record does not matter
    assert json.load(open(os.path.join(workdir, ".lock")))["pid"] == os.getpid()


def test_every_free_field_names_config_fields():
  """``FREE_ON_RESUME`` is spelled in config keys: a renamed field must not silently become free."""
  fields = workdir_lib.flat_config(cfg_lib.experiment_config(baselines.get_config("tiny")))
  for name in workdir_lib.FREE_ON_RESUME + workdir_lib.RECORDED_FREE:
    assert any(workdir_lib.covers([name], field) for field in fields), name
  assert not workdir_lib.covers(workdir_lib.FREE_ON_RESUME, "train.learning_rate")
  assert workdir_lib.covers(workdir_lib.FREE_ON_RESUME, "wandb.mode")
  assert "data.sources.embedded.path" in fields  # named sources are keyed as their overrides are


def test_a_field_on_one_side_only_is_a_change_and_history_rows_replay_it(tmp_path):
  """A source added on resume shows as fields that were absent; the history's rows (``new`` left out for a
  field that went away) turn run_info.json's config into the one the checkpoints were trained with."""
  one = baselines.get_config("tiny")
  two = baselines.get_config("tiny")
  two.data.sources["extra"] = dict(two.data.sources.embedded.to_dict(), weight=0.5)
  trained = workdir_lib.flat_config(cfg_lib.experiment_config(one))
  now = workdir_lib.flat_config(cfg_lib.experiment_config(two))
  changes = workdir_lib.config_changes(trained, now)
  assert changes[0].describe() == 'data.sources.extra.name (absent) -> "extra"'
  assert [c.field for c in changes] == [k.replace(".embedded.", ".extra.") for k in trained
                                        if k.startswith("data.sources.embedded.")]
  workdir = tmp_path / "run"
  workdir.mkdir()
  run_info = {"config": cfg_lib.to_jsonable(cfg_lib.experiment_config(two))}
  (workdir / "run_info.json").write_text(json.dumps(run_info))
  with open(workdir / "config_history.jsonl", "w") as f:
    f.writelines(json.dumps(change.row(3)) + "\n" for change in workdir_lib.config_changes(now, trained))
  assert workdir_lib.trained_config(str(workdir)) == trained


# ------------------------------------------------------------------------------------- resumed configs


@pytest.fixture(scope="module")
def own_text(tmp_path_factory) -> dict[str, str]:
  """A folder of 40 short prose files and a 300-piece tokenizer trained on them."""
  root = tmp_path_factory.mktemp("workdir_text")
  rng = random.Random(2)
  words = "the river bridge lantern harbour winter market letter quiet morning garden stone".split()
  docs = [" ".join(rng.choices(words, k=rng.randint(5, 40))) + ".\n" for _ in range(40)]
  for i, doc in enumerate(docs):
    (root / f"d{i:02d}.txt").write_text(doc)
  model = root / "tok.model"
  with open(model, "wb") as writer:
    spm_training.train_bpe(spm_training.document_lines(docs), 300, writer)
  return {"glob": str(root / "*.txt"), "tokenizer": str(model), "cache": str(root / "cache")}


def overrides(own_text) -> dict[str, object]:
  """The tiny softmax preset at test size on the prose folder, as ``<key>: <value>`` overrides."""
  return {"model.d_model": 16, "model.n_layers": 1, "model.pattern": "softmax*1", "model.mlp": "none",
          "model.vocab_size": 320, "model.mixers.softmax.n_heads": 2,
          "data.seq_len": 16, "data.cache_dir": own_text["cache"], "data.sources.embedded.kind": "text",
          "data.sources.embedded.path": own_text["glob"], "data.sources.embedded.heldout_fraction": 0.1,
          "data.tokenizer.kind": "sentencepiece", "data.tokenizer.path": own_text["tokenizer"],
          "data.heldout.num_sequences": 2, "train.batch_size": 2, "train.steps": STEPS,
          "train.checkpoint_every": STEPS, "train.learning_rate": 1e-2, "train.warmup_steps": 1,
          "train.log_every": 1, "train.compilation_cache": False, "train.loss_impl": "materialized",
          "eval.batch_size": 2, "eval.paired": False, "wandb.mode": "disabled"}


def experiment(values: dict[str, object]) -> cfg_lib.ExperimentConfig:
  cd = baselines.get_config("tiny")
  for key, value in values.items():
    *parents, leaf = key.split(".")
    node = cd
    for name in parents:
      node = node[name]
    node[leaf] = value
  return cfg_lib.experiment_config(cd)


@pytest.fixture(scope="module", autouse=True)
def no_unigram_yardstick():
  """The evaluations here leave out the unigram yardstick (it reads 500,000 training tokens); what they
  record about the workdir does not depend on it."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(data_lib, "unigram_baseline",
                  lambda *_, **__: {"unigram_entropy": 0.0, "unigram_heldout_xent": 0.0})
    yield


@pytest.fixture(scope="module")
def trained(own_text, tmp_path_factory):
  """A run of STEPS steps (checkpointed at the last) and its config values."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  values = overrides(own_text)
  train_lib.train_and_evaluate(experiment(values), str(workdir))
  return workdir, values


def copy_of(trained, tmp_path) -> str:
  workdir = tmp_path / "run"
  shutil.copytree(trained[0], workdir)
  return str(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("train.learning_rate", 3e-3), ("train.seed", 7),
                                          ("model.mixers.softmax.rope_base", 500.0)])
def test_a_resume_that_changes_the_optimisation_or_the_model_is_refused_in_one_line(trained, tmp_path,
                                                                                    field, value):
  workdir = copy_of(trained, tmp_path)
  before = {k: v for k, v in snapshot(workdir).items() if k != ".lock"}
  old = trained[1].get(field, {"train.seed": 0, "model.mixers.softmax.rope_base": 10000.0}.get(field))
  with pytest.raises(ConfigChanged) as refused:
    train_lib.train_and_evaluate(experiment({**trained[1], field: value}), workdir)
  assert str(refused.value) == (
      f"{workdir} holds checkpoints (latest: step {STEPS}) trained with another config: {field} "
      f"{json.dumps(old)} -> {json.dumps(value)}. To resume with it and record it in "
      f"{workdir}/config_history.jsonl, add --accept_config_changes={field}; or use another --workdir.")
  assert {k: v for k, v in snapshot(workdir).items() if k != ".lock"} == before


@pytest.mark.slow
def test_an_accepted_change_is_recorded_and_cited_and_run_info_keeps_the_original(trained, tmp_path, capsys):
  workdir = copy_of(trained, tmp_path)
  run_info = open(os.path.join(workdir, "run_info.json")).read()
  changed = {**trained[1], "train.learning_rate": 3e-3, "train.seed": 7,
             "model.mixers.softmax.rope_base": 500.0}
  accept = ("train.learning_rate", "train.seed", "model.mixers.softmax")  # a group covers its fields
  with pytest.raises(ConfigChanged, match="add --accept_config_changes=model.mixers.softmax.rope_base,"
                     "train.learning_rate,train.seed;"):
    train_lib.train_and_evaluate(experiment(changed), workdir, accept[:2])
  record = train_lib.train_and_evaluate(experiment(changed), workdir, accept)
  rows = workdir_lib.read_history(workdir)
  assert [(r["step"], r["field"], r["old"], r["new"]) for r in rows] == [
      (STEPS, "model.mixers.softmax.rope_base", 10000.0, 500.0), (STEPS, "train.learning_rate", 1e-2, 3e-3),
      (STEPS, "train.seed", 0, 7)]
  out = capsys.readouterr().out
  assert ("Accepted config changes at step 2: model.mixers.softmax.rope_base 10000.0 -> 500.0; "
          "train.learning_rate 0.01 -> 0.003; train.seed 0 -> 7") in out
  assert f"config changed on resume since the first start (3, {workdir}/config_history.jsonl)" in out
  assert open(os.path.join(workdir, "run_info.json")).read() == run_info
  assert json.load(open(os.path.join(workdir, f"eval_{STEPS}.json")))["config_history"] == rows == \
      record["config_history"]
  # The accepted config is now the one the checkpoints were trained with: it resumes without the flag.
  train_lib.train_and_evaluate(experiment(changed), workdir)
  assert workdir_lib.read_history(workdir) == rows


@pytest.mark.slow
def test_a_changed_step_count_or_bookkeeping_resumes_silently(trained, tmp_path, capsys):
  workdir = copy_of(trained, tmp_path)
  run_info = open(os.path.join(workdir, "run_info.json")).read()
  longer = {**trained[1], "train.steps": STEPS + 1, "train.checkpoint_every": 1, "train.log_every": 3,
            "train.eval_every": 5, "eval.batch_size": 1, "data.token_cache": True, "wandb.name": "renamed"}
  record = train_lib.train_and_evaluate(experiment(longer), workdir)
  out = capsys.readouterr().out
  assert f"Resumed from step {STEPS}" in out and "Accepted config changes" not in out
  assert record["step"] == STEPS + 1
  # The schedule follows the new length from the resumed step on: recorded without asking.
  rows = [(r["step"], r["field"], r["old"], r["new"]) for r in workdir_lib.read_history(workdir)]
  assert rows == [(STEPS, "train.steps", STEPS, STEPS + 1)]
  assert [(r["field"]) for r in record["config_history"]] == ["train.steps"]
  assert open(os.path.join(workdir, "run_info.json")).read() == run_info


def test_an_accept_name_that_is_no_config_field_fails_before_the_workdir_exists(own_text, tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError, match="--accept_config_changes: 'train.learning_rat' is no config field"):
    train_lib.train_and_evaluate(experiment(overrides(own_text)), str(workdir), ("train.learning_rat",))
  assert not workdir.exists()


@pytest.mark.slow
def test_eval_reads_a_held_workdir_without_taking_the_lock(trained, tmp_path):
  workdir = copy_of(trained, tmp_path)
  config = experiment(trained[1])
  with workdir_lib.WorkdirLock(workdir):
    record = chain.evaluate_step(config, workdir, STEPS, out_dir=str(tmp_path / "eval"))
  assert record["config_history"] == [] and record["step"] == STEPS
  assert json.load(open(os.path.join(workdir, f"eval_{STEPS}.json")))["loss"] == pytest.approx(record["loss"])


# ------------------------------------------------------------------------------------------ train.py


@pytest.mark.slow
def test_train_py_on_a_held_workdir_stops_in_one_line_and_touches_nothing(own_text, tmp_path):
  """A second train.py while a run holds the workdir (here: this process, through the lock) exits 75 with
  the one line, before it changes anything in the workdir."""
  workdir = tmp_path / "run"
  args = [f"--config.{k}={v}" for k, v in overrides(own_text).items()]
  cmd = [sys.executable, os.path.join(REPO, "train.py"), f"--config={REPO}/configs/baselines.py:tiny",
         f"--workdir={workdir}", *args]
  with workdir_lib.WorkdirLock(str(workdir)):
    (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # what the holder has written
    before = snapshot(workdir)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == WorkdirInUse.exit_code == 75, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"WorkdirInUse: {in_use_line(workdir)}"
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert snapshot(workdir) == before
