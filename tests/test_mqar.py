"""MQAR (MATH §6.5): the generator's invariants, the zoology state accounting, the training recipe's
pieces against direct transcriptions, and a CPU smoke sweep that learns recall and plots it."""

import itertools
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lmcore.mqar import config as mqar_config
from lmcore.mqar import data as mqar_data
from lmcore.mqar import report, sweep, train
from lmcore.mqar.data import IGNORE_INDEX, SegmentSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def segment(L=64, kv=4, n=300, seed=0, **kwargs):
  return mqar_data.multiquery_ar(SegmentSpec(L, kv, n), seed, **kwargs)


# --- generator ---------------------------------------------------------------------------------


@pytest.mark.parametrize("L, kv", [(64, 4), (64, 16), (256, 64)])
def test_context_holds_distinct_keys_then_values_in_their_ranges(L, kv):
  seg = segment(L, kv, n=200, seed=L + kv)
  assert seg.inputs_NxL.shape == seg.labels_NxL.shape == (200, L)
  keys, values = seg.inputs_NxL[:, 0:2 * kv:2], seg.inputs_NxL[:, 1:2 * kv:2]
  assert keys.min() >= 1 and keys.max() < 4096 and values.min() >= 4096 and values.max() < 8192
  assert all(len(set(row)) == kv for row in keys) and all(len(set(row)) == kv for row in values)


@pytest.mark.parametrize("L, kv", [(64, 4), (128, 8), (256, 64)])
def test_every_key_is_queried_once_and_labelled_with_its_value(L, kv):
  seg = segment(L, kv, n=200, seed=7 * kv)
  positions, labels = seg.queries()
  for row in range(200):
    pairs = dict(zip(seg.inputs_NxL[row, 0:2 * kv:2], seg.inputs_NxL[row, 1:2 * kv:2]))
    queried = seg.inputs_NxL[row, positions[row]]
    assert sorted(queried) == sorted(pairs)  # every key exactly once
    np.testing.assert_array_equal(labels[row], [pairs[k] for k in queried])
  assert np.all(positions >= 2 * kv) and np.all((positions - 2 * kv) % 2 == 0)


def test_labels_are_ignored_everywhere_but_the_query_positions():
  seg = segment(64, 8, n=100, seed=3)
  labelled = seg.labels_NxL != IGNORE_INDEX
  assert np.all(labelled.sum(axis=1) == 8)
  assert not labelled[:, :16].any()  # never in the context
  # The token after a query is filler, never the value (the value is the next-token target).
  positions, values = seg.queries()
  after = np.take_along_axis(seg.inputs_NxL, np.minimum(positions + 1, 63), axis=1)
  assert np.mean(after == values) < 0.01


def test_full_query_region_when_space_equals_kv():
  seg = segment(256, 64, n=20, seed=5)
  positions, _ = seg.queries()
  np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(128, 256, 2), (20, 64)))


def test_filler_is_random_and_only_zeros_are_replaced():
  plain = segment(64, 4, n=50, seed=11, random_non_queries=False)
  filled = segment(64, 4, n=50, seed=11)
  filler = plain.inputs_NxL == 0
  np.testing.assert_array_equal(filled.inputs_NxL[~filler], plain.inputs_NxL[~filler])
  assert filler.sum() == 50 * (64 - 8 - 4)
  assert len(np.unique(filled.inputs_NxL[filler])) > 1000  # the full vocabulary, not a constant


def test_same_seed_same_data_other_seed_other_data():
  a, b, c = segment(seed=42), segment(seed=42), segment(seed=43)
  np.testing.assert_array_equal(a.inputs_NxL, b.inputs_NxL)
  np.testing.assert_array_equal(a.labels_NxL, b.labels_NxL)
  assert np.mean(a.inputs_NxL != c.inputs_NxL) > 0.5


def test_rejects_sequences_too_short_for_their_pairs():
  with pytest.raises(ValueError, match="4·num_kv_pairs"):
    segment(64, 17)


