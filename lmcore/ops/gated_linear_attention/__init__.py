"""Gated linear attention (MATH §3, §4): ``gated_linear_attention`` and ``LinearAttentionState``."""

from lmcore.ops.gated_linear_attention.api import (IMPLEMENTATIONS, Implementation,
                                                   gated_linear_attention, resolve_implementation)
from lmcore.ops.gated_linear_attention.base import LinearAttentionState

__all__ = ["IMPLEMENTATIONS", "Implementation", "LinearAttentionState", "gated_linear_attention",
           "resolve_implementation"]
