"""Typed configuration: the ``ml_collections.ConfigDict`` of a config file, converted once.

Config files (``configs/*.py``) return a ConfigDict; ``experiment_config(cd)`` turns it into frozen
dataclasses and rejects unknown keys with the list of valid ones. Nothing below this module reads a
ConfigDict.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any

from flax.core import FrozenDict

from lmcore.data.config import DataConfig, HeldoutConfig, SourceConfig, TokenizerConfig
from lmcore import remat
from lmcore.errors import ConfigError
from lmcore.registry import mixer_class


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The backbone (MATH §5): embeddings -> L pre-norm blocks (mixer, MLP) -> final norm -> head.

  ``pattern`` names the mixer of every layer: ``"sanatan*12"``, ``"cyfa*8,gdn*4"``, or a default
  kind followed by index overrides, ``"base_conv*27;taylor@1,6,11;swa@2,7,12"`` (0-based indices).
  ``mixers`` maps each kind used to its mixer's typed ``Config``.
  """

  vocab_size: int = 8192
  d_model: int = 128
  n_layers: int = 2
  pattern: str = "softmax*2"
  mixers: Mapping[str, Any] = dataclasses.field(default_factory=FrozenDict)
  mlp: str = "swiglu"  # "swiglu" | "none" | "zoology_identity" (residual += norm(residual); MQAR)
  mlp_hidden: int = 512
  norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
  norm_eps: float = 1e-5
  max_positions: int = 0  # > 0: a learned absolute position table of this length
  tie_embeddings: bool = True
  init_std: float = 0.02
  scale_out_init: bool = False  # out projections N(0, init_std / sqrt(2 L)) (BASED, MATH §2.4)
  dtype: str = "bfloat16"  # activation dtype; parameters are always fp32
  remat: bool = False  # recompute each block's activations in the backward (memory for compute)
  # Under remat, what each block keeps for the backward: a name of lmcore/remat.py's POLICIES for every
  # layer, or one per layer in the syntax of ``pattern``.
  remat_policy: str = "full"

  def layer_kinds(self) -> tuple[str, ...]:
    return parse_pattern(self.pattern, self.n_layers)

  def layer_remat_policies(self) -> tuple[str, ...]:
    """The remat policy of every layer ("none" everywhere without ``remat``)."""
    if not self.remat:
      return ("none",) * self.n_layers
    return parse_pattern(self.remat_policy, self.n_layers, "model.remat_policy")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimiser, schedule and loop (AdamW, warmup + cosine to ``min_lr_ratio`` of the peak)."""

  steps: int = 200
  batch_size: int = 8  # global sequences per optimiser step
  grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
  learning_rate: float = 1e-3
  warmup_steps: int = 20
  warmup_init_lr: float = 0.0
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 0
  log_every: int = 10
  eval_every: int = 0  # 0: evaluate only at the end
  eval_batches: int = 0  # 0: the whole held-out set
  checkpoint_every: int = 100
  keep_last: int = 2
  keep_every: int = 0  # also keep every K-th step forever (0: off)
  init_from: str = ""  # a checkpoint directory (or a workdir) to load parameters from (staged training)
  init_data_from: str = ""  # continue the data stream of that run (MATH §1.4 stage 2)
  monitor_every: int = 0  # per-layer mixer monitors (CyFA), 0: off
  loss_impl: str = "auto"  # "fused" | "materialized" | "auto" (per backend: lmcore.loss.AUTO_LOSS_IMPL)
  loss_block_tokens: int = 0  # tokens per block of the fused loss (0: 2^27 logits per block)
  compilation_cache: bool = True  # persistent XLA compilation cache under the cache dir (data.cache_dir)
  profile_steps: str = ""  # "10,12": a jax.profiler trace of steps 10..12 in <workdir>/profile


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation (MATH §6.3)."""

  batch_size: int = 8
  paired: bool = True  # fixed-state models: the same sequences through two implementations
  paired_a: str = ""  # "" = as trained (e.g. "parallel")
  paired_b: str = "recurrent"
  gate_stats: bool = False  # SANATAN root-gate statistics (MATH §1.3)
  gate_stats_sequences: int = 8


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  mode: str = "offline"  # "online" | "offline" | "disabled"
  project: str = "fixed-state-lm"
  name: str = ""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The device mesh (docs/SCALING.md, ``lmcore.train.sharding``): axis sizes whose product is the
  device count; one may be -1 (the devices the others leave). Default: data parallelism."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  model: ModelConfig = ModelConfig()
  train: TrainConfig = TrainConfig()
  data: DataConfig = DataConfig()
  eval: EvalConfig = EvalConfig()
  wandb: WandbConfig = WandbConfig()
  mesh: MeshConfig = MeshConfig()
  name: str = ""


