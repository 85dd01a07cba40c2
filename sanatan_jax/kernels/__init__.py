"""Pallas kernels for SANATAN (SPEC §1.2): the p = 1 six-channel chunked recurrence."""

from sanatan_jax.kernels.pallas_p1 import sanatan_p1_pallas

__all__ = ["sanatan_p1_pallas"]
