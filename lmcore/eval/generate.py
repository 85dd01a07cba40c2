"""Sampling from a trained model through its decode state (MATH §5): prefill once, then a compiled loop.

Prefill (one jitted call) makes a new decode state and feeds it the shortest prompt's ``min_len`` tokens
of every row; the state is made inside that call, so softmax attention knows its cache is empty and runs
the prompt through the training forward's attention (``lmcore.mixers.softmax``). Decode (jitted, the state
donated) loops on the device, each step picking every row's next token and feeding it back (T = 1). A row
still inside its prompt is fed its next prompt token instead of the sample, so all rows stay at one
position and no pad enters a state (exact for every mixer). Row b's n-th sample draws with its own key
folded with n, so a row samples the same tokens in any batch. A row stops after ``max_new_tokens`` samples
or at ``eos_id``; without an ``eos_id`` the loop is a ``fori_loop`` (no predicate read back per token).
Streaming runs the same loop in segments of a few steps, the carry (logits, state, counts, stops) handed
from one call to the next. Softmax attention preallocates its KV cache; SANATAN p >= 2 has no decode state
and raises before anything runs. Decoding runs a copy of the model prepared once (``_decode_form``):
Linear layers' weights and the head in the compute dtype (the numbers the layers compute per token), and
each layer's projections of one input as one matmul (``prepare_decode``). ``sample_texts`` runs text
prompts (``eval.py --prompt_file``) and streams their text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterator, Sequence
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


def _decode_form(graphdef, params, rest) -> LanguageModel:
  """A copy of the model as decoding runs it: Linear kernels and biases in their compute dtype, then
  every module's ``prepare_decode`` (``lmcore.mixers.base``: a layer's projections of one input as one
  matmul). Done once before the loop: XLA need not hoist the casts and concatenations out of it."""
  model = nnx.merge(graphdef, params, rest)
  modules = [module for _, module in nnx.iter_modules(model)]
  for module in modules:
    # nnx.Linear casts kernel and bias to its dtype on every call: casting them once is the same.
    if isinstance(module, nnx.Linear) and module.dtype is not None:
      module.kernel.set_value(module.kernel[...].astype(module.dtype))
      if module.bias is not None:
        module.bias.set_value(module.bias[...].astype(module.dtype))
  for module in modules:
    if hasattr(module, "prepare_decode"):
      module.prepare_decode()
  return model


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _decode_weights(graphdef, params, rest) -> DecodeWeights:
  model = _decode_form(graphdef, params, rest)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  return DecodeWeights(params, rest, model.unembed_kernel().astype(jnp.dtype(model.config.dtype)))


def _forward(graphdef, weights: DecodeWeights, tokens_BxT, state):
  """Last-position fp32 logits [B, V] and the new state."""
  model = nnx.merge(graphdef, weights.params, weights.rest)
  h_BxTxD, state = model.hidden_states(tokens_BxT, state)
  return model.logits(h_BxTxD[:, -1], weights.unembed_DxV), state


_prefill = jax.jit(_forward, static_argnames=("graphdef",), donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _prefill_new(graphdef, weights: DecodeWeights, tokens_BxT, *, max_len: int):
  """``_forward`` from a new state for ``max_len`` tokens, made inside this call."""
  state = nnx.merge(graphdef, weights.params, weights.rest).init_state(tokens_BxT.shape[0], max_len)
  return _forward(graphdef, weights, tokens_BxT, state)


class Carry(NamedTuple):
  """What one decode segment hands the next: the logits to sample from, the model state, every row's
  sample count and whether it has stopped."""

  logits_BxV: jax.Array
  state: Any
  n_new_B: jax.Array
  done_B: jax.Array


def _sample_rows(logits_BxV, keys_B, n_new_B, sampling: Sampling):
  """Row b draws with ``fold_in(keys_B[b], n_new_B[b])``: its n-th sample depends on its own key and n
  only, never on the batch it sits in or on how many prompt tokens it was still being fed."""
  if sampling.greedy:
    return sample_logits(logits_BxV, None, sampling)
  draw = lambda logits_V, key, n: sample_logits(logits_V[None], jax.random.fold_in(key, n), sampling)[0]
  return jax.vmap(draw)(logits_BxV, keys_B, n_new_B)


def _decode_loop(graphdef, weights: DecodeWeights, logits_BxV, state, n_new_B, done_B, forced_BxF, n_forced_B,
            keys_B, start, *, steps: int, feed_last: bool, max_new_tokens: int, sampling: Sampling,
            eos_id: int | None):
  """Loop steps ``start … start + steps − 1`` (``Generator.decode``): each records every row's token (its
  next prompt token, a sample, or padding once stopped) and feeds it back, except the last step when
  ``feed_last`` is False. Returns the tokens [B, steps] and the ``Carry`` (``state`` donated: its
  buffers hold the new state)."""
  B, F = forced_BxF.shape
  pad = 0 if eos_id is None else eos_id

  def choose(j, carry: Carry, out_BxS):
    i = start + j
    sampled_B = _sample_rows(carry.logits_BxV, keys_B, carry.n_new_B, sampling)
    forcing_B = i < n_forced_B
    if F:
      sampled_B = jnp.where(forcing_B, forced_BxF[:, jnp.minimum(i, F - 1)], sampled_B)
    new_B = ~carry.done_B & ~forcing_B
    token_B = jnp.where(carry.done_B, pad, sampled_B)
    out_BxS = jax.lax.dynamic_update_slice_in_dim(out_BxS, token_B[:, None], j, axis=1)
    n_new_B = carry.n_new_B + new_B
    stop_B = n_new_B >= max_new_tokens
    if eos_id is not None:
      stop_B = stop_B | (token_B == eos_id)
    return token_B, carry._replace(n_new_B=n_new_B, done_B=carry.done_B | (new_B & stop_B)), out_BxS

  def step(j, loop):
    carry, out_BxS = loop
    token_B, carry, out_BxS = choose(j, carry, out_BxS)
    logits_BxV, state = _forward(graphdef, weights, token_B[:, None], carry.state)
    return carry._replace(logits_BxV=logits_BxV, state=state), out_BxS

  loop = (Carry(logits_BxV, state, n_new_B, done_B), jnp.full((B, steps), pad, jnp.int32))
  fed = steps if feed_last else steps - 1
  if eos_id is None:  # a fixed trip count: no predicate read back per token
    j = fed
    loop = jax.lax.fori_loop(0, fed, step, loop)
  else:
    j, loop = jax.lax.while_loop(lambda c: (c[0] < fed) & ~jnp.all(c[1][0].done_B),
                                 lambda c: (c[0] + 1, step(c[0], c[1])), (jnp.int32(0), loop))
  carry, out_BxS = loop
  if not feed_last:  # the last token is only recorded
    _, carry, out_BxS = choose(j, carry, out_BxS)
  return out_BxS, carry


@functools.cache
def _decode_jit(compiler_options: tuple[tuple[str, Any], ...] = ()):
  """``_decode_loop`` jitted with these XLA options (one jit, so one cache of programs, per options)."""
  static = ("graphdef", "steps", "feed_last", "max_new_tokens", "sampling", "eos_id")
  return jax.jit(_decode_loop, static_argnames=static, donate_argnames=("state",),
                 compiler_options=dict(compiler_options) or None)


class Generator:
  """Compiled sampling for one model: ``Generator(model)(prompts, max_new_tokens=N)``; ``stream`` gives
  the samples as they come; ``init_state``, ``prefill`` and ``decode`` serve callers that manage the
  state (``scripts/bench_decode.py``). ``decode_options``: XLA options of the decode loop's program
  only (e.g. ``{"xla_gpu_enable_command_buffer": "..."}``; names XLA does not know fail when it
  compiles)."""

  def __init__(self, model: LanguageModel, *, decode_options: dict[str, Any] | None = None):
    check_can_decode(model)
    self._decode = _decode_jit(tuple(sorted((decode_options or {}).items())))
    self.config = model.config
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    self.weights = _decode_weights(graphdef, params, rest)
    decode_form = nnx.eval_shape(lambda p, r: _decode_form(graphdef, p, r), params, rest)
    self.graphdef = nnx.split(decode_form, nnx.Param, ...)[0]
    self._model = model

  def init_state(self, batch_size: int, max_len: int):
    """The zero decode state for ``batch_size`` rows of up to ``max_len`` tokens."""
    return self._model.init_state(batch_size, max_len)

  def compile(self, batch_size: int, max_len: int, *, prefill_lengths=(), continued_lengths=(),
              max_new_tokens: int = 0, sampling: Sampling = Sampling(), eos_id: int | None = None,
              forced_len: int = 0):
    """Compiles ``prefill`` of prompts of ``prefill_lengths`` into a new state, and of pieces of
    ``continued_lengths`` into a given one, and, with ``max_new_tokens``, one-call ``decode`` ahead of
    the calls (thread-safe: XLA compiles in parallel); returns the compiled decode (None without
    ``max_new_tokens``), whose ``as_text()`` shows the ops of the loop."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    state = jax.eval_shape(lambda: self.init_state(batch_size, max_len))
    for length in prefill_lengths:
      _prefill_new.lower(self.graphdef, self.weights, i32(batch_size, length), max_len=max_len).compile()
    for length in continued_lengths:
      _prefill.lower(self.graphdef, self.weights, i32(batch_size, length), state).compile()
    if max_new_tokens:
      logits = jax.ShapeDtypeStruct((batch_size, self.config.vocab_size), jnp.float32)
      keys = jax.eval_shape(lambda: _row_keys(0, batch_size))
      return self._decode.lower(self.graphdef, self.weights, logits, state, i32(batch_size),
                           jax.ShapeDtypeStruct((batch_size,), jnp.bool_), i32(batch_size, forced_len),
                           i32(batch_size), keys, i32(), steps=forced_len + max_new_tokens, feed_last=False,
                           max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id).compile()
    return None

  def prefill(self, tokens_BxT, state=None, *, max_len: int = 0):
    """Feeds ``tokens_BxT`` (every row the same length) through the model; returns the last
    position's fp32 logits [B, V] and the new state. ``state`` (donated) continues a sequence; None
    starts one in a new state for ``max_len`` tokens (the prompt's length when 0), made inside the
    call (see the module docstring)."""
    tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
    if state is None:
      return _prefill_new(self.graphdef, self.weights, tokens_BxT, max_len=max_len or tokens_BxT.shape[1])
    return _prefill(self.graphdef, self.weights, tokens_BxT, state)

  def decode(self, logits_BxV, state, *, max_new_tokens: int, sampling: Sampling = Sampling(),
             seed: int | Sequence[int] = 0, eos_id: int | None = None, forced_BxF=None, n_forced_B=None):
    """The whole sampling loop after a prefill in one call (``state`` donated); ``forced_BxF`` /
    ``n_forced_B``: each row's remaining prompt tokens; ``seed``: one per row, or the first of
    ``seed, seed + 1, …``. Returns tokens [B, F + max_new_tokens] (prompt tail, samples, padding),
    each row's sample count [B] and the state after the last token fed."""
    B = logits_BxV.shape[0]
    forced_BxF, n_forced_B = _forced(B, forced_BxF, n_forced_B)
    steps = forced_BxF.shape[1] + max_new_tokens
    out_BxS, carry = self._decode(self.graphdef, self.weights, *_start(logits_BxV, state), forced_BxF,
                                  n_forced_B, _row_keys(seed, B), jnp.int32(0), steps=steps, feed_last=False,
                                  max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id)
    return out_BxS, carry.n_new_B, carry.state

  def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
             seed: int | Sequence[int] = 0, eos_id: int | None = None,
             segment: int = 0) -> Iterator[list[list[int]]]:
    """Every row's new samples after each ``segment`` loop steps (0: all in one call): one ragged batch,
    prefilled with the shortest prompt, each longer row fed the rest of its prompt inside the loop. The
    segments run the same steps as one call, so they sample the same tokens."""
    lengths = check_prompts(prompts, max_new_tokens, self.config)
    B, min_len = len(prompts), min(lengths)
    tokens_BxL = np.zeros((B, max(lengths)), np.int32)
    for b, prompt in enumerate(prompts):
      tokens_BxL[b, :lengths[b]] = prompt
    n_forced_B = np.asarray(lengths, np.int32) - min_len
    forced_BxF = jnp.asarray(tokens_BxL[:, min_len:])
    logits_BxV, state = self.prefill(tokens_BxL[:, :min_len], max_len=max(lengths) + max_new_tokens)
    carry, keys_B = _start(logits_BxV, state), _row_keys(seed, B)
    total = forced_BxF.shape[1] + max_new_tokens
    segment = segment or total
    n_new_B = np.zeros((B,), np.int64)
    for start in range(0, total, segment):
      steps = min(segment, total - start)
      out_BxS, carry = self._decode(self.graphdef, self.weights, *carry, forced_BxF, jnp.asarray(n_forced_B),
                                    keys_B, jnp.int32(start), steps=steps, feed_last=start + steps < total,
                                    max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id)
      out_BxS, before_B, n_new_B = np.asarray(out_BxS), n_new_B, np.asarray(carry.n_new_B)
      # Row b's samples sit at loop steps n_forced_B[b] ... n_forced_B[b] + n_new_B[b] - 1.
      first_B = n_forced_B + before_B - start
      yield [out_BxS[b, first_B[b]:first_B[b] + n_new_B[b] - before_B[b]].tolist() for b in range(B)]
      if np.all(np.asarray(carry.done_B)):
        break

  def __call__(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               sampling: Sampling = Sampling(), seed: int | Sequence[int] = 0,
               eos_id: int | None = None) -> list[list[int]]:
    """The sampled continuation of every prompt (a stop at ``eos_id`` includes the EOS token)."""
    rows = [[] for _ in prompts]
    for pieces in self.stream(prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                              eos_id=eos_id):
      for row, piece in zip(rows, pieces):
        row += piece
    return rows


