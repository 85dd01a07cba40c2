"""Root-gate statistics of one layer, measured the way MATH §1.3 asks.

For the SAME head's query and key roots under the causal mask (pairs j <= t):
  frac_saturated_{q,k} = mean [|r| > 0.99] over all root activations,
  mismatch_fraction    = mean over (pair, head, dim) of [sign(rq_t) != sign(rk_j)],
  mismatch_gate_mean   = mean of (1 + rq_t rk_j) over the mismatched (pair, head, dim) entries.

Sampling: up to ``num_positions`` query positions t per sequence (drawn without replacement,
deterministically from ``seed``), each paired with ALL its causal keys j <= t. Every key is used, so
there is no key-sampling noise, and memory stays O(T H d) per sequence: the sums over keys come from
prefix sums over j of the key roots split by sign, never from a T x T array.

One formula, two array libraries: ``gate_statistics`` runs it in numpy (fp64, exact counts; the
reference the tests check against loops over pairs), ``gate_statistics_arrays`` in jax.numpy, traced
inside the evaluation's compiled program (fp32 sums: the counts are exact below 2^24 entries).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SATURATION = 0.99


def sample_positions(num_sequences: int, length: int, num_positions: int,
                     seed: int = 0) -> list[np.ndarray]:
  """Sorted query positions for each sequence: all of 0..T-1 when num_positions >= T."""
  if num_positions >= length:
    return [np.arange(length) for _ in range(num_sequences)]
  rng = np.random.default_rng(seed)
  return [np.sort(rng.choice(length, size=num_positions, replace=False))
          for _ in range(num_sequences)]


def _statistics(rq_BxTxHxd, rk_BxTxHxd, t_BxP, xp) -> dict:
  """The module docstring's statistics with array library ``xp`` (numpy or jax.numpy), as 0-d arrays
  in the roots' float dtype (``num_pairs`` an integer)."""
  B, T, H, d = rq_BxTxHxd.shape
  at_queries = lambda x_BxTxHxd: xp.take_along_axis(x_BxTxHxd, t_BxP[:, :, None, None], axis=1)
  pos_BxTxHxd, neg_BxTxHxd = rk_BxTxHxd > 0, rk_BxTxHxd < 0
  n_pos = at_queries(xp.cumsum(pos_BxTxHxd, axis=1))
  n_neg = at_queries(xp.cumsum(neg_BxTxHxd, axis=1))
  sum_pos = at_queries(xp.cumsum(xp.where(pos_BxTxHxd, rk_BxTxHxd, 0.0), axis=1))
  sum_neg = at_queries(xp.cumsum(xp.where(neg_BxTxHxd, rk_BxTxHxd, 0.0), axis=1))
  n_keys_BxPx1x1 = (t_BxP + 1)[:, :, None, None]
  rq_BxPxHxd = at_queries(rq_BxTxHxd)
  # sign(rk) = 0 keys mismatch every non-zero query sign and contribute rk = 0 to the gate sum.
  conditions = [rq_BxPxHxd > 0, rq_BxPxHxd < 0]
  n_mis_BxPxHxd = xp.select(conditions, [n_keys_BxPx1x1 - n_pos, n_keys_BxPx1x1 - n_neg], n_pos + n_neg)
  rk_mis_BxPxHxd = xp.select(conditions, [sum_neg, sum_pos], sum_pos + sum_neg)
  dtype = rq_BxTxHxd.dtype
  mismatched = n_mis_BxPxHxd.astype(dtype).sum()
  gate_sum = (n_mis_BxPxHxd + rq_BxPxHxd * rk_mis_BxPxHxd).sum()
  num_pairs = n_keys_BxPx1x1.sum()
  return {
      "frac_saturated_q": (xp.abs(rq_BxTxHxd) > SATURATION).astype(dtype).mean(),
      "frac_saturated_k": (xp.abs(rk_BxTxHxd) > SATURATION).astype(dtype).mean(),
      "mismatch_fraction": mismatched / (num_pairs.astype(dtype) * (H * d)),
      "mismatch_gate_mean": xp.where(mismatched > 0, gate_sum / xp.maximum(mismatched, 1), np.nan),
      "num_pairs": num_pairs,
      "num_mismatched": mismatched,
  }


def _positions(shape, num_positions: int, seed: int) -> np.ndarray:
  B, T = shape[:2]
  return np.stack(sample_positions(B, T, num_positions, seed))


def gate_statistics(r_q_BxTxHxd, r_k_BxTxHxd, *, num_positions: int = 512,
                    seed: int = 0) -> dict[str, float]:
  """MATH §1.3 statistics of one layer's roots [B, T, H, d] (see the module docstring), in fp64.

  Returns ``frac_saturated_q``, ``frac_saturated_k``, ``mismatch_fraction``, ``mismatch_gate_mean``
  (NaN when nothing mismatches), ``num_pairs`` (causal (t, j) position pairs used, summed over
  sequences) and ``num_mismatched`` (mismatched (pair, head, dim) entries, for pooling batches).
  """
  rq, rk = np.asarray(r_q_BxTxHxd, np.float64), np.asarray(r_k_BxTxHxd, np.float64)
  _check_shapes(rq, rk)
  stats = _statistics(rq, rk, _positions(rq.shape, num_positions, seed), np)
  return {k: int(v) if k.startswith("num_") else float(v) for k, v in stats.items()}


def gate_statistics_arrays(r_q_BxTxHxd: jax.Array, r_k_BxTxHxd: jax.Array, *, num_positions: int = 512,
                           seed: int = 0) -> dict[str, jax.Array]:
  """``gate_statistics`` as 0-d jax arrays (fp32; ``num_pairs`` int32), to trace inside a compiled
  program; the query positions are constants of the trace."""
  _check_shapes(r_q_BxTxHxd, r_k_BxTxHxd)
  t_BxP = jnp.asarray(_positions(r_q_BxTxHxd.shape, num_positions, seed), jnp.int32)
  return _statistics(r_q_BxTxHxd.astype(jnp.float32), r_k_BxTxHxd.astype(jnp.float32), t_BxP, jnp)


def _check_shapes(rq, rk) -> None:
  if rq.shape != rk.shape or rq.ndim != 4:
    raise ValueError(f"r_q and r_k must both be [B, T, H, d], got {rq.shape} and {rk.shape}")
