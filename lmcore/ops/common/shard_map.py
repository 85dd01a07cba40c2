"""Pallas kernels on a device mesh: each device runs the kernel on its own batch rows (and heads).

XLA cannot partition a Pallas custom call (a Mosaic kernel fails to lower, a Triton one would gather
its inputs), so ``run_sharded`` wraps it in ``jax.shard_map`` over the mesh in context, splitting batch
dimensions over ``BATCH_AXES`` and heads over ``HEAD_AXIS``. A dimension the axes do not divide (a
decode batch of 1 on 8 devices) is split for no argument: the devices compute it redundantly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")  # the mesh axes the batch is split over (lmcore.train.sharding)
HEAD_AXIS = "tensor"  # the mesh axis attention heads are split over


def _present(mesh, axes: tuple[str, ...]) -> tuple[str, ...]:
  return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def _leaf_layouts(tree, layout):
  """(leaf, layout string) pairs of ``tree``; a string layout applies to every leaf under it."""
  if tree is None:
    return []
  if isinstance(layout, str):
    return [(leaf, layout) for leaf in jax.tree.leaves(tree)]
  leaves, layouts = jax.tree.leaves(tree), jax.tree.leaves(layout)
  if len(leaves) != len(layouts):
    raise ValueError(f"layout {layout!r} does not match the structure of {jax.tree.structure(tree)}")
  return list(zip(leaves, layouts))


def _spec(layout: str, ndim: int | None, batch: tuple[str, ...], heads: tuple[str, ...]) -> P:
  def axes(letter):
    chosen = batch if letter == "B" else heads if letter == "H" else ()
    return None if not chosen else chosen[0] if len(chosen) == 1 else chosen
  letters = layout if ndim is None else layout[:ndim]
  return P(*[axes(letter) for letter in letters])


def run_sharded(kernel: Callable[..., Any], inputs: Mapping[str, Any], layouts: Mapping[str, Any],
                out_layouts: Any) -> Any:
  """``kernel(**inputs)``, per device by ``jax.shard_map`` when the mesh in context splits batch or heads.

  A layout names an array's leading dimensions: "B" batch, "H" heads, any other letter (and every
  dimension past the string) not split. ``layouts`` maps an input name to a string for every array
  under it, or to a pytree of strings; a missing name is replicated. ``out_layouts``: the output's
  structure with a string per array (None where the kernel returns None).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return kernel(**inputs)
  batch, heads = _present(mesh, BATCH_AXES), _present(mesh, (HEAD_AXIS,))
  n_batch, n_heads = math.prod(mesh.shape[a] for a in batch), math.prod(mesh.shape[a] for a in heads)
  pairs = [pair for name, value in inputs.items() for pair in _leaf_layouts(value, layouts.get(name, ""))]
  for leaf, layout in pairs:
    for size, letter in zip(leaf.shape, layout):
      batch = batch if letter != "B" or size % n_batch == 0 else ()
      heads = heads if letter != "H" or size % n_heads == 0 else ()
  if not batch and not heads:
    return kernel(**inputs)
  names = list(inputs)

  def in_spec(name, value):
    layout = layouts.get(name, "")
    if isinstance(layout, str):
      return jax.tree.map(lambda leaf: _spec(layout, leaf.ndim, batch, heads), value)
    return jax.tree.map(lambda leaf, lay: _spec(lay, leaf.ndim, batch, heads), value, layout)

  in_specs = tuple(in_spec(name, inputs[name]) for name in names)
  out_specs = jax.tree.map(lambda lay: _spec(lay, None, batch, heads), out_layouts)
  per_device = jax.shard_map(lambda *values: kernel(**dict(zip(names, values))), mesh=mesh,
                             in_specs=in_specs, out_specs=out_specs, check_vma=False)
  return per_device(*(inputs[name] for name in names))
