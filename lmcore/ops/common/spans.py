"""A row of T tokens run as G rows of T / G ("spans"), for kernels that walk their state along T.

A fused-chunk kernel walks each (row, head) chunk by chunk, so at B = 1 a long row leaves most of a GPU
idle; cut into G spans (G a power of two, spans of whole chunks), the row becomes G rows walked side by
side. For an additive state the states entering the spans follow from the spans' totals L_g (over each
span's last document):

    E_0 = E (the row's incoming state),  E_g = c_g · (L_{g-1} + k_{g-1} · E_{g-1})  (g >= 1),

k_g = 1 when span g is one document, c_g = 1 when its first token is in span g-1's last document.
The map is linear: its transpose (``jax.linear_transpose``) takes the gradients of the entering
states to those of the totals and of the incoming state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


# "auto": spans until the (row, head) pairs reach PAIRS, none shorter than MIN_LENGTH tokens; totals
# are summed in parts of PART_LENGTH tokens (docs/BENCHMARKS.md, Spans).
PAIRS = 128
MIN_LENGTH = 2048
PART_LENGTH = 2048


def count(batch: int, heads: int, length: int, chunk: int, requested: int = 0) -> int:
  """G for [batch, length] rows of ``heads`` heads: ``requested`` (a power of two cutting ``length``
  into whole chunks, else ValueError), or for 0 the smallest power of two with batch · heads · G >=
  ``PAIRS`` that keeps spans of ``MIN_LENGTH`` tokens and whole chunks (1 when none does)."""
  if requested:
    if requested < 1 or requested & (requested - 1) or length % (requested * chunk):
      raise ValueError(f"spans={requested}: expected a power of two that cuts T = {length} into "
                       f"multiples of the {chunk}-token chunk (or 0 for auto)")
    return requested
  G = 1
  while (batch * heads * G < PAIRS and length % (2 * G * chunk) == 0
         and length // (2 * G) >= MIN_LENGTH):
    G *= 2
  return G


def parts(length: int, count: int, chunk: int) -> int:
  """How many parts each of ``count`` spans of a ``length``-token row is summed in: the most that
  cut the span into whole chunks of at least ``PART_LENGTH`` tokens each (1 for a short span)."""
  span = length // count
  K = max(1, span // max(PART_LENGTH, chunk))
  while K > 1 and span % (K * chunk):
    K -= 1
  return K


def to_rows(x_BxTx: jax.Array, G: int) -> jax.Array:
  """[B, T, ...] -> [B·G, T / G, ...]: span g of row b is row b·G + g."""
  B, T = x_BxTx.shape[:2]
  return x_BxTx.reshape(B * G, T // G, *x_BxTx.shape[2:])


def from_rows(x_BGxLx: jax.Array, G: int) -> jax.Array:
  """The inverse of ``to_rows``: [B·G, L, ...] -> [B, G·L, ...]."""
  BG, L = x_BGxLx.shape[:2]
  return x_BGxLx.reshape(BG // G, G * L, *x_BGxLx.shape[2:])


class Documents(NamedTuple):
  """Per span, from the row's document index: ``keeps`` [B, G] (1.0 where the span is one
  document) and ``continues`` [B, G] (1.0 where span g's first token is in span g-1's last
  document; 1.0 for span 0, which the row's incoming state continues)."""

  keeps: jax.Array
  continues: jax.Array


def documents(doc_BxT: jax.Array, G: int) -> Documents:
  """``Documents`` of the G spans of each row of ``doc_BxT`` (``segments.document_index``)."""
  B, T = doc_BxT.shape
  doc_BxGxL = doc_BxT.reshape(B, G, T // G)
  first_BxG, end_BxG = doc_BxGxL[:, :, 0], doc_BxGxL[:, :, -1]
  previous_end_BxG = jnp.concatenate([first_BxG[:, :1], end_BxG[:, :-1]], axis=1)
  flag = lambda x: x.astype(jnp.float32)
  return Documents(flag(first_BxG == end_BxG), flag(first_BxG == previous_end_BxG))


def renumbered(doc_BxT: jax.Array, G: int) -> jax.Array:
  """The document index of each span as its own row, [B·G, T / G], counting from 0 at the span's
  first token (the document its entering state belongs to)."""
  rows_BGxL = to_rows(doc_BxT, G)
  return rows_BGxL - rows_BGxL[:, :1]


def merged(docs: Documents, K: int) -> Documents:
  """``docs`` of G·K parts as those of the G spans they make up (K consecutive parts per span): a span
  is one document when each of its parts is and each part after its first continues the one before."""
  B, GK = docs.keeps.shape
  keeps, continues = (x.reshape(B, GK // K, K) for x in docs)
  return Documents(jnp.prod(keeps, axis=2) * jnp.prod(continues[:, :, 1:], axis=2), continues[:, :, 0])


def _weights(docs: Documents) -> jax.Array:
  """W [B, G, G]: W[g, j] = prod_{i = j+1..g} a_i for j <= g, else 0, with a_i = c_i k_{i-1} (1 where
  span i's entering state is span i-1's entering state plus its total). As a_i is 0 or 1, W[g, j] is
  1 exactly when no a_i in j+1..g is 0: when the count of zeros up to g equals that up to j."""
  a_BxG = docs.continues * jnp.concatenate([jnp.ones_like(docs.keeps[:, :1]), docs.keeps[:, :-1]], axis=1)
  zeros_BxG = jnp.cumsum(1.0 - a_BxG.at[:, 0].set(1.0), axis=1)
  G = a_BxG.shape[1]
  lower_GxG = jnp.tril(jnp.ones((G, G), jnp.float32))
  return jnp.where(zeros_BxG[:, :, None] == zeros_BxG[:, None, :], lower_GxG, 0.0)


def entering(totals_BxGm1, initial_B, docs: Documents):
  """The states entering each of G spans, [B, G, ...] per leaf, from the totals of spans 0..G-2
  ([B, G - 1, ...] per leaf) and the incoming state ([B, ...]): unrolled, E_g = sum_{j <= g} W[g, j] X_j
  with X_0 = initial, X_j = c_j L_{j-1} (``_weights``), one exact contraction instead of G steps."""
  W_BxGxG = _weights(docs)

  def spans(L_BxGm1x, E_Bx):
    c_BxG = docs.continues.reshape(docs.continues.shape + (1,) * (E_Bx.ndim - 1))
    X_BxGx = c_BxG * jnp.concatenate([E_Bx[:, None], L_BxGm1x], axis=1)
    return jnp.einsum("bgj,bj...->bg...", W_BxGxG, X_BxGx, precision=jax.lax.Precision.HIGHEST)

  return jax.tree.map(spans, totals_BxGm1, initial_B)


def states(totals_BxG, initial_B, docs: Documents):
  """(the states entering each span [B, G, ...], the state leaving the last span [B, ...]) per leaf,
  from all G spans' totals [B, G, ...] and the row's incoming state: ``entering``, and
  F_{G-1} = L_{G-1} + k_{G-1} E_{G-1}."""
  E = entering(jax.tree.map(lambda L: L[:, :-1], totals_BxG), initial_B, docs)

  def final(L_BxGx, E_BxGx):
    k_B = docs.keeps[:, -1].reshape((-1,) + (1,) * (E_BxGx.ndim - 2))
    return L_BxGx[:, -1] + k_B * E_BxGx[:, -1]

  return E, jax.tree.map(final, totals_BxG, E)


def leaving_grads(reads_BxG, final_B, docs: Documents):
  """The transpose of ``states``: from the gradients each span's tokens give its entering state
  ([B, G, ...] per leaf) and the final state's cotangent, (the gradients of the states leaving each
  span, which are the totals' ones, [B, G, ...]; that of the incoming state [B, ...])."""
  totals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), reads_BxG)
  initial = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), final_B)
  transpose = jax.linear_transpose(lambda L, E: states(L, E, docs), totals, initial)
  return transpose((reads_BxG, final_B))


