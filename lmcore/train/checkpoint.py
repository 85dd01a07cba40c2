"""Orbax checkpoints of {params, non-trainable model state, optimizer state, step, data iterator, meta}.

Saves are asynchronous and atomic (a temporary folder renamed when complete); old steps go by the
keep-last-N / keep-every-K policy only after a newer save commits. A save costs the training loop the
dispatch of an on-device copy of the state: a background thread hands the copy to Orbax, which moves it
to the host and writes it. The metadata holds a checksum of
each parameter: a restore checks it and finiteness, and names the latest earlier step that passes.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lmcore.config import TrainConfig
from lmcore.errors import UserError

META_VERSION = 1
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


class CheckpointError(UserError, RuntimeError):
  """A checkpoint that cannot be used; the message says which, why and what to do. Nothing is deleted."""


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """sum_i bits(x_i) * (2 i + 1) mod 2^32: any change of one element changes it (odd weights are
  invertible mod 2^32), and the modular sum does not depend on how the array is sharded."""
  bits = (x.astype(jnp.uint32) if x.dtype == jnp.bool_
          else jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[x.dtype.itemsize]).astype(jnp.uint32))
  weights = (jnp.arange(x.size, dtype=jnp.uint32) * 2 + 1).reshape(x.shape)
  return jnp.sum(bits * weights, dtype=jnp.uint32)


@jax.jit
def _checks(params):
  finite = lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)  # noqa: E731
  return jax.tree.map(_leaf_checksum, params), jax.tree.map(finite, params)


def _named_ints(sums) -> dict[str, int]:
  """{"path/to/param": value} of a pytree of device scalars, fetched in one transfer."""
  return {_path_name(p): int(v) for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(sums))[0]}


def start_checksums(params):
  """The checksums of a parameter pytree, dispatched on its devices (device scalars, fetched later)."""
  return _checks(params)[0]


def param_checksums(params) -> dict[str, int]:
  """{"path/to/param": checksum} of a parameter pytree, computed on its devices."""
  return _named_ints(start_checksums(params))


def param_problem(params, stored: dict[str, int] | None) -> str | None:
  """Why restored ``params`` are not what was saved (checksum or non-finite values), or None."""
  sums, finite = _checks(params)
  sums = _named_ints(sums)
  for path, ok in jax.tree_util.tree_flatten_with_path(finite)[0]:
    if not bool(np.asarray(ok)):
      return f"parameter '{_path_name(path)}' holds NaN or inf"
  for name, value in sums.items():
    if stored and name in stored and stored[name] != value:
      return f"parameter '{name}' differs from the checksum stored when it was written"
  return None


def param_signature(params) -> dict[str, list[int]]:
  """{"path/to/param": shape} — what decides whether a checkpoint fits a model."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {_path_name(path): list(leaf.shape) for path, leaf in flat}


def resolve_checkpoint_dir(path: str) -> str:
  """Accepts a run's workdir or its ``checkpoints`` folder."""
  candidate = os.path.join(path, "checkpoints")
  return candidate if os.path.isdir(candidate) else path


class _Position:
  """A data iterator's position when a save starts, in the form Grain's Orbax handler writes (the
  iterator may move on, or stop, before the save is written)."""

  def __init__(self, iterator):
    state = iterator.get_state()
    self._state = json.dumps(state, indent=4).encode() if isinstance(state, dict) else state

  def get_state(self) -> bytes:
    return self._state


def _bytes_per_device(tree) -> int:
  """Bytes of ``tree``'s arrays that the most loaded device holds (each leaf's shard on every device of
  its sharding); host values (numpy, Python numbers) take none."""
  per_device: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    if not isinstance(x, jax.Array):
      continue
    nbytes = int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
    for device in x.sharding.device_set:
      per_device[device] = per_device.get(device, 0) + nbytes
  return max(per_device.values(), default=0)


def room_for_copy(tree, margin: float = 1.1) -> bool:
  """Whether every local device can hold another copy of its part of ``tree`` (with ``margin``); True
  on devices that report no memory limit (CPU)."""
  need = _bytes_per_device(tree) * margin
  for device in jax.local_devices():
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats and stats["bytes_limit"] - stats.get("bytes_in_use", 0) < need:
      return False
  return True


