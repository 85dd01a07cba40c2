"""The run state: model, optimizer, data iterator and checkpointer, built once from the config, and
the two ways a run starts from a checkpoint (resume this run, or initialise from another run)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lmcore import data as data_lib
from lmcore.config import ExperimentConfig, to_jsonable
from lmcore.model import LanguageModel
from lmcore.train import checkpoint as ckpt_lib
from lmcore.train import sharding
from lmcore.train.optim import make_optimizer


@dataclasses.dataclass
class Run:
  """Everything the loop needs, built once from the config."""

  config: ExperimentConfig
  workdir: str
  graphdef: Any
  params: Any
  rest: Any
  tx: optax.GradientTransformation
  opt_state: Any
  tokenizer: Any
  data_iterator: Any
  checkpointer: ckpt_lib.Checkpointer
  meta: dict[str, Any]
  step: int = 0


def run_meta(config: ExperimentConfig, params, tokenizer, fingerprint) -> dict[str, Any]:
  model = config.model
  return {"version": ckpt_lib.META_VERSION, "param_signature": ckpt_lib.param_signature(params),
          "model_summary": {"pattern": model.pattern, "d_model": model.d_model, "n_layers": model.n_layers,
                            "vocab_size": model.vocab_size},
          "model": to_jsonable(model), "tokenizer": tokenizer.name, "data_fingerprint": fingerprint}


def build_run(config: ExperimentConfig, workdir: str) -> Run:
  """Model, optimizer, data and checkpoints; restores the workdir's latest checkpoint if any."""
  os.makedirs(workdir, exist_ok=True)
  cache_dir = data_lib.cache_dir(config.data)
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer, cache_dir)
  data_lib.check_vocab(tokenizer, config.model.vocab_size)
  model = LanguageModel(config.model, rngs=nnx.Rngs(config.train.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = sharding.replicate(nnx.to_pure_dict(params)), sharding.replicate(nnx.to_pure_dict(rest))
  tx = make_optimizer(config.train)
  data_iterator = data_lib.make_train_iterator(
      config.data, tokenizer, batch_size=config.train.batch_size, seed=config.train.seed,
      process_index=jax.process_index(), process_count=jax.process_count())
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), config.train)
  meta = run_meta(config, params, tokenizer, data_lib.fingerprint(config.data))
  run = Run(config, workdir, graphdef, params, rest, tx, tx.init(params), tokenizer, data_iterator,
            checkpointer, meta)
  latest = checkpointer.latest_step()
  if latest is not None:
    resume(run, latest)
  elif config.train.init_from:
    init_from(run)
  return run


def train_state(run: Run) -> dict[str, Any]:
  return {"params": run.params, "rest": run.rest, "opt_state": run.opt_state,
          "step": jnp.asarray(run.step, jnp.int32)}


def resume(run: Run, step: int) -> None:
  run.checkpointer.check_compatible(step, run.meta["param_signature"])
  abstract = jax.tree.map(ocp_abstract, train_state(run))
  state = run.checkpointer.restore(step, abstract, run.data_iterator)
  run.params, run.rest, run.opt_state = state["params"], state["rest"], state["opt_state"]
  run.step = int(state["step"])
  print(f"Resumed from step {run.step} in {run.checkpointer.directory}", flush=True)


def ocp_abstract(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def init_from(run: Run) -> None:
  """Stage chaining: parameters from another run (fresh optimizer), optionally its data position."""
  train = run.config.train
  params, rest, step, _ = ckpt_lib.load_params(train.init_from, jax.tree.map(ocp_abstract, run.params),
                                               jax.tree.map(ocp_abstract, run.rest))
  run.params, run.rest = sharding.replicate(params), sharding.replicate(rest)
  run.opt_state = run.tx.init(run.params)
  print(f"Initialised parameters from step {step} of {train.init_from}", flush=True)
  if train.init_data_from:
    source = ckpt_lib.Checkpointer(ckpt_lib.resolve_checkpoint_dir(train.init_data_from), read_only=True)
    data_step = source.latest_step()
    source.restore_data(data_step, run.data_iterator)
    print(f"Continuing the data stream of {train.init_data_from} (step {data_step})", flush=True)
