"""The end-of-run gate statistics (MATH §1.3) run inside one compiled program: the jax.numpy form of
``sanatan_jax.gate_stats`` equals its fp64 numpy form, and ``evaluate.gate_statistics`` gives, for
every SANATAN layer of a model, the statistics of that layer's roots on the held-out windows."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import sanatan
from lmcore import config as cfg_lib
from lmcore.eval import evaluate
from lmcore.model import LanguageModel
from sanatan_jax import gate_stats

# fp32 sums over a few thousand entries against fp64: a few ulps of fp32 each.
FP32_REL = 1e-5


def _roots(seed: int, shape=(3, 20, 2, 4)):
  rng = np.random.default_rng(seed)
  r = np.tanh(4 * rng.normal(size=(2,) + shape))
  r[0, 0, 3, 1, 2] = r[1, 1, 4, 0, 0] = 0.0  # exact zeros: sign 0 mismatches both signs
  return r[0], r[1]


def _assert_close(got: dict, expected: dict) -> None:
  assert set(got) == set(expected)
  for key, value in expected.items():
    assert got[key] == pytest.approx(value, rel=FP32_REL), key


@pytest.mark.parametrize("num_positions", [100, 6])
def test_the_compiled_form_equals_the_fp64_numpy_form(num_positions):
  rq, rk = _roots(num_positions)
  expected = gate_stats.gate_statistics(rq, rk, num_positions=num_positions, seed=5)
  compiled = jax.jit(lambda q, k: gate_stats.gate_statistics_arrays(q, k, num_positions=num_positions,
                                                                    seed=5))
  got = jax.device_get(compiled(rq.astype(np.float32), rk.astype(np.float32)))
  _assert_close({k: np.asarray(v).item() for k, v in got.items()}, expected)
  assert got["num_pairs"] == expected["num_pairs"] and got["num_mismatched"] == expected["num_mismatched"]


def test_evaluation_gives_each_sanatan_layers_statistics_of_its_roots():
  config = cfg_lib.experiment_config(sanatan.get_config("tiny_p1_adapt"))
  model = LanguageModel(config.model, rngs=nnx.Rngs(3))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rows = (config.eval.gate_stats_sequences + 2, config.data.seq_len + 1)
  heldout = {"tokens": np.random.default_rng(4).integers(0, config.model.vocab_size, rows, dtype=np.int32)}
  records = evaluate.gate_statistics(config, graphdef, params, rest, heldout)
  tokens_BxT = heldout["tokens"][:config.eval.gate_stats_sequences, :-1]
  inputs = model.mixer_inputs(tokens_BxT)
  assert [r["layer"] for r in records] == list(range(config.model.n_layers))
  for record, block, x_BxTxD in zip(records, model.blocks, inputs):
    expected = gate_stats.gate_statistics(*block.mixer.roots(x_BxTxD))
    _assert_close({k: v for k, v in record.items() if k != "layer"}, expected)