class _ReadOnlyNotice(logging.Filter):
  """Drops the WARNING every read-only Orbax manager logs (other runs are read on purpose)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.msg != "Given directory is read only=%s"


def _manager(directory: str, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
  if not options.read_only:
    return ocp.CheckpointManager(directory, options=options)
  absl_logger, notice = logging.getLogger("absl"), _ReadOnlyNotice()  # Orbax logs through absl
  absl_logger.addFilter(notice)
  try:
    return ocp.CheckpointManager(directory, options=options)
  finally:
    absl_logger.removeFilter(notice)


class Checkpointer:
  """``ocp.CheckpointManager`` with this project's items and policies; ``read_only`` never writes."""

  def __init__(self, directory: str, train: TrainConfig | None = None, *, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    if read_only:  # no saves: no save interval, no preservation policy
      options = ocp.CheckpointManagerOptions(create=False, read_only=True, save_interval_steps=0,
                                             enable_async_checkpointing=False)
    else:
      policies = [ocp.checkpoint_managers.LatestN(train.keep_last if train else 2)]
      if train and train.keep_every:
        policies.append(ocp.checkpoint_managers.EveryNSteps(train.keep_every))
      options = ocp.CheckpointManagerOptions(
          create=True, preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
    self.manager = _manager(self.directory, options)
    self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
    self._pending: concurrent.futures.Future | None = None

  def latest_step(self) -> int | None:
    self._settle()
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    self._settle()
    return list(self.manager.all_steps())

  def save(self, step: int, state: dict[str, Any], data_iterator, meta: dict[str, Any]) -> None:
    """Starts an async save of ``state`` (pytree), the data iterator's current position and ``meta``
    (JSON, with the checksums of ``state["params"]`` added); the caller may then change or donate
    ``state`` and advance or close the iterator. Where the devices have room, the state is copied on
    them and a background thread starts the Orbax save of the copy; otherwise Orbax copies it to the
    host before this returns. A save waits for the previous one to be started; errors of a background
    save are raised by the next ``save``, ``wait`` or ``close``."""
    self._raise_pending()
    sums = start_checksums(state["params"])  # dispatched from this thread, in the order of its other programs
    position = _Position(data_iterator) if data_iterator is not None else None
    if room_for_copy(state):
      copy = jax.device_put(state, may_alias=False)
      self._pending = self._writer.submit(self._write, step, copy, sums, position, meta)
    else:
      self._write(step, state, sums, position, meta)

  def _write(self, step: int, state: dict[str, Any], sums, position: _Position | None,
             meta: dict[str, Any]) -> None:
    meta = {**meta, "param_checksums": _named_ints(sums)}
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if position is not None:
      items["data"] = grain.checkpoint.CheckpointSave(position)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def _settle(self) -> None:
    """Waits until the background save, if any, has been handed to Orbax (its errors left to raise)."""
    if self._pending is not None:
      concurrent.futures.wait([self._pending])

  def _raise_pending(self) -> None:
    pending, self._pending = self._pending, None
    if pending is not None:
      pending.result()

  def read_meta(self, step: int) -> dict[str, Any]:
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # Orbax raises several types for missing/corrupted items.
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} has no readable metadata ({type(e).__name__}: "
          f"{e}). It was not written by this codebase or it is corrupted. Nothing was deleted: move that "
          f"step folder aside to resume from an earlier step, or use a new --workdir.") from e
    return restored["meta"]

  def check_compatible(self, step: int, expected_signature: dict[str, list[int]]) -> dict[str, Any]:
    """Raises ``CheckpointError`` when the stored parameters do not fit the current model."""
    meta = self.read_meta(step)
    stored = meta.get("param_signature", {})
    if stored != expected_signature:
      missing = sorted(set(expected_signature) - set(stored))[:5]
      extra = sorted(set(stored) - set(expected_signature))[:5]
      shape = sorted(k for k in set(stored) & set(expected_signature)
                     if stored[k] != expected_signature[k])[:5]
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} was written by a different model "
          f"(stored model: {json.dumps(meta.get('model_summary', {}))}). Parameters missing from it: "
          f"{missing}; unexpected in it: {extra}; with other shapes: {shape}. Use the config that wrote "
          f"it, or a new --workdir. Nothing was deleted.")
    return meta

  def restore(self, step: int, abstract_state: dict[str, Any], data_iterator) -> dict[str, Any]:
    """Restores the pytree ``state`` (shapes/dtypes/shardings from ``abstract_state``) and the iterator."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} could not be read ({type(e).__name__}: {e}). "
          f"It may be corrupted or incomplete. Nothing was deleted: move that step folder aside to "
          f"resume from an earlier step, or use a new --workdir.") from e
    self.verify(step, restored["state"]["params"], abstract_state["params"], abstract_state["rest"])
    return restored["state"]

  def restore_params(self, step: int, abstract_params, abstract_rest):
    """Parameters and non-trainable model state of ``step`` (not the optimizer), unverified."""
    target = {"params": abstract_params, "rest": abstract_rest}
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
    except Exception as e:
      raise CheckpointError(f"parameters of step {step} in {self.directory} could not be read "
                            f"({type(e).__name__}: {e}). Nothing was deleted.") from e
    return restored["state"]["params"], restored["state"]["rest"]

  def verify(self, step: int, params, abstract_params, abstract_rest) -> None:
    """Raises ``CheckpointError`` naming ``step`` and the latest earlier good step when ``params`` are
    not what was saved (checksum) or are not finite."""
    problem = param_problem(params, self.read_meta(step).get("param_checksums"))
    if problem is None:
      return
    good = self._latest_good_before(step, abstract_params, abstract_rest)
    fallback = (f"The latest good checkpoint before it is step {good}: evaluate it with eval.py --step={good}, "
                f"or move the folder {os.path.join(self.directory, str(step))} aside to resume from it."
                if good is not None else "No earlier checkpoint passes this check; start a new --workdir.")
    raise CheckpointError(f"checkpoint step {step} in {self.directory} is corrupted: {problem}. {fallback} "
                          "Nothing was deleted.")

  def _latest_good_before(self, step: int, abstract_params, abstract_rest) -> int | None:
    for earlier in sorted((s for s in self.all_steps() if s < step), reverse=True):
      try:
        params, _ = self.restore_params(earlier, abstract_params, abstract_rest)
        if param_problem(params, self.read_meta(earlier).get("param_checksums")) is None:
          return earlier
      except CheckpointError:
        continue
    return None

  def restore_data(self, step: int, data_iterator) -> None:
    """Sets ``data_iterator`` to the position saved at ``step`` (continuing another run's stream)."""
    try:
      self.manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data_iterator)))
    except Exception as e:
      raise CheckpointError(f"the data-iterator state of step {step} in {self.directory} could not be "
                            f"restored ({type(e).__name__}: {e}); the data config must match that run's.") from e

  def wait(self) -> None:
    """Returns once every save started is committed."""
    self._raise_pending()
    self.manager.wait_until_finished()

  def close(self) -> None:
    try:
      self._raise_pending()
    finally:
      self._writer.shutdown()
      self.manager.wait_until_finished()
      self.manager.close()


