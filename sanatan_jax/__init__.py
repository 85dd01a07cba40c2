"""SANATAN: root-parity gated angular attention (SPEC §1)."""

from sanatan_jax.attention import SanatanState, sanatan_attention
from sanatan_jax.mixer import SanatanMixer

__all__ = ["SanatanMixer", "SanatanState", "sanatan_attention"]