def parse_pattern(pattern: str, n_layers: int, field: str = "model.pattern") -> tuple[str, ...]:
  """Expands a per-layer pattern (see ``ModelConfig``) of config ``field`` into one name per layer."""
  head, *overrides = [part.strip() for part in pattern.split(";") if part.strip()]
  kinds: list[str] = []
  for run in head.split(","):
    kind, _, count = run.strip().partition("*")
    kinds += [kind.strip()] * (int(count) if count else (n_layers if head.count(",") == 0 else 1))
  if len(kinds) != n_layers:
    raise ConfigError(f"{field} {pattern!r} gives {len(kinds)} layers but model.n_layers is "
                      f"{n_layers}; make the counts add up to n_layers.")
  for override in overrides:
    kind, _, indices = override.partition("@")
    for index in indices.split(","):
      i = int(index)
      if not 0 <= i < n_layers:
        raise ConfigError(f"{field} override {override!r}: layer {i} is outside 0..{n_layers - 1}.")
      kinds[i] = kind.strip()
  return tuple(kinds)


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
  """``train.profile_steps``: "" (off), "N" (step N) or "A,B" (steps A..B, 1-based) -> (A, B)."""
  if not spec.strip():
    return None
  parts = [p.strip() for p in spec.split(",")]
  if len(parts) > 2 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1 or int(parts[-1]) < int(parts[0]):
    raise ConfigError(f"train.profile_steps={spec!r}; give 'FIRST,LAST' (1-based steps, FIRST <= LAST), "
                      f"e.g. '10,12', a single step '10', or '' for no trace.")
  return int(parts[0]), int(parts[-1])


def unknown_key_error(path: str, key: str, valid: list[str]) -> ConfigError:
  """The error for key ``path.key`` that does not exist: the closest valid key and all of them."""
  close = difflib.get_close_matches(key, valid, n=1)
  hint = f" Did you mean '{path}.{close[0]}'?" if close else ""
  return ConfigError(f"unknown key '{path}.{key}'.{hint} Valid keys under '{path}': {', '.join(valid)}")


def to_dataclass(cls: type, values: Mapping[str, Any], path: str):
  """Builds dataclass ``cls`` from a mapping, recursively; unknown keys raise ``ConfigError``."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, value in values.items():
    if key not in fields:
      raise unknown_key_error(path, key, list(fields))
    kwargs[key] = _convert(hints[key], value, f"{path}.{key}")
  try:
    return cls(**kwargs)
  except ValueError as e:  # a dataclass's own check (e.g. a mixer's __post_init__): name where it is
    raise ConfigError(f"{path}: {e}") from e


def _convert(hint: Any, value: Any, path: str):
  if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
    return to_dataclass(hint, value, path)
  if typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)):
    return tuple(value)
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  return value


def _plain(value: Any) -> Any:
  """ConfigDict / FieldReference -> plain Python containers."""
  if hasattr(value, "to_dict"):
    return value.to_dict()
  return value


def model_config(values: Mapping[str, Any]) -> ModelConfig:
  values = dict(_plain(values))
  mixers_in = dict(values.pop("mixers", {}) or {})
  model = to_dataclass(ModelConfig, values, "model")
  kinds = set(model.layer_kinds())
  mixers = {}
  for kind in sorted(kinds | set(mixers_in)):
    cls = mixer_class(kind)
    mixers[kind] = to_dataclass(cls.Config, dict(mixers_in.get(kind, {}) or {}), f"model.mixers.{kind}")
  return dataclasses.replace(model, mixers=FrozenDict(mixers))


def data_config(values: Mapping[str, Any]) -> DataConfig:
  """``data.sources`` is a mapping name -> source fields (so each is reachable by override)."""
  values = dict(_plain(values))
  sources = values.pop("sources", None)
  tokenizer = values.pop("tokenizer", {})
  heldout = values.pop("heldout", {})
  data = to_dataclass(DataConfig, values, "data")
  changes = dict(tokenizer=to_dataclass(TokenizerConfig, tokenizer, "data.tokenizer"),
                 heldout=to_dataclass(HeldoutConfig, heldout, "data.heldout"))
  if sources is not None:
    if not sources:
      raise ConfigError("data.sources is empty; give at least one source (e.g. the embedded corpus).")
    changes["sources"] = tuple(
        to_dataclass(SourceConfig, {"name": name, **dict(fields)}, f"data.sources.{name}")
        for name, fields in sources.items())
  return dataclasses.replace(data, **changes)


def experiment_config(cd: Mapping[str, Any]) -> ExperimentConfig:
  """The typed view of a whole config file's ConfigDict."""
  values = dict(_plain(cd))
  parts = {
      "model": model_config(values.pop("model", {})),
      "data": data_config(values.pop("data", {})),
      "train": to_dataclass(TrainConfig, values.pop("train", {}), "train"),
      "eval": to_dataclass(EvalConfig, values.pop("eval", {}), "eval"),
      "wandb": to_dataclass(WandbConfig, values.pop("wandb", {}), "wandb"),
      "mesh": to_dataclass(MeshConfig, values.pop("mesh", {}), "mesh"),
  }
  config = to_dataclass(ExperimentConfig, values, "config")
  config = dataclasses.replace(config, **parts)
  validate(config)
  return config


