"""Sampling from a trained model through its decode state (MATH §5): prefill once, then a compiled loop.

Prefill (one jitted call) feeds the shortest prompt's ``min_len`` tokens of every row into a fresh
decode state; decode (one jitted call, the state donated) loops on the device, each step picking every
row's next token and feeding it back (T = 1). A row still inside its prompt is fed its next prompt
token instead of the sample, so all rows stay at one position and no pad enters a state (exact for
every mixer). A row stops after ``max_new_tokens`` samples or at ``eos_id``; without an ``eos_id`` the
loop is a ``fori_loop`` (no predicate read back per token). Softmax attention preallocates its KV cache;
SANATAN p >= 2 has no decode state and raises before anything runs. Linear layers' weights and the
head are cast to the compute dtype once (the numbers the layers compute per token).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lmcore.config import ModelConfig
from lmcore.errors import ConfigError
from lmcore.model import LanguageModel


def check_decodable(config: ModelConfig) -> None:
  """Raises ``ConfigError`` when a model of ``config`` cannot decode token by token (a mixer without a
  decode state, e.g. SANATAN p >= 2); nothing is allocated."""
  abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  try:
    check_can_decode(abstract)
  except (ValueError, NotImplementedError) as e:
    raise ConfigError(f"--prompt needs a model that decodes token by token, and this one cannot: {e} "
                      "Drop --prompt to evaluate it.") from None


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn: ``temperature`` 0 is greedy (argmax); otherwise logits / temperature,
  kept to the ``top_k`` most likely (0: all), then to the smallest set whose probability reaches
  ``top_p`` (1: all; the most likely token stays), then one categorical draw."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ConfigError(f"temperature must be >= 0 (0 samples greedily), got {self.temperature}")
    if not (isinstance(self.top_k, int) and self.top_k >= 0):
      raise ConfigError(f"top_k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}")
    if not 0 < self.top_p <= 1:
      raise ConfigError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def sample_logits(logits_BxV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Next token ids int32 [B] from fp32 logits [B, V] (``Sampling``); rows draw independently."""
  if sampling.greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
  index_BxK = None
  if sampling.top_k and sampling.top_k < logits_BxV.shape[-1]:
    logits_BxV, index_BxK = jax.lax.top_k(logits_BxV, sampling.top_k)
  elif sampling.top_p < 1:
    index_BxK = jnp.argsort(-logits_BxV, axis=-1)
    logits_BxV = jnp.take_along_axis(logits_BxV, index_BxK, axis=-1)
  if sampling.top_p < 1:  # logits are sorted in descending order here
    probs_BxK = jax.nn.softmax(logits_BxV, axis=-1)
    mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
    logits_BxV = jnp.where(mass_before_BxK < sampling.top_p, logits_BxV, -jnp.inf)
  choice_B = jax.random.categorical(key, logits_BxV, axis=-1)
  if index_BxK is not None:
    choice_B = jnp.take_along_axis(index_BxK, choice_B[:, None], axis=-1)[:, 0]
  return choice_B.astype(jnp.int32)


def check_can_decode(model: LanguageModel) -> None:
  """Raises the mixer's one-line ValueError if some layer has no decode state (SANATAN p >= 2)."""
  jax.eval_shape(lambda: model.init_state(1, 1))


class DecodeWeights(NamedTuple):
  """The model's parameters as decoding reads them (see the module docstring)."""

  params: Any  # nnx.Param state, Linear kernels and biases in their layer's compute dtype
  rest: Any  # every other variable
  unembed_DxV: jax.Array  # the head's matrix in the activation dtype


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _decode_weights(graphdef, params, rest) -> DecodeWeights:
  model = nnx.merge(graphdef, params, rest)
  for _, module in nnx.iter_modules(model):
    # nnx.Linear casts kernel and bias to its dtype on every call: casting them once is the same.
    if isinstance(module, nnx.Linear) and module.dtype is not None:
      module.kernel.set_value(module.kernel[...].astype(module.dtype))
      if module.bias is not None:
        module.bias.set_value(module.bias[...].astype(module.dtype))
  _, params, rest = nnx.split(model, nnx.Param, ...)
  return DecodeWeights(params, rest, model.unembed_kernel().astype(jnp.dtype(model.config.dtype)))


