"""Helper processes of the data layer (Grain's workers, the token cache's builders): what they import at
start and how they treat the signals meant for the training process."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys


def usable_cores() -> int:
  """The cores this process may run on (its affinity: a container's share, not the host's count)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def spawn_workers_light() -> None:
  """Makes spawned processes import ``lmcore.data.worker_main`` as their main module instead of this
  process's: multiprocessing's "spawn" children import ``__main__.__spec__.name`` when it is set. A
  process without a ``__main__`` module (an embedded interpreter) is left as it is."""
  main = sys.modules.get("__main__")
  if main is not None and getattr(main, "__spec__", None) is None:
    main.__spec__ = importlib.util.find_spec("lmcore.data.worker_main")


def leave_signals_to_the_parent(*_) -> None:
  """Worker start-up: SIGINT and SIGTERM, sent to the whole process group, are for the training process
  (which saves, then stops its workers); a worker whose parent is gone exits on them. Takes and ignores
  Grain's (worker_index, worker_count)."""
  parent = os.getppid()

  def handle(signum, frame):
    del frame
    if os.getppid() != parent:
      os._exit(128 + signum)

  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, handle)
