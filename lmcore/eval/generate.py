"""Sampling from a trained model through its decode state (MATH §5): prefill, then one token a step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.model import LanguageModel


def generate(model: LanguageModel, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
             seed: int = 0, eos_id: int | None = None) -> list[int]:
  """Samples a continuation using the decode state: prefill the prompt once, then one token per call."""
  state = model.init_state(1, len(prompt_ids) + max_new_tokens)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def step(params, rest, tokens_1xT, state, key):
    logits, state = nnx.merge(graphdef, params, rest)(tokens_1xT, state=state)
    last_1xV = logits[:, -1] / max(temperature, 1e-6)
    next_token = jax.random.categorical(key, last_1xV) if temperature > 0 else jnp.argmax(last_1xV, -1)
    return next_token.astype(jnp.int32), state

  key = jax.random.key(seed)
  tokens = jnp.asarray([prompt_ids], jnp.int32)
  out: list[int] = []
  for i in range(max_new_tokens):
    token, state = step(params, rest, tokens, state, jax.random.fold_in(key, i))
    out.append(int(token[0]))
    if eos_id is not None and out[-1] == eos_id:
      break
    tokens = token[:, None]
  return out