def open_latest(path: str, key: str) -> tuple[Checkpointer, int]:
  """A read-only ``Checkpointer`` on the run at ``path`` (a workdir or its ``checkpoints`` folder) and
  its latest step; ``CheckpointError`` naming the setting ``key`` when there is none."""
  directory = resolve_checkpoint_dir(path)
  if not path or not os.path.isdir(directory):
    raise CheckpointError(f"{key}={path!r}: no such folder. Point {key} at the workdir of a run that "
                          "saved checkpoints (or its 'checkpoints' folder).")
  checkpointer = Checkpointer(directory, read_only=True)
  step = checkpointer.latest_step()
  if step is None:
    checkpointer.close()
    raise CheckpointError(f"{key}={path!r}: {directory} holds no finished checkpoint. Point {key} at the "
                          "workdir of a run that saved checkpoints (or its 'checkpoints' folder).")
  return checkpointer, step


def committed_steps(workdir: str) -> list[int]:
  """The steps of the committed checkpoints in ``<workdir>/checkpoints``, ascending, read from the folder
  names alone (a save in progress is a temporary folder, renamed to its step when it commits)."""
  own = os.path.join(workdir, "checkpoints")
  return sorted(int(name) for name in os.listdir(own) if name.isdigit()) if os.path.isdir(own) else []


def check_init_sources(train: TrainConfig, workdir: str) -> None:
  """Before anything is created: ``train.init_from`` / ``train.init_data_from`` hold checkpoints (when
  they will be read, i.e. the workdir has none of its own to resume)."""
  if committed_steps(workdir):
    return
  for key, path in (("train.init_from", train.init_from), ("train.init_data_from", train.init_data_from)):
    if path:
      checkpointer, _ = open_latest(path, key)
      checkpointer.close()


def load_params(path: str, abstract_params, abstract_rest, *, step: int | None = None):
  """Parameters and non-trainable model state only, from a run's workdir or checkpoint folder
  (staged training, evaluation), verified against their checksums. Returns ``(params, rest, step, meta)``."""
  directory = resolve_checkpoint_dir(path)
  if not os.path.isdir(directory):
    raise CheckpointError(f"no checkpoint directory at {path!r}; pass a run's workdir or its "
                          f"'checkpoints' folder (train.init_from / --workdir).")
  checkpointer = Checkpointer(directory, read_only=True)
  step = checkpointer.latest_step() if step is None else step
  if step is None or step not in checkpointer.all_steps():
    raise CheckpointError(f"{directory} holds no finished checkpoint"
                          f"{'' if step is None else f' at step {step}'} (steps: {checkpointer.all_steps()}).")
  meta = checkpointer.check_compatible(step, param_signature(abstract_params))
  params, rest = checkpointer.restore_params(step, abstract_params, abstract_rest)
  checkpointer.verify(step, params, abstract_params, abstract_rest)
  return params, rest, step, meta
