"""Taylor linear attention (MATH §2.1): ``taylor_linear_attention`` and its ``TaylorState``."""

from based_jax.ops.taylor_attention.api import taylor_linear_attention
from based_jax.ops.taylor_attention.base import TaylorState, default_decay_rates, zero_state

__all__ = ["TaylorState", "default_decay_rates", "taylor_linear_attention", "zero_state"]
