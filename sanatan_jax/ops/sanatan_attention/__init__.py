"""SANATAN attention (MATH §1.1-1.2): ``sanatan_attention`` and its ``SanatanState``."""

from sanatan_jax.ops.sanatan_attention.api import SanatanState, sanatan_attention

__all__ = ["SanatanState", "sanatan_attention"]