def _forward(graphdef, weights: DecodeWeights, tokens_BxT, state):
  """Last-position fp32 logits [B, V] and the new state."""
  model = nnx.merge(graphdef, weights.params, weights.rest)
  h_BxTxD, state = model.hidden_states(tokens_BxT, state)
  return model.logits(h_BxTxD[:, -1], weights.unembed_DxV), state


_prefill = jax.jit(_forward, static_argnames=("graphdef",), donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "eos_id"),
                   donate_argnames=("state",))
def _decode(graphdef, weights: DecodeWeights, logits_BxV, state, forced_BxF, n_forced_B, key, *,
            max_new_tokens: int, sampling: Sampling, eos_id: int | None):
  """The sampling loop (``Generator.decode``); the final state is returned so that the donated
  buffers carry it in place."""
  B, F = forced_BxF.shape
  steps = F + max_new_tokens
  pad = 0 if eos_id is None else eos_id

  def choose(i, logits_BxV, out_BxS, n_new_B, done_B):
    sampled_B = sample_logits(logits_BxV, jax.random.fold_in(key, i), sampling)
    forcing_B = i < n_forced_B
    if F:
      sampled_B = jnp.where(forcing_B, forced_BxF[:, jnp.minimum(i, F - 1)], sampled_B)
    new_B = ~done_B & ~forcing_B
    token_B = jnp.where(done_B, pad, sampled_B)
    out_BxS = jax.lax.dynamic_update_slice_in_dim(out_BxS, token_B[:, None], i, axis=1)
    n_new_B = n_new_B + new_B
    stop_B = n_new_B >= max_new_tokens
    if eos_id is not None:
      stop_B = stop_B | (token_B == eos_id)
    return token_B, out_BxS, n_new_B, done_B | (new_B & stop_B)

  def step(i, carry):
    logits_BxV, state, out_BxS, n_new_B, done_B = carry
    token_B, out_BxS, n_new_B, done_B = choose(i, logits_BxV, out_BxS, n_new_B, done_B)
    logits_BxV, state = _forward(graphdef, weights, token_B[:, None], state)
    return logits_BxV, state, out_BxS, n_new_B, done_B

  carry = (logits_BxV, state, jnp.full((B, steps), pad, jnp.int32), jnp.zeros((B,), jnp.int32),
           jnp.zeros((B,), bool))
  # Every step but the last feeds its token back; the last token is only recorded.
  if eos_id is None:
    i = steps - 1
    carry = jax.lax.fori_loop(0, i, step, carry)
  else:
    i, carry = jax.lax.while_loop(
        lambda c: (c[0] < steps - 1) & ~jnp.all(c[1][4]),
        lambda c: (c[0] + 1, step(c[0], c[1])), (jnp.int32(0), carry))
  logits_BxV, state, out_BxS, n_new_B, done_B = carry
  _, out_BxS, n_new_B, _ = choose(i, logits_BxV, out_BxS, n_new_B, done_B)
  return out_BxS, n_new_B, state


