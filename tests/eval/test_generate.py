"""The compiled generation loop: greedy samples equal the argmax of a full forward for every mixer family
(prompts of different lengths in one batch), a ragged batch samples what each prompt samples alone,
streamed segments sample what one call samples, EOS stopping, the sampling filters, text prompts to
JSONL records with streamed text, and the input errors."""

import dataclasses
import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.errors import ConfigError
from lmcore.eval.generate import (Generator, Sampling, generate, print_text, prompts_of, read_prompt_file,
                                  sample_logits, sample_to_jsonl)
from lmcore.mixers.base import InitSpec
from lmcore.mixers.softmax import SoftmaxAttention
from lmcore.model import LanguageModel
from lmcore.numerics import relative_l2

VOCAB = 61
# Every mixer family, hybrids where a family is small; untied heads and a larger init make the argmax
# depend on the context (a tied tiny model mostly repeats its input token).
FAMILIES = {
    "sanatan_p1": ("sanatan*2", {"sanatan": {"n_heads": 2, "head_dim": 8, "p": 1}}),
    "based": ("base_conv*3;taylor@1;swa@2", {"taylor": {"n_heads": 2, "feature_dim": 8},
                                             "swa": {"n_heads": 2, "window": 3}, "base_conv": {}}),
    "base_conv_zoology": ("base_conv_zoology*2", {"base_conv_zoology": {"kernel_size": 3}}),
    "softmax": ("softmax*2", {"softmax": {"n_heads": 2}}),
    "gla": ("gla*2", {"gla": {"n_heads": 2}}),
    "cyfa_gdn": ("cyfa*1,gdn*1", {"cyfa": {"n_heads": 2, "head_dim": 8, "v_head_dim": 8},
                                  "gdn": {"n_heads": 2, "head_dim": 8}}),
    "linear_baselines": ("linear_transformer*1,performer*1,cosformer*1",
                         {kind: {"n_heads": 2, "head_dim": 16}
                          for kind in ("linear_transformer", "performer", "cosformer")}),
}
PROMPTS = [[5, 17, 3, 40, 22], [9], [31, 2, 7]]


def make_model(pattern, mixers, seed=0, **fields):
  values = dict(vocab_size=VOCAB, d_model=32, n_layers=_layers(pattern), pattern=pattern, mlp_hidden=48,
                dtype="float32", tie_embeddings=False, init_std=0.2, mixers=mixers)
  return LanguageModel(cfg_lib.model_config({**values, **fields}), rngs=nnx.Rngs(seed))


def _layers(pattern):
  head = pattern.split(";")[0]
  return sum(int(run.partition("*")[2] or 1) for run in head.split(","))


def argmax_of_full_forward(model, prompts, generated):
  """Every row's argmax after each of its prefixes: one causal forward over prompt + generated[:-1]
  (rows right-padded to one length, which causality makes harmless)."""
  rows = [p + g[:-1] for p, g in zip(prompts, generated)]
  tokens_BxT = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for b, row in enumerate(rows):
    tokens_BxT[b, :len(row)] = row
  graphdef, state = nnx.split(model)
  logits_BxTxV = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])(state, tokens_BxT)
  argmax_BxT = np.asarray(jnp.argmax(logits_BxTxV, axis=-1))
  return [argmax_BxT[b, len(p) - 1:len(r)].tolist() for b, (p, r) in enumerate(zip(prompts, rows))]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_argmax_of_the_full_forward(family):
  """Prompts of lengths 5, 1 and 3 in one batch (rows fed their own prompt tails inside the loop),
  8 tokens each (past the SWA window of 3): every sample is the full forward's argmax (fp32)."""
  model = make_model(*FAMILIES[family])
  out = generate(model, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=0))
  assert [len(row) for row in out] == [8, 8, 8]
  assert out == argmax_of_full_forward(model, PROMPTS, out)
  assert len({t for row in out for t in row}) > 4, out  # the check compares varied tokens


