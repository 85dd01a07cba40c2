"""The lm-eval model class against plain references on an untrained model (fp32, so agreement is to
1e-5): loglikelihood is the sum of the continuation's log-probabilities of one unpadded forward (left
truncated to the window, or the whole sequence when streaming), scores do not depend on batch size or
request order, rolling scores cover every token once, and generate_until is greedy decoding cut at the
stop sequence."""

import functools
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm-eval imports the datasets package
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from lmcore import config as cfg_lib  # noqa: E402
from lmcore.data.tokenizers import HuggingFaceTokenizer  # noqa: E402
from lmcore.errors import ConfigError  # noqa: E402
from lmcore.eval import harness  # noqa: E402
from lmcore.model import LanguageModel  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
WINDOW = 16
MIXERS = {"gla": ("gla*2", {"gla": {"n_heads": 2}}), "softmax": ("softmax*2", {"softmax": {"n_heads": 2}})}
# (context, continuation): empty context, continuations of several tokens, contexts longer than WINDOW.
PAIRS = [("", "hello"), ("ab", "c"), ("the cat sat on", " the mat"), ("x" * 3, "yz"),
         ("a long context that is longer than the window", " ends"), ("0123456789" * 5, "!"),
         ("q", " a continuation"), ("some words", " more")]


@pytest.fixture(scope="module")
def tokenizer():
  with open(os.path.join(FIXTURES, "char_tokenizer.json")) as f:
    return HuggingFaceTokenizer(f.read(), name="char")


