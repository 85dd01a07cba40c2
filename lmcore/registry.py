"""Mixer registry: a kind name in a config's mixer pattern -> the NNX module that implements it.

A package registers its mixers with ``register_mixer`` when it is imported. ``lmcore`` names no model
family: the packages that provide mixers are listed as entry points of the group
``fixed_state_lm.mixers`` (``pyproject.toml``), and ``mixer_class`` imports them on first use.
"""

from __future__ import annotations

from importlib import metadata, import_module

ENTRY_POINT_GROUP = "fixed_state_lm.mixers"
_MIXERS: dict[str, type] = {}
_LOADED = False


def register_mixer(kind: str, cls: type) -> None:
  """Registers ``cls`` under ``kind``; registering another class under a taken kind is an error."""
  if _MIXERS.get(kind, cls) is not cls:
    raise ValueError(f"mixer kind {kind!r} is already registered to {_MIXERS[kind].__qualname__}")
  _MIXERS[kind] = cls


def load_mixer_packages() -> None:
  """Imports every package listed under the ``fixed_state_lm.mixers`` entry points (once)."""
  global _LOADED
  if _LOADED:
    return
  _LOADED = True
  for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
    import_module(entry.value)


def mixer_kinds() -> list[str]:
  """Every registered kind, sorted."""
  load_mixer_packages()
  return sorted(_MIXERS)


def mixer_class(kind: str) -> type:
  """The mixer class registered under ``kind``; unknown kinds list the valid ones."""
  load_mixer_packages()
  if kind not in _MIXERS:
    hint = "" if _MIXERS else (" (none are registered: install the project with "
                               "`pip install -e .` so that its mixer packages are found)")
    raise ValueError(f"unknown mixer kind {kind!r}; valid kinds: {', '.join(sorted(_MIXERS))}{hint}")
  return _MIXERS[kind]
