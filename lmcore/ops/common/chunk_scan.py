"""The between-chunk recurrence of the chunked kernels, as one Pallas (Triton) kernel or an XLA scan.

Per (batch, head), with c_n [R, V] what chunk n adds and a_n [R] its per-row carry factor (a chunk's
decay, 0 where a new document starts inside it)::

    forward:  x_0 = edge,  x_{n+1} = a_n ⊙ x_n + c_n        (states entering each chunk)
    reverse:  x_N = edge,  x_n = a_n ⊙ x_{n+1} + c_n        (state gradients after each chunk)

``chunk_scan`` returns the x held when chunk n is reached (forward: x_n; reverse: x_{n+1}) for every
n in ``out_dtype``, and the x the walk ends with (forward: x_N; reverse: x_0) in fp32. ``"pallas"``: a
kernel over (batch, head, row tile, value tile), each program carrying one fp32 [BR, BV] tile through
the chunks (c read once, x written once: the bandwidth floor; default tiles: docs/BENCHMARKS.md,
Chunk scan). ``"xla"``: ``jax.lax.associative_scan`` over the chunks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.ops.common import pallas_utils as pu

IMPLEMENTATIONS = ("pallas", "xla")
_F32 = jnp.float32


def _scan_kernel(c_ref, a_ref, edge_ref, x_ref, end_ref, *, reverse: bool, unroll: int):
  """One [BR, BV] tile through the chunks: c_ref [N, BR, BV], a_ref [N, BR], x_ref [N, BR, BV]. Each
  step loads ``unroll`` chunks' terms before the first multiply-add: one memory latency per step."""
  n_steps = c_ref.shape[0] // unroll

  def step(m, x):
    block = n_steps - 1 - m if reverse else m
    chunks = [block * unroll + u for u in range(unroll)]
    if reverse:
      chunks.reverse()
    terms = [(a_ref[n][:, None], c_ref[n]) for n in chunks]
    for n, (a, c) in zip(chunks, terms):
      x_ref[n] = x.astype(x_ref.dtype)
      x = a * x + c
    return x

  end_ref[...] = jax.lax.fori_loop(0, n_steps, step, edge_ref[...])


def _pallas(c, a, edge, *, reverse, out_dtype, block_rows, block_v, unroll, interpret, num_warps,
            num_stages):
  B, H, N, R, V = c.shape
  for name, size in (("block_rows", block_rows), ("block_v", block_v), ("unroll", unroll)):
    if size < 1 or size & (size - 1):
      raise ValueError(f"chunk_scan: {name} must be a power of two, got {size}")
  BR, BV = math.gcd(R, block_rows), math.gcd(V, block_v)  # the largest power-of-two tiles that fit
  stack = pl.BlockSpec((None, None, N, BR, BV), lambda b, h, r, j: (b, h, 0, r, j))
  tile = pl.BlockSpec((None, None, BR, BV), lambda b, h, r, j: (b, h, r, j))
  return pl.pallas_call(
      functools.partial(_scan_kernel, reverse=reverse, unroll=math.gcd(N, unroll)),
      grid=(B, H, R // BR, V // BV),
      in_specs=[stack, pl.BlockSpec((None, None, N, BR), lambda b, h, r, j: (b, h, 0, r)), tile],
      out_specs=[stack, tile],
      out_shape=(jax.ShapeDtypeStruct(c.shape, out_dtype), jax.ShapeDtypeStruct(edge.shape, _F32)),
      interpret=interpret,
      compiler_params=pu.compiler_params(interpret, num_warps, num_stages))(c, a, edge)


def _xla(c, a, edge, *, reverse, out_dtype):
  """The same by an associative scan; the edge enters as one more map x -> edge."""
  compose = lambda first, then: (first[0] * then[0], then[0] * first[1] + then[1])
  maps = [(jnp.ones_like(a[:, :, :1]), edge[:, :, None]), (a, c)]
  if reverse:
    maps.reverse()
  factors, terms = (jnp.concatenate(parts, axis=2) for parts in zip(*maps))
  _, x = jax.lax.associative_scan(compose, (factors[..., None], terms), reverse=reverse, axis=2)
  held, end = (x[:, :, 1:], x[:, :, 0]) if reverse else (x[:, :, :-1], x[:, :, -1])
  return held.astype(out_dtype), end


def chunk_scan(c_BxHxNxRxV: jax.Array, a_BxHxNxR: jax.Array, edge_BxHxRxV: jax.Array, *,
               reverse: bool = False, out_dtype=_F32, implementation: str = "pallas",
               block_rows: int = 8, block_v: int = 64, unroll: int = 16,
               interpret: bool | None = None,
               num_warps: int = 4, num_stages: int = 3) -> tuple[jax.Array, jax.Array]:
  """The recurrence of the module docstring: (held [B, H, N, R, V] in ``out_dtype``, end [B, H, R, V]
  fp32). ``block_rows``, ``block_v``, ``unroll``: the kernel's largest tiles and chunks per step (powers
  of two; smaller where R, V or N has fewer factors of two)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"chunk_scan: unknown implementation {implementation!r}; valid: "
                     f"{', '.join(IMPLEMENTATIONS)}")
  c, a, edge = (x.astype(_F32) for x in (c_BxHxNxRxV, a_BxHxNxR, edge_BxHxRxV))
  if implementation == "xla":
    return _xla(c, a, edge, reverse=reverse, out_dtype=out_dtype)
  interpret = pu.resolve_interpret(interpret)
  return _pallas(c, a, edge, reverse=reverse, out_dtype=out_dtype, block_rows=block_rows,
                 block_v=block_v, unroll=unroll, interpret=interpret, num_warps=num_warps,
                 num_stages=num_stages)
