"""The three numbers to hold equal, or report, when two models are compared (MATH §3): parameters,
recurrent-state bytes per sequence, and FLOPs per token (forward and training).

FLOPs are counted analytically, per token of a fresh sequence of the configured length T:

    forward = sum over layers (mixer.flops_per_token(T) + MLP) + unembedding,
    MLP = 2 · 3 · D · mlp_hidden (SwiGLU's gate, up and down kernels; 0 without an MLP),
    unembedding = 2 · D · V (tied or not; the embedding and position lookups cost nothing),
    train = 3 × forward (the backward pass costs twice the forward; remat's recomputation is
    not counted, as in the usual MFU convention).

Each mixer counts by the conventions of ``lmcore/mixers/flops.py``. XLA's cost analysis is not used:
it counts a ``lax.scan`` body once and a Pallas kernel only by the estimate the kernel passes.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from lmcore.config import ModelConfig
from lmcore.model import LanguageModel, count_params


def flops_per_token(config: ModelConfig, seq_len: int, model: LanguageModel | None = None
                    ) -> dict[str, float]:
  """Forward FLOPs per token by part (module docstring): ``{"mixers", "mlp", "unembedding",
  "forward", "train"}``. ``model``: the (abstract) model of ``config``, built here when omitted."""
  if seq_len < 1:
    raise ValueError(f"data.seq_len={seq_len}: FLOPs per token need a sequence of at least one token.")
  if model is None:
    model = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  D = config.d_model
  mixers = sum(float(block.mixer.flops_per_token(seq_len)) for block in model.blocks)
  mlp = len(model.blocks) * 2.0 * 3 * D * config.mlp_hidden if config.mlp == "swiglu" else 0.0
  unembedding = 2.0 * D * config.vocab_size
  forward = mixers + mlp + unembedding
  return {"mixers": mixers, "mlp": mlp, "unembedding": unembedding, "forward": forward,
          "train": 3.0 * forward}


def card(config: ModelConfig, seq_len: int) -> dict[str, Any]:
  abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  n_params = count_params(abstract)
  embedding = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
  try:
    state_bytes = abstract.state_bytes(1, seq_len)
  except (ValueError, NotImplementedError):
    state_bytes = None  # e.g. SANATAN p >= 2: no constant-size state
  flops = flops_per_token(config, seq_len, abstract)
  return {"params": n_params, "params_non_embedding": n_params - embedding,
          "state_bytes_per_sequence": state_bytes, "seq_len": seq_len,
          "flops_per_token_forward": flops["forward"], "flops_per_token_train": flops["train"],
          "flops_per_token_forward_parts": {k: flops[k] for k in ("mixers", "mlp", "unembedding")},
          "layers": list(config.layer_kinds())}


def format_card(c: dict[str, Any]) -> str:
  state = c["state_bytes_per_sequence"]
  state = ("no constant-size state" if state is None
           else f"state {state:,.0f} B/sequence at T={c['seq_len']}")
  return (f"model: {c['params']:,} params ({c['params_non_embedding']:,} non-embedding) | {state} | "
          f"FLOPs/token fwd {c['flops_per_token_forward']:,.0f}, train {c['flops_per_token_train']:,.0f}")
