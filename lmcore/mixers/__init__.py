"""Mixer registry: a kind name in a config's mixer pattern -> the NNX module that implements it.

Classes are imported lazily so that ``lmcore`` does not import the model-family packages at import
time (they import ``lmcore``).
"""

from __future__ import annotations

import importlib

MIXERS: dict[str, str] = {
    "softmax": "lmcore.mixers.softmax:SoftmaxAttention",
    "sanatan": "sanatan_jax.mixer:SanatanMixer",
    "taylor": "based_jax.mixers:TaylorLinearAttention",
    "swa": "based_jax.mixers:SlidingWindowAttention",
    "base_conv": "based_jax.mixers:BaseConv",
    "base_conv_zoology": "based_jax.mixers:ZoologyBaseConv",
    "gla": "lmcore.mixers.gla:GLA",
    "gdn": "lmcore.mixers.gated_deltanet:GatedDeltaNet",
    "cyfa": "lmcore.mixers.cyfa:CyFA",
    "linear_transformer": "lmcore.mixers.linear_attention:LinearTransformer",
    "performer": "lmcore.mixers.linear_attention:Performer",
    "cosformer": "lmcore.mixers.linear_attention:CosFormer",
}


def mixer_class(kind: str) -> type:
  """The mixer class registered under ``kind``; unknown kinds list the valid ones."""
  if kind not in MIXERS:
    raise ValueError(f"unknown mixer kind {kind!r}; valid kinds: {', '.join(sorted(MIXERS))}")
  module_name, class_name = MIXERS[kind].split(":")
  return getattr(importlib.import_module(module_name), class_name)