def _start(logits_BxV, state) -> Carry:
  B = logits_BxV.shape[0]
  return Carry(logits_BxV, state, jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool))


def _row_keys(seed: int | Sequence[int], batch_size: int) -> jax.Array:
  """One key per row: ``seed`` per row, or ``seed + b`` for row b of a single ``seed``."""
  seeds_B = np.asarray(seed, np.int64) + (np.arange(batch_size) if np.ndim(seed) == 0 else 0)
  if seeds_B.shape != (batch_size,):
    raise ConfigError(f"give one seed or one per prompt ({batch_size} prompts), got {seeds_B.size}")
  return jax.vmap(jax.random.key)(jnp.asarray(seeds_B % 2**32, jnp.uint32))


def _forced(B: int, forced_BxF, n_forced_B) -> tuple[jax.Array, jax.Array]:
  if forced_BxF is None:
    forced_BxF, n_forced_B = np.zeros((B, 0), np.int32), np.zeros((B,), np.int32)
  return jnp.asarray(forced_BxF, jnp.int32), jnp.asarray(n_forced_B, jnp.int32)


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


def read_prompt_file(path: str) -> list[str]:
  """The prompts of a text file, one per line (blank lines skipped); a ``ConfigError`` naming the file
  when it is missing or holds no prompt."""
  if not os.path.isfile(path):
    raise ConfigError(f"--prompt_file={path}: no such file; give a text file with one prompt per line")
  with open(path, encoding="utf-8") as f:
    prompts = [line.rstrip("\r\n") for line in f if line.strip()]
  if not prompts:
    raise ConfigError(f"--prompt_file={path} holds no prompt; write one prompt per line")
  return prompts


