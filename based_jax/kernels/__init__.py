"""Pallas kernels for BASED (SPEC §2.1): Taylor linear attention, chunk-parallel, with custom VJP."""

from based_jax.kernels.pallas_taylor import taylor_linear_attention_pallas

__all__ = ["taylor_linear_attention_pallas"]
