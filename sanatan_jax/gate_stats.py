"""Root-gate statistics of one layer, measured the way MATH §1.3 asks.

For the SAME head's query and key roots under the causal mask (pairs j <= t):
  frac_saturated_{q,k} = mean [|r| > 0.99] over all root activations,
  mismatch_fraction    = mean over (pair, head, dim) of [sign(rq_t) != sign(rk_j)],
  mismatch_gate_mean   = mean of (1 + rq_t rk_j) over the mismatched (pair, head, dim) entries.

Sampling: up to ``num_positions`` query positions t per sequence (drawn without replacement,
deterministically from ``seed``), each paired with ALL its causal keys j <= t. Every key is used, so
there is no key-sampling noise, and memory stays O(T H d) per sequence: the sums over keys come from
prefix sums over j of the key roots split by sign, never from a T x T array.
"""

from __future__ import annotations

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


def _sequence_sums(rq_TxHxd: np.ndarray, rk_TxHxd: np.ndarray,
                   t_P: np.ndarray) -> tuple[float, float, float]:
  """(entries, mismatched entries, sum of 1 + rq rk over them) for queries t_P and keys j <= t."""
  pos_TxHxd, neg_TxHxd = rk_TxHxd > 0, rk_TxHxd < 0
  n_pos = np.cumsum(pos_TxHxd, axis=0)[t_P]
  n_neg = np.cumsum(neg_TxHxd, axis=0)[t_P]
  sum_pos = np.cumsum(np.where(pos_TxHxd, rk_TxHxd, 0.0), axis=0)[t_P]
  sum_neg = np.cumsum(np.where(neg_TxHxd, rk_TxHxd, 0.0), axis=0)[t_P]
  n_keys_Px1x1 = (t_P + 1)[:, None, None].astype(np.float64)
  rq_PxHxd = rq_TxHxd[t_P]
  # sign(rk) = 0 keys mismatch every non-zero query sign and contribute rk = 0 to the gate sum.
  n_mis = np.select([rq_PxHxd > 0, rq_PxHxd < 0], [n_keys_Px1x1 - n_pos, n_keys_Px1x1 - n_neg],
                    n_pos + n_neg)
  rk_mis = np.select([rq_PxHxd > 0, rq_PxHxd < 0], [sum_neg, sum_pos], sum_pos + sum_neg)
  entries = float(n_keys_Px1x1.sum()) * rq_PxHxd.shape[1] * rq_PxHxd.shape[2]
  return entries, float(n_mis.sum()), float((n_mis + rq_PxHxd * rk_mis).sum())


def gate_statistics(r_q_BxTxHxd, r_k_BxTxHxd, *, num_positions: int = 512,
                    seed: int = 0) -> dict[str, float]:
  """MATH §1.3 statistics of one layer's roots [B, T, H, d] (see the module docstring).

  Returns ``frac_saturated_q``, ``frac_saturated_k``, ``mismatch_fraction``, ``mismatch_gate_mean``
  (NaN when nothing mismatches), ``num_pairs`` (causal (t, j) position pairs used, summed over
  sequences) and ``num_mismatched`` (mismatched (pair, head, dim) entries, for pooling batches).
  """
  rq, rk = np.asarray(r_q_BxTxHxd), np.asarray(r_k_BxTxHxd)
  if rq.shape != rk.shape or rq.ndim != 4:
    raise ValueError(f"r_q and r_k must both be [B, T, H, d], got {rq.shape} and {rk.shape}")
  B, T = rq.shape[:2]
  entries = mismatched = gate_sum = 0.0
  num_pairs = 0
  for b, t_P in enumerate(sample_positions(B, T, num_positions, seed)):
    e, m, g = _sequence_sums(rq[b].astype(np.float64), rk[b].astype(np.float64), t_P)
    entries, mismatched, gate_sum = entries + e, mismatched + m, gate_sum + g
    num_pairs += int((t_P + 1).sum())
  return {
      "frac_saturated_q": float(np.mean(np.abs(rq) > SATURATION)),
      "frac_saturated_k": float(np.mean(np.abs(rk) > SATURATION)),
      "mismatch_fraction": mismatched / entries,
      "mismatch_gate_mean": gate_sum / mismatched if mismatched else float("nan"),
      "num_pairs": num_pairs,
      "num_mismatched": int(mismatched),
  }
