"""Checkpoints restore what the model cannot rebuild from its seed, and keep the steps they promise.

The end-to-end resume test (tests/test_train.py) trains a softmax model, whose only state is its
parameters, and resumes with the seed that built it: a checkpoint that lost the non-trainable state
(the Performer's fixed random features) would pass it, since the same seed rebuilds the same
features. Here the restoring model is built from another seed, so everything must come from disk.
"""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.model import LanguageModel
from lmcore.train import checkpoint as ckpt_lib
from lmcore.train.optim import make_optimizer


def performer_model(seed: int):
  config = cfg_lib.model_config(dict(
      vocab_size=97, d_model=16, n_layers=1, pattern="performer*1", mlp="none", dtype="float32",
      mixers={"performer": {"n_heads": 2, "head_dim": 8, "n_features": 8}}))
  _, params, rest = nnx.split(LanguageModel(config, rngs=nnx.Rngs(seed)), nnx.Param, ...)
  return config, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def assert_trees_equal(got, want):
  flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
  assert [p for p, _ in got_flat] == list(flat)
  for path, value in got_flat:
    assert value.dtype == flat[path].dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(value, flat[path], err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Step 3 of a Performer run (seed 0) after one optimizer update: params, fixed features,
  AdamW moments and count."""
  _, params, rest = performer_model(seed=0)
  train = cfg_lib.TrainConfig(warmup_steps=0)
  tx = make_optimizer(train)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
  updates, opt_state = tx.update(grads, tx.init(params), params)
  params = jax.tree.map(jnp.add, params, updates)
  state = {"params": params, "rest": rest, "opt_state": opt_state, "step": jnp.asarray(3, jnp.int32)}
  directory = tmp_path_factory.mktemp("run") / "checkpoints"
  checkpointer = ckpt_lib.Checkpointer(str(directory), train)
  meta = {"version": ckpt_lib.META_VERSION, "param_signature": ckpt_lib.param_signature(params)}
  checkpointer.save(3, state, None, meta)
  checkpointer.close()
  return directory, state, tx


def test_restore_takes_everything_from_disk_not_from_the_seed(saved):
  directory, state, tx = saved
  _, params_b, rest_b = performer_model(seed=1)
  features = lambda rest: jax.tree.leaves(rest)  # noqa: E731
  assert features(rest_b) and not np.array_equal(features(rest_b)[0], features(state["rest"])[0])
  target = {"params": params_b, "rest": rest_b, "opt_state": tx.init(params_b),
            "step": jnp.asarray(0, jnp.int32)}
  checkpointer = ckpt_lib.Checkpointer(str(directory), read_only=True)
  checkpointer.check_compatible(3, ckpt_lib.param_signature(params_b))
  restored = checkpointer.restore(3, abstract(target), None)
  assert_trees_equal(restored, state)


def test_load_params_for_init_from_brings_the_fixed_features_too(saved):
  """Stage chaining and evaluation load parameters and the non-trainable state (not the optimizer)."""
  directory, state, _ = saved
  _, params_b, rest_b = performer_model(seed=1)
  params, rest, step, meta = ckpt_lib.load_params(str(directory.parent), abstract(params_b),
                                                  abstract(rest_b))
  assert step == 3 and meta["param_signature"] == ckpt_lib.param_signature(params_b)
  assert_trees_equal(params, state["params"])
  assert_trees_equal(rest, state["rest"])


def test_reading_another_runs_checkpoints_logs_no_warning_and_writes_nothing(saved, caplog):
  """Read-only access (train.init_from, eval.py) says nothing: Orbax's notices about the options of a
  read-only manager are not warnings here. The folder is left exactly as it was."""
  directory, _, _ = saved
  before = sorted((p.relative_to(directory), p.stat().st_mtime_ns) for p in directory.rglob("*"))
  with caplog.at_level(logging.INFO):
    checkpointer = ckpt_lib.Checkpointer(str(directory), read_only=True)
    assert checkpointer.latest_step() == 3 and checkpointer.read_meta(3)["version"] == ckpt_lib.META_VERSION
    checkpointer.close()
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
  assert sorted((p.relative_to(directory), p.stat().st_mtime_ns) for p in directory.rglob("*")) == before
  logging.getLogger("absl").warning("Given directory is read only=%s", "x")  # the filter was scoped
  assert caplog.records[-1].getMessage() == "Given directory is read only=x"


def test_keep_last_and_keep_every_decide_which_steps_survive(tmp_path):
  train = cfg_lib.TrainConfig(keep_last=2, keep_every=3)
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), train)
  for step in range(1, 8):
    state = {"params": {"w": jnp.full((2,), float(step))}, "step": jnp.asarray(step, jnp.int32)}
    checkpointer.save(step, state, None, {"version": ckpt_lib.META_VERSION})
    checkpointer.wait()
  assert sorted(checkpointer.all_steps()) == [3, 6, 7]  # every third, and the last two
  checkpointer.close()


class CountingIterator:
  """A data iterator whose position is how many batches it has given (Grain's byte-state form)."""

  def __init__(self, position: int = 0):
    self.position = position

  def get_state(self) -> bytes:
    return json.dumps({"position": self.position}).encode()

  def set_state(self, state: bytes) -> None:
    self.position = json.loads(state)["position"]

  def start_prefetch(self) -> None:
    pass


def test_a_save_holds_the_state_and_position_it_was_given_though_both_move_on(tmp_path):
  """The loop donates the parameters to the next step and advances the iterator as soon as ``save``
  returns, before the save is written: the checkpoint holds the values and the position of the call."""
  w = jnp.arange(6.0).reshape(2, 3)
  state = {"params": {"w": w}, "rest": {}, "step": jnp.asarray(1, jnp.int32)}
  want = jax.tree.map(lambda x: np.array(x, copy=True), state)
  iterator = CountingIterator(5)
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), cfg_lib.TrainConfig())
  checkpointer.save(1, state, iterator, {"version": ckpt_lib.META_VERSION})
  jax.jit(lambda x: x * 2, donate_argnums=0)(w)
  iterator.position = 6
  checkpointer.close()
  assert w.is_deleted()
  reader = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), read_only=True)
  restored_iterator = CountingIterator()
  restored = reader.restore(1, abstract(want), restored_iterator)
  assert_trees_equal(restored, want)
  assert restored_iterator.position == 5
  reader.close()
