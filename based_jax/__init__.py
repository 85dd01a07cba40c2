"""BASED: Taylor linear attention, sliding-window attention, short gated convolutions (MATH §2).
Importing the package registers the ``taylor``, ``swa``, ``base_conv`` and ``base_conv_zoology`` mixer
kinds."""

from based_jax.mixers import (BaseConv, SlidingWindowAttention, TaylorLinearAttention,
                              ZoologyBaseConv)
from based_jax.sliding_window import WindowState, rotary, sliding_window_attention
from based_jax.ops.taylor_attention import (TaylorState, default_decay_rates,
                                            taylor_linear_attention)
from based_jax.taylor import feature_width, taylor_features
from lmcore.registry import register_mixer

for _kind, _cls in {"taylor": TaylorLinearAttention, "swa": SlidingWindowAttention,
                    "base_conv": BaseConv, "base_conv_zoology": ZoologyBaseConv}.items():
  register_mixer(_kind, _cls)

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
