"""Document indices from segment ids (``lmcore.ops.common.segments``)."""

import jax
import jax.numpy as jnp
import numpy as np

from lmcore.ops.common.segments import document_index


def test_document_index_counts_starts_and_is_plain_zeros_without_segments():
  """Segment ids [a a b b b c] give runs 0 0 1 1 1 2 per row; None gives int32 zeros with no
  cumulative sum in the program (XLA folds one over constants at compile time, seconds at training
  shapes)."""
  ids = jnp.array([[7, 7, 3, 3, 3, 9], [1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(document_index(ids, 2, 6), [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
  none = document_index(None, 3, 4)
  assert none.dtype == jnp.int32 and none.shape == (3, 4) and not np.any(np.asarray(none))
  jaxpr = str(jax.make_jaxpr(lambda: document_index(None, 32, 2048))())
  assert "cumsum" not in jaxpr
