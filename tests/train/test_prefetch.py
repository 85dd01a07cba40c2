"""Batches placed on the device ahead of the loop: the same batches in order, the position of the last
one handed out (not of those in flight), the iterator's errors where the batch would have been."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from lmcore.errors import DataError
from lmcore.train import prefetch, sharding


class Counting:
  """Batches {"tokens": [[i]]}; its state is the number handed out; fails at ``fail_at`` when given."""

  def __init__(self, fail_at: int | None = None):
    self.i, self.fail_at = 0, fail_at

  def __next__(self):
    if self.i == self.fail_at:
      raise DataError("shard 3 is truncated")
    self.i += 1
    return {"tokens": np.full((jax.device_count(), 1), self.i, np.int32)}

  def get_state(self):
    return {"next": self.i}


def test_batches_in_order_with_the_position_of_the_last_one_handed_out():
  data = prefetch.DevicePrefetch(Counting(), sharding.make_mesh())
  try:
    assert data.get_state() == {"next": 0}
    for expected in range(1, 6):
      batch = next(data)
      assert isinstance(batch["tokens"], jax.Array) and int(batch["tokens"][0, 0]) == expected
      time.sleep(0.01)  # the thread runs ahead meanwhile
      assert data.get_state() == {"next": expected}
  finally:
    data.close()


def test_an_iterator_error_is_raised_by_the_next_that_would_have_returned_the_batch():
  data = prefetch.DevicePrefetch(Counting(fail_at=2), None)
  try:
    next(data), next(data)
    with pytest.raises(DataError, match="truncated"):
      next(data)
    assert data.get_state() == {"next": 2}
  finally:
    data.close()


def test_close_returns_while_the_thread_waits_on_a_full_queue():
  data = prefetch.DevicePrefetch(Counting(), None, depth=1)
  time.sleep(0.2)
  start = time.perf_counter()
  data.close()
  assert time.perf_counter() - start < 1.0