def entering_rows(part_totals, initial_B, docs: Documents, G: int, K: int):
  """The states entering a kernel's rows, [B·G, ...] per leaf (span g of row b is row b·G + g), from
  the totals of every part of those rows (K parts per span, [B·G·K, ...]; the last part's unread), the
  rows' incoming state [B, ...] and the parts' ``Documents``."""
  by_row = lambda x: x.reshape(-1, G * K, *x.shape[1:])[:, :-1]
  states = entering(jax.tree.map(by_row, part_totals), initial_B, docs)
  return jax.tree.map(lambda x: x[:, ::K].reshape(-1, *x.shape[2:]), states)


def leaving_row_grads(reads, final_B, docs: Documents, G: int, K: int):
  """The gradients of the states leaving a kernel's rows, [B·G, ...] per leaf, from the gradients each
  row's tokens give its entering state ([B·G, ...]), the final state's cotangent [B, ...] and the
  ``Documents`` of the rows' K parts per span (``leaving_grads``)."""
  by_row = lambda x: x.reshape(-1, G, *x.shape[1:])
  leaving, _ = leaving_grads(jax.tree.map(by_row, reads), final_B, merged(docs, K))
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), leaving)


def span(x_BGx: jax.Array, index: int, G: int) -> jax.Array:
  """Span ``index`` of each row: [B·G, ...] -> [B, ...]."""
  return x_BGx.reshape(-1, G, *x_BGx.shape[1:])[:, index]
