"""The training loss: next-token cross-entropy in nats, token mean, computed in fp32 (MATH §6.3).

Two implementations of the same number (``train.loss_impl``):
  * "materialized": the head's fp32 logits [B, T, V], then ``optax`` cross-entropy;
  * "fused": the head and the cross-entropy in blocks of tokens (``fused_cross_entropy``), so that no
    [B, T, V] array exists in the forward or the backward.
"auto" picks one per backend from ``AUTO_LOSS_IMPL``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

LOSS_IMPLEMENTATIONS = ("auto", "fused", "materialized")
# "auto" per backend; fused everywhere until the whole-step benchmark (scripts/bench_train.py with
# --override train.loss_impl=...) says otherwise. Its memory saving holds either way.
AUTO_LOSS_IMPL = {"gpu": "fused", "tpu": "fused", "cpu": "fused"}
# Logits per block of the fused loss: 2^27 fp32 values (512 MiB), e.g. 32 × 32 tokens at V = 126,349.
BLOCK_LOGITS = 2 ** 27
# The fused loss pads the vocabulary once to a multiple of this (masked columns): a width such as
# 126,349 would otherwise be padded (copied) by XLA for every block's matmuls (cuBLAS and the TPU's
# lanes want aligned widths).
VOCAB_MULTIPLE = 128


def resolve_loss_impl(loss_impl: str, backend: str | None = None) -> str:
  """"fused" or "materialized" for ``loss_impl`` ("auto": ``AUTO_LOSS_IMPL`` of the backend)."""
  if loss_impl not in LOSS_IMPLEMENTATIONS:
    raise ValueError(f"train.loss_impl={loss_impl!r}; valid: {', '.join(map(repr, LOSS_IMPLEMENTATIONS))}.")
  if loss_impl == "auto":
    return AUTO_LOSS_IMPL.get(backend or jax.default_backend(), "fused")
  return loss_impl


def split_batch(batch: dict[str, Any], use_segments: bool):
  """[b, T+1] windows -> inputs, targets, positions, segment ids (the latter two None unless packed)."""
  tokens = batch["tokens"]
  inputs_BxT, targets_BxT = tokens[:, :-1], tokens[:, 1:]
  if not use_segments:
    return inputs_BxT, targets_BxT, None, None
  return inputs_BxT, targets_BxT, batch["positions"][:, :-1], batch["segment_ids"][:, :-1]


def forward(graphdef, params, rest, inputs_BxT, positions_BxT=None, segment_ids_BxT=None):
  model = nnx.merge(graphdef, params, rest)
  logits_BxTxV, _ = model(inputs_BxT, positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT)
  return logits_BxTxV


def token_nll(logits_BxTxV, targets_BxT):
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV.astype(jnp.float32), targets_BxT)


def nll_sum(graphdef, params, rest, inputs_BxT, targets_BxT, positions_BxT=None, segment_ids_BxT=None, *,
            loss_impl: str = "auto", block_tokens: int = 0):
  """Σ over tokens of −log p(target), fp32, by ``loss_impl`` (see the module docstring)."""
  model = nnx.merge(graphdef, params, rest)
  h_BxTxD, _ = model.hidden_states(inputs_BxT, positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT)
  # The head and the loss under one named scope: their ops carry it in HLO and in profiles.
  with jax.named_scope("cross_entropy"):
    if resolve_loss_impl(loss_impl) == "materialized":
      return token_nll(model.logits(h_BxTxD), targets_BxT).sum()
    return fused_cross_entropy(h_BxTxD, model.unembed_kernel(), targets_BxT,
                               compute_dtype=model.config.dtype, block_tokens=block_tokens)


def loss_fn(graphdef, params, rest, batch, use_segments: bool, loss_impl: str = "auto", block_tokens: int = 0):
  """Token-mean cross-entropy of one batch of [b, T+1] windows."""
  inputs, targets, positions, segments = split_batch(batch, use_segments)
  total = nll_sum(graphdef, params, rest, inputs, targets, positions, segments, loss_impl=loss_impl,
                  block_tokens=block_tokens)
  return total / targets.size


def fused_cross_entropy(h_BxTxD, w_DxV, targets_BxT, weights_BxT=None, *, compute_dtype=jnp.bfloat16,
                        block_tokens: int = 0):
  """Σ_{b,t} weights · (logsumexp(h W) − (h W)[target]) without a [B, T, V] array.

  Logits are formed ``block_tokens`` time steps at a time (default ``BLOCK_LOGITS / V``) from
  ``compute_dtype`` operands with fp32 accumulation, as the head computes them; the rest is fp32. W is
  padded to a multiple of ``VOCAB_MULTIPLE`` columns masked to −inf. The forward of a gradient computes
  the gradients of h and W in the same pass (softmax − one-hot), so the result must be the loss being
  differentiated (a scalar cotangent). ``weights`` (default 1) are not differentiated.
  """
  B, T, _ = h_BxTxD.shape
  weights_BxT = jnp.ones((B, T), jnp.float32) if weights_BxT is None else weights_BxT.astype(jnp.float32)
  Tb = block_length(T, B, w_DxV.shape[1], block_tokens)
  pad = -T % Tb
  if pad:
    h_BxTxD = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    weights_BxT = jnp.pad(weights_BxT, ((0, 0), (0, pad)))  # padded tokens weigh 0: no loss, no gradient
  V = w_DxV.shape[1]
  w_DxVp = jnp.pad(w_DxV, ((0, 0), (0, -V % VOCAB_MULTIPLE)))
  return _fused_nll(h_BxTxD, w_DxVp, targets_BxT, weights_BxT, jnp.dtype(compute_dtype), Tb, V)


def block_length(T: int, B: int, V: int, block_tokens: int = 0) -> int:
  """Time steps per block: about ``block_tokens / B`` (default ``BLOCK_LOGITS / (B V)``), preferring a
  divisor of T (no padding) within a factor 2 of it, else the balanced split of T."""
  target = max(1, (block_tokens or BLOCK_LOGITS // V) // B)
  n_blocks = -(-T // target)
  for n in range(n_blocks, min(2 * n_blocks, T) + 1):
    if T % n == 0:
      return T // n
  return -(-T // n_blocks)


def _blocks_first(x_BxTx, Tb: int):
  """[B, N·Tb, ...] -> [N, B, Tb, ...] (the scan axis first)."""
  B, T = x_BxTx.shape[:2]
  return jnp.moveaxis(x_BxTx.reshape(B, T // Tb, Tb, *x_BxTx.shape[2:]), 1, 0)


def _block_logits(h_BxTbxD, w_DxV, compute_dtype, vocab: int):
  """fp32 logits of one block; columns from ``vocab`` on (W's padding) are −inf."""
  logits_BxTbxV = jnp.einsum("btd,dv->btv", h_BxTbxD.astype(compute_dtype), w_DxV.astype(compute_dtype),
                             preferred_element_type=jnp.float32)
  if vocab == w_DxV.shape[1]:
    return logits_BxTbxV
  return jnp.where(jnp.arange(w_DxV.shape[1]) < vocab, logits_BxTbxV, -jnp.inf)


def _block_nll(logits_BxTbxV, targets_BxTb, weights_BxTb):
  """Weighted −log softmax at the targets, the log-sum-exp and the one-hot targets."""
  lse_BxTb = jax.nn.logsumexp(logits_BxTbxV, axis=-1)
  # A masked sum rather than a gather: it fuses with the log-sum-exp pass and stays local to each
  # shard when the vocabulary is split over devices.
  onehot_BxTbxV = jnp.arange(logits_BxTbxV.shape[-1]) == targets_BxTb[..., None]
  target_BxTb = jnp.sum(jnp.where(onehot_BxTbxV, logits_BxTbxV, 0.0), axis=-1)
  return ((lse_BxTb - target_BxTb) * weights_BxTb).sum(), lse_BxTb, onehot_BxTbxV


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_nll(h_BxTxD, w_DxV, targets_BxT, weights_BxT, compute_dtype, Tb, vocab):
  def body(total, xs):
    h_BxTbxD, targets_BxTb, weights_BxTb = xs
    logits_BxTbxV = _block_logits(h_BxTbxD, w_DxV, compute_dtype, vocab)
    nll, _, _ = _block_nll(logits_BxTbxV, targets_BxTb, weights_BxTb)
    return total + nll, None

  xs = tuple(_blocks_first(x, Tb) for x in (h_BxTxD, targets_BxT, weights_BxT))
  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
  return total


def _fused_nll_fwd(h_BxTxD, w_DxV, targets_BxT, weights_BxT, compute_dtype, Tb, vocab):
  """The loss and, in the same pass, its gradients: dlogits = weights · (softmax − one-hot),
  dh = dlogits Wᵀ, dW = Σ_blocks hᵀ dlogits (fp32 accumulation)."""
  w_c = w_DxV.astype(compute_dtype)

  def body(carry, xs):
    total, dw_DxV = carry
    h_BxTbxD, targets_BxTb, weights_BxTb = xs
    logits_BxTbxV = _block_logits(h_BxTbxD, w_c, compute_dtype, vocab)
    nll, lse_BxTb, onehot_BxTbxV = _block_nll(logits_BxTbxV, targets_BxTb, weights_BxTb)
    dlogits_BxTbxV = ((jnp.exp(logits_BxTbxV - lse_BxTb[..., None]) - onehot_BxTbxV)
                      * weights_BxTb[..., None]).astype(compute_dtype)
    dh_BxTbxD = jnp.einsum("btv,dv->btd", dlogits_BxTbxV, w_c, preferred_element_type=jnp.float32)
    dw_DxV = dw_DxV + jnp.einsum("btd,btv->dv", h_BxTbxD.astype(compute_dtype), dlogits_BxTbxV,
                                 preferred_element_type=jnp.float32)
    return (total + nll, dw_DxV), dh_BxTbxD.astype(h_BxTxD.dtype)

  xs = tuple(_blocks_first(x, Tb) for x in (h_BxTxD, targets_BxT, weights_BxT))
  (total, dw_DxV), dh_NxBxTbxD = jax.lax.scan(
      body, (jnp.zeros((), jnp.float32), jnp.zeros(w_DxV.shape, jnp.float32)), xs)
  dh_BxTxD = jnp.moveaxis(dh_NxBxTbxD, 0, 1).reshape(h_BxTxD.shape)
  return total, (dh_BxTxD, dw_DxV.astype(w_DxV.dtype))


def _fused_nll_bwd(compute_dtype, Tb, vocab, residuals, g):
  del compute_dtype, Tb, vocab
  dh_BxTxD, dw_DxV = residuals
  return (g * dh_BxTxD).astype(dh_BxTxD.dtype), (g * dw_DxV).astype(dw_DxV.dtype), None, None


_fused_nll.defvjp(_fused_nll_fwd, _fused_nll_bwd)
