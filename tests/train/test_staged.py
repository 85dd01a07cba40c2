"""Staged training (MATH §1.4): stage 2 starts from stage 1's parameters with a fresh optimizer and
reads stage 1's data stream from the record where stage 1 stopped; after a crash inside stage 2 it
resumes its own run (its parameters, optimizer and stream position), not stage 1's again.

Both stages train in this process (their final evaluations left out) with the same optimizer settings,
so that they share one compiled step. The reference stream is a fresh training iterator of the same data
config and seed."""

import dataclasses
import functools
import json
import os
import random

import jax
import numpy as np
import pytest

from configs import baselines
from lmcore import config as cfg_lib
from lmcore import data as data_lib
from lmcore import loss as loss_lib
from lmcore.data import spm_training
from lmcore.train import checkpoint as ckpt_lib
from lmcore.train import loop as train_lib
from lmcore.train import state as state_lib
from lmcore.train.optim import make_optimizer

N = 2  # stage-1 steps
MAKE_TRAIN_STEP = train_lib.make_train_step


@pytest.fixture(scope="module")
def own_text(tmp_path_factory) -> dict[str, str]:
  """A folder of 40 short prose files and a 300-piece tokenizer trained on them."""
  root = tmp_path_factory.mktemp("staged_text")
  rng = random.Random(1)
  words = "the river bridge lantern harbour winter market letter quiet morning garden stone".split()
  docs = [" ".join(rng.choices(words, k=rng.randint(5, 40))) + ".\n" for _ in range(40)]
  for i, doc in enumerate(docs):
    (root / f"d{i:02d}.txt").write_text(doc)
  model = root / "tok.model"
  with open(model, "wb") as writer:
    spm_training.train_bpe(spm_training.document_lines(docs), 300, writer)
  return {"glob": str(root / "*.txt"), "tokenizer": str(model), "cache": str(root / "cache")}


def overrides(own_text, **stage) -> dict[str, object]:
  """The tiny softmax preset at test size on the prose folder, as ``<key>: <value>`` overrides."""
  return {"model.d_model": 16, "model.n_layers": 1, "model.pattern": "softmax*1", "model.mlp": "none",
          "model.vocab_size": 320, "model.mixers.softmax.n_heads": 2,
          "data.seq_len": 16, "data.cache_dir": own_text["cache"], "data.sources.embedded.kind": "text",
          "data.sources.embedded.path": own_text["glob"], "data.sources.embedded.heldout_fraction": 0.1,
          "data.tokenizer.kind": "sentencepiece", "data.tokenizer.path": own_text["tokenizer"],
          "data.heldout.num_sequences": 2, "train.batch_size": 2, "train.steps": N,
          "train.learning_rate": 1e-2, "train.warmup_steps": 1, "train.warmup_init_lr": 1e-3,
          "train.log_every": 1, "train.compilation_cache": False, "train.loss_impl": "materialized",
          "eval.batch_size": 2, "eval.paired": False, "wandb.mode": "disabled",
          **{f"train.{k}": v for k, v in stage.items()}}


def experiment(values: dict[str, object]) -> cfg_lib.ExperimentConfig:
  cd = baselines.get_config("tiny")
  for key, value in values.items():
    *parents, leaf = key.split(".")
    node = cd
    for name in parents:
      node = node[name]
    node[leaf] = value
  return cfg_lib.experiment_config(cd)


def stage2_values(own_text, stage1_dir) -> dict[str, object]:
  return overrides(own_text, checkpoint_every=1, init_from=str(stage1_dir), init_data_from=str(stage1_dir))


@functools.cache
def _shared_step(graphdef, tx_train, config):
  return MAKE_TRAIN_STEP(graphdef, make_optimizer(tx_train), config, None)


def shared_train_step(graphdef, tx, config, shardings=None):
  """``make_train_step`` compiled once for both stages: they differ only in fields the step does not
  read (``init_from``, ``init_data_from``, ``checkpoint_every``)."""
  del tx, shardings  # one device: without explicit shardings the step computes the same
  train = dataclasses.replace(config.train, init_from="", init_data_from="", checkpoint_every=1)
  return _shared_step(graphdef, train, dataclasses.replace(config, train=train))


def reference_batches(config: cfg_lib.ExperimentConfig, n: int) -> list[dict[str, np.ndarray]]:
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer, data_lib.cache_dir(config.data))
  iterator = data_lib.make_train_iterator(config.data, tokenizer, batch_size=config.train.batch_size,
                                          seed=config.train.seed)
  try:
    return data_lib.take_batches(iterator, n)
  finally:
    iterator.close()


def opened_run(config, workdir):
  """``build_run`` (the start of ``train.py``): a fresh start, ``init_from`` or a resume."""
  run = state_lib.build_run(config, str(workdir))
  batch = next(run.data_iterator)
  run.data_iterator.close()
  run.checkpointer.close()
  return run, batch


