"""Pallas kernels for BASED (SPEC §2.1): chunk-parallel Taylor linear attention, custom VJP."""

from based_jax.kernels.pallas_taylor import taylor_linear_attention_pallas

__all__ = ["taylor_linear_attention_pallas"]
