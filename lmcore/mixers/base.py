"""The mixer interface every sequence mixer implements (ARCHITECTURE.md, "The central interface").

A mixer is an NNX module built as::

    mixer = SomeMixer(SomeMixer.Config(...), d_model=D, init=InitSpec(...), dtype=jnp.bfloat16, rngs=rngs)

and called, for training, prefill and one-token decode alike, as::

    y_BxTxD, new_state = mixer(x_BxTxD, state=None, positions_BxT=None, segment_ids_BxT=None)

* ``x`` and ``y`` in the compute dtype; parameters fp32; states, normalisers and gates accumulate in fp32.
* ``state=None`` starts a sequence; fixed-state mixers still return the final state. A growing state
  (softmax KV cache) comes back None then: to decode, prefill from ``init_state(batch_size, max_len)``.
* ``positions_BxT``: 0-based within the document (a mixer alone counts on from its state).
* ``segment_ids_BxT``: packed documents; no token sees another segment and the state resets at a
  boundary, or ``NotImplementedError`` names the supported alternative.
* ``init_state(batch_size, max_len)``: the zero state; ``state_bytes`` its bytes (MATH §6.5).
* ``flops_per_token(seq_len)``: forward FLOPs per token over a causal sequence (``mixers/flops.py``).
* A nested frozen dataclass ``Config`` with defaults for every field.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class InitSpec:
  """Projections N(0, std), output projections N(0, out_std); BASED (MATH §2.4): 0.02 / sqrt(2 L)."""

  std: float = 0.02
  out_std: float = 0.02

  @classmethod
  def scaled(cls, std: float, n_layers: int) -> "InitSpec":
    return cls(std=std, out_std=std / math.sqrt(2 * n_layers))


def dense(in_features: int, out_features: int, *, std: float, rngs: nnx.Rngs, dtype=jnp.float32,
          use_bias: bool = False) -> nnx.Linear:
  """A Linear layer with N(0, std) kernel, zero bias, fp32 parameters and ``dtype`` compute."""
  return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype,
                    param_dtype=jnp.float32, kernel_init=nnx.initializers.normal(std), rngs=rngs)


def scaled_linear(layer: nnx.Linear, x: jax.Array, scale: float) -> jax.Array:
  """``layer(x) * scale`` as ``x (scale W) + scale b``: the [in, out] kernel is scaled before the dot,
  so no pass over the [..., out] result is left for XLA, forward or backward (a power-of-two scale
  gives the same bits as scaling the result)."""
  kernel = layer.kernel[...] * scale
  bias = None if layer.bias is None else layer.bias[...] * scale
  x, kernel, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)
  return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


def float_bytes(*shapes: tuple[int, ...], itemsize: int = 4) -> int:
  """Bytes of fp32 (by default) arrays of the given shapes."""
  return sum(math.prod(s) for s in shapes) * itemsize
