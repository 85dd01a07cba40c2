"""SANATAN: root-parity gated angular attention (MATH §1). Importing the package registers the
``sanatan`` mixer kind."""

from lmcore.registry import register_mixer
from sanatan_jax.mixer import SanatanMixer
from sanatan_jax.ops.sanatan_attention import SanatanState, sanatan_attention

register_mixer("sanatan", SanatanMixer)

__all__ = ["SanatanMixer", "SanatanState", "sanatan_attention"]
