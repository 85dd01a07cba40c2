"""Analytic forward FLOPs per token and head of the ops' forms (the conventions of
``lmcore.mixers.flops``): each backend's ``flops_per_head`` is one of these."""

from __future__ import annotations


def quadratic(score_width: int, value_width: int, seq_len: int) -> float:
  """One head of a quadratic form over the causal half: 2 · (F + V) · (T + 1) / 2 per token."""
  return (score_width + value_width) * (seq_len + 1.0)


def chunked(features: int, values: int, chunk: int, seq_len: int,
            score_width: int | None = None) -> float:
  """One head of a chunked linear form: 2 · C' · (F_s + V) + 4 · F · V per token, C' = min(C, T).

  ``score_width`` F_s is the width the intra-chunk scores are computed at (default ``features``;
  Taylor attention scores from the raw q · k).
  """
  c = min(chunk, seq_len)
  scores = features if score_width is None else score_width
  return 2.0 * c * (scores + values) + 4.0 * features * values


def recurrent(features: int, values: int) -> float:
  """One head of a token-by-token recurrence: 4 · F · V per token (write k vᵀ, read Sᵀ q)."""
  return 4.0 * features * values