class TextStream:
  """Each row's new text as its tokens arrive: the decoded samples so far, less what was already given
  out (token pieces decode differently alone, e.g. a leading space or half a UTF-8 character)."""

  def __init__(self, tokenizer, batch_size: int):
    self.tokenizer, self.ids = tokenizer, [[] for _ in range(batch_size)]
    self.shown = [""] * batch_size

  def add(self, b: int, ids: list[int], final: bool = False) -> str:
    self.ids[b] += ids
    text = self.tokenizer.decode(_without_eos(self.ids[b], self.tokenizer.eos_id))
    if not final and text.endswith("\ufffd"):  # an incomplete character: wait for its next token
      return ""
    new, self.shown[b] = text[len(self.shown[b]):] if text.startswith(self.shown[b]) else text, text
    return new


def _without_eos(ids: list[int], eos_id: int | None) -> list[int]:
  return ids[:-1] if ids and eos_id is not None and ids[-1] == eos_id else ids


def sample_texts(model: LanguageModel | Generator, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                 sampling: Sampling = Sampling(), seed: int = 0, segment: int = 8,
                 on_text: Callable[[int, str], None] | None = None) -> list[dict[str, Any]]:
  """Samples a continuation of every text prompt in one ragged batch, stopping a row at the tokenizer's
  EOS; ``on_text(b, text)`` receives row b's new text after every ``segment`` loop steps. Returns one
  record per prompt: prompt, completion (the text, without a final EOS), tokens (the sampled ids, a
  final EOS included), stop ("eos" or "length") and the sampling settings (row b's seed is seed + b,
  so one prompt sampled alone with that seed gives the same tokens)."""
  gen = model if isinstance(model, Generator) else Generator(model)
  ids = [tokenizer.encode(p) for p in prompts]
  text = TextStream(tokenizer, len(prompts))
  for pieces in gen.stream(ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                           eos_id=tokenizer.eos_id, segment=segment):
    for b, piece in enumerate(pieces):
      new = text.add(b, piece) if piece else ""
      if new and on_text:
        on_text(b, new)
  records = []
  for b, prompt in enumerate(prompts):
    if (rest := text.add(b, [], final=True)) and on_text:
      on_text(b, rest)
    tokens = text.ids[b]
    records.append(dict(prompt=prompt, completion=text.shown[b], tokens=tokens, prompt_tokens=len(ids[b]),
                        stop="eos" if tokens and tokens[-1] == tokenizer.eos_id else "length",
                        max_new_tokens=max_new_tokens, seed=seed + b, **dataclasses.asdict(sampling)))
  return records


