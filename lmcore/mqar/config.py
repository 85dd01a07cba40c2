"""Typed MQAR configuration: the ConfigDict of ``configs/mqar.py``, converted once (MATH §6.5)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from flax.core import FrozenDict

from lmcore import config as cfg_lib
from lmcore.mqar.data import TEST_SEGMENTS, TRAIN_SEGMENTS, VOCAB_SIZE, SegmentSpec

LEARNING_RATES = (1e-3, 3.16e-3, 1e-2, 3.16e-2)  # zoology: logspace(-3, -1.5, 4)


@dataclasses.dataclass(frozen=True)
class MQARConfig:
  """One MQAR training run (zoology's recipe, based_zoology.md §7.3) for each of ``learning_rates``.

  The model is 2 layers: zoology's BaseConv, then ``mixer`` (a registry kind) with ``mixer_fields``;
  no MLP (zoology's Identity state mixer), LayerNorm, tied embeddings, no positions, fp32.
  ``label`` names the series in the sweep's table and plot ("based" for kind "taylor").
  """

  mixer: str = "taylor"
  label: str = "based"
  d_model: int = 64
  mixer_fields: Mapping[str, Any] = dataclasses.field(default_factory=FrozenDict)
  learning_rates: tuple[float, ...] = (1e-3,)
  epochs: int = 32  # also the cosine's T_max (zoology: CosineAnnealingLR(T_max=max_epochs))
  train_batch_size: int = 256
  eval_batch_size: int = 32
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.999
  adam_eps: float = 1e-8
  early_stop_accuracy: float = 0.99
  vocab_size: int = VOCAB_SIZE
  power_a: float = 0.01
  train_segments: tuple[SegmentSpec, ...] = TRAIN_SEGMENTS
  test_segments: tuple[SegmentSpec, ...] = TEST_SEGMENTS
  train_examples_scale: float = 1.0  # < 1 for quick runs: fewer examples in every train segment
  seed: int = 123  # data seed (zoology DataConfig.seed)
  model_seed: int = 123  # parameter init; shared by all learning rates (zoology: seed 123)
  matmul_precision: str = "highest"  # fp32 matmuls as zoology's torch fp32; "default" allows TF32
  state_max_len: int = 1024  # the longest test length: zoology's state_size(sequence_length)


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """Which grid points ``scripts/mqar_sweep.py`` runs (``lmcore.mqar.sweep``): the ``grid``
  ("default": the ten-minute one-GPU grid, "full": every point), filtered by labels and widths."""

  grid: str = "default"
  mixers: tuple[str, ...] = ()  # series labels; () = every label of the grid
  widths: tuple[int, ...] = ()  # d_model values; () = every width of the grid
  out: str = "runs/mqar/sweep.jsonl"
  # > 0: start no new point once the elapsed time plus the slowest point so far would pass it
  # (the rest runs on the next call: the sweep resumes from its JSONL).
  time_budget_s: float = 0.0


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
  """A ConfigDict (or any mapping) -> a plain dict."""
  return values.to_dict() if hasattr(values, "to_dict") else dict(values)


def _segments(values: Sequence[Any], path: str) -> tuple[SegmentSpec, ...]:
  """(seq_len, num_kv_pairs, num_examples) triples (or SegmentSpecs) -> SegmentSpecs."""
  specs = []
  for value in values:
    if isinstance(value, SegmentSpec):
      specs.append(value)
    elif len(value) == 3:
      specs.append(SegmentSpec(*(int(v) for v in value)))
    else:
      raise cfg_lib.ConfigError(
          f"{path}: each segment is (seq_len, num_kv_pairs, num_examples); got {value!r}")
  return tuple(specs)


def mqar_config(values: Mapping[str, Any]) -> MQARConfig:
  """A ``MQARConfig`` from a mapping; unknown keys raise ``ConfigError`` with the valid ones."""
  values = _plain(values)
  for key in ("train_segments", "test_segments"):
    if key in values:
      values[key] = _segments(values[key], key)
  fields = FrozenDict(dict(values.pop("mixer_fields", {}) or {}))
  config = cfg_lib.to_dataclass(MQARConfig, values, "config")
  return dataclasses.replace(config, mixer_fields=fields,
                             learning_rates=tuple(map(float, config.learning_rates)))


def parse(cd: Mapping[str, Any]) -> tuple[MQARConfig, SweepConfig]:
  """The typed view of ``configs/mqar.py``: the run recipe and the sweep selection."""
  values = _plain(cd)
  sweep = cfg_lib.to_dataclass(SweepConfig, values.pop("sweep", {}) or {}, "sweep")
  values.pop("name", None)
  return mqar_config(values), sweep


def segments_as_tuples(specs: Sequence[SegmentSpec]) -> tuple[tuple[int, int, int], ...]:
  """SegmentSpecs -> ((seq_len, num_kv_pairs, num_examples), …): a ConfigDict tuple can be overridden
  from the command line, ``--config.train_segments='((64, 4, 1024),)'``."""
  return tuple((s.seq_len, s.num_kv_pairs, s.num_examples) for s in specs)
