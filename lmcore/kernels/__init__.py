"""Sequence-mixing ops: functions on arrays with an ``implementation=`` switch, one folder each."""

from lmcore.kernels.gated_linear_attention import LinearAttentionState, gated_linear_attention

__all__ = ["LinearAttentionState", "gated_linear_attention"]