def validate(config: ExperimentConfig) -> None:
  """Cross-field checks a user can act on."""
  train = config.train
  if train.batch_size % train.grad_accum:
    raise ConfigError(f"train.batch_size={train.batch_size} is not divisible by "
                      f"train.grad_accum={train.grad_accum}.")
  if train.init_data_from and not train.init_from:
    raise ConfigError(f"train.init_data_from={train.init_data_from!r} continues another run's data stream "
                      "only together with its parameters; set train.init_from too (usually the same run).")
  if config.model.max_positions and config.data.seq_len > config.model.max_positions:
    raise ConfigError(f"data.seq_len={config.data.seq_len} exceeds model.max_positions="
                      f"{config.model.max_positions}; raise model.max_positions or shorten data.seq_len.")
  if config.model.mlp not in ("swiglu", "none", "zoology_identity"):
    raise ConfigError(f"model.mlp={config.model.mlp!r}; valid: 'swiglu', 'none', 'zoology_identity'.")
  policies = parse_pattern(config.model.remat_policy, config.model.n_layers, "model.remat_policy")
  for name in dict.fromkeys(policies):
    if name not in remat.POLICIES:
      raise ConfigError(f"model.remat_policy={config.model.remat_policy!r}: unknown policy {name!r}; valid: "
                        f"{', '.join(map(repr, remat.POLICIES))} (one for every layer, or per layer as "
                        f"model.pattern).")
  if config.model.norm not in ("rmsnorm", "layernorm"):
    raise ConfigError(f"model.norm={config.model.norm!r}; valid: 'rmsnorm', 'layernorm'.")
  if train.loss_impl not in ("auto", "fused", "materialized"):
    raise ConfigError(f"train.loss_impl={train.loss_impl!r}; valid: 'auto', 'fused', 'materialized'.")
  if train.loss_block_tokens < 0:
    raise ConfigError(f"train.loss_block_tokens={train.loss_block_tokens} is negative; use 0 (automatic) "
                      f"or a positive number of tokens.")
  parse_profile_steps(train.profile_steps)
  validate_mesh(config.mesh)
  if config.wandb.mode not in ("online", "offline", "disabled"):
    raise ConfigError(f"wandb.mode={config.wandb.mode!r}; valid: 'online', 'offline', 'disabled'.")


def validate_mesh(mesh: MeshConfig) -> None:
  """Each axis a positive int or -1, at most one -1 (the product is checked against the devices when
  the mesh is built)."""
  sizes = {f"mesh.{f.name}": getattr(mesh, f.name) for f in dataclasses.fields(mesh)}
  for name, size in sizes.items():
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ConfigError(f"{name}={size!r}; give a positive number of devices or -1 (all remaining devices).")
  if list(sizes.values()).count(-1) > 1:
    auto = [name for name, size in sizes.items() if size == -1]
    raise ConfigError(f"{' and '.join(auto)} are all -1; at most one mesh axis can take the remaining "
                      f"devices, give the others a size.")


def to_jsonable(obj: Any) -> Any:
  """Dataclasses/mappings/tuples -> JSON-friendly dicts and lists (for run records)."""
  if dataclasses.is_dataclass(obj):
    return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
  if isinstance(obj, Mapping):
    return {k: to_jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [to_jsonable(v) for v in obj]
  return obj