def assert_batches_equal(got, want, what):
  for key in state_lib.BATCH_KEYS:
    np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def stage1(own_text, tmp_path_factory):
  """Stage 1: N steps in this process; returns its workdir, config and the parameters the loop ended
  with (taken where the final evaluation, left out here, would read them)."""
  workdir = tmp_path_factory.mktemp("stage1")
  config = experiment(overrides(own_text, checkpoint_every=N))
  final = {}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train_lib, "evaluate_run",
                  lambda run, heldout, writer=None, clock=None: final.update(params=leaves(run.params)) or {})
    patch.setattr(train_lib, "make_train_step", shared_train_step)
    train_lib.train_and_evaluate(config, str(workdir))
  return workdir, config, final["params"]


def test_stage2_starts_from_stage1s_parameters_fresh_optimizer_and_next_record(stage1, own_text, tmp_path):
  """Right after ``init_from`` + ``init_data_from``: stage 1's parameters bit for bit, an optimizer
  state equal to ``tx.init`` of them, step 0, and the batch stage 1 would have read at step N + 1."""
  stage1_dir, stage1_config, stage1_params = stage1
  reference = reference_batches(stage1_config, N + 2)
  run, first = opened_run(experiment(stage2_values(own_text, stage1_dir)), tmp_path / "stage2")
  assert run.step == 0
  for got, want in zip(leaves(run.params), stage1_params, strict=True):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(leaves(run.opt_state), leaves(run.tx.init(run.params)), strict=True):
    np.testing.assert_array_equal(got, want)
  assert_batches_equal(first, reference[N], "stage 2's first batch")
  assert not np.array_equal(reference[N]["tokens"], reference[N - 1]["tokens"])


class Crash(Exception):
  """Stands for a SIGKILL: raised right after a checkpoint commits, so the disk holds what a killed run
  leaves (that checkpoint, nothing later)."""


def test_stage2_trains_on_the_next_record_and_resumes_its_own_run_after_a_crash(stage1, own_text, tmp_path):
  """Stage 2 crashes right after its step-1 checkpoint: the loss it logged at step 1 is the loss of
  stage 1's parameters on reference batch N + 1 (not N, not N + 2). Reopened, the workdir resumes stage
  2 (step 1, its own parameters and optimizer state, the stream at batch N + 2) instead of initialising
  from stage 1 again. (A real SIGKILL and resume: tests/test_train.py.)"""
  stage1_dir, stage1_config, stage1_params = stage1
  config = experiment(stage2_values(own_text, stage1_dir))
  workdir = tmp_path / "stage2"
  save, saved = ckpt_lib.Checkpointer.save, {}

  def save_then_crash(self, step, state, *args, **kwargs):
    save(self, step, state, *args, **kwargs)
    self.wait()
    saved.update(params=leaves(state["params"]))
    raise Crash(step)

  with pytest.MonkeyPatch.context() as patch, pytest.raises(Crash):
    patch.setattr(ckpt_lib.Checkpointer, "save", save_then_crash)
    patch.setattr(train_lib, "evaluate_run", lambda run, heldout, writer=None, clock=None: {"step": run.step})
    patch.setattr(train_lib, "make_train_step", shared_train_step)
    train_lib.train_and_evaluate(config, str(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]

  reference = reference_batches(stage1_config, N + 3)
  with open(workdir / "metrics.jsonl") as f:
    logged = [json.loads(line)["loss"] for line in f if '"loss"' in line]
  graphdef = state_lib.abstract_model(config.model)[0]
  loss_fn = jax.jit(loss_lib.loss_fn, static_argnums=(0, 4))
  params = jax.tree.unflatten(jax.tree.structure(state_lib.abstract_model(config.model)[1]), stage1_params)
  losses = [float(loss_fn(graphdef, params, {}, reference[i], config.data.segment_ids))
            for i in (N - 1, N, N + 1)]
  assert logged == [pytest.approx(losses[1], rel=1e-5)], (logged, losses)
  assert min(abs(losses[1] - losses[0]), abs(losses[1] - losses[2])) > 1e-3  # the batches tell apart

  run, batch = opened_run(config, workdir)
  assert run.step == 1
  assert_batches_equal(batch, reference[N + 1], "stage 2's batch after the resume")
  assert int(np.asarray(run.opt_state[1][0].count)) == 1  # AdamW's step count: not a fresh state
  for got, want, before in zip(leaves(run.params), saved["params"], stage1_params, strict=True):
    np.testing.assert_array_equal(got, want)  # stage 2's step-1 parameters ...
    assert not np.array_equal(got, before)  # ... which one step moved away from stage 1's


def test_the_stream_depends_on_train_seed_and_data_shuffle_seed(own_text):
  """Why stage 2 must keep stage 1's ``train.seed`` and ``data.shuffle_seed``: its iterator is built from
  its own config and only the position is restored, and either seed reorders the documents."""
  base = experiment(overrides(own_text))
  reference = reference_batches(base, 2)
  for key, value in (("train.seed", 1), ("data.shuffle_seed", 1)):
    other = reference_batches(experiment({**overrides(own_text), key: value}), 2)
    assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(reference, other)), key
