"""Backends and the registry that picks one (openxla/tokamax's pattern).

Each op's ``api.py`` builds one ``Registry`` of ``Backend`` objects. A problem is a frozen dataclass with
a ``platform`` and ``describe()`` (``HeadProblem``, or the op's own in ``base.py``): the widths and
options that decide the backend, its tiling and its FLOP count. "auto" (or None) takes the first
supported and preferred backend of the platform's list (``Registry.auto``); a name that is unknown or
does not run the problem is one ``ConfigError`` (a ``ValueError``) listing the names that do. A mixer
holds a name and optional ``tiles`` (``Registry.tiles``) and never imports a backend module.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from lmcore.errors import ConfigError

AUTO = ("auto", None)
PLATFORMS = ("cpu", "gpu", "tpu")
TRITON = ("gpu", "cpu")  # Pallas Triton kernels: compiled on GPUs, interpreted on CPUs
MOSAIC_TPU = ("tpu", "cpu")  # Pallas Mosaic TPU kernels: compiled on TPUs, interpreted on CPUs

TilesT = TypeVar("TilesT")


@dataclasses.dataclass(frozen=True)
class HeadProblem:
  """A linear-state op's problem: the platform, the kernel's head widths K x V (V + 1 for a normalised
  form: the ones column) and the length T (None: not known)."""

  platform: str
  key_dim: int = 0
  value_dim: int = 0
  length: int | None = None

  def describe(self) -> str:
    return f"heads of {self.key_dim} x {self.value_dim} on {self.platform}"


class Backend(Generic[TilesT]):
  """One implementation of an op, with the call signature of its ``base.py``."""

  platforms: ClassVar[tuple[str, ...]] = PLATFORMS
  tiles_type: ClassVar[type | None] = None
  requirement: ClassVar[str] = ""  # what ``supports`` asks of a problem, in words

  def supports(self, problem) -> bool:
    """Whether the problem is one this backend computes (the platform aside)."""
    del problem
    return True

  def supported(self, problem) -> bool:
    return problem.platform in self.platforms and self.supports(problem)

  def preferred(self, problem) -> bool:
    """Whether "auto" may take this backend for a problem it supports."""
    del problem
    return True

  def heuristic_config(self, problem) -> TilesT | None:
    del problem
    return None

  def default_tiles(self) -> TilesT | None:
    """The tiling whose fields a mapping that names only some of them keeps (``Registry.tiles``); None:
    the defaults of ``tiles_type``."""
    return None

  def config(self, problem, tiles: TilesT | None) -> TilesT | None:
    """``tiles`` when given (of ``tiles_type``, else ConfigError), else ``heuristic_config(problem)``."""
    if tiles is None:
      return self.heuristic_config(problem)
    if self.tiles_type is None or not isinstance(tiles, self.tiles_type):
      expected = "no tiles" if self.tiles_type is None else f"a {self.tiles_type.__name__}"
      raise ConfigError(f"tiles {tiles!r} do not fit {type(self).__name__}, which takes {expected}")
    return tiles

  def flops_per_head(self, problem, tiles: TilesT | None = None) -> float:
    raise NotImplementedError(f"{type(self).__name__} has no FLOP count")

  def needs(self) -> str:
    """What the backend needs of a problem, in words."""
    where = " or ".join(self.platforms)
    return f"{self.requirement} on {where}" if self.requirement else f"a {where} platform"


class Registry:
  """An op's backends by name and its ordered preference per platform for "auto"."""

  def __init__(self, op: str, backends: Mapping[str, Backend], auto: Mapping[str, Sequence[str]]):
    unknown = {name for names in auto.values() for name in names} - set(backends)
    if unknown or set(auto) != set(PLATFORMS):
      raise ValueError(f"{op}: auto must list known backends for each of {PLATFORMS}; got {dict(auto)}")
    self.op = op
    self.backends = dict(backends)
    self.auto = {platform: tuple(names) for platform, names in auto.items()}

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.backends)

  def supported(self, problem) -> tuple[str, ...]:
    """The names whose backend runs ``problem``."""
    return tuple(name for name, b in self.backends.items() if b.supported(problem))

  def check_name(self, implementation: str | None) -> None:
    """Raises ConfigError unless ``implementation`` is "auto", None or a backend's name."""
    if implementation not in AUTO and implementation not in self.backends:
      raise ConfigError(f"{self.op}: unknown implementation {implementation!r}; valid: "
                       f"{', '.join(self.names)} or 'auto'")

  def resolve_name(self, implementation: str | None, problem) -> str:
    """The name of the backend that runs ``problem`` (see the module docstring)."""
    if implementation in AUTO:
      for name in self.auto[problem.platform]:
        backend = self.backends[name]
        if backend.supported(problem) and backend.preferred(problem):
          return name
      raise ConfigError(f"{self.op}: no backend runs {problem.describe()}")
    if implementation not in self.backends:
      raise ConfigError(f"{self.op}: unknown implementation {implementation!r}; for "
                       f"{problem.describe()} use one of {self._choices(problem)}")
    if not self.backends[implementation].supported(problem):
      raise ConfigError(f"{self.op}: implementation {implementation!r} does not run "
                       f"{problem.describe()} (it needs {self.backends[implementation].needs()}); use "
                       f"one of {self._choices(problem)}")
    return implementation

  def resolve(self, implementation: str | None, problem) -> Backend:
    return self.backends[self.resolve_name(implementation, problem)]

  def counting_platform(self, implementation: str | None) -> str:
    """Where a model card counts ``implementation``: a GPU (the papers' kernels) unless it runs only
    elsewhere."""
    if implementation in AUTO or "gpu" in self.backends[implementation].platforms:
      return "gpu"
    return self.backends[implementation].platforms[0]

  def _choices(self, problem) -> str:
    return ", ".join([*self.supported(problem), "auto"])

  def tiles(self, implementation: str | None, value: Any, where: str) -> Any:
    """``value`` (None, an instance, or a mapping of fields) as backend ``implementation``'s typed
    tiling; ConfigError naming ``where`` for "auto", a backend without tiles or an unknown field."""
    if value is None:
      return None
    self.check_name(implementation)
    if implementation in AUTO:
      raise ConfigError(f"{where}: tiles belong to one backend, but the implementation is 'auto' (it "
                       f"resolves per platform); name one of {', '.join(self.tiled())}")
    cls = self.backends[implementation].tiles_type
    if cls is None:
      raise ConfigError(f"{where}: implementation {implementation!r} has no tiles; backends with tiles: "
                       f"{', '.join(self.tiled())}")
    return typed(cls, value, where, base=self.backends[implementation].default_tiles())

  def tiled(self) -> tuple[str, ...]:
    return tuple(name for name, b in self.backends.items() if b.tiles_type is not None)


