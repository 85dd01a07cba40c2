"""chunk_scan (the between-chunk recurrence) equals a plain loop, forward and reverse, in both forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.ops.common import pallas_utils
from lmcore.ops.common.chunk_scan import chunk_scan


def _inputs(B=2, H=3, N=12, R=24, V=4, seed=0):
  """c, a (some rows reset to 0, some chunks fully), edge; fp32."""
  rng = np.random.default_rng(seed)
  a = rng.uniform(0.5, 1.0, size=(B, H, N, R))
  a[:, :, 2] = 0.0  # a new document in chunk 2
  a[0, 1, 3, :3] = 0.0
  arrays = rng.normal(size=(B, H, N, R, V)), a, rng.normal(size=(B, H, R, V))
  return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def _loop(c, a, edge, reverse):
  """held (x when chunk n is reached) and end, by the recurrence itself."""
  N = c.shape[2]
  order = range(N - 1, -1, -1) if reverse else range(N)
  held, x = [None] * N, edge
  for n in order:
    held[n] = x
    x = a[:, :, n, :, None] * x + c[:, :, n]
  return jnp.stack(held, axis=2), x


@pytest.mark.parametrize("implementation,tiles,N", [
    ("xla", {}, 12),
    ("pallas", {}, 12),  # 4 chunks per loop step (gcd of N and unroll 8)
    ("pallas", {"block_rows": 4, "block_v": 2, "unroll": 2}, 12),
    ("pallas", {"block_rows": 32}, 5),  # an odd number of chunks: one per step
])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_scan_equals_the_loop(implementation, tiles, N, reverse):
  c, a, edge = _inputs(N=N)
  held, end = chunk_scan(c, a, edge, reverse=reverse, implementation=implementation, **tiles)
  want_held, want_end = _loop(c, a, edge, reverse)
  np.testing.assert_allclose(held, want_held, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(end, want_end, rtol=1e-5, atol=1e-5)


def test_held_states_come_in_the_requested_dtype():
  c, a, edge = _inputs()
  held, end = chunk_scan(c, a, edge, out_dtype=jnp.bfloat16)
  assert held.dtype == jnp.bfloat16 and end.dtype == jnp.float32
  np.testing.assert_allclose(held.astype(jnp.float32), _loop(c, a, edge, False)[0], rtol=1e-2,
                             atol=1e-2)


def test_bad_tiles_and_names_raise_clear_errors():
  c, a, edge = _inputs()
  with pytest.raises(ValueError, match="block_rows must be a power of two, got 3"):
    chunk_scan(c, a, edge, block_rows=3)
  with pytest.raises(ValueError, match="unroll must be a power of two, got 6"):
    chunk_scan(c, a, edge, unroll=6)
  with pytest.raises(ValueError, match="unknown implementation 'assoc'"):
    chunk_scan(c, a, edge, implementation="assoc")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_kernel_lowers_to_triton_for_an_h200():
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  fn = lambda c, a, e: chunk_scan(c, a, e, reverse=True, out_dtype=jnp.bfloat16, interpret=False)
  lowered = pallas_utils.lower_for_gpu(fn, shape(2, 3, 64, 384, 64), shape(2, 3, 64, 384),
                                       shape(2, 3, 384, 64))
  assert lowered.as_text().count("xla.gpu.triton") == 1