def test_gumbel_top_k_is_sequential_sampling_without_replacement():
  """Exact ordered-pair probabilities of successive sampling: P(i, j) = p_i p_j / (1 - p_i)."""
  p = np.array([0.5, 0.3, 0.2])
  draws = mqar_data.sample_weighted_without_replacement(np.random.default_rng(0), p, 200_000, 2)
  for i, j in itertools.permutations(range(3), 2):
    expected = p[i] * p[j] / (1 - p[i])
    observed = np.mean((draws[:, 0] == i) & (draws[:, 1] == j))
    assert abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / 200_000)


def test_power_law_puts_the_first_key_near_the_start_of_the_query_region():
  """The first key's gap is the first draw, distributed as p_i ∝ i^(a-1) (28 slots for (64, 4))."""
  n = 20_000
  seg = segment(64, 4, n=n, seed=9)
  positions = seg.queries()[0]
  queried = seg.inputs_NxL[np.arange(n)[:, None], positions]
  gap = lambda j: (positions[queried == seg.inputs_NxL[:, 2 * j, None]] - 8) // 2
  p = mqar_data.power_law(28, 0.01)
  assert p[0] > 5 / 28  # far from uniform
  assert abs(np.mean(gap(0) == 0) - p[0]) < 4 * math.sqrt(p[0] * (1 - p[0]) / n)
  assert np.mean(gap(0)) < np.mean(gap(3)) and np.mean(gap(0)) < 0.6 * 13.5  # uniform mean: 13.5


def test_sample_distinct_is_uniform_over_ordered_tuples():
  draws = mqar_data.sample_distinct(np.random.default_rng(1), 3, 7, 60_000, 2)
  assert draws.min() >= 3 and draws.max() < 7 and np.all(draws[:, 0] != draws[:, 1])
  counts = np.unique(draws[:, 0] * 10 + draws[:, 1], return_counts=True)[1]
  assert len(counts) == 12 and counts.min() > 0.9 * 5000 and counts.max() < 1.1 * 5000


def test_segment_seeds_are_disjoint_between_train_and_test():
  train_seeds, test_seeds = mqar_data.segment_seeds(123, 5, 7)
  assert train_seeds.max() < 2**31 <= test_seeds.min() and len(set(train_seeds) | set(test_seeds)) == 12


def test_batches_pad_queries_to_l_over_4_and_the_last_batch_with_zero_weight():
  seg = segment(64, 4, n=70, seed=2)
  b = mqar_data.make_batches(seg, 32)
  assert b.tokens.shape == (3, 32, 64) and b.positions.shape == b.targets.shape == (3, 32, 16)
  assert b.weights.sum() == 70 * 4 and b.weights.reshape(96, 16)[70:].sum() == 0
  positions, values = seg.queries()
  np.testing.assert_array_equal(b.positions.reshape(96, 16)[:70, :4], positions)
  np.testing.assert_array_equal(b.targets.reshape(96, 16)[:70, :4], values)


# --- model, state accounting, recipe -----------------------------------------------------------


def abstract_model(**config_fields):
  return nnx.eval_shape(lambda: train.build_model(mqar_config.MQARConfig(**config_fields)))


@pytest.mark.parametrize("d, f, zoology_bytes", [(64, 16, 40_548), (128, 16, 80_484), (128, 24, 169_236),
                                                  (48, 8, 9_396)])
def test_based_state_bytes_match_zoology_up_to_the_base_conv_window(d, f, zoology_bytes):
  """zoology counts BaseConv as 3·d floats; ours keeps the K-1 = 2 inputs it needs (2·d floats)."""
  point = sweep.based(d, f)
  model = abstract_model(mixer=point.kind, d_model=d, mixer_fields=dict(point.fields))
  assert model.blocks[1].mixer.state_bytes(1, 1024) == zoology_bytes - 3 * d * 4
  assert train.decode_state_bytes(model, 1024) == zoology_bytes - d * 4


