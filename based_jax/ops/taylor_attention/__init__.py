"""Taylor linear attention (MATH §2.1): ``taylor_linear_attention`` and its ``TaylorState``."""

from based_jax.ops.taylor_attention.api import TaylorState, taylor_linear_attention

__all__ = ["TaylorState", "taylor_linear_attention"]
