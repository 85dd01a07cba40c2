"""BASED: Taylor linear attention, sliding-window attention, short gated convolutions (SPEC §2)."""

from based_jax.linear_attention import TaylorState, default_decay_rates, taylor_linear_attention
from based_jax.mixers import (BaseConv, SlidingWindowAttention, TaylorLinearAttention,
                              ZoologyBaseConv)
from based_jax.sliding_window import WindowState, rotary, sliding_window_attention
from based_jax.taylor import feature_width, taylor_features

__all__ = [
    "BaseConv",
    "SlidingWindowAttention",
    "TaylorLinearAttention",
    "TaylorState",
    "WindowState",
    "ZoologyBaseConv",
    "default_decay_rates",
    "feature_width",
    "rotary",
    "sliding_window_attention",
    "taylor_features",
    "taylor_linear_attention",
]
