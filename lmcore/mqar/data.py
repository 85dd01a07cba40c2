"""MQAR data: zoology's multi-query associative recall generator and its batching (MATH §6.5).

One example of length L with ``kv`` pairs (based_zoology.md §7.1)::

    inputs:  k1 v1 k2 v2 … k_kv v_kv | query region: keys at even offsets, random tokens elsewhere
    labels:  -100 everywhere except at the position of the queried key, which holds its value

Keys from [1, V/2), values from [V/2, V); every key is queried once, in slot ``2·gap`` of the query
region, gaps drawn without replacement with p_i ∝ i^(a-1), a = 0.01. The value is the next-token
target at the query key; the token after it is filler. zoology's algorithm and per-segment seeds
(train in [0, 2^31), test in [2^31, 2^32)), but each segment draws from its own
``np.random.default_rng(seed)``: the same data on every machine, not zoology's token ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

VOCAB_SIZE = 8192
IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class SegmentSpec:
  """``num_examples`` sequences of ``seq_len`` tokens with ``num_kv_pairs`` key-value pairs each."""

  seq_len: int
  num_kv_pairs: int
  num_examples: int

  @property
  def name(self) -> str:
    return f"L{self.seq_len}_kv{self.num_kv_pairs}"


# The BASED paper's mixture (zoology arxiv24_based_figure2): 180k training examples, 7 test slices.
TRAIN_SEGMENTS = (SegmentSpec(64, 4, 100_000), SegmentSpec(128, 8, 20_000), SegmentSpec(256, 16, 20_000),
                  SegmentSpec(256, 32, 20_000), SegmentSpec(256, 64, 20_000))
TEST_SEGMENTS = (SegmentSpec(64, 4, 1_000), SegmentSpec(64, 8, 1_000), SegmentSpec(64, 16, 1_000),
                 SegmentSpec(128, 32, 1_000), SegmentSpec(256, 64, 1_000), SegmentSpec(512, 128, 1_000),
                 SegmentSpec(1024, 256, 1_000))


@dataclasses.dataclass(frozen=True)
class Segment:
  """Generated examples of one spec: ``inputs_NxL`` and ``labels_NxL`` (int32, -100 = ignored)."""

  spec: SegmentSpec
  inputs_NxL: np.ndarray
  labels_NxL: np.ndarray

  def queries(self) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of the labelled positions, int32 [N, kv], positions ascending."""
    rows, cols = np.nonzero(self.labels_NxL != IGNORE_INDEX)
    shape = (self.spec.num_examples, self.spec.num_kv_pairs)
    positions_NxQ = cols.reshape(shape).astype(np.int32)
    return positions_NxQ, self.labels_NxL[rows, cols].reshape(shape).astype(np.int32)


def power_law(space: int, power_a: float) -> np.ndarray:
  """p_i ∝ a·i^(a-1), i = 1..space, normalised (a = 1 is uniform)."""
  p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
  return p / p.sum()


def sample_distinct(rng: np.random.Generator, low: int, high: int, rows: int, k: int) -> np.ndarray:
  """``rows`` independent uniform samples of k distinct integers from [low, high), random order.

  Floyd's algorithm, vectorised over rows (O(rows·k²), no [rows, high - low] table), then a
  per-row shuffle: Floyd yields a uniform subset but not a uniform order.
  """
  n = high - low
  chosen = np.empty((rows, k), np.int64)
  for i, j in enumerate(range(n - k, n)):
    t = rng.integers(0, j + 1, size=rows)
    taken = (chosen[:, :i] == t[:, None]).any(axis=1)
    chosen[:, i] = np.where(taken, j, t)
  return rng.permuted(chosen, axis=1) + low


def sample_weighted_without_replacement(rng: np.random.Generator, p: np.ndarray, rows: int,
                                        k: int) -> np.ndarray:
  """``rows`` sequential draws of k distinct indices with probabilities ``p``, in draw order.

  Gumbel top-k: sorting log p + Gumbel noise in decreasing order is exactly successive sampling
  without replacement (draw i with prob p_i, remove it, renormalise, repeat).
  """
  perturbed = np.log(p)[None, :] + rng.gumbel(size=(rows, p.size))
  return np.argsort(-perturbed, axis=1, kind="stable")[:, :k]


