"""Packed documents (MATH §6.4): segment ids -> where documents start and each token's document.

Every op resets its state where the segment id changes between consecutive tokens; the first token
of a call never starts a document (the incoming state belongs to its segment).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common.pallas_utils import pad_axis


def document_starts(segment_ids_BxT: jax.Array | None, batch_size: int, length: int) -> jax.Array:
  """bool [B, T]: True where token t's segment id differs from token t-1's (never at t = 0)."""
  if segment_ids_BxT is None:
    return jnp.zeros((batch_size, length), dtype=bool)
  changed_BxTm1 = segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]
  return jnp.concatenate([jnp.zeros((batch_size, 1), dtype=bool), changed_BxTm1], axis=1)


def document_index(segment_ids_BxT: jax.Array | None, batch_size: int, length: int) -> jax.Array:
  """int32 [B, T]: 0 for each row's first document, +1 at every start. None gives zeros directly (XLA
  would fold a cumulative sum of constants at compile time, slowly)."""
  if segment_ids_BxT is None:
    return jnp.zeros((batch_size, length), jnp.int32)
  starts_BxT = document_starts(segment_ids_BxT, batch_size, length)
  return jnp.cumsum(starts_BxT, axis=1, dtype=jnp.int32)


class ChunkDocuments(NamedTuple):
  """Document arrays per batch row (int32), see ``chunk_documents``."""

  doc: jax.Array
  doc_row: jax.Array
  reads: jax.Array
  writes: jax.Array


def chunk_documents(doc_BxT: jax.Array, Tp: int, C: int) -> ChunkDocuments:
  """The document index edge-padded to Tp as ``doc`` [B, Tp, 1] and ``doc_row`` [B, 1, Tp]; ``reads``
  [B, Tp, 1]: 1 in the document of the state entering the token's chunk of C; ``writes``: 1 in the
  document of the chunk's last token."""
  B = doc_BxT.shape[0]
  doc = pad_axis(doc_BxT.astype(jnp.int32), 1, Tp, mode="edge")
  previous = jnp.concatenate([doc[:, :1], doc[:, :-1]], axis=1)
  chunks = lambda x: x.reshape(B, Tp // C, C)
  state_doc_BxNx1 = chunks(previous)[:, :, :1]
  last_doc_BxNx1 = chunks(doc)[:, :, -1:]
  flag = lambda x: x.reshape(B, Tp, 1).astype(jnp.int32)
  return ChunkDocuments(doc[:, :, None], doc[:, None, :], flag(chunks(doc) == state_doc_BxNx1),
               flag(chunks(doc) == last_doc_BxNx1))
