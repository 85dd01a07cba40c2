"""chunk_prefix_sum (the states entering the chunks) equals the sum written out: chunk m reaches chunk
n > m while the state leaving chunk n - 1 is in chunk m's last document, decayed by exp(ℓ) per chunk
between them; in one level and in several (blocks of 2 chunks, padded blocks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.ops.common.chunk_prefix import chunk_prefix_sum

prefix_sum = jax.jit(chunk_prefix_sum, static_argnames="block")


def _written_out(x, last, ell):
  """y_n = Σ_{m<n} [last_m = last_{n-1}] exp(Σ_{m<j<n} ℓ_j) x_m, in float64."""
  B, N, H = x.shape[:3]
  want = np.zeros(x.shape)
  for b, n in np.ndindex(B, N):
    for m in range(n):
      if last is None or last[b, m] == last[b, n - 1]:
        decay_H = np.ones(H) if ell is None else np.exp(ell[0, m + 1:n].sum(0))
        want[b, n] += decay_H[:, None] * x[b, m]
  return want


@pytest.mark.parametrize("N", [1, 5, 17])
def test_chunk_prefix_sum_equals_the_sum_written_out(N):
  """N = 17 in blocks of 2: five levels, padded blocks; with and without documents and decay (one rate
  per head, 3 heads)."""
  rng = np.random.default_rng(N)
  x = rng.normal(size=(2, N, 3, 2)).astype(np.float32)
  last = np.sort(rng.integers(0, 4, size=(2, N)), axis=1).astype(np.int32)
  ell = -rng.uniform(0.0, 0.5, size=(1, N, 3)).astype(np.float32)
  for docs in (None, last):
    for decay in (None, ell):
      got = prefix_sum(jnp.asarray(x), None if docs is None else jnp.asarray(docs), block=2,
                       log_decay_BxNxH=None if decay is None else jnp.asarray(decay))
      np.testing.assert_allclose(got, _written_out(x, docs, decay), rtol=1e-5, atol=1e-5)
