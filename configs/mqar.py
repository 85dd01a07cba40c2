"""MQAR, zoology's synthetic recall benchmark (MATH §6.5; ``lmcore.mqar``).

Presets (``--config=configs/mqar.py:<preset>``):
  tiny     CPU smoke run: softmax, vocab 256, 4,096 examples of (64, 4), 2 epochs, lr 1e-2
  based    one zoology run: BASED d = 64, d' = 16, the full recipe, all four learning rates
  sweep    the default grid at a reduced recipe (below)
  paper    zoology's full recipe (32 epochs, 180k examples) over the full grid (hours on one GPU)

``sweep``: 11 points (``lmcore.mqar.sweep.default_grid``), each training zoology's four learning rates
side by side (one vmapped model), for 8 epochs (cosine T_max 8) on a quarter of every train segment (45k
examples, 178 steps of 256 per epoch), early stop at 0.99, TF32 matmuls (``matmul_precision="default"``).
Compilation dominates a point's time. ``time_budget_s`` stops starting new points after that many
seconds; the next call resumes from the JSONL (docs/mqar/README.md has a measured run).

    python scripts/mqar_sweep.py --config=configs/mqar.py:sweep --out=runs/mqar/sweep.jsonl
"""

import ml_collections

from configs import common
from lmcore import config as cfg_lib
from lmcore.registry import mixer_class
from lmcore.mqar.config import LEARNING_RATES, MQARConfig, SweepConfig, segments_as_tuples


def _mixer_fields(kind: str, fields: dict) -> dict:
  """Every field of the kind's ``Config`` (so each is an override key), ``fields`` applied."""
  values = cfg_lib.to_jsonable(mixer_class(kind).Config())
  unknown = set(fields) - set(values)
  if unknown:
    raise cfg_lib.ConfigError(f"preset sets unknown mixer_fields {sorted(unknown)} for {kind!r}; "
                              f"valid: {', '.join(values)}")
  return common.overridable(mixer_class(kind).Config(), {**values, **fields})


def _config(*, mixer: str, label: str, d_model: int, mixer_fields: dict, sweep: dict | None = None,
            **recipe) -> ml_collections.ConfigDict:
  """The typed defaults of ``MQARConfig`` and ``SweepConfig`` with the preset's changes."""
  values = cfg_lib.to_jsonable(MQARConfig())
  unknown = set(recipe) - set(values)
  if unknown:
    raise cfg_lib.ConfigError(f"preset sets unknown keys {sorted(unknown)}; valid: {', '.join(values)}")
  values.update(recipe, mixer=mixer, label=label, d_model=d_model,
                mixer_fields=_mixer_fields(mixer, mixer_fields))
  for key in ("train_segments", "test_segments"):
    values[key] = segments_as_tuples(getattr(MQARConfig(), key)) if key not in recipe else recipe[key]
  values["learning_rates"] = tuple(values["learning_rates"])
  values["sweep"] = {**cfg_lib.to_jsonable(SweepConfig()), **(sweep or {})}
  values["sweep"].update(mixers=tuple(values["sweep"]["mixers"]), widths=tuple(values["sweep"]["widths"]))
  return ml_collections.ConfigDict(values)


_BASED = dict(mixer="taylor", label="based", d_model=64,
              mixer_fields=dict(n_heads=1, feature_dim=16, feature="compact", implementation="parallel"))


def tiny():
  """A softmax model that learns (64, 4) recall in ~130 steps on 2 CPU cores (chance 1/128)."""
  return _config(mixer="softmax", label="softmax", d_model=64,
                 mixer_fields=dict(n_heads=1, rope=False, implementation="xla"),
                 learning_rates=(1e-2,), epochs=2, train_batch_size=64, vocab_size=256,
                 train_segments=((64, 4, 4096),), test_segments=((64, 4, 256), (128, 8, 256)),
                 matmul_precision="default",
                 sweep=dict(mixers=("softmax",), widths=(64,), out="runs/mqar/tiny.jsonl"))


def based():
  return _config(**_BASED, learning_rates=LEARNING_RATES)


def sweep():
  return _config(**_BASED, learning_rates=LEARNING_RATES, epochs=8, train_examples_scale=0.25,
                 matmul_precision="default", sweep=dict(grid="default", time_budget_s=480.0))


def paper():
  return _config(**_BASED, learning_rates=LEARNING_RATES,
                 sweep=dict(grid="full", out="runs/mqar/paper.jsonl"))


PRESETS = {"tiny": tiny, "based": based, "sweep": sweep, "paper": paper}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  name = arg or "tiny"
  if name not in PRESETS:
    raise cfg_lib.ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
  cd = PRESETS[name]()
  cd.name = name
  return cd