def test_a_model_trained_with_recomputation_samples_as_without_it():
  """``model.remat`` (BASED's presets train with "dots") changes nothing a forward computes: a prefill
  and decode through the generator (they carry a state) sample the tokens of the same weights without
  it, where the full forward (no state) recomputes."""
  model = make_model(*FAMILIES["based"], remat=True, remat_policy="dots")
  out = generate(model, PROMPTS, max_new_tokens=6, sampling=Sampling(temperature=0))
  plain = make_model(*FAMILIES["based"])
  nnx.update(plain, nnx.state(model))
  assert out == generate(plain, PROMPTS, max_new_tokens=6, sampling=Sampling(temperature=0))
  assert out == argmax_of_full_forward(model, PROMPTS, out)


def _primitives(jaxpr) -> set[str]:
  """Every primitive of a jaxpr, nested jaxprs (jit, custom_jvp, scan bodies) included."""
  found = set()
  for eqn in jaxpr.eqns:
    found.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found |= _primitives(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found |= _primitives(sub)
  return found


@pytest.mark.parametrize("family", FAMILIES)
def test_the_one_token_step_has_no_loop_and_no_kernel_call(family):
  """Decoding one token runs each mixer's one-step form: no scan or while loop (a serial loop of one
  step), no Pallas kernel and no chunked padding path."""
  model = make_model(*FAMILIES[family])
  graphdef, state = nnx.split(model)
  step = lambda state, tokens, decode: nnx.merge(graphdef, state)(tokens, state=decode)
  jaxpr = jax.make_jaxpr(step)(state, jnp.zeros((2, 1), jnp.int32), model.init_state(2, 8))
  assert not _primitives(jaxpr.jaxpr) & {"scan", "while", "pallas_call", "cond"}


def test_learned_positions_follow_each_row_and_their_limit_is_checked():
  model = make_model(*FAMILIES["softmax"], max_positions=12)
  out = generate(model, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=0))
  assert out == argmax_of_full_forward(model, PROMPTS, out)
  with pytest.raises(ValueError, match=r"model.max_positions=12"):
    generate(model, PROMPTS, max_new_tokens=9)


def test_eos_stops_each_row_at_its_first_eos_and_top_k_1_sampling_is_greedy():
  """With eos_id, each row is the greedy continuation cut after its first EOS (EOS included); top_k = 1
  at temperature 1 draws the argmax, so the sampled (while-loop) path must give the same tokens."""
  model = make_model(*FAMILIES["sanatan_p1"])
  greedy = generate(model, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=0))
  eos = greedy[0][2]
  cut = [row[:row.index(eos) + 1] if eos in row else row for row in greedy]
  assert len(cut[0]) == 3 and any(len(row) == 8 for row in cut)
  assert generate(model, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=1.0, top_k=1),
                  eos_id=eos) == cut


def test_a_ragged_batch_samples_what_each_prompt_samples_alone():
  """Temperature 1: row b of one batch (seed 7 + b) draws the tokens its prompt draws alone with seed
  7 + b, though in the batch it is prefilled with the shortest prompt and fed its own tail inside the
  loop (fp32; a draw would move only if the two forms' rounding flipped a sample)."""
  gen = Generator(make_model(*FAMILIES["sanatan_p1"]))
  batch = gen(PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=1.0), seed=7)
  alone = [gen([p], max_new_tokens=8, sampling=Sampling(temperature=1.0), seed=7 + b)[0]
           for b, p in enumerate(PROMPTS)]
  assert batch == alone and len(set(map(tuple, batch))) == 3


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=1.0)],
                         ids=["greedy", "temperature_1"])
def test_a_prompt_token_equal_to_eos_past_the_shortest_prompt_does_not_stop_its_row(sampling):
  """EOS (id 47 here) sits in the longer prompts after the shortest prompt's length (1), so the batch
  feeds it inside the loop, and it ends row 0's prompt: a row stops only on an EOS it sampled, and each
  row samples exactly what its prompt samples alone (seed 5 + b). With this id a row also samples EOS
  and stops (row 1 greedily, row 2 at temperature 1), so both kinds of EOS meet in one batch."""
  eos, prompts = 47, [[5, 17, 47, 40, 47], [9], [31, 47, 7]]
  gen = Generator(make_model(*FAMILIES["sanatan_p1"]))
  kwargs = dict(max_new_tokens=8, sampling=sampling, eos_id=eos)
  batch = gen(prompts, seed=5, **kwargs)
  alone = [gen([p], seed=5 + b, **kwargs)[0] for b, p in enumerate(prompts)]
  assert batch == alone
  assert len(batch[0]) == 8 and any(len(row) < 8 and row[-1] == eos for row in batch), batch
  assert all(eos not in row[:-1] for row in batch)  # a sampled EOS is a row's last token


