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
* ``prepare_decode()`` (optional, any module): turns a copy of the module into the form decoding runs,
  once, before the decode loop (``lmcore.eval.generate``): e.g. its projections of one input as one
  ``FusedProjection``. The function it computes does not change; parameters stay as they are saved.
"""

from __future__ import annotations

import dataclasses
import itertools
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


class FusedProjection(nnx.Module):
  """Linear layers of one input (no biases) as one matmul: ``x @ [s_1 W_1 | s_2 W_2 | …]`` split back
  into each layer's output, the kernels scaled and concatenated once (``of``). Each output column is
  the same dot over the input as its layer computes (``scaled_linear`` for a scale other than 1)."""

  def __init__(self, kernel_DxN: jax.Array, widths: tuple[int, ...], dtype):
    self.kernel = nnx.Param(kernel_DxN)
    self.widths, self.dtype = widths, dtype

  @classmethod
  def of(cls, layers, scales=None) -> "FusedProjection":
    if any(layer.bias is not None for layer in layers) or len({layer.dtype for layer in layers}) != 1:
      raise ValueError("FusedProjection joins bias-free linear layers of one compute dtype")
    scales = scales or (1.0,) * len(layers)
    kernels = [layer.kernel[...] if scale == 1.0 else layer.kernel[...] * scale
               for layer, scale in zip(layers, scales)]
    return cls(jnp.concatenate(kernels, axis=1), tuple(k.shape[1] for k in kernels), layers[0].dtype)

  def __call__(self, x: jax.Array) -> list[jax.Array]:
    dtype = self.dtype or jnp.result_type(x, self.kernel[...])
    x, kernel = x.astype(dtype), self.kernel[...].astype(dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    return jnp.split(y, list(itertools.accumulate(self.widths[:-1])), axis=-1)
