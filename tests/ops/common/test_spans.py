"""spans: the span count, the parts, the documents of spans and parts, and the spans' state map and its
transpose against the recurrence they unroll."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.ops.common import spans

# Document starts per row of 48 tokens: row 0 starts documents inside spans and at a span's first token
# (24, of spans of 8 or 12 tokens); row 1 is one document; row 2 has two starts inside one span.
_STARTS = ((5, 8, 30, 24), (), (16, 17, 40))


def _doc(T=48):
  doc = np.zeros((len(_STARTS), T), np.int32)
  for b, starts in enumerate(_STARTS):
    for s in starts:
      doc[b, s:] += 1
  return jnp.asarray(doc)


def _loop(L, E0, docs):
  """(entering states, last leaving state) by the recurrence E_g = c_g (L_{g-1} + k_{g-1} E_{g-1})."""
  scale = lambda w: w.reshape(w.shape + (1,) * (E0.ndim - 1))
  states = [E0]
  for g in range(1, L.shape[1]):
    states.append(scale(docs.continues[:, g]) * (L[:, g - 1] + scale(docs.keeps[:, g - 1]) * states[-1]))
  E = jnp.stack(states, axis=1)
  return E, L[:, -1] + scale(docs.keeps[:, -1]) * E[:, -1]


@pytest.mark.parametrize("G", [2, 4, 6])
def test_states_and_their_transpose_equal_the_recurrence(G):
  docs = spans.documents(_doc(), G)
  rng = np.random.default_rng(G)
  L, E0, reads, final = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                         for shape in ((3, G, 4, 5), (3, 4, 5), (3, G, 4, 5), (3, 4, 5)))
  got, want = spans.states(L, E0, docs), _loop(L, E0, docs)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  _, vjp = jax.vjp(lambda L, E0: _loop(L, E0, docs), L, E0)
  for a, b in zip(spans.leaving_grads(reads, final, docs), vjp((reads, final))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_documents_of_parts_merge_into_those_of_their_spans():
  doc = _doc()
  for G, K in ((2, 3), (4, 3), (6, 2)):
    merged, direct = spans.merged(spans.documents(doc, G * K), K), spans.documents(doc, G)
    np.testing.assert_array_equal(merged.keeps, direct.keeps)
    np.testing.assert_array_equal(merged.continues, direct.continues)


def test_count_and_parts():
  assert spans.count(1, 12, 32768, 64) == 16  # 12 pairs: 16 spans of 2048 reach 192 >= PAIRS
  assert spans.count(2, 12, 8192, 64) == 4  # spans stop at MIN_LENGTH tokens
  assert spans.count(8, 12, 2048, 64) == 1
  assert spans.count(1, 12, 32768, 64, requested=2) == 2
  with pytest.raises(ValueError, match="spans=3"):
    spans.count(1, 12, 32768, 64, requested=3)
  assert spans.parts(32768, 16, 64) == max(1, 2048 // spans.PART_LENGTH)
  assert spans.parts(1 << 20, 16, 64) == (1 << 16) // spans.PART_LENGTH  # spans of 65536 tokens
  assert spans.parts(3 * 2048, 1, 512) == 3 * 2048 // max(spans.PART_LENGTH, 512)
  assert spans.parts(7, 1, 8) == 1  # a row shorter than one chunk
  assert spans.parts(3 * 64, 1, 64) == 1