def test_streamed_segments_sample_the_tokens_of_one_call():
  """Decoding in segments of 3 loop steps (state, counts and stops carried between the calls) yields,
  piece by piece, exactly the tokens one call samples with the same seed (the fixed-trip-count loop;
  the text test below checks the EOS-stopping loop)."""
  gen = Generator(make_model(*FAMILIES["sanatan_p1"]))
  kwargs = dict(max_new_tokens=8, sampling=Sampling(temperature=1.0), seed=3)
  pieces = list(gen.stream(PROMPTS, segment=3, **kwargs))
  assert len(pieces) == 4  # 4 prompt tokens fed and 8 sampled: 12 loop steps
  assert [sum((p[b] for p in pieces), []) for b in range(len(PROMPTS))] == gen(PROMPTS, **kwargs)


class Letters:
  """A tokenizer of VOCAB ids: id i > 0 is one character of ALPHABET; EOS = 0."""

  name, vocab_size, eos_id = "letters", VOCAB, 0
  ALPHABET = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ012345678"

  def encode(self, text):
    return [self.ALPHABET.index(c) + 1 for c in text]

  def decode(self, ids):
    return "".join(self.ALPHABET[i - 1] for i in ids if i)


def test_text_prompts_give_jsonl_records_and_their_text_streams_as_it_is_sampled(tmp_path, capsys):
  """sample_to_jsonl (eval.py's sampling): one record per prompt, its completion the decoded tokens (a
  final EOS kept in the tokens, not in the text), the tokens those of one call on the prompts' ids
  (seed 12 stops row 2 at EOS in the second of the segments of 3 steps while the others run to the
  end); the pieces printed as they come add up to each completion; the JSON lines read back equal."""
  gen = Generator(make_model(*FAMILIES["sanatan_p1"]))
  prompts, path = ["abc e", "x", "yz "], tmp_path / "out" / "samples.jsonl"
  records = sample_to_jsonl(gen, Letters(), prompts, str(path), max_new_tokens=8,
                            sampling=Sampling(temperature=1.0), seed=12, segment=3)
  ids = [Letters().encode(p) for p in prompts]
  whole = gen(ids, max_new_tokens=8, sampling=Sampling(temperature=1.0), seed=12, eos_id=0)
  assert [r["tokens"] for r in records] == whole and [r["seed"] for r in records] == [12, 13, 14]
  assert [(len(r["tokens"]), r["stop"]) for r in records] == [(8, "length"), (8, "length"), (5, "eos")]
  printed = capsys.readouterr().out.splitlines()
  for b, r in enumerate(records):
    assert r["prompt"] == prompts[b] and r["prompt_tokens"] == len(ids[b])
    pieces = [line[len(f"[{b}] "):] for line in printed[4:-2] if line.startswith(f"[{b}] ")]
    assert r["completion"] == Letters().decode(r["tokens"]) == "".join(pieces) and len(pieces) > 1
    assert (r["temperature"], r["top_k"], r["top_p"], r["max_new_tokens"]) == (1.0, 0, 1.0, 8)
  assert printed[:4] == ["--- sample ---", "[0] abc e", "[1] x", "[2] yz "]
  assert printed[-1] == f"wrote 3 sample(s) to {path}"
  assert [json.loads(line) for line in open(path)] == records


