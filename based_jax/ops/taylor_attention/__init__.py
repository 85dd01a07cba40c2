"""Taylor linear attention (MATH §2.1): ``taylor_linear_attention``, its ``TaylorState``, the backend
``REGISTRY`` and the ``Problem`` a backend is chosen for."""

from based_jax.ops.taylor_attention.api import REGISTRY, problem, taylor_linear_attention
from based_jax.ops.taylor_attention.base import Problem, TaylorState, default_decay_rates, zero_state

__all__ = ["REGISTRY", "Problem", "TaylorState", "default_decay_rates", "problem", "taylor_linear_attention",
           "zero_state"]