def multiquery_ar(spec: SegmentSpec, seed: int, *, vocab_size: int = VOCAB_SIZE, power_a: float = 0.01,
                  random_non_queries: bool = True) -> Segment:
  """One MQAR segment (module docstring; zoology ``multiquery_ar`` with one pass)."""
  L, kv, N = spec.seq_len, spec.num_kv_pairs, spec.num_examples
  if L % 2 or 4 * kv > L or vocab_size <= L:
    raise ValueError(f"MQAR needs an even seq_len >= 4·num_kv_pairs and vocab_size > seq_len; got "
                     f"seq_len={L}, num_kv_pairs={kv}, vocab_size={vocab_size}")
  rng = np.random.default_rng(seed)
  half = vocab_size // 2
  keys_NxK = sample_distinct(rng, 1, half, N, kv)
  values_NxK = sample_distinct(rng, half, vocab_size, N, kv)
  context = 2 * kv
  gaps_NxK = sample_weighted_without_replacement(rng, power_law((L - context) // 2, power_a), N, kv)
  query_positions_NxK = context + 2 * gaps_NxK
  inputs_NxL = np.zeros((N, L), np.int64)
  inputs_NxL[:, 0:context:2], inputs_NxL[:, 1:context:2] = keys_NxK, values_NxK
  np.put_along_axis(inputs_NxL, query_positions_NxK, keys_NxK, axis=1)
  labels_NxL = np.full((N, L), IGNORE_INDEX, np.int64)
  np.put_along_axis(labels_NxL, query_positions_NxK, values_NxK, axis=1)
  if random_non_queries:
    # zoology's torch.randint(vocab_size): the full vocabulary, 0 and key/value ids included.
    filler = inputs_NxL == 0
    inputs_NxL[filler] = rng.integers(0, vocab_size, size=int(filler.sum()))
  return Segment(spec, inputs_NxL.astype(np.int32), labels_NxL.astype(np.int32))


def segment_seeds(seed: int, n_train: int, n_test: int) -> tuple[np.ndarray, np.ndarray]:
  """Per-segment seeds: train from [0, 2^31), test from [2^31, 2^32) (disjoint, as zoology)."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, 2**31, n_train), rng.integers(2**31, 2**32, n_test)


def build_segments(specs: Sequence[SegmentSpec], seeds: Sequence[int], *, vocab_size: int = VOCAB_SIZE,
                   power_a: float = 0.01) -> list[Segment]:
  return [multiquery_ar(spec, int(seed), vocab_size=vocab_size, power_a=power_a)
          for spec, seed in zip(specs, seeds, strict=True)]


def scale_specs(specs: Sequence[SegmentSpec], scale: float) -> tuple[SegmentSpec, ...]:
  """The same mixture with ``round(num_examples · scale)`` examples per segment (at least 1)."""
  return tuple(dataclasses.replace(s, num_examples=max(1, round(s.num_examples * scale))) for s in specs)


@dataclasses.dataclass(frozen=True)
class Batches:
  """A segment cut into equal batches for a ``lax.scan``: tokens int32 [Nb, B, L]; positions, targets
  int32 [Nb, B, Q]; weights fp32 [Nb, B, Q]. Q = L // 4 query slots (the most 4·kv <= L allows) and a
  last batch padded with weight 0, so every segment of length L has one shape, whatever its kv."""

  spec: SegmentSpec
  tokens: np.ndarray
  positions: np.ndarray
  targets: np.ndarray
  weights: np.ndarray


def make_batches(segment: Segment, batch_size: int) -> Batches:
  """Consecutive batches of ``batch_size`` examples in generation order (zoology does not shuffle)."""
  N, L, kv = segment.spec.num_examples, segment.spec.seq_len, segment.spec.num_kv_pairs
  Q, Nb = L // 4, -(-N // batch_size)
  positions_NxK, values_NxK = segment.queries()
  tokens = np.zeros((Nb * batch_size, L), np.int32)
  positions = np.zeros((Nb * batch_size, Q), np.int32)
  targets = np.zeros((Nb * batch_size, Q), np.int32)
  weights = np.zeros((Nb * batch_size, Q), np.float32)
  tokens[:N], positions[:N, :kv], targets[:N, :kv], weights[:N, :kv] = (
      segment.inputs_NxL, positions_NxK, values_NxK, 1.0)
  split = lambda x: x.reshape(Nb, batch_size, *x.shape[1:])
  return Batches(segment.spec, split(tokens), split(positions), split(targets), split(weights))
