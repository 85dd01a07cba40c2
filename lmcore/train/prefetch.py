"""Batches on the device ahead of the training loop: one thread reads the data iterator and places each
batch on the mesh while the previous steps run, so the loop's ``next`` only waits when the input
pipeline is slower than the steps."""

from __future__ import annotations

import queue
import threading
from typing import Any

from lmcore.train import sharding

DEPTH = 2  # batches placed ahead of the one in use
_POLL_S = 0.1


class _Failed:
  def __init__(self, error: BaseException):
    self.error = error


class DevicePrefetch:
  """``next``: the iterator's next batch as global arrays on ``mesh``. ``get_state``: the iterator's state
  after the batches ``next`` has returned (not those in flight), what a save records and a resume
  continues from. Errors of the iterator are raised by the ``next`` that would have returned the batch."""

  def __init__(self, iterator, mesh, depth: int = DEPTH):
    self._iterator = iterator
    self._mesh = mesh
    self._state = iterator.get_state()
    self._ready: queue.Queue = queue.Queue(depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._fill, name="device-prefetch", daemon=True)
    self._thread.start()

  def _fill(self) -> None:
    while not self._stop.is_set():
      try:
        batch = next(self._iterator)
        item: Any = (sharding.global_batch(batch, self._mesh), self._iterator.get_state())
      except BaseException as e:  # handed to the loop's thread, which raises it
        item = _Failed(e)
      while not self._stop.is_set():
        try:
          self._ready.put(item, timeout=_POLL_S)
          break
        except queue.Full:
          continue
      if isinstance(item, _Failed):
        return

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, Any]:
    item = self._ready.get()
    if isinstance(item, _Failed):
      raise item.error
    batch, self._state = item
    return batch

  def get_state(self) -> dict[str, Any]:
    return self._state

  def close(self) -> None:
    """Stops the thread (the iterator itself is closed by its owner, which may do it first)."""
    self._stop.set()
    while True:
      try:
        self._ready.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout=5 * _POLL_S)
