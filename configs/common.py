"""Builds ConfigDicts from the typed defaults, so that every field of every dataclass is a valid
``--config.a.b=v`` override key, and presets only state what differs from the defaults."""

from __future__ import annotations

import types
import typing
from typing import Any, Callable

import ml_collections
from ml_collections import config_dict

# The model families register their mixer kinds on import. The entry points of pyproject.toml do the
# same for an installed project; importing them here also serves a source checkout on PYTHONPATH.
import based_jax  # noqa: F401
import sanatan_jax  # noqa: F401
from lmcore import config as cfg_lib
from lmcore.data.config import HeldoutConfig, SourceConfig, TokenizerConfig
from lmcore.registry import mixer_class


def _merged(defaults: Any, overrides: dict[str, Any], path: str) -> dict[str, Any]:
  values = cfg_lib.to_jsonable(defaults)
  for key, value in overrides.items():
    if key not in values:
      raise cfg_lib.ConfigError(f"preset sets unknown key '{path}.{key}'; valid: {', '.join(values)}")
    values[key] = value
  return overridable(defaults, values)


def overridable(defaults: Any, values: dict[str, Any]) -> dict[str, Any]:
  """``values`` of dataclass ``defaults``' fields with each None made a typed placeholder
  (``_overridable``)."""
  hints = typing.get_type_hints(type(defaults))
  return {key: _overridable(hints[key]) if value is None else value for key, value in values.items()}


def _overridable(hint: Any) -> Any:
  """A None field as a typed placeholder, so that ``--config.a.b=v`` can set it: ``int | None`` takes an
  int, anything else (``tiles``: a mapping of the named backend's tiling fields) a Python literal."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  simple = typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1
  return config_dict.placeholder(args[0] if simple and args[0] in (int, float, str, bool) else object)


def experiment(*, model: dict[str, Any], mixers: dict[str, dict[str, Any]], train: dict[str, Any] | None = None,
               data: dict[str, Any] | None = None, sources: dict[str, dict[str, Any]] | None = None,
               tokenizer: dict[str, Any] | None = None, heldout: dict[str, Any] | None = None,
               eval: dict[str, Any] | None = None, wandb: dict[str, Any] | None = None,
               mesh: dict[str, Any] | None = None, name: str = "") -> ml_collections.ConfigDict:
  """A full ConfigDict: typed defaults overlaid with the given fields. ``sources`` maps a source name
  to its fields (default: the embedded corpus)."""
  model_values = _merged(cfg_lib.ModelConfig(), model, "model")
  model_values["mixers"] = {kind: _merged(mixer_class(kind).Config(), fields, f"model.mixers.{kind}")
                            for kind, fields in mixers.items()}
  data_values = _merged(cfg_lib.DataConfig(), data or {}, "data")
  data_values["sources"] = {name_: _merged(SourceConfig(), {k: v for k, v in fields.items()},
                                           f"data.sources.{name_}")
                            for name_, fields in (sources or {"embedded": {}}).items()}
  for fields in data_values["sources"].values():
    fields.pop("name")
  data_values["tokenizer"] = _merged(TokenizerConfig(), tokenizer or {}, "data.tokenizer")
  data_values["heldout"] = _merged(HeldoutConfig(), heldout or {}, "data.heldout")
  cd = ml_collections.ConfigDict({
      "name": name,
      "model": model_values,
      "data": data_values,
      "train": _merged(cfg_lib.TrainConfig(), train or {}, "train"),
      "eval": _merged(cfg_lib.EvalConfig(), eval or {}, "eval"),
      "wandb": _merged(cfg_lib.WandbConfig(), wandb or {}, "wandb"),
      "mesh": _merged(cfg_lib.MeshConfig(), mesh or {}, "mesh"),
  })
  return cd


def select(presets: dict[str, Callable[[], ml_collections.ConfigDict]], arg: str | None,
           default: str = "tiny") -> ml_collections.ConfigDict:
  """``--config=configs/x.py:<preset>``; an unknown preset lists the valid ones."""
  name = arg or default
  if name not in presets:
    raise cfg_lib.ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(presets)}")
  cd = presets[name]()
  cd.name = cd.name or name
  return cd


# The small model every `tiny` preset trains on the embedded corpus on 2 CPU cores.
TINY_MODEL = dict(vocab_size=8192, d_model=128, n_layers=4, mlp_hidden=384, dtype="float32")
TINY_TRAIN = dict(steps=300, batch_size=16, learning_rate=3e-3, warmup_steps=30, log_every=25,
                  checkpoint_every=100, eval_batches=0)
TINY_DATA = dict(seq_len=128)
TINY_HELDOUT = dict(num_sequences=64)