def typed(cls: type, value: Any, where: str, base: Any = None) -> Any:
  """``value`` (an instance of dataclass ``cls`` or a mapping of its fields) as a ``cls``; the fields a
  mapping leaves out take ``base``'s values (default: ``cls``'s defaults)."""
  if isinstance(value, cls):
    return value
  if not isinstance(value, Mapping):
    raise ConfigError(f"{where}: expected the fields of {cls.__name__} as a mapping, got {value!r}")
  fields = {f.name for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, item in value.items():
    if key not in fields:
      raise ConfigError(f"{where}: {cls.__name__} has no field {key!r}; valid: {', '.join(sorted(fields))}")
    hint = hints[key]
    nested = dataclasses.is_dataclass(hint) and isinstance(item, Mapping)
    kwargs[key] = typed(hint, item, f"{where}.{key}") if nested else item
  return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)


def check_power_of_two(where: str, **sizes: int) -> None:
  """Raises ConfigError naming ``where`` and the field for a size that is not a power of two."""
  for name, size in sizes.items():
    if not isinstance(size, int) or size < 1 or size & (size - 1):
      raise ConfigError(f"{where}: {name} must be a power of two, got {size!r}")


@dataclasses.dataclass(frozen=True)
class ChunkTiles:
  """The tiling of an XLA chunked form: ``chunk`` tokens per chunk."""

  chunk: int = 64

  def __post_init__(self):
    if not isinstance(self.chunk, int) or self.chunk < 1:
      raise ConfigError(f"tiles: chunk must be a positive number of tokens, got {self.chunk!r}")


class ChunkedBackend(Backend[ChunkTiles]):
  """An XLA chunked form: any platform, ``ChunkTiles`` (its default chunk unless given)."""

  tiles_type = ChunkTiles

  def heuristic_config(self, problem) -> ChunkTiles:
    del problem
    return ChunkTiles()
