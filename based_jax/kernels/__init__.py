"""Pallas kernels for BASED (SPEC §2.1): Taylor linear attention with a custom VJP, chunk-parallel
for GPUs (Triton) and in sequential chunks for TPUs (Mosaic), and the quadratic form block by block
for GPUs (Triton)."""

from based_jax.kernels.pallas_taylor import taylor_linear_attention_pallas
from based_jax.kernels.pallas_taylor_blocked import taylor_sums_blocked
from based_jax.kernels.pallas_taylor_tpu import taylor_linear_attention_tpu

__all__ = ["taylor_linear_attention_pallas", "taylor_sums_blocked", "taylor_linear_attention_tpu"]
