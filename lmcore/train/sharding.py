"""Data parallelism over every device: a 1-D ``("data",)`` mesh, replicated parameters, sharded batches.

Multi-host: ``initialize_distributed()`` before anything touches devices; each process feeds its own
shard of the batch (the data pipeline shards documents by ``process_index``) and
``global_batch`` assembles the global array.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def initialize_distributed() -> None:
  """``jax.distributed.initialize()`` where a cluster is detected; a no-op on a single host."""
  try:
    jax.distributed.initialize()
  except (ValueError, RuntimeError):
    pass  # Single process: no coordinator to find.


@functools.cache
def mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def replicated() -> NamedSharding:
  return NamedSharding(mesh(), P())


def replicate(tree):
  return jax.device_put(tree, replicated())


def global_batch(local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """Per-process numpy batch -> global arrays sharded on the batch axis."""
  sharding = NamedSharding(mesh(), P("data"))
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
