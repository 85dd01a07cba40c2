"""The backbone shared by every model family (MATH §5).

tokens -> embedding (+ learned absolute positions) -> L pre-norm blocks (mixer, then MLP; the residual
stream is fp32) -> final norm -> tied or untied head -> fp32 logits. The fused loss takes the two
halves instead: ``hidden_states`` (after the final norm) and the head's matrix ``unembed_kernel``.
The mixer of each layer comes from ``ModelConfig.pattern``; every mixer follows ``lmcore.mixers.base``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from lmcore import remat
from lmcore.config import ModelConfig
from lmcore.registry import mixer_class
from lmcore.mixers.base import FusedProjection, InitSpec, dense
from lmcore.ops.common.layout import default_positions

ModelState = dict[str, Any]  # {"position": int32 [B], "layers": tuple of per-layer mixer states}


def _norm(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  if config.norm == "layernorm":
    return nnx.LayerNorm(config.d_model, epsilon=config.norm_eps, dtype=jnp.float32, rngs=rngs)
  return nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, dtype=jnp.float32, rngs=rngs)


class SwiGLU(nnx.Module):
  """y = W_down (SiLU(x W_gate) ⊙ x W_up), no biases."""

  def __init__(self, d_model: int, hidden: int, *, init: InitSpec, dtype, rngs: nnx.Rngs):
    self.w_gate = dense(d_model, hidden, std=init.std, dtype=dtype, rngs=rngs)
    self.w_up = dense(d_model, hidden, std=init.std, dtype=dtype, rngs=rngs)
    self.w_down = dense(hidden, d_model, std=init.out_std, dtype=dtype, rngs=rngs)
    self.gate_up: FusedProjection | None = nnx.data(None)  # decoding's form of w_gate and w_up

  def prepare_decode(self) -> None:
    """W_gate and W_up as one matmul (``lmcore.mixers.base``: ``prepare_decode``)."""
    self.gate_up, self.w_gate, self.w_up = FusedProjection.of([self.w_gate, self.w_up]), None, None

  def __call__(self, x_BxTxD):
    if self.gate_up is None:
      gate_BxTxF, up_BxTxF = self.w_gate(x_BxTxD), self.w_up(x_BxTxD)
    else:
      gate_BxTxF, up_BxTxF = self.gate_up(x_BxTxD)
    return self.w_down(jax.nn.silu(gate_BxTxF) * up_BxTxF)


class Block(nnx.Module):
  """h + mixer(norm(h)), then h + mlp(norm(h)); h is the fp32 residual stream.

  ``mlp="none"`` skips the second half; ``"zoology_identity"`` adds norm(h) instead (zoology's quirk).
  """

  def __init__(self, config: ModelConfig, kind: str, *, init: InitSpec, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    self.dtype = dtype
    self.mixer_norm = _norm(config, rngs)
    self.mixer = mixer_class(kind)(config.mixers[kind], d_model=config.d_model, init=init, dtype=dtype,
                                   rngs=rngs)
    self.mlp_kind = config.mlp
    self.mlp_norm = _norm(config, rngs) if config.mlp != "none" else None
    self.mlp = (SwiGLU(config.d_model, config.mlp_hidden, init=init, dtype=dtype, rngs=rngs)
                if config.mlp == "swiglu" else None)

  def __call__(self, h_BxTxD, state, positions_BxT, segment_ids_BxT):
    h_BxTxD, new_state = self.mix(h_BxTxD, state, positions_BxT, segment_ids_BxT)
    return self.feed_forward(h_BxTxD), new_state

  def mix(self, h_BxTxD, state, positions_BxT, segment_ids_BxT):
    """The first half: h + mixer(norm(h)), and the mixer's new state."""
    # The named scopes label the two halves' ops in the HLO metadata and so in profiles.
    with jax.named_scope("mixer"):
      y_BxTxD, new_state = self.mixer(self.mixer_norm(h_BxTxD).astype(self.dtype), state=state,
                                      positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT)
    return h_BxTxD + y_BxTxD.astype(jnp.float32), new_state

  def feed_forward(self, h_BxTxD):
    """The second half: h + mlp(norm(h)) (or as ``mlp`` says)."""
    if self.mlp_kind == "swiglu":
      with jax.named_scope("mlp"):
        h_BxTxD = h_BxTxD + self.mlp(self.mlp_norm(h_BxTxD).astype(self.dtype)).astype(jnp.float32)
    elif self.mlp_kind == "zoology_identity":
      # zoology with an Identity state mixer returns LN2(residual), which the next step adds to the
      # residual again (based_zoology.md §7.3): reproduced for faithful MQAR numbers.
      h_BxTxD = h_BxTxD + self.mlp_norm(h_BxTxD)
    return h_BxTxD


def _apply_block(block: Block, h_BxTxD, state, positions_BxT, segment_ids_BxT):
  return block(h_BxTxD, state, positions_BxT, segment_ids_BxT)


def _mix(block: Block, h_BxTxD, state, positions_BxT, segment_ids_BxT):
  return block.mix(h_BxTxD, state, positions_BxT, segment_ids_BxT)


def _feed_forward(block: Block, h_BxTxD):
  return block.feed_forward(h_BxTxD)


def _checkpointed(fn, policy):
  return fn if policy is None else nnx.remat(fn, policy=policy)


def _run_block(block: Block, policy: remat.Policy, h_BxTxD, state, positions_BxT, segment_ids_BxT):
  """``block`` on the residual stream, checkpointed as ``policy`` says (``lmcore.remat``)."""
  if policy.mlp is None:
    return _checkpointed(_apply_block, policy.block)(block, h_BxTxD, state, positions_BxT, segment_ids_BxT)
  h_BxTxD, new_state = _checkpointed(_mix, policy.block)(block, h_BxTxD, state, positions_BxT, segment_ids_BxT)
  return _checkpointed(_feed_forward, policy.mlp)(block, h_BxTxD), new_state


class LanguageModel(nnx.Module):
  """``logits_BxTxV, new_state = model(tokens_BxT, state=None, positions_BxT=None, segment_ids_BxT=None)``.

  ``state=None`` starts every row at position 0 (training). To decode, ``state = model.init_state(B,
  max_len)``, prefill with the prompt, then feed one token at a time with the returned state.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    init = (InitSpec.scaled(config.init_std, config.n_layers) if config.scale_out_init
            else InitSpec(config.init_std, config.init_std))
    embed_init = nnx.initializers.normal(config.init_std)
    self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=embed_init, rngs=rngs)
    self.pos_embed = (nnx.Embed(config.max_positions, config.d_model, embedding_init=embed_init, rngs=rngs)
                      if config.max_positions else None)
    self.blocks = nnx.List([Block(config, kind, init=init, rngs=rngs) for kind in config.layer_kinds()])
    self.final_norm = _norm(config, rngs)
    self.head = (None if config.tie_embeddings else
                 dense(config.d_model, config.vocab_size, std=config.init_std, rngs=rngs))

  def init_state(self, batch_size: int, max_len: int) -> ModelState:
    return {"position": jnp.zeros((batch_size,), jnp.int32),
            "layers": tuple(b.mixer.init_state(batch_size, max_len) for b in self.blocks)}

  def state_bytes(self, batch_size: int, max_len: int) -> int:
    """Bytes of the decode state of all mixers for ``batch_size`` sequences of ``max_len`` tokens."""
    return sum(b.mixer.state_bytes(batch_size, max_len) for b in self.blocks)

  def __call__(self, tokens_BxT, state: ModelState | None = None, positions_BxT=None, segment_ids_BxT=None):
    h_BxTxD, new_state = self.hidden_states(tokens_BxT, state, positions_BxT, segment_ids_BxT)
    return self.logits(h_BxTxD), new_state

  def hidden_states(self, tokens_BxT, state: ModelState | None = None, positions_BxT=None,
                    segment_ids_BxT=None):
    """The final-normed hidden states [B, T, D] (fp32) and the new state; ``logits`` maps them to V."""
    B, T = tokens_BxT.shape
    if positions_BxT is None:
      positions_BxT = default_positions(B, T, None if state is None else state["position"])
    h_BxTxD = self._embed(tokens_BxT, positions_BxT)
    layer_states = (None,) * len(self.blocks) if state is None else state["layers"]
    new_layer_states = []
    # Recomputation serves training's backward pass, which starts every row without a state; a call
    # that carries a decode state (prefill, decoding, chunked scoring) runs each block as it is.
    names = self.config.layer_remat_policies() if state is None else ("none",) * len(self.blocks)
    policies = [remat.POLICIES[name] for name in names]
    for block, layer_state, policy in zip(self.blocks, layer_states, policies):
      h_BxTxD, new_layer_state = _run_block(block, policy, h_BxTxD, layer_state, positions_BxT, segment_ids_BxT)
      new_layer_states.append(new_layer_state)
    new_state = {"position": positions_BxT[:, -1] + 1, "layers": tuple(new_layer_states)}
    return self.final_norm(h_BxTxD), new_state

  def mixer_inputs(self, tokens_BxT) -> list[jax.Array]:
    """The normalised input of every layer's mixer for a fresh sequence (diagnostics, gate statistics)."""
    positions_BxT = default_positions(*tokens_BxT.shape)
    h_BxTxD = self._embed(tokens_BxT, positions_BxT)
    inputs = []
    for block in self.blocks:
      inputs.append(block.mixer_norm(h_BxTxD).astype(block.dtype))
      h_BxTxD, _ = block(h_BxTxD, None, positions_BxT, None)
    return inputs

  def unembed_kernel(self) -> jax.Array:
    """The head's [D, V] matrix (fp32 parameter): the embedding transposed when tied, else the head's."""
    return self.embed.embedding[...].T if self.head is None else self.head.kernel[...]

  def logits(self, h_BxTxD, unembed_DxV: jax.Array | None = None):
    """fp32 logits of final-normed hidden states (any leading shape): h and ``unembed_kernel()`` in
    the activation dtype, fp32 accumulation. ``unembed_DxV``: that matrix already cast (decoding
    casts it once instead of once per token)."""
    dtype = jnp.dtype(self.config.dtype)
    kernel_DxV = self.unembed_kernel() if unembed_DxV is None else unembed_DxV
    return jnp.einsum("...d,dv->...v", h_BxTxD.astype(dtype), kernel_DxV.astype(dtype),
                      preferred_element_type=jnp.float32)

  def _embed(self, tokens_BxT, positions_BxT):
    h_BxTxD = self.embed(tokens_BxT).astype(jnp.float32)
    if self.pos_embed is not None:
      h_BxTxD = h_BxTxD + self.pos_embed(positions_BxT).astype(jnp.float32)
    return h_BxTxD


def with_mixer_overrides(config: ModelConfig, kinds=None, **overrides) -> ModelConfig:
  """The same model with the named fields replaced in every mixer config (of ``kinds``) that has them."""
  mixers = {}
  for kind, mixer_cfg in config.mixers.items():
    names = {f.name for f in dataclasses.fields(mixer_cfg)} if kinds is None or kind in kinds else set()
    mixers[kind] = dataclasses.replace(mixer_cfg, **{k: v for k, v in overrides.items() if k in names})
  return dataclasses.replace(config, mixers=FrozenDict(mixers))


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def abstract_param_count(config: ModelConfig) -> int:
  """Parameter count without allocating the model (``nnx.eval_shape``)."""
  abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
  return count_params(abstract)