def test_streamed_text_waits_for_whole_characters(capsys):
  """A byte-level tokenizer splits "é" over two tokens: the stream gives out no replacement character,
  and its pieces add up to the text."""
  from lmcore.eval.generate import TextStream

  class Bytes:
    eos_id = 0

    def decode(self, ids):
      return bytes(ids).decode("utf-8", errors="replace")

  stream, ids = TextStream(Bytes(), 1), list("a é!".encode())
  shown = [stream.add(0, [i]) for i in ids] + [stream.add(0, [], final=True)]
  assert "".join(shown) == "a é!" and not any("\ufffd" in s for s in shown)
  print_text(2)(1, "xy")
  print_text(1)(0, "z")
  assert capsys.readouterr().out == "[1] xy\nz"


def test_a_prompt_file_gives_its_lines_and_bad_sampling_flags_say_what_to_fix(tmp_path):
  path = tmp_path / "prompts.txt"
  path.write_text("first prompt\n\n  second one \n")
  assert read_prompt_file(str(path)) == ["first prompt", "  second one "]
  with pytest.raises(ConfigError, match=r"--prompt_file=.*nope.txt: no such file"):
    read_prompt_file(str(tmp_path / "nope.txt"))
  (tmp_path / "blank.txt").write_text("\n \n")
  with pytest.raises(ConfigError, match=r"blank.txt holds no prompt; write one prompt per line"):
    read_prompt_file(str(tmp_path / "blank.txt"))
  assert prompts_of("one", "") == ["one"] and prompts_of("", str(path)) == read_prompt_file(str(path))
  assert prompts_of("", "") == []
  with pytest.raises(ConfigError, match="give --prompt or --prompt_file, not both"):
    prompts_of("one", str(path))
  with pytest.raises(ConfigError, match="--stream_tokens must be >= 1"):
    prompts_of("one", "", stream_tokens=0)


def test_decode_returns_the_state_after_the_fed_tokens():
  """The loop's final state equals a prefill of the prompt and every recorded token but the last:
  positions exactly, S and z to fp32 rounding (relative L2 1e-5; the two layers' one-token and
  chunked forms round differently, and layer 2's root gates, tanh(10 ·), amplify layer 1's rounding
  in a few elements to ~1e-5 absolute; one token too few or too many moves them by 14-40%)."""
  model = make_model(*FAMILIES["sanatan_p1"])
  gen = Generator(model)
  prompt = jnp.asarray([PROMPTS[0]], jnp.int32)
  logits, state = gen.prefill(prompt, gen.init_state(1, 16))
  out, n_new, state = gen.decode(logits, state, max_new_tokens=4, sampling=Sampling(temperature=0))
  assert int(n_new[0]) == 4
  fed = jnp.concatenate([prompt, out[:, :3]], axis=1)
  _, expected = gen.prefill(fed, gen.init_state(1, 16))
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
    if jnp.issubdtype(got.dtype, jnp.integer):
      np.testing.assert_array_equal(got, want)
    else:
      assert relative_l2(got, want) <= 1e-5


def _draws(logits_V, sampling, n=4000, seed=0):
  logits_NxV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
  return np.asarray(sample_logits(logits_NxV, jax.random.key(seed), sampling))


def test_top_k_and_top_p_keep_only_the_most_likely_tokens_in_proportion():
  probs = np.array([0.05, 0.5, 0.15, 0.3])  # order by probability: 1, 3, 2, 0
  logits = np.log(probs)
  assert set(_draws(logits, Sampling(top_k=2))) == {1, 3}
  assert set(_draws(logits, Sampling(top_p=0.75))) == {1, 3}  # 0.5 + 0.3 reach 0.75
  assert set(_draws(logits, Sampling(top_p=0.85))) == {1, 3, 2}
  assert set(_draws(logits, Sampling(top_k=3, top_p=0.5))) == {1}
  draws = _draws(logits, Sampling())
  np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), probs, atol=0.03)
  kept = _draws(logits, Sampling(top_p=0.85))
  np.testing.assert_allclose(np.bincount(kept, minlength=4)[[1, 3, 2]] / len(kept),
                             probs[[1, 3, 2]] / 0.95, atol=0.03)
  assert set(_draws(logits, Sampling(temperature=0.05))) == {1}
  assert set(_draws(logits, Sampling(temperature=0))) == {1}


