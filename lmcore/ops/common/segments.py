"""Packed documents (MATH §6.4): segment ids -> where documents start and which document each token is in.

Every op resets its state where the segment id changes between consecutive tokens, and no token sees a
token of another document. The first token of a call never starts a document: the incoming state
belongs to its segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def document_starts(segment_ids_BxT: jax.Array | None, batch_size: int, length: int) -> jax.Array:
  """bool [B, T]: True where token t's segment id differs from token t-1's (never at t = 0)."""
  if segment_ids_BxT is None:
    return jnp.zeros((batch_size, length), dtype=bool)
  changed_BxTm1 = segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]
  return jnp.concatenate([jnp.zeros((batch_size, 1), dtype=bool), changed_BxTm1], axis=1)


def document_index(segment_ids_BxT: jax.Array | None, batch_size: int, length: int) -> jax.Array:
  """int32 [B, T]: 0 for the first document of each row, +1 at every start. Two tokens are in the
  same document exactly when their indices are equal; None (one document) gives zeros."""
  starts_BxT = document_starts(segment_ids_BxT, batch_size, length)
  return jnp.cumsum(starts_BxT, axis=1, dtype=jnp.int32)
