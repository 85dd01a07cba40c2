"""The run state: mesh, model, optimizer, data iterator and checkpointer, built once from the config,
and the two ways a run starts from a checkpoint (resume this run, or initialise from another run).

Parameters and optimizer state are created directly in their shardings (``sharding.train_shardings``);
a checkpoint restores into the shardings of the current mesh, whatever mesh wrote it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from lmcore import data as data_lib
from lmcore.config import ExperimentConfig, ModelConfig, to_jsonable
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
  shardings: sharding.TrainShardings
  step: int = 0


def run_meta(config: ExperimentConfig, params, tokenizer, fingerprint) -> dict[str, Any]:
  model = config.model
  return {"version": ckpt_lib.META_VERSION, "param_signature": ckpt_lib.param_signature(params),
          "model_summary": {"pattern": model.pattern, "d_model": model.d_model, "n_layers": model.n_layers,
                            "vocab_size": model.vocab_size},
          "model": to_jsonable(model), "tokenizer": tokenizer.name, "data_fingerprint": fingerprint}


def abstract_model(config: ModelConfig):
  """``(graphdef, params, rest)`` of ``LanguageModel(config)`` as pure dicts of ShapeDtypeStructs,
  without allocating anything."""
  abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def make_shardings(config: ExperimentConfig, mesh, tx: optax.GradientTransformation):
  """``(graphdef, abstract params, abstract rest, TrainShardings)`` of this config on ``mesh``."""
  graphdef, abstract_params, abstract_rest = abstract_model(config.model)
  shardings = sharding.train_shardings(mesh, abstract_params, abstract_rest, tx, config.model.d_model)
  return graphdef, abstract_params, abstract_rest, shardings


# The arrays of every training batch (lmcore.data.pipeline.FinishWindows), int32 [batch, T + 1].
BATCH_KEYS = ("tokens", "segment_ids", "positions")


def abstract_batch(config: ExperimentConfig, shardings: sharding.TrainShardings) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch the train step receives, as sharded ShapeDtypeStructs (AOT compilation)."""
  shape = (config.train.batch_size, config.data.seq_len + 1)
  return {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=shardings.batch) for k in BATCH_KEYS}


def init_params(config: ExperimentConfig, shardings: sharding.TrainShardings):
  """Freshly initialised ``(params, rest)`` (seed ``train.seed``), created in their shardings."""
  def init():
    model = LanguageModel(config.model, rngs=nnx.Rngs(config.train.seed))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  if jax.device_count() == 1:
    # One device: initialise op by op; the whole initialiser as one program (every random draw in one
    # module) compiles far slower than its eager ops.
    return jax.device_put(init(), (shardings.params, shardings.rest))
  return jax.jit(init, out_shardings=(shardings.params, shardings.rest))()


def init_opt_state(run: Run):
  """``tx.init`` of the run's parameters in the optimizer state's shardings; op by op on one device (as
  ``init_params``: a run compiles nothing for it)."""
  if jax.device_count() == 1:
    return jax.device_put(run.tx.init(run.params), run.shardings.opt_state)
  return jax.jit(run.tx.init, out_shardings=run.shardings.opt_state)(run.params)


def check_start(config: ExperimentConfig, workdir: str):
  """What must hold before the workdir is created: the mesh and batch fit the devices, the tokenizer
  fits the model, the data paths and the ``init_from`` sources exist. Returns ``(mesh, tokenizer)``."""
  mesh = sharding.make_mesh(config.mesh)
  sharding.check_batch(mesh, config.train.batch_size, config.train.grad_accum)
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer, data_lib.cache_dir(config.data))
  data_lib.check_vocab(tokenizer, config.model.vocab_size)
  data_lib.check_paths(config.data)
  ckpt_lib.check_init_sources(config.train, workdir)
  return mesh, tokenizer


def _no_phase(part: str):
  del part
  return contextlib.nullcontext()


def build_run(config: ExperimentConfig, workdir: str, phase=_no_phase) -> Run:
  """Mesh, model, optimizer, data and checkpoints; restores the workdir's latest checkpoint if any.
  A config that ``check_start`` refuses fails before the workdir is created. ``phase(part)``: a
  context manager around each part of the start-up (``checks``, ``model``, ``data``, ``restore``,
  ``init_from``), e.g. a run's phase clock."""
  with phase("checks"):
    mesh, tokenizer = check_start(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  tx = make_optimizer(config.train)
  with phase("model"):
    graphdef, _, _, shardings = make_shardings(config, mesh, tx)
    params, rest = init_params(config, shardings)
  with phase("data"):
    data_iterator = data_lib.make_train_iterator(
        config.data, tokenizer, batch_size=config.train.batch_size, seed=config.train.seed,
        process_index=jax.process_index(), process_count=jax.process_count())
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), config.train)
  meta = run_meta(config, params, tokenizer, data_lib.fingerprint(config.data))
  run = Run(config, workdir, graphdef, params, rest, tx, None, tokenizer, data_iterator, checkpointer, meta,
            shardings)
  with phase("model"):
    run.opt_state = init_opt_state(run)
  latest = checkpointer.latest_step()
  if latest is not None:
    with phase("restore"):
      resume(run, latest)
  elif config.train.init_from:
    with phase("init_from"):
      init_from(run)
  return run


def train_state(run: Run) -> dict[str, Any]:
  return {"params": run.params, "rest": run.rest, "opt_state": run.opt_state,
          "step": replicated_scalar(run.step, run.shardings.replicated)}


def replicated_scalar(value: int, replicated) -> jax.Array:
  """An int32 scalar on every device of the mesh (built per process, so valid on several hosts)."""
  return jax.make_array_from_callback((), replicated, lambda _: np.asarray(value, np.int32))


def resume(run: Run, step: int) -> None:
  run.checkpointer.check_compatible(step, run.meta["param_signature"])
  abstract = jax.tree.map(ocp_abstract, train_state(run))
  state = run.checkpointer.restore(step, abstract, run.data_iterator)
  run.params, run.rest, run.opt_state = state["params"], state["rest"], state["opt_state"]
  run.step = int(state["step"])
  if sharding.is_main_process():
    print(f"Resumed from step {run.step} in {run.checkpointer.directory}", flush=True)


def ocp_abstract(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def init_from(run: Run) -> None:
  """Stage chaining: parameters from another run (fresh optimizer), optionally its data position."""
  train = run.config.train
  params, rest, step, _ = ckpt_lib.load_params(train.init_from, jax.tree.map(ocp_abstract, run.params),
                                               jax.tree.map(ocp_abstract, run.rest))
  run.params, run.rest = params, rest
  run.opt_state = init_opt_state(run)
  main = sharding.is_main_process()
  if main:
    print(f"Initialised parameters from step {step} of {train.init_from}", flush=True)
  if train.init_data_from:
    source, data_step = ckpt_lib.open_latest(train.init_data_from, "train.init_data_from")
    source.restore_data(data_step, run.data_iterator)
    if main:
      print(f"Continuing the data stream of {train.init_data_from} (step {data_step})", flush=True)