class Generator:
  """Compiled sampling for one model: ``Generator(model)(prompts, max_new_tokens=N)``; ``init_state``,
  ``prefill`` and ``decode`` serve callers that manage the state (``scripts/bench_decode.py``)."""

  def __init__(self, model: LanguageModel):
    check_can_decode(model)
    self.config = model.config
    self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    self.weights = _decode_weights(self.graphdef, params, rest)
    self._model = model

  def init_state(self, batch_size: int, max_len: int):
    """The zero decode state for ``batch_size`` rows of up to ``max_len`` tokens."""
    return self._model.init_state(batch_size, max_len)

  def compile(self, batch_size: int, max_len: int, *, prefill_lengths=(), max_new_tokens: int = 0,
              sampling: Sampling = Sampling(), eos_id: int | None = None, forced_len: int = 0) -> None:
    """Compiles ``prefill`` for ``prefill_lengths`` and, with ``max_new_tokens``, ``decode`` ahead of
    the calls (thread-safe: XLA compiles in parallel)."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    state = jax.eval_shape(lambda: self.init_state(batch_size, max_len))
    for length in prefill_lengths:
      _prefill.lower(self.graphdef, self.weights, i32(batch_size, length), state).compile()
    if max_new_tokens:
      logits = jax.ShapeDtypeStruct((batch_size, self.config.vocab_size), jnp.float32)
      _decode.lower(self.graphdef, self.weights, logits, state, i32(batch_size, forced_len), i32(batch_size),
                    jax.eval_shape(lambda: jax.random.key(0)), max_new_tokens=max_new_tokens,
                    sampling=sampling, eos_id=eos_id).compile()

  def prefill(self, tokens_BxT, state):
    """Feeds ``tokens_BxT`` (every row the same length) through the model; returns the last
    position's fp32 logits [B, V] and the new state. ``state`` is donated."""
    return _prefill(self.graphdef, self.weights, jnp.asarray(tokens_BxT, jnp.int32), state)

  def decode(self, logits_BxV, state, *, max_new_tokens: int, sampling: Sampling = Sampling(),
             key: jax.Array | None = None, eos_id: int | None = None, forced_BxF=None,
             n_forced_B=None):
    """The sampling loop after a prefill (``state`` donated); ``forced_BxF`` / ``n_forced_B``: each
    row's remaining prompt tokens. Returns tokens [B, F + max_new_tokens] (prompt tail, samples,
    padding), each row's sample count [B] and the state after the last token fed."""
    B = logits_BxV.shape[0]
    if forced_BxF is None:
      forced_BxF, n_forced_B = np.zeros((B, 0), np.int32), np.zeros((B,), np.int32)
    key = jax.random.key(0) if key is None else key
    return _decode(self.graphdef, self.weights, logits_BxV, state, jnp.asarray(forced_BxF, jnp.int32),
                   jnp.asarray(n_forced_B, jnp.int32), key, max_new_tokens=max_new_tokens,
                   sampling=sampling, eos_id=eos_id)

  def __call__(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               sampling: Sampling = Sampling(), seed: int = 0,
               eos_id: int | None = None) -> list[list[int]]:
    """The sampled continuation of every prompt (a stop at ``eos_id`` includes the EOS token)."""
    lengths = check_prompts(prompts, max_new_tokens, self.config)
    B, min_len, max_len = len(prompts), min(lengths), max(lengths) + max_new_tokens
    tokens_BxL = np.zeros((B, max(lengths)), np.int32)
    for b, prompt in enumerate(prompts):
      tokens_BxL[b, :lengths[b]] = prompt
    n_forced_B = np.asarray(lengths, np.int32) - min_len
    logits_BxV, state = self.prefill(tokens_BxL[:, :min_len], self.init_state(B, max_len))
    out_BxS, n_new_B, _ = self.decode(logits_BxV, state, max_new_tokens=max_new_tokens, sampling=sampling,
                                   key=jax.random.key(seed), eos_id=eos_id,
                                   forced_BxF=tokens_BxL[:, min_len:], n_forced_B=n_forced_B)
    out_BxS, n_new_B = np.asarray(out_BxS), np.asarray(n_new_B)
    return [out_BxS[b, n_forced_B[b]:n_forced_B[b] + n_new_B[b]].tolist() for b in range(B)]


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, config: ModelConfig) -> list[int]:
  """The prompts' lengths; a ``ConfigError`` naming the prompt or the limit for anything decoding
  cannot run (empty prompts, ids outside the vocabulary, positions past ``model.max_positions``)."""
  if isinstance(prompts, (str, bytes)) or not len(prompts):
    raise ConfigError("prompts must be a non-empty list of token-id lists")
  if not (isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens >= 1):
    raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  lengths = []
  for b, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not ids.size:
      raise ConfigError(f"prompt {b} must be a non-empty list of token ids (give at least one token, e.g. "
                       "the tokenizer's EOS as a document start)")
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= config.vocab_size:
      raise ConfigError(f"prompt {b} has token ids outside 0..{config.vocab_size - 1}")
    lengths.append(int(ids.size))
  if config.max_positions and max(lengths) + max_new_tokens - 1 > config.max_positions:
    raise ConfigError(f"the longest prompt ({max(lengths)} tokens) plus max_new_tokens={max_new_tokens} "
                     f"passes the model's learned positions (model.max_positions={config.max_positions}); "
                     "shorten the prompt or ask for fewer tokens")
  return lengths


def generate(model: LanguageModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), seed: int = 0, eos_id: int | None = None) -> list[list[int]]:
  """Samples a continuation of every prompt (lists of token ids, any lengths); see the module docstring."""
  return Generator(model)(prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                          eos_id=eos_id)