@pytest.mark.parametrize("fields,message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_options_name_the_field(fields, message):
  with pytest.raises(ValueError, match=message):
    Sampling(**fields)


def test_sanatan_p2_says_it_has_no_constant_state_before_running():
  model = make_model("sanatan*2", {"sanatan": {"n_heads": 2, "head_dim": 8, "p": 2}})
  with pytest.raises(ValueError, match=r"p=2.*no constant-size state") as error:
    generate(model, PROMPTS, max_new_tokens=2)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("prompts,message", [
    ([[1, 2], []], "prompt 1 must be a non-empty list"),
    ([[1, VOCAB]], rf"prompt 0 has token ids outside 0..{VOCAB - 1}"),
    ([], "prompts must be a non-empty list"),
])
def test_bad_prompts_name_the_prompt(prompts, message):
  model = make_model(*FAMILIES["softmax"])
  with pytest.raises(ValueError, match=message):
    generate(model, prompts, max_new_tokens=2)


def test_a_bf16_kv_cache_holds_half_the_bytes_and_decodes_within_bf16_rounding():
  """cache_dtype="bfloat16": the same layer decoded through a bf16 cache (prefill of 4, then one token
  at a time) stays within bf16 rounding of the full fp32 forward."""
  config = SoftmaxAttention.Config(n_heads=2)
  fp32 = SoftmaxAttention(config, d_model=16, init=InitSpec(0.3, 0.3), rngs=nnx.Rngs(0))
  bf16 = SoftmaxAttention(dataclasses.replace(config, cache_dtype="bfloat16"), d_model=16,
                          init=InitSpec(0.3, 0.3), rngs=nnx.Rngs(0))
  x_BxTxD = jax.random.normal(jax.random.key(1), (2, 7, 16))
  full, _ = fp32(x_BxTxD)
  state = bf16.init_state(2, 8)
  assert state.k.dtype == jnp.bfloat16 and 2 * bf16.state_bytes(2, 8) == fp32.state_bytes(2, 8)
  pieces = []
  for start, stop in ((0, 4), (4, 5), (5, 6), (6, 7)):
    y, state = bf16(x_BxTxD[:, start:stop], state)
    pieces.append(y)
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=2e-2, atol=2e-2)
  with pytest.raises(ValueError, match="cache_dtype must be 'float32' or 'bfloat16'"):
    SoftmaxAttention.Config(cache_dtype="float16")


