"""The jitted train step: gradient accumulation over micro-batches is the same step as one pass over
the whole global batch.

The loss is a token mean and micro-batches hold equally many tokens, so the mean of the micro-batch
losses (and gradients) is the global one: accumulating 1, 2 or 4 micro-batches must give the same
loss, gradient norm, learning rate and updated parameters (fp32, up to summation order). Rows pack
several documents (segment ids on), so micro-batches must also split segment ids and positions
exactly like the tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.model import LanguageModel
from lmcore.numerics import relative_l2
from lmcore.train.loop import make_train_step
from lmcore.train.optim import make_optimizer

BATCH, SEQ, VOCAB = 8, 16, 97
# These tests check arithmetic, not code generation: skip LLVM's expensive passes on a shared CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def experiment(grad_accum: int) -> cfg_lib.ExperimentConfig:
  model = cfg_lib.model_config(dict(vocab_size=VOCAB, d_model=16, n_layers=1, pattern="softmax*1",
                                    mlp_hidden=32, dtype="float32", mixers={"softmax": {"n_heads": 2}}))
  train = cfg_lib.TrainConfig(steps=10, batch_size=BATCH, grad_accum=grad_accum, learning_rate=3e-3,
                              warmup_steps=1, warmup_init_lr=1e-3)
  data = dataclasses.replace(cfg_lib.DataConfig(), seq_len=SEQ, segment_ids=True)
  return dataclasses.replace(cfg_lib.ExperimentConfig(), model=model, train=train, data=data)


def packed_batch(seed: int) -> dict[str, jnp.ndarray]:
  """[BATCH, SEQ + 1] windows of 2-4 documents each, rows all different."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, (BATCH, SEQ + 1))
  segment_ids = np.zeros((BATCH, SEQ + 1), np.int32)
  positions = np.zeros((BATCH, SEQ + 1), np.int32)
  for row in range(BATCH):
    starts = np.sort(rng.choice(np.arange(1, SEQ + 1), size=rng.integers(1, 4), replace=False))
    segment_ids[row] = np.searchsorted(starts, np.arange(SEQ + 1), side="right") + 1
    last_start = np.maximum.accumulate(np.where(np.isin(np.arange(SEQ + 1), starts), np.arange(SEQ + 1), 0))
    positions[row] = np.arange(SEQ + 1) - last_start
  return {"tokens": jnp.asarray(tokens, jnp.int32), "segment_ids": jnp.asarray(segment_ids),
          "positions": jnp.asarray(positions)}


def run_steps(grad_accum: int, batches) -> list:
  """Metrics and parameters after each step, from the same initial model and optimizer state."""
  config = experiment(grad_accum)
  graphdef, params, rest = nnx.split(LanguageModel(config.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  tx = make_optimizer(config.train)
  opt_state = tx.init(params)
  jitted = make_train_step(graphdef, tx, config)
  train_step = jitted.lower(params, opt_state, rest, batches[0], 0).compile(compiler_options=FAST_COMPILE)
  history = []
  for step, batch in enumerate(batches):
    params, opt_state, metrics = train_step(params, opt_state, rest, batch, step)
    history.append(jax.device_get((metrics, params)))
  return history


@pytest.fixture(scope="module")
def histories():
  batches = [packed_batch(seed) for seed in (1, 2)]
  return {accum: run_steps(accum, batches) for accum in (1, 2, 4)}


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_micro_batches_equal_one_pass_over_the_global_batch(histories, accum):
  for step, ((metrics, params), (want_metrics, want_params)) in enumerate(
      zip(histories[accum], histories[1])):
    where = f"grad_accum={accum}, step {step}"
    assert relative_l2(metrics["loss"], want_metrics["loss"]) < 1e-5, (where, metrics, want_metrics)
    assert relative_l2(metrics["grad_norm"], want_metrics["grad_norm"]) < 1e-5, (where, metrics,
                                                                                 want_metrics)
    assert metrics["learning_rate"] == want_metrics["learning_rate"], where
    flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, want in jax.tree_util.tree_flatten_with_path(want_params)[0]:
      error = relative_l2(flat[path], want)
      assert error < 1e-5, f"{where}: parameter {jax.tree_util.keystr(path)} differs by {error:.2e}"


def test_the_step_moves_the_parameters_and_reports_a_plausible_loss(histories):
  """The comparison above is not vacuous: the parameters change and the loss is about log(V) at
  initialisation."""
  (metrics, params), _ = histories[1]
  assert abs(float(metrics["loss"]) - np.log(VOCAB)) < 0.5 and float(metrics["grad_norm"]) > 0
  _, second = histories[1]
  moved = [relative_l2(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(second[1]))]
  assert max(moved) > 1e-4


def test_batch_size_not_divisible_by_grad_accum_names_both_keys():
  with pytest.raises(cfg_lib.ConfigError, match=r"train.batch_size=6 .*train.grad_accum=4"):
    cfg_lib.experiment_config({"train": {"batch_size": 6, "grad_accum": 4}})
