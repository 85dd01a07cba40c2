"""The three numbers that must match before two models are compared (MATH §3):
parameters, recurrent-state bytes per sequence, and FLOPs per token (forward and training).

FLOPs come from XLA's cost analysis of the lowered (not compiled) forward and gradient functions at
the configured sequence length and implementation ("auto" counted as its XLA form on every host: XLA
sees no FLOPs inside a Pallas kernel), divided by the tokens of one sequence.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lmcore.config import ModelConfig
from lmcore.ops.common import pallas_utils
from lmcore.model import LanguageModel, count_params


def _lowered_flops(fn, *args) -> float | None:
  try:
    cost = jax.jit(fn).lower(*args).cost_analysis()
  except Exception:  # Some backends/ops have no cost model; the card then says "n/a".
    return None
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0)) if cost else None


def card(config: ModelConfig, seq_len: int) -> dict[str, Any]:
  abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  n_params = count_params(abstract)
  embedding = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
  try:
    state_bytes = abstract.state_bytes(1, seq_len)
  except (ValueError, NotImplementedError):
    state_bytes = None  # e.g. SANATAN p >= 2: no constant-size state
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)

  def forward(params, rest, tokens):
    return nnx.merge(graphdef, params, rest)(tokens)[0]

  def loss(params, rest, tokens):
    logits = forward(params, rest, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  with pallas_utils.assume_backend("cpu"):  # "auto" mixers count as their XLA forms (see there)
    fwd = _lowered_flops(forward, params, rest, tokens)
    train = _lowered_flops(jax.grad(loss), params, rest, tokens)
  return {"params": n_params, "params_non_embedding": n_params - embedding,
          "state_bytes_per_sequence": state_bytes, "seq_len": seq_len,
          "flops_per_token_forward": None if fwd is None else fwd / seq_len,
          "flops_per_token_train": None if train is None else train / seq_len,
          "layers": list(config.layer_kinds())}


def format_card(c: dict[str, Any]) -> str:
  def num(x, unit=""):
    return "n/a" if x is None else f"{x:,.0f}{unit}"
  return (f"model: {c['params']:,} params ({c['params_non_embedding']:,} non-embedding) | "
          f"state {num(c['state_bytes_per_sequence'], ' B')}/sequence at T={c['seq_len']} | "
          f"FLOPs/token fwd {num(c['flops_per_token_forward'])}, train {num(c['flops_per_token_train'])}")
