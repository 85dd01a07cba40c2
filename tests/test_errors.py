"""Every mistake a new user makes is answered in one line naming the field and the fix, before anything
is created: unknown override keys, missing data and tokenizer files, ``init_from`` / ``init_data_from``
pointing nowhere, corrupted checkpoints, NaN results, ``--prompt`` on a model that cannot decode, wandb
without its package, and Ctrl-C / SIGTERM while compiling or evaluating."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import baselines, sanatan
from lmcore import cli
from lmcore import config as cfg_lib
from lmcore.data import spm_training
from lmcore.errors import ConfigError, Diverged, MissingFileError
from lmcore.eval import evaluate
from lmcore.model import LanguageModel
from lmcore.train import chain
from lmcore.train import checkpoint as ckpt_lib
from lmcore.train import loop as train_lib
from lmcore.train import metrics

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def own_text(tmp_path_factory) -> dict[str, str]:
  """A folder of 60 short prose files and a 300-piece tokenizer trained on them (0.1 s)."""
  root = tmp_path_factory.mktemp("own_text")
  rng = random.Random(0)
  words = "the river bridge lantern harbour winter market letter quiet morning garden stone".split()
  docs = [" ".join(rng.choices(words, k=60)) + ".\n" for _ in range(60)]
  for i, doc in enumerate(docs):
    (root / f"d{i:02d}.txt").write_text(doc)
  model = root / "tok.model"
  with open(model, "wb") as writer:
    spm_training.train_bpe(spm_training.document_lines(docs), 300, writer)
  return {"glob": str(root / "*.txt"), "tokenizer": str(model), "cache": str(root / "cache")}


def small_config(own_text, **train) -> cfg_lib.ExperimentConfig:
  """The tiny softmax preset at test size, on the prose folder (10 % held out by hash)."""
  cd = baselines.get_config("tiny")
  cd.model.update(d_model=32, n_layers=2, pattern="softmax*2", mlp_hidden=64, vocab_size=320)
  cd.model.mixers.softmax.n_heads = 2
  cd.data.update(seq_len=32, cache_dir=own_text["cache"])
  cd.data.sources.embedded.update(kind="text", path=own_text["glob"], heldout_fraction=0.1)
  cd.data.tokenizer.update(kind="sentencepiece", path=own_text["tokenizer"])
  cd.data.heldout.num_sequences = 4
  cd.train.update(batch_size=4, warmup_steps=1, log_every=1, **train)
  cd.eval.batch_size = 4
  cd.wandb.mode = "disabled"
  return cfg_lib.experiment_config(cd)


# ------------------------------------------------------------------------------ one line at the edge


def test_unknown_override_key_lists_the_valid_keys_at_its_level():
  cd = baselines.get_config("tiny")
  message = str(cli.unknown_override(cd, "train.stpes"))
  assert "unknown key 'config.train.stpes'. Did you mean 'config.train.steps'?" in message
  assert "Valid keys under 'config.train': " in message and "learning_rate" in message
  assert "Valid keys under 'config': " in str(cli.unknown_override(cd, "zzz"))
  assert "'config.model.mixers.softmax.n_heads'" in str(cli.unknown_override(cd, "model.mixers.softmax.nheads"))
  assert "is a value, not a group" in str(cli.unknown_override(cd, "train.steps.x"))
  assert cli.unknown_override(cd, "model.mixers.softmax.n_heads") is None


def test_train_py_answers_an_unknown_key_in_one_line_and_creates_nothing(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config=configs/baselines.py:tiny",
                         f"--workdir={workdir}", "--config.train.stpes=3"], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("ConfigError: unknown key 'config.train.stpes'")
  assert "Valid keys under 'config.train'" in lines[0] and not workdir.exists()


def test_model_card_answers_a_bad_preset_in_one_line():
  proc = subprocess.run([sys.executable, str(REPO / "scripts" / "model_card.py"), "--config=configs/mqar.py:nope"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
  assert "unknown preset 'nope'; valid presets: tiny," in lines[0]


def test_user_errors_and_interrupts_end_in_one_line_with_their_exit_codes(capsys):
  def exit_code(body) -> int:
    with pytest.raises(SystemExit) as info:
      with cli.user_errors():
        body()
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return info.value.code, err

  def missing():
    raise MissingFileError("data.sources.x.path='nothing/*' matches no file; fix the glob.")

  assert exit_code(missing) == (2, "MissingFileError: data.sources.x.path='nothing/*' matches no file; fix the glob.")
  assert exit_code(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))[0] == 130
  code, err = exit_code(lambda: os.kill(os.getpid(), signal.SIGTERM))
  assert code == 143 and err.startswith("SIGTERM received: stopped.")


# ------------------------------------------------------------------------- rejected before the workdir


@pytest.mark.parametrize("change,field", [
    (dict(path="/nowhere/*.txt"), "data.sources.embedded.path"),
    (dict(tokenizer="/nowhere/tok.model"), "data.tokenizer.path"),
    (dict(init_from="/nowhere/run"), "train.init_from"),
])
def test_missing_inputs_are_rejected_before_the_workdir_exists(own_text, tmp_path, change, field):
  config = small_config(own_text, init_from=change.get("init_from", ""))
  data = config.data
  if "path" in change:
    data = dataclasses.replace(data, sources=(dataclasses.replace(data.sources[0], path=change["path"]),))
  if "tokenizer" in change:
    data = dataclasses.replace(data, tokenizer=dataclasses.replace(data.tokenizer, path=change["tokenizer"]))
  workdir = tmp_path / "run"
  with pytest.raises((MissingFileError, ckpt_lib.CheckpointError), match=field.replace(".", r"\.")):
    train_lib.train_and_evaluate(dataclasses.replace(config, data=data), str(workdir))
  assert not workdir.exists()


def test_init_data_from_needs_init_from_and_a_checkpoint(own_text, tmp_path):
  with pytest.raises(ConfigError, match=r"train\.init_data_from=.*set train\.init_from"):
    small_config(own_text, init_data_from="runs/x")
  source = tmp_path / "stage1"
  save_steps(source, [("good", 1)])
  config = small_config(own_text, init_from=str(source), init_data_from=str(tmp_path / "nowhere"))
  with pytest.raises(ckpt_lib.CheckpointError, match=r"train\.init_data_from=.*no such folder"):
    train_lib.train_and_evaluate(config, str(tmp_path / "stage2"))
  assert not (tmp_path / "stage2").exists()


# ------------------------------------------------------------------------------ corrupted checkpoints


def model_state(seed: int = 0):
  config = cfg_lib.experiment_config(baselines.get_config("tiny")).model
  config = dataclasses.replace(config, d_model=32, n_layers=2, pattern="softmax*2", mlp_hidden=64, vocab_size=320)
  _, params, rest = nnx.split(LanguageModel(config, rngs=nnx.Rngs(seed)), nnx.Param, ...)
  return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def save_steps(workdir: pathlib.Path, steps: list[tuple[str, int]]) -> None:
  """Checkpoints as training writes them; "stale" stores the checksums of other parameters (its bytes
  changed after the save), "nan" holds a NaN parameter."""
  params, rest = model_state()
  checkpointer = ckpt_lib.Checkpointer(str(workdir / "checkpoints"), cfg_lib.TrainConfig(keep_last=10))
  meta = {"param_signature": ckpt_lib.param_signature(params)}
  for kind, step in steps:
    saved = params
    if kind != "good":
      value = np.float32("nan") if kind == "nan" else np.float32(0.5)
      saved = jax.tree.map(lambda x: x, params)
      saved["final_norm"]["scale"] = saved["final_norm"]["scale"].at[3].set(value)
    original = ckpt_lib.start_checksums
    if kind == "stale":
      ckpt_lib.start_checksums = lambda _: original(params)
    try:
      checkpointer.save(step, {"params": saved, "rest": rest, "step": np.int32(step)}, None, meta)
      checkpointer.wait()
    finally:
      ckpt_lib.start_checksums = original
  checkpointer.close()


def abstract(tree):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def test_corrupted_checkpoints_name_the_step_and_the_latest_good_one(tmp_path):
  save_steps(tmp_path, [("good", 1), ("stale", 2), ("nan", 3)])
  params, rest = model_state()
  with pytest.raises(ckpt_lib.CheckpointError, match=r"step 3 .* is corrupted: parameter 'final_norm/scale' "
                                                      r"holds NaN or inf\. The latest good checkpoint before it is "
                                                      r"step 1: evaluate it with eval.py --step=1"):
    ckpt_lib.load_params(str(tmp_path), abstract(params), abstract(rest))
  with pytest.raises(ckpt_lib.CheckpointError, match=r"step 2 .* differs from the checksum stored when it was "
                                                      r"written\. The latest good checkpoint before it is step 1"):
    ckpt_lib.load_params(str(tmp_path), abstract(params), abstract(rest), step=2)
  restored, _, step, _ = ckpt_lib.load_params(str(tmp_path), abstract(params), abstract(rest), step=1)
  assert step == 1
  np.testing.assert_array_equal(restored["final_norm"]["scale"], params["final_norm"]["scale"])
  # Resuming checks the same way.
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), read_only=True)
  state = {"params": abstract(params), "rest": abstract(rest), "step": jax.ShapeDtypeStruct((), np.int32)}
  with pytest.raises(ckpt_lib.CheckpointError, match=r"step 2 .* corrupted"):
    checkpointer.restore(2, state, None)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3"], "nothing is deleted"


def test_evaluation_never_prints_or_writes_nan(own_text, tmp_path, capsys):
  config = small_config(own_text)
  model = LanguageModel(config.model, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  params["final_norm"]["scale"] = params["final_norm"]["scale"].at[0].set(np.inf)
  tokens = np.random.default_rng(0).integers(0, 300, size=(4, 33)).astype(np.int32)
  heldout = {"tokens": tokens, "segment_ids": np.ones_like(tokens), "positions": np.tile(np.arange(33), (4, 1))}
  with pytest.raises(Diverged, match=r"evaluation of step 7 gives non-finite loss=nan.*nothing was written"):
    evaluate.evaluate_params(config, str(tmp_path), graphdef, params, rest, heldout, 7, tokenizer=None)
  assert not list(tmp_path.glob("eval_*")) and "nan" not in capsys.readouterr().out


def test_prompt_on_a_model_without_a_decode_state_fails_before_evaluating(tmp_path):
  config = cfg_lib.experiment_config(sanatan.get_config("tiny"))  # p = 2: no constant-size state
  with pytest.raises(ConfigError, match=r"--prompt needs a model that decodes token by token.*p=2"):
    chain.evaluate_checkpoint(config, str(tmp_path / "no_run_here"), prompt="def ")


def test_wandb_offline_without_the_package_falls_back_to_disabled(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
  writer = metrics.MetricWriter(str(tmp_path), cfg_lib.WandbConfig(mode="offline"), {})
  writer.write(1, {"loss": 2.0})
  writer.close()
  assert "wandb is not installed: wandb.mode='offline' falls back to 'disabled'" in capsys.readouterr().out
  assert (tmp_path / "metrics.jsonl").read_text().strip() == '{"step": 1, "loss": 2.0}'
  with pytest.raises(ConfigError, match=r"wandb\.mode='online' needs the wandb package"):
    metrics.MetricWriter(str(tmp_path), cfg_lib.WandbConfig(mode="online"), {})


# ------------------------------------------------------------------------------------------- signals


def test_sigterm_while_compiling_saves_and_sigint_while_evaluating_stops(own_text, tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  compile_step = train_lib.compile_train_step

  def compile_signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first step is being compiled
    return compile_step(*args, **kwargs)

  monkeypatch.setattr(train_lib, "compile_train_step", compile_signalled)
  result = train_lib.train_and_evaluate(small_config(own_text, steps=3, checkpoint_every=100), workdir)
  assert result == {"stopped_by": "SIGTERM", "step": 1}
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1"]

  monkeypatch.setattr(train_lib, "compile_train_step", compile_step)
  monkeypatch.setattr(train_lib, "evaluate_run", lambda *_: os.kill(os.getpid(), signal.SIGINT))
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (xdist ignores it)
  try:
    with pytest.raises(KeyboardInterrupt, match=r"evaluation was interrupted; step 2 is saved"):
      train_lib.train_and_evaluate(small_config(own_text, steps=2, checkpoint_every=100), workdir)
  finally:
    signal.signal(signal.SIGINT, previous)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]


def test_a_dataclass_check_names_the_config_path():
  cd = sanatan.get_config("tiny")
  cd.model.mixers.sanatan.channels = 5
  with pytest.raises(ConfigError, match=r"^model\.mixers\.sanatan: channels must be one of"):
    cfg_lib.experiment_config(cd)