def test_softmax_and_sanatan_p2_are_counted_as_key_value_caches():
  softmax = abstract_model(mixer="softmax", d_model=64, mixer_fields=dict(sweep.softmax(64).fields))
  assert train.decode_state_bytes(softmax, 1024) == 2 * 1024 * 64 * 4 + 2 * 64 * 4
  sanatan = abstract_model(mixer="sanatan", d_model=64, mixer_fields=dict(sweep.sanatan(2, 64).fields))
  assert train.decode_state_bytes(sanatan, 1024) == 1024 * (16 + 64) * 4 + 2 * 64 * 4


def test_query_logits_equal_the_full_models_logits_at_those_positions():
  model = train.build_model(mqar_config.MQARConfig(mixer="softmax", d_model=32, vocab_size=97,
                                                   mixer_fields=dict(n_heads=1, rope=False)))
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, 97, (3, 16)), jnp.int32)
  positions = jnp.asarray(np.sort(rng.choice(16, (3, 4)), axis=1), jnp.int32)
  full_BxTxV, _ = model(tokens)
  expected = jnp.take_along_axis(full_BxTxV, positions[..., None], axis=1)
  got = train.query_logits(model, tokens, positions)
  assert float(jnp.linalg.norm(got - expected) / jnp.linalg.norm(expected)) < 1e-5


def test_loss_is_cross_entropy_over_labelled_positions_only():
  """torch CrossEntropyLoss(ignore_index=-100) on the full [B, T] labels, from the full logits."""
  model = train.build_model(mqar_config.MQARConfig(mixer="softmax", d_model=32, vocab_size=256,
                                                   mixer_fields=dict(n_heads=1, rope=False)))
  seg = segment(32, 4, n=8, seed=6, vocab_size=256)
  b = mqar_data.make_batches(seg, 8)
  batch = {k: jnp.asarray(getattr(b, k)[0]) for k in ("tokens", "positions", "targets", "weights")}
  logits, _ = model(jnp.asarray(seg.inputs_NxL))
  labels = seg.labels_NxL
  mask = labels != IGNORE_INDEX
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(np.where(mask, labels, 0)))
  expected = float((np.asarray(nll) * mask).sum() / mask.sum())
  assert abs(float(train.batch_loss(model, batch)) - expected) < 1e-5 * expected


def test_cosine_factor_is_per_epoch_cosine_annealing():
  assert train.cosine_factor(0, 32) == 1.0 and abs(train.cosine_factor(16, 32) - 0.5) < 1e-12
  assert abs(train.cosine_factor(31, 32) - 0.5 * (1 + math.cos(math.pi * 31 / 32))) < 1e-12


def test_adamw_step_is_torch_adamw():
  """p ← p(1 − lr·wd) − lr·m̂/(√v̂ + eps), torch's update order, over two steps."""
  rng = np.random.default_rng(8)
  p, grads = rng.normal(size=5), [rng.normal(size=5) for _ in range(2)]
  lr, wd, b1, b2, eps = 0.01, 0.1, 0.9, 0.999, 1e-8
  tx = train.AdamW(b1, b2, eps, wd).transform()
  state, ours = tx.init(jnp.asarray(p)), jnp.asarray(p)
  m = v = np.zeros(5)
  for t, g in enumerate(grads, start=1):
    u, state = tx.update(jnp.asarray(g), state, ours)
    ours = ours - lr * u
    p = p * (1 - lr * wd)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
  np.testing.assert_allclose(np.asarray(ours), p, rtol=1e-5)


def tiny_config(**fields):
  values = dict(mixer="softmax", label="softmax", d_model=16, vocab_size=64,
                mixer_fields=dict(n_heads=1, rope=False), epochs=2, train_batch_size=16, eval_batch_size=8,
                train_segments=(SegmentSpec(16, 2, 40),), test_segments=(SegmentSpec(16, 2, 12),))
  return mqar_config.MQARConfig(**{**values, **fields})


def test_learning_rates_trained_side_by_side_equal_separate_runs():
  together = train.train(tiny_config(learning_rates=(1e-3, 3e-2)), log=lambda _: None)
  for member in together.members:
    alone = train.train(tiny_config(learning_rates=(member.learning_rate,)), log=lambda _: None).members[0]
    assert abs(alone.train_loss - member.train_loss) < 1e-5 * alone.train_loss
    assert alone.accuracy == member.accuracy


