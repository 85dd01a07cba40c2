"""The implementation switch every op shares.

Each op's ``api.py`` holds a registry ``IMPLEMENTATIONS: dict[name, backend function]`` and a
resolver with one signature, ``resolve_implementation(implementation, **problem) -> name``: "auto"
(or None) becomes the measured fastest name for the backend and problem (keyword facts such as
``length``, ``p``, ``channels``, ``decay``; an op reads those it needs and ignores the rest), and any
other name must be in the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

AUTO = ("auto", None)


def resolve(op: str, implementation: str | None, valid: Iterable[str],
            auto: Callable[[], str]) -> str:
  """``auto()`` for "auto" or None; a valid name as is; anything else a ValueError listing the names."""
  if implementation in AUTO:
    return auto()
  valid = tuple(valid)
  if implementation not in valid:
    raise ValueError(f"{op}: unknown implementation {implementation!r}; valid: "
                     f"{', '.join(valid)} or 'auto'")
  return implementation