def print_text(n_prompts: int) -> Callable[[int, str], None]:
  """An ``on_text`` that prints as text arrives: one prompt's continuation inline, several prompts'
  pieces one per line behind their prompt's index."""
  if n_prompts == 1:
    return lambda b, text: print(text, end="", flush=True)
  return lambda b, text: print(f"[{b}] {text}", flush=True)


def write_jsonl(path: str, records: Sequence[dict[str, Any]]) -> None:
  """``records`` as JSON lines in ``path`` (replaced; its folder created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def sample_to_jsonl(model: LanguageModel | Generator, tokenizer, prompts: Sequence[str], path: str, *,
                    max_new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
                    segment: int = 8) -> list[dict[str, Any]]:
  """``sample_texts`` with the text printed as it is sampled (``print_text``) and the records written
  to ``path`` as JSON lines (``eval.py --prompt`` / ``--prompt_file``); returns the records."""
  header = f"{prompts[0]}" if len(prompts) == 1 else "\n".join(f"[{b}] {p}" for b, p in enumerate(prompts))
  print(f"--- sample ---\n{header}", end="" if len(prompts) == 1 else "\n", flush=True)
  records = sample_texts(model, tokenizer, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                         seed=seed, segment=segment, on_text=print_text(len(prompts)))
  write_jsonl(path, records)
  print(f"\n--------------\nwrote {len(records)} sample(s) to {path}", flush=True)
  return records


def prompts_of(prompt: str, prompt_file: str, stream_tokens: int = 8) -> list[str]:
  """The prompts of ``eval.py``'s flags: ``--prompt``, the lines of ``--prompt_file``, or none; a
  ``ConfigError`` for both at once or a ``--stream_tokens`` below 1."""
  if prompt and prompt_file:
    raise ConfigError("give --prompt or --prompt_file, not both (put the prompt on a line of the file)")
  if not stream_tokens >= 1:
    raise ConfigError(f"--stream_tokens must be >= 1, got {stream_tokens}")
  return read_prompt_file(prompt_file) if prompt_file else [prompt] if prompt else []
