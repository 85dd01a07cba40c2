"""SANATAN attention (MATH §1.1-1.2): ``sanatan_attention``, its ``SanatanState`` and backends."""

from sanatan_jax.ops.sanatan_attention.api import (REGISTRY, Implementation, check_variant, problem,
                                                   sanatan_attention)
from sanatan_jax.ops.sanatan_attention.base import Problem, SanatanState

__all__ = ["REGISTRY", "Implementation", "Problem", "SanatanState", "check_variant", "problem",
           "sanatan_attention"]