def make_lm(tokenizer, kind="gla", batch_size=3, long_context="truncate", window=WINDOW):
  pattern, mixers = MIXERS[kind]
  config = cfg_lib.model_config(dict(vocab_size=128, d_model=32, n_layers=2, pattern=pattern, mlp_hidden=48,
                                     dtype="float32", tie_embeddings=False, init_std=0.2, mixers=mixers))
  graphdef, params, rest = nnx.split(LanguageModel(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
  return harness.HarnessLM(graphdef, params, rest, tokenizer, window=window, batch_size=batch_size,
                           long_context=long_context)


REFERENCE_LEN = 128  # the references' one compiled length (right padding: causality makes it harmless)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, rest, tokens_1xT):
  return nnx.merge(graphdef, params, rest)(tokens_1xT)[0][0]


def forward(lm, tokens):
  """fp64 log-softmax [len(tokens), V] of one causal forward over ``tokens`` from position 0."""
  padded = np.zeros((1, REFERENCE_LEN), np.int32)
  padded[0, :len(tokens)] = tokens
  logits_TxV = np.asarray(_logits(lm.graphdef, lm.params, lm.rest, padded), np.float64)[:len(tokens)]
  return logits_TxV - np.log(np.exp(logits_TxV - logits_TxV.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits_TxV.max(-1, keepdims=True)


def direct_logprobs(lm, tokens):
  """log p(tokens[t+1] | tokens[:t+1]) and whether it is the argmax, for every t."""
  logp_TxV = forward(lm, tokens[:-1])
  targets = np.asarray(tokens[1:])
  return logp_TxV[np.arange(len(targets)), targets], logp_TxV.argmax(-1) == targets


def reference(lm, context, continuation, window):
  """The continuation's log-probability and greediness, as lm-eval's HF model defines them."""
  ctx = lm.tok_encode(context) if context else [lm.eot_token_id]
  whole = ctx + lm.tok_encode(continuation)
  n = len(whole) - len(ctx)
  tokens = whole if window is None else whole[-(window + 1):]
  logp_T, greedy_T = direct_logprobs(lm, tokens)
  return logp_T[-n:].sum(), bool(greedy_T[-n:].all())


def requests(kind, args):
  return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def check_scores(got, want):
  for (logp, greedy), (logp_ref, greedy_ref) in zip(got, want, strict=True):
    assert abs(logp - logp_ref) <= 1e-5 * abs(logp_ref), (logp, logp_ref)
    assert greedy == greedy_ref


@pytest.mark.parametrize("kind", ["gla", "softmax"])
def test_loglikelihood_is_the_direct_sum_of_logprobs_with_long_contexts_cut_on_the_left(tokenizer, kind):
  lm = make_lm(tokenizer, kind)
  got = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
  check_scores(got, [reference(lm, c, x, WINDOW) for c, x in PAIRS])


def test_streaming_scores_long_contexts_as_one_forward_over_the_whole_sequence(tokenizer):
  lm = make_lm(tokenizer, "gla", long_context="stream")
  got = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
  check_scores(got, [reference(lm, c, x, None) for c, x in PAIRS])


def test_scores_do_not_depend_on_batch_size_or_request_order(tokenizer):
  base = make_lm(tokenizer, "gla", batch_size=3).loglikelihood(requests("loglikelihood", PAIRS), True)
  order = np.random.default_rng(0).permutation(len(PAIRS))
  for batch_size in (1, 8):
    shuffled = make_lm(tokenizer, "gla", batch_size=batch_size).loglikelihood(
        requests("loglikelihood", [PAIRS[i] for i in order]), True)
    check_scores([shuffled[list(order).index(i)] for i in range(len(PAIRS))], base)


def test_rolling_loglikelihood_scores_every_token_once(tokenizer):
  short, long = "a short text", "a document several windows long, " * 2
  lm = make_lm(tokenizer, "gla")
  got_short, _ = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(short,), (long,)]), True)
  np.testing.assert_allclose(got_short, reference(lm, "", short, WINDOW)[0], rtol=1e-5)
  rows = lm.rolling_rows(long)
  assert sum(row.n_scored for row in rows) == len(lm.tok_encode(long))
  assert all(len(row.inputs) <= WINDOW for row in rows)
  streamed, = make_lm(tokenizer, "gla", long_context="stream").loglikelihood_rolling(
      requests("loglikelihood_rolling", [(long,)]), True)
  np.testing.assert_allclose(streamed, reference(lm, "", long, None)[0], rtol=1e-5)


def greedy_reference(lm, context, max_gen_toks, until):
  """Greedy decoding by one full forward per new token, stopped at EOS, cut at the first stop string."""
  tokens = lm.tok_encode(context) or [lm.eot_token_id]
  if lm.long_context == "truncate":
    tokens = tokens[-(lm.window - max_gen_toks):]
  new = []
  for _ in range(max_gen_toks):
    token = int(np.argmax(forward(lm, tokens + new)[-1]))
    if token == lm.eot_token_id:
      break
    new.append(token)
  text = lm.tok_decode(new)
  for stop in until:
    text = text.split(stop, 1)[0]
  return text


# GLA streams its prompts through the state in chunks of its window; softmax attention (window 64) prefills
# one chunk into its KV cache. Batches of 3 sorted by length: [50, 40, 33] tokens (a prefill of 32, then
# up to 18 prompt tokens fed by the decode loop), [25, 3, EOS] (no prefill).
@pytest.mark.parametrize("kind,long_context,window", [("gla", "stream", WINDOW), ("softmax", "truncate", 64)])
def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(tokenizer, kind, long_context, window):
  lm = make_lm(tokenizer, kind, long_context=long_context, window=window)
  contexts = ["", "abc", "a context of twenty chars", "the quick brown fox jumps over it", "0123456789" * 4,
              "0123456789" * 5]
  kwargs = {"until": ["~", "U"], "max_gen_toks": 5, "do_sample": False}  # stops this model generates
  got = lm.generate_until(requests("generate_until", [(c, kwargs) for c in contexts]), True)
  assert got == [greedy_reference(lm, c, 5, ["~", "U"]) for c in contexts]


def test_streaming_a_model_whose_state_grows_is_one_line_error(tokenizer):
  with pytest.raises(ConfigError, match="long_context='truncate'"):
    make_lm(tokenizer, "softmax", long_context="stream")
