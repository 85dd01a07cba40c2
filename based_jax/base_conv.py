"""Short causal depthwise convolutions and the two BaseConv gates (MATH §2.3, based_zoology §4).

* LM BaseConv (the released 360M / 1.3B models): ``y = SiLU(conv(u1)) ⊙ u2`` on the two halves of
  ``in_proj(x)``, conv without bias; the mixer applies ``out_proj`` after it.
* zoology BaseConv (MQAR): ``y = conv(u) ⊙ Linear(u) + u``, no activation, conv with bias.

The convolution is ``y_t = sum_{i<K} w_i · u_{t-K+1+i} (+ b)``: tap K-1 multiplies the current
token, as PyTorch's ``Conv1d(padding=K-1)`` truncated to the first T outputs. Its decode state is
the last ``K - 1`` pre-conv inputs (oldest first): exactly what output t needs besides u_t, which
arrives with the call. (The released code keeps K vectors because it appends u_t to the state
before the dot product; the oldest of those is never used again.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmcore.ops.common.segments import document_index


def causal_depthwise_conv(u_BxTxC: jax.Array, w_KxC: jax.Array, bias_C: jax.Array | None = None, *,
                          state: jax.Array | None = None,
                          segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Depthwise causal convolution with a carried input window (module docstring).

  Args:
    u_BxTxC: inputs. w_KxC: per-channel taps, oldest first. bias_C: optional bias.
    state: the last K-1 inputs before this call [B, K-1, C], or None (zeros: start of a sequence).
    segment_ids: packed-document ids [B, T]; taps never reach into another document, and the state
      continues the first run of ids.

  Returns:
    ``(y_BxTxC, new_state)``: y in u's dtype (computed in fp32); the last K-1 inputs of the current
    document, zeros where it is shorter, in the incoming state's dtype (u's when None).
  """
  batch, length, channels = u_BxTxC.shape
  taps = w_KxC.shape[0]
  if state is None:
    state = jnp.zeros((batch, taps - 1, channels), u_BxTxC.dtype)
  # The window in the inputs' own (wider) dtype, each tap widened to fp32 where it is multiplied: the
  # same values as an fp32 window, which for bf16 inputs would be a copy of twice their bytes.
  ext_BxSxC = jnp.concatenate([state, u_BxTxC], axis=1, dtype=jnp.result_type(state, u_BxTxC))
  runs_BxT = document_index(segment_ids, batch, length)
  ext_runs_BxS = jnp.pad(runs_BxT, [(0, 0), (taps - 1, 0)])
  y_BxTxC = jnp.zeros((batch, length, channels), jnp.float32)
  for i in range(taps):
    tap_BxTxC = ext_BxSxC[:, i:i + length].astype(jnp.float32) * w_KxC[i].astype(jnp.float32)
    if segment_ids is not None:  # taps never reach into another document
      tap_BxTxC = jnp.where((ext_runs_BxS[:, i:i + length] == runs_BxT)[..., None], tap_BxTxC, 0.0)
    y_BxTxC += tap_BxTxC
  if bias_C is not None:
    y_BxTxC += bias_C.astype(jnp.float32)
  in_last_doc_BxKx1 = (ext_runs_BxS[:, length:] == runs_BxT[:, -1:])[..., None]
  new_state = jnp.where(in_last_doc_BxKx1, ext_BxSxC[:, length:], 0.0).astype(state.dtype)
  return y_BxTxC.astype(u_BxTxC.dtype), new_state


def silu_gated_conv(u1_BxTxC: jax.Array, u2_BxTxC: jax.Array, w_KxC: jax.Array, *,
                    state: jax.Array | None = None, segment_ids: jax.Array | None = None,
                    remat: bool = True) -> tuple[jax.Array, jax.Array]:
  """LM BaseConv gate ``SiLU(conv(u1)) ⊙ u2``, conv without bias; state as in
  ``causal_depthwise_conv``.

  ``remat``: the backward recomputes the convolution and the gate from u1, u2 and the taps
  (``jax.checkpoint``), so autodiff keeps those inputs, which the projection before keeps anyway,
  instead of the fp32 taps, the convolution's output and SiLU's: a few elementwise passes for several
  times the inputs' bytes. Inside a checkpoint that recomputes the gate anyway (``model.remat``) it
  would be a third forward."""
  gate = jax.checkpoint(_silu_gate) if remat else _silu_gate
  return gate(u1_BxTxC, u2_BxTxC, w_KxC, state, segment_ids)


def _silu_gate(u1_BxTxC, u2_BxTxC, w_KxC, state, segment_ids):
  conv_BxTxC, new_state = causal_depthwise_conv(u1_BxTxC, w_KxC, state=state,
                                                segment_ids=segment_ids)
  return jax.nn.silu(conv_BxTxC) * u2_BxTxC, new_state


def zoology_gated_conv(u_BxTxD: jax.Array, proj_BxTxD: jax.Array, w_KxD: jax.Array,
                       bias_D: jax.Array, *, state: jax.Array | None = None,
                       segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """zoology BaseConv ``conv(u) ⊙ proj + u`` with ``proj = Linear(u)``; conv with bias, no
  activation."""
  conv_BxTxD, new_state = causal_depthwise_conv(u_BxTxD, w_KxD, bias_D, state=state,
                                                segment_ids=segment_ids)
  return conv_BxTxD * proj_BxTxD + u_BxTxD, new_state
