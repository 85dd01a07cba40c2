"""A workdir is one run: one writer at a time, and a record of the config its checkpoints were trained with.

* ``WorkdirLock``: an exclusive ``flock`` on ``<workdir>/.lock`` for the run's lifetime. The file holds
  the holder's pid, host and start time, for the one line a second process prints before it stops. The
  kernel drops the lock when its holder exits, however it exits (SIGKILL too), so no stale lock is ever
  left to remove. On several hosts process 0 holds it. Readers (``eval.py``) take no lock.
* ``run_info.json``: the config (and model card, tokenizer, data fingerprint, devices) of the run's first
  start, never rewritten by a resume.
* ``config_history.jsonl``: one row per field changed at a resume: ``{"step", "field", "old", "new",
  "time"}`` (``old`` / ``new`` left out where the field did not exist). The config the checkpoints were
  trained with is ``run_info.json``'s with these rows applied in order.

``claim(config, workdir, accept)`` is what a training run holds: the checks that need no workdir, the
lock, and at a resume the field-by-field comparison of the config with the checkpoints' one. Fields of
``FREE_ON_RESUME`` change freely (those of ``RECORDED_FREE`` are still written to the history); any
other change stops the resume with one line naming each field, unless ``--accept_config_changes`` names
it, and then it goes to the history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from lmcore.config import ExperimentConfig, to_jsonable
from lmcore.errors import ConfigChanged, ConfigError, WorkdirInUse
from lmcore.train import checkpoint as ckpt_lib
from lmcore.train import sharding
from lmcore.train import state as state_lib

LOCK_FILE = ".lock"
RUN_INFO_FILE = "run_info.json"
HISTORY_FILE = "config_history.jsonl"
ACCEPT_FLAG = "--accept_config_changes"

# Config fields (dotted keys; a group name covers every field under it) that a resume may change without
# the flag. Everything else defines the model, the data or the optimisation. docs/DECISIONS.md says why.
FREE_ON_RESUME: tuple[str, ...] = (
    # What is logged, evaluated, saved and profiled, and when.
    "name", "wandb", "eval", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.keep_last", "train.keep_every", "train.monitor_every",
    "train.profile_steps",
    # The run's length. The cosine schedule ends at train.steps, so a new length changes the learning
    # rate from the resumed step on: recorded in the history (RECORDED_FREE), without asking.
    "train.steps",
    # Read only by a start without checkpoints.
    "train.init_from", "train.init_data_from",
    # Where files are, and how the same computation is spread and scheduled.
    "data.cache_dir", "data.token_cache", "data.token_cache_processes", "data.worker_kind",
    "data.heldout.path",
    "train.compilation_cache", "mesh",
    "model.remat", "train.grad_accum", "train.loss_impl", "train.loss_block_tokens",
)
# Free fields whose change alters the training trajectory: written to the history, silently.
RECORDED_FREE: tuple[str, ...] = ("train.steps",)


# ------------------------------------------------------------------------------------------- the lock


class WorkdirLock:
  """An exclusive ``flock`` on ``<workdir>/.lock``; ``acquire`` creates the workdir if needed and raises
  ``WorkdirInUse`` (changing nothing) when another process holds it. A child forked from the holder
  without exec shares the lock until it exits; the file is opened close-on-exec."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd: int | None = None

  def acquire(self) -> WorkdirLock:
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # no O_TRUNC: a holder's record
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a file system without locks (ENOLCK, ...)
        os.close(fd)
        print(f"note: {self.path} cannot be locked ({os.strerror(e.errno)}); nothing stops a second "
              "process from writing this workdir.", flush=True)
        return self
      holder = _holder(fd)
      os.close(fd)
      raise WorkdirInUse(f"{self.workdir} is in use by {holder}; stop it first, or use another "
                         "--workdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder_record()).encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    """Empties the record and drops the lock (idempotent)."""
    fd, self._fd = self._fd, None
    if fd is None:
      return
    try:
      os.ftruncate(fd, 0)
    finally:
      os.close(fd)  # closing the only descriptor drops the flock

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def holder_record() -> dict[str, Any]:
  """What ``.lock`` holds while this process has it."""
  return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _holder(fd: int, attempts: int = 20) -> str:
  """The holder of a held lock file as "pid N on host H since T". A holder that has just taken the lock
  writes its record a moment later, so an empty file is read again for up to a second."""
  for attempt in range(attempts):
    try:
      record = json.loads(os.pread(fd, 4096, 0))
      return f"pid {record['pid']} on host {record['host']} since {record['since']}"
    except (ValueError, KeyError, TypeError):
      if attempt + 1 < attempts:
        time.sleep(0.05)
  return "another process (its record in .lock is unreadable)"


# ---------------------------------------------------------------------------------- the config record


_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class Change:
  """One config field whose value differs from the checkpoints' (``_ABSENT``: the field did not exist)."""

  field: str
  old: Any = _ABSENT
  new: Any = _ABSENT

  def describe(self) -> str:
    return f"{self.field} {_shown(self.old)} -> {_shown(self.new)}"

  def row(self, step: int) -> dict[str, Any]:
    values = {k: v for k, v in (("old", self.old), ("new", self.new)) if v is not _ABSENT}
    return {"step": step, "field": self.field, **values, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _shown(value: Any) -> str:
  return "(absent)" if value is _ABSENT else json.dumps(value)


def covers(names: Sequence[str], field: str) -> bool:
  """Whether ``field`` is one of ``names`` or lies in a group one of them names."""
  return any(field == name or field.startswith(name + ".") for name in names)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Dotted key -> value of a JSON config (``to_jsonable``), in config order: ``train.learning_rate``.
  A list of named records (``data.sources``) is keyed by name, as its overrides are
  (``data.sources.<name>.path``)."""
  flat: dict[str, Any] = {}
  for key, value in tree.items():
    dotted = f"{prefix}{key}"
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
      value = {v["name"]: v for v in value}
    if isinstance(value, dict) and value:
      flat.update(flatten(value, dotted + "."))
    else:
      flat[dotted] = value
  return flat


def flat_config(config: ExperimentConfig) -> dict[str, Any]:
  """``flatten`` of the config as ``run_info.json`` stores it (tuples as lists)."""
  return flatten(json.loads(json.dumps(to_jsonable(config))))


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def read_history(workdir: str) -> list[dict[str, Any]]:
  """The rows of ``<workdir>/config_history.jsonl`` in the order written (empty when there is none)."""
  path = os.path.join(workdir, HISTORY_FILE)
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def history_until(workdir: str, step: int) -> list[dict[str, Any]]:
  """The history rows that apply to checkpoint ``step``: changes made at resumes from step <= ``step``."""
  return [row for row in read_history(workdir) if row["step"] <= step]


def trained_config(workdir: str) -> dict[str, Any] | None:
  """The flat config the workdir's checkpoints were trained with: ``run_info.json``'s, then every
  history row applied; None without ``run_info.json``."""
  path = os.path.join(workdir, RUN_INFO_FILE)
  if not os.path.isfile(path):
    return None
  flat = flatten(read_json(path)["config"])
  for row in read_history(workdir):
    if "new" in row:
      flat[row["field"]] = row["new"]
    else:
      flat.pop(row["field"], None)
  return flat


def config_changes(trained: Mapping[str, Any], now: Mapping[str, Any]) -> list[Change]:
  """Every field whose value differs, in the order of ``now`` (then the fields ``now`` lacks)."""
  fields = list(now) + [k for k in trained if k not in now]
  return [Change(k, trained.get(k, _ABSENT), now.get(k, _ABSENT)) for k in fields
          if trained.get(k, _ABSENT) != now.get(k, _ABSENT)]


def check_accept_names(accept: Sequence[str], *flat_configs: Mapping[str, Any]) -> None:
  """Each name of ``--accept_config_changes`` is a field or group of the configs."""
  for name in accept:
    if not any(covers([name], k) for flat in flat_configs for k in flat):
      raise ConfigError(f"{ACCEPT_FLAG}: {name!r} is no config field; name the fields as the refused "
                        "resume listed them, e.g. train.learning_rate.")


def check_resume(config: ExperimentConfig, workdir: str, accept: Sequence[str] = ()) -> list[Change]:
  """At a resume (committed checkpoints in ``workdir``): the config against the checkpoints' one.
  When a change outside ``FREE_ON_RESUME`` is not covered by ``accept``, raises ``ConfigChanged`` naming
  every change outside it and the flag that accepts them all; otherwise appends the accepted changes and
  those of ``RECORDED_FREE`` to the history (process 0) and returns them."""
  steps = ckpt_lib.committed_steps(workdir)
  if not steps:
    return []
  trained, now = trained_config(workdir), flat_config(config)
  main = sharding.is_main_process()
  if trained is None:
    if main:
      print(f"note: {workdir} has checkpoints but no {RUN_INFO_FILE}: the config they were trained with is "
            "unknown, so this resume is not compared with it.", flush=True)
    return []
  changes = config_changes(trained, now)
  ruled = [c for c in changes if not covers(FREE_ON_RESUME, c.field)]
  refused = [c for c in ruled if not covers(accept, c.field)]
  step = steps[-1]
  if refused:
    if any(c.field.startswith("model.") for c in refused):
      check_model_fits(config, workdir, step)  # a checkpoint no flag can load is refused as such
    them = "it" if len(ruled) == 1 else "them"
    raise ConfigChanged(
        f"{workdir} holds checkpoints (latest: step {step}) trained with another config: "
        f"{'; '.join(c.describe() for c in ruled)}. To resume with {them} and record {them} in "
        f"{os.path.join(workdir, HISTORY_FILE)}, add {ACCEPT_FLAG}={','.join(c.field for c in ruled)}; "
        "or use another --workdir.")
  recorded = [c for c in changes if c in ruled or covers(RECORDED_FREE, c.field)]
  if recorded and main:
    with open(os.path.join(workdir, HISTORY_FILE), "a") as f:
      f.writelines(json.dumps(c.row(step)) + "\n" for c in recorded)
  if ruled and main:
    print(f"Accepted config changes at step {step}: {'; '.join(c.describe() for c in ruled)} (recorded in "
          f"{os.path.join(workdir, HISTORY_FILE)})", flush=True)
  return recorded


def check_model_fits(config: ExperimentConfig, workdir: str, step: int) -> None:
  """``CheckpointError`` when the parameters of checkpoint ``step`` do not fit ``config.model``."""
  _, abstract_params, _ = state_lib.abstract_model(config.model)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  try:
    checkpointer.check_compatible(step, ckpt_lib.param_signature(abstract_params))
  finally:
    checkpointer.close()


@contextlib.contextmanager
def claim(config: ExperimentConfig, workdir: str, accept: Sequence[str] = ()) -> Iterator[None]:
  """A training run's hold on ``workdir`` for the ``with`` block: ``state.check_start`` and the names of
  ``accept`` (a config that cannot run fails before the workdir exists), the lock (process 0 only: the
  other processes of a run cannot train without it), then ``check_resume``."""
  state_lib.check_start(config, workdir)
  check_accept_names(accept, flat_config(config), trained_config(workdir) or {})
  lock = WorkdirLock(workdir).acquire() if sharding.is_main_process() else None
  try:
    check_resume(config, workdir, accept)
    yield
  finally:
    if lock is not None:
      lock.release()


# ---------------------------------------------------------------------------------------- the run card


def write_run_info(workdir: str, info: Mapping[str, Any], fresh: bool) -> bool:
  """Writes ``run_info.json`` at a start without checkpoints (``fresh``) or where it is missing; a resume
  keeps the original. Returns whether it was written."""
  path = os.path.join(workdir, RUN_INFO_FILE)
  if not fresh and os.path.isfile(path):
    return False
  with open(path + ".tmp", "w") as f:
    json.dump({**info, "config_history_file": HISTORY_FILE}, f, indent=1)
  os.replace(path + ".tmp", path)
  return True


def history_line(workdir: str) -> str | None:
  """One console line citing the config history, None when it is empty."""
  rows = read_history(workdir)
  if not rows:
    return None
  changes = "; ".join(f"{Change(r['field'], r.get('old', _ABSENT), r.get('new', _ABSENT)).describe()} "
                      f"at step {r['step']}" for r in rows)
  return (f"config changed on resume since the first start ({len(rows)}, "
          f"{os.path.join(workdir, HISTORY_FILE)}): {changes}")