# --- configs, sweep, plot ------------------------------------------------------------------------


def load_preset(name):
  sys.path.insert(0, REPO)
  try:
    from configs import mqar as mqar_configs
  finally:
    sys.path.remove(REPO)
  return mqar_configs.get_config(name)


@pytest.mark.parametrize("name", ["tiny", "based", "sweep", "paper"])
def test_every_preset_parses_into_the_typed_config(name):
  base, selection = mqar_config.parse(load_preset(name))
  train.model_config(base)  # the mixer fields are valid names of the mixer's Config
  assert set(selection.mixers) <= {p.label for p in sweep.full_grid()}
  assert set(base.learning_rates) <= set(mqar_config.LEARNING_RATES) | {1e-2}


def test_unknown_config_key_names_the_valid_ones():
  with pytest.raises(ValueError, match="Valid keys"):
    mqar_config.mqar_config({"epoch": 3})


def test_default_grid_spans_the_state_range():
  sizes = []
  for point in sweep.default_grid():
    model = abstract_model(mixer=point.kind, d_model=point.d_model, mixer_fields=dict(point.fields))
    sizes.append(train.decode_state_bytes(model, 1024))
  assert min(sizes) <= 2**14 and max(sizes) >= 2**19


def test_smoke_sweep_learns_recall_writes_jsonl_and_resumes(tmp_path):
  """The `tiny` preset: softmax d = 64, 4,096 (64, 4) examples, 2 epochs on CPU; chance is 1/128."""
  base, selection = mqar_config.parse(load_preset("tiny"))
  points = sweep.select(sweep.full_grid(), selection.mixers, selection.widths)
  out = str(tmp_path / "sweep.jsonl")
  rows = sweep.run_sweep(base, points, out, log=lambda _: None)
  assert len(rows) == 1 and rows[0]["slice_accuracy"]["L64_kv4"] > 0.3, rows
  assert rows[0]["state_bytes"] == 2 * 1024 * 64 * 4 + 2 * 64 * 4 and rows[0]["params"] > 0
  lines = []
  assert sweep.run_sweep(base, points, out, log=lines.append) == rows
  assert "already" in lines[0] and len(report.read_rows(out)) == 1
  assert "Best learning rate per point" in sweep.summary(rows)


def fake_row(mixer, d, state_bytes, lr, accuracy):
  return {"mixer": mixer, "kind": mixer, "d_model": d, "mixer_fields": {"n_heads": 1}, "lr": lr,
          "accuracy": accuracy, "slice_accuracy": {"L64_kv4": accuracy, "L1024_kv256": accuracy / 2},
          "state_bytes": state_bytes, "params": 1000, "epochs_run": 3, "stopped_early": False,
          "train_loss": 1.0, "epochs": 8, "train_examples": 100, "train_examples_scale": 1.0,
          "wall_time_s": 1.0, "lrs_trained_together": 2, "date": "", "device": "cpu"}


def test_best_lr_per_point_and_plot_script_writes_png_and_table(tmp_path):
  rows = [fake_row(m, d, b, lr, acc) for m, d, b in [("based", 64, 2**15), ("based", 128, 2**17),
                                                      ("softmax", 64, 2**19)]
          for lr, acc in [(1e-3, 0.4 + d / 1000), (1e-2, 0.6 + d / 1000)]]
  best = report.best_per_point(rows)
  assert [r["lr"] for r in best] == [1e-2] * 3 and [r["state_bytes"] for r in best[:2]] == [2**15, 2**17]
  jsonl, png, table = tmp_path / "s.jsonl", tmp_path / "s.png", tmp_path / "s.md"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
  result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plot_mqar.py"), f"--jsonl={jsonl}",
                           f"--png={png}", f"--table={table}"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
  assert result.returncode == 0, result.stderr
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "| based | 128 |" in table.read_text() and "L1024_kv256" in result.stdout
