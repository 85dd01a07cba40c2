"""A row of T tokens run as G rows of T / G ("spans"), for kernels that walk their state along T.

A fused-chunk kernel gives each (row, head) programs that walk every chunk in order, so at B = 1 a
long row leaves most of a GPU idle while each program walks a long chain. Cut into G spans, the row
becomes G rows that the kernel walks side by side, each from the state entering its span. For an
additive state (a sum over the keys a token sees, with document resets) the entering states follow
from the spans' own totals L_g (over each span's last document, a cheap pass with no outputs):

    E_0 = E (the row's incoming state),  E_g = c_g · (L_{g-1} + k_{g-1} · E_{g-1})  (g >= 1),

where k_g is 1 when span g is one document (it keeps what enters it) and c_g is 1 when span g's
first token is in span g-1's last document (else it starts from zeros). The map (L, E) -> (E_g) is
linear, so its transpose (``jax.linear_transpose``) takes the gradients of the entering states,
which the kernels' backward returns, to those of the totals and of the incoming state.

Which G: ``count``. The span length must be a multiple of the kernels' chunk (no padding inside the
row), and G a power of two.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


# "auto": spans until the (row, head) pairs reach PAIRS, none shorter than MIN_LENGTH tokens (the
# fastest rule measured: docs/BENCHMARKS.md, Spans).
PAIRS = 128
MIN_LENGTH = 2048
# The totals are summed over rows of this many tokens ("parts" of a span; ``parts``), whose programs
# run side by side; parts of 2048 were the fastest measured, so the auto rule's spans are summed whole.
PART_LENGTH = 2048


def count(batch: int, heads: int, length: int, chunk: int, requested: int = 0) -> int:
  """G for a [batch, length] row set of ``heads`` heads and kernels of ``chunk`` tokens per step.

  ``requested`` > 0 asks for that many (it must be a power of two dividing ``length`` into
  multiples of ``chunk``: ValueError otherwise); 0 means "auto": the smallest power of two with
  batch · heads · G >= ``PAIRS``, as long as each span keeps ``MIN_LENGTH`` tokens and a whole
  number of chunks (1 when no split qualifies).
  """
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
  """The states entering each of G spans, [B, G, ...] per leaf, from the totals of spans 0..G-2 (a
  pytree of [B, G - 1, ...] arrays, each over its span's last document) and the row's incoming state
  (the same pytree, [B, ...]): E_0 = initial, E_g = c_g (L_{g-1} + k_{g-1} E_{g-1}).

  Unrolled, E_g = sum_{j <= g} W[g, j] X_j with X_0 = initial, X_j = c_j L_{j-1} (``_weights``): one
  contraction over the spans, exact in fp32 (W is 0 or 1), rather than a chain of G steps."""
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
  """The transpose of ``states``: from the gradients that each span's own tokens give the state
  entering it (``reads``, [B, G, ...] per leaf) and the cotangent of the row's final state, (the
  gradients of the states leaving each span [B, G, ...], that of the row's incoming state [B, ...]).
  A span's leaving state is its total plus what it keeps of its entering state, so the totals'
  gradients are the leaving states' ones: those a reverse walk over each span starts from."""
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
