"""Analytic forward FLOPs per token, the pieces every mixer's ``flops_per_token(seq_len)`` adds up.

The model card sums them over the layers. Conventions, one for all mixers:

* A multiply-add is 2 FLOPs; only contractions count (dense kernels, scores, mixing, state reads and
  writes, convolution taps), not elementwise work.
* Per token of a fresh causal sequence of T = ``seq_len`` tokens, averaged over its T positions.
* Dense kernels: 2 · in · out each (``dense``).
* Quadratic forms: the causal half only, per head 2 · (F + V) · (T + 1) / 2 (``quadratic``).
* Chunked linear forms, C' = min(C, T): per head 2 · C' · (F + V) + 4 · F · V (``chunked``, as
  ``benchmarks/rows.py``'s ``chunked_flops``); recurrent forms 4 · F · V (``recurrent``).
* Depthwise causal convolutions: 2 · taps · channels (``short_conv``).
* A normalised form mixes V + 1 columns (the ones column appended to v).
* "auto" counts as the backend it resolves to on a GPU (``Backend.flops_per_head``).
"""

from __future__ import annotations

from flax import nnx

from lmcore.ops.common.flops import chunked, quadratic, recurrent  # noqa: F401  (the forms' counts)


def dense(module: nnx.Module) -> float:
  """2 · in · out summed over every ``nnx.Linear`` inside ``module`` (abstract modules too)."""
  return float(sum(2 * m.in_features * m.out_features for _, m in nnx.iter_graph(module)
                   if isinstance(m, nnx.Linear)))


def sliding_window(key_dim: int, value_dim: int, window: int, seq_len: int) -> float:
  """One head of sliding-window attention: 2 · (d + V) per visible key, token t seeing
  min(t + 1, window + 1) keys, averaged over t < T (4 · d · (window + 1) once T >> window)."""
  w, T = window + 1, seq_len
  visible = (min(T, w) * (min(T, w) + 1) / 2 + max(T - w, 0) * w) / T
  return 2.0 * (key_dim + value_dim) * visible


def short_conv(taps: int, channels: int) -> float:
  """A depthwise causal convolution: 2 · taps · channels per token."""
  return 2.0 * taps * channels
