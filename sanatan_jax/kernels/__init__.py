"""Pallas kernels for SANATAN (SPEC §1.1-1.2): the p = 1 six-channel chunked recurrence (Triton for
GPUs, Mosaic for TPUs) and the blocked (flash-style) kernels for every other power and channel
variant."""

from sanatan_jax.kernels.pallas_blocked import sanatan_blocked_pallas
from sanatan_jax.kernels.pallas_p1 import sanatan_p1_pallas
from sanatan_jax.kernels.pallas_p1_tpu import sanatan_p1_tpu

__all__ = ["sanatan_blocked_pallas", "sanatan_p1_pallas", "sanatan_p1_tpu"]
