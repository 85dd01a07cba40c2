"""Runs of one process share a compiled train step only when it is the same program: ``step_key``
ignores what only the loop reads (seed, checkpoint cadence) and tells apart the model, the optimizer
settings and the batch layout; a run whose key was seen before compiles and traces nothing."""

import dataclasses

import jax

from lmcore import config as cfg_lib
from lmcore.train import loop as train_lib
from lmcore.train import sharding
from lmcore.train import state as state_lib
from lmcore.train.optim import make_optimizer


MODEL = dict(vocab_size=97, d_model=16, n_layers=1, pattern="softmax*1", mlp_hidden=32, dtype="float32",
             mixers={"softmax": {"n_heads": 2}})


def experiment(model=MODEL, **train) -> cfg_lib.ExperimentConfig:
  model = cfg_lib.model_config(model)
  data = dataclasses.replace(cfg_lib.DataConfig(), seq_len=8)
  return dataclasses.replace(cfg_lib.ExperimentConfig(), model=model, data=data,
                             train=cfg_lib.TrainConfig(**{"steps": 10, "batch_size": 2, **train}))


def abstract_run(config: cfg_lib.ExperimentConfig):
  """A ``Run`` as far as ``compile_train_step`` reads it, its arrays as sharded ShapeDtypeStructs."""
  tx = make_optimizer(config.train)
  graphdef, params, rest, shardings = state_lib.make_shardings(config, sharding.make_mesh(config.mesh), tx)
  place = lambda tree, s: jax.tree.map(lambda x, y: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=y), tree, s)  # noqa: E731
  params = place(params, shardings.params)
  opt_state = place(jax.eval_shape(tx.init, params), shardings.opt_state)
  return state_lib.Run(config, "", graphdef, params, place(rest, shardings.rest), tx, opt_state, None, None,
                       None, {}, shardings)


def key(config):
  run = abstract_run(config)
  inputs = (run.params, run.opt_state, run.rest, state_lib.abstract_batch(config, run.shardings), 0)
  return train_lib.step_key(run.graphdef, config, run.shardings, inputs)


def test_the_key_ignores_loop_only_fields_and_tells_steps_apart():
  base = experiment()
  assert key(base) == key(experiment(seed=3, checkpoint_every=7, log_every=2, init_from="x", eval_every=5))
  different = {
      "model width": experiment({**MODEL, "d_model": 32}),
      "model depth": experiment({**MODEL, "n_layers": 2, "pattern": "softmax*2"}),
      "heads": experiment({**MODEL, "mixers": {"softmax": {"n_heads": 4}}}),
      "learning rate": experiment(learning_rate=3e-3),
      "schedule length": experiment(steps=11),
      "micro-batches": experiment(grad_accum=2),
      "batch size": experiment(batch_size=4),
      "segments": dataclasses.replace(base, data=dataclasses.replace(base.data, segment_ids=True)),
  }
  for what, config in different.items():
    assert key(config) != key(base), what


def test_a_run_with_a_seen_key_reuses_the_executable_without_tracing(monkeypatch):
  monkeypatch.setattr(train_lib, "_COMPILED_STEPS", {})
  monkeypatch.setattr(train_lib, "_STEP_TEXTS", {})
  built = []
  make = train_lib.make_train_step
  monkeypatch.setattr(train_lib, "make_train_step", lambda *a: built.append(a[2]) or make(*a))

  def compiled(config):
    run = abstract_run(config)
    return train_lib.compile_train_step(run, state_lib.abstract_batch(config, run.shardings))

  first = compiled(experiment())
  assert compiled(experiment(seed=1, checkpoint_every=3)) is first and len(built) == 1
  wider = compiled(experiment({**MODEL, "d_model": 32}))
  assert wider is not first and len(built) == 2
