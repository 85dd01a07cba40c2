"""The mixer interface every sequence mixer implements (ARCHITECTURE.md, "The central interface").

A mixer is an NNX module built as::

    mixer = SomeMixer(SomeMixer.Config(...), d_model=D, init=InitSpec(...), dtype=jnp.bfloat16, rngs=rngs)

and called, for training, prefill and one-token decode alike, as::

    y_BxTxD, new_state = mixer(x_BxTxD, state=None, positions_BxT=None, segment_ids_BxT=None)

* ``x_BxTxD`` arrives in the compute dtype (bf16 in training, fp32 in tests); ``y`` has the same dtype.
  Parameters are fp32; recurrent state, normalisers and gates are accumulated in fp32.
* ``state=None`` means "start of a sequence". Fixed-state mixers then still return the final state
  (XLA drops it when unused). Mixers whose state grows (softmax KV cache) return ``None`` when called
  with ``state=None``; to decode, call ``init_state(batch_size, max_len)`` first and prefill with it.
* ``positions_BxT`` are the 0-based positions inside the document (the backbone always passes them;
  a mixer used alone defaults to ``arange(T)`` offset by the state's own counter).
* ``segment_ids_BxT`` (optional) marks packed documents; a mixer that supports it lets no token see
  another segment and resets its state at a boundary. A mixer or implementation that cannot honour it
  raises ``NotImplementedError`` naming the supported alternative.
* ``init_state(batch_size, max_len)`` returns the zero state pytree; ``state_bytes(batch_size, max_len)``
  the bytes that state occupies (the accounting of docs/MATH.md §6.5, used by model cards and the MQAR plot).
* ``flops_per_token(seq_len)`` returns the layer's forward FLOPs per token over a causal sequence of
  ``seq_len`` tokens (dense kernels plus the configured implementation's sequence mixing; the
  conventions are in ``lmcore/mixers/flops.py``), which the model card sums.
* Every mixer class has a nested frozen dataclass ``Config`` whose fields all have defaults; the
  config files set its fields by name and unknown names are rejected.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class InitSpec:
  """Initialisation scales: every projection N(0, std); output projections N(0, out_std).

  BASED (MATH §2.4) uses std 0.02 and out_std = 0.02 / sqrt(2 L).
  """

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
