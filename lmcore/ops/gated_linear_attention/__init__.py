"""Gated linear attention (SPEC §3, §4): ``gated_linear_attention`` and ``LinearAttentionState``."""

from lmcore.ops.gated_linear_attention.api import (IMPLEMENTATIONS, LinearAttentionState,
                                                       document_index, gated_linear_attention)

__all__ = ["IMPLEMENTATIONS", "LinearAttentionState", "document_index", "gated_linear_attention"]
