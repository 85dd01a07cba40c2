"""Gated linear attention (MATH §3, §4): ``gated_linear_attention`` and ``LinearAttentionState``."""

from lmcore.ops.gated_linear_attention.api import REGISTRY, Implementation, gated_linear_attention, problem
from lmcore.ops.gated_linear_attention.base import LinearAttentionState, Problem

__all__ = ["REGISTRY", "Implementation", "LinearAttentionState", "Problem", "gated_linear_attention",
           "problem"]