def _dot_shapes(jaxpr) -> list[tuple[int, ...]]:
  """The output shapes of every dot_general of a jaxpr, nested jaxprs included."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      shapes += [tuple(v.aval.shape) for v in eqn.outvars]
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          shapes += _dot_shapes(getattr(sub, "jaxpr", sub))
  return shapes


@pytest.mark.parametrize("dtype,cache_dtype,tolerance", [
    ("float32", "float32", 1e-5),  # two fp32 softmax forms: rounding only
    ("bfloat16", "bfloat16", 2e-2),  # bf16 operands either way (eps 2^-8), fp32 sums in different orders
])
def test_a_prompt_into_a_new_cache_attends_like_training_and_fills_what_the_cache_path_fills(
    dtype, cache_dtype, tolerance):
  """A softmax layer with RoPE, 7 prompt tokens into a cache of 40: made inside the call (a cache
  known to be empty) the prompt runs through the training forward's attention, which computes no
  score array over the cache's 40 positions; passed in, it attends over the cache. The outputs agree
  to the dtype's tolerance (relative L2), the written keys and values are identical, both report 7
  tokens, and a decoded token after each reads the same. A prompt longer than the cache is one line."""
  config = SoftmaxAttention.Config(n_heads=2, cache_dtype=cache_dtype)
  layer = SoftmaxAttention(config, d_model=16, init=InitSpec(0.3, 0.3), dtype=jnp.dtype(dtype),
                           rngs=nnx.Rngs(2))
  graphdef, params = nnx.split(layer)
  x_BxTxD = jax.random.normal(jax.random.key(3), (2, 8, 16)).astype(dtype)
  call = jax.jit(lambda params, x, state: nnx.merge(graphdef, params)(x, state))
  new = lambda params, x: nnx.merge(graphdef, params)(x, nnx.merge(graphdef, params).init_state(2, 40))
  y_new, state_new = jax.jit(new)(params, x_BxTxD[:, :7])
  y_cache, state_cache = call(params, x_BxTxD[:, :7], layer.init_state(2, 40))
  assert relative_l2(y_new, y_cache) <= tolerance
  np.testing.assert_array_equal(state_new.k, state_cache.k)
  np.testing.assert_array_equal(state_new.v, state_cache.v)
  assert int(state_new.length) == int(state_cache.length) == 7
  next_new, _ = call(params, x_BxTxD[:, 7:], state_new)
  next_cache, _ = call(params, x_BxTxD[:, 7:], state_cache)
  assert relative_l2(next_new, next_cache) <= tolerance
  assert all(40 not in shape for shape in _dot_shapes(jax.make_jaxpr(new)(params, x_BxTxD[:, :7]).jaxpr))
  assert any(40 in shape for shape in _dot_shapes(jax.make_jaxpr(call)(params, x_BxTxD[:, :7],
                                                                        layer.init_state(2, 40)).jaxpr))
  with pytest.raises(ValueError, match="a prompt of 8 tokens does not fit a KV cache of 6"):
    nnx.merge(graphdef, params)(x_BxTxD, layer.init_state(2, 6))


def test_the_generators_prefill_from_a_new_state_equals_prefill_into_a_given_one():
  """Transformer++ layers (RoPE) through ``Generator.prefill``: from a new state (made in the call) and
  into a zero state passed in, the same last-position logits and states (fp32, relative L2 1e-5: the
  second layer's keys and values carry the first layer's rounding; lengths and positions exact), and
  greedy decoding goes on with the same tokens."""
  gen = Generator(make_model(*FAMILIES["softmax"]))
  prompt = np.asarray([PROMPTS[0], [3, 1, 4, 1, 5]], np.int32)
  logits_new, state_new = gen.prefill(prompt, max_len=16)
  logits_cache, state_cache = gen.prefill(prompt, gen.init_state(2, 16))
  assert relative_l2(logits_new, logits_cache) <= 1e-5
  for got, want in zip(jax.tree.leaves(state_new), jax.tree.leaves(state_cache)):
    if jnp.issubdtype(got.dtype, jnp.integer):
      np.testing.assert_array_equal(got, want)
    else:
      assert relative_l2(got, want) <= 1e-5
  greedy = dict(max_new_tokens=6, sampling=Sampling(temperature=0))
  assert np.array_equal(gen.decode(logits_new, state_new, **greedy)[0],
                        gen.decode(logits_cache, state_cache, **greedy)[0])


@pytest.mark.parametrize("family", ["sanatan_p1", "softmax"])
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_decoding_runs_each_layers_projections_as_one_matmul_and_computes_the_same(family, dtype, tolerance):
  """The decode form (``prepare_decode``): q, k, v and the MLP's gate and up projections are one
  matmul each (their kernels concatenated, SANATAN's 1/sqrt(d) folded in, once), the separate kernels
  gone from the decode weights; the prefill's last logits equal the model's own forward to the dtype's
  rounding (relative L2; bf16: eps 2^-8 through two layers), and the model's parameters are untouched."""
  model = make_model(*FAMILIES[family], dtype=dtype)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  gen = Generator(model)
  paths = {"/".join(str(getattr(key, "key", key)) for key in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(gen.weights.params)[0]}
  assert "blocks/1/mixer/qkv/kernel/.value" in paths and "blocks/1/mlp/gate_up/kernel/.value" in paths, paths
  assert not any(w in p for p in paths for w in ("/wq/", "/wk/", "/wv/", "/w_gate/", "/w_up/")), paths
  tokens = np.asarray([PROMPTS[0], [3, 1, 4, 1, 5]], np.int32)
  logits, _ = gen.prefill(tokens)
  full, _ = model(jnp.asarray(tokens))
  assert relative_l2(logits, full[:, -1]) <= tolerance
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
