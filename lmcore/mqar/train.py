"""MQAR training and evaluation: zoology's recipe in JAX (MATH §6.5, based_zoology.md §7.3–7.5).

Model: embedding -> zoology BaseConv -> the mixer under test -> LayerNorm -> tied head, no MLP, fp32.
Recipe: AdamW with decoupled decay on every parameter, lr cosine across epochs (constant within one, no
warmup or clipping), the train segments in config order, early stop once test accuracy > 0.99; loss
over the labelled positions; accuracy per example, averaged overall or per slice.

Departures that leave the task unchanged: no dropout, no out-projection init rescaling, only labelled
positions through the head, and all learning rates trained side by side (``jax.vmap`` over a member
axis, one data stream, identical initial parameters as zoology's seed 123 gives).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.model import LanguageModel, count_params
from lmcore.mqar import data as mqar_data
from lmcore.mqar.config import MQARConfig


def model_config(config: MQARConfig) -> cfg_lib.ModelConfig:
  """zoology's 2-layer MQAR model: layer 0 zoology BaseConv (kernel 3), layer 1 ``config.mixer``."""
  return cfg_lib.model_config({
      "vocab_size": config.vocab_size, "d_model": config.d_model, "n_layers": 2,
      "pattern": f"base_conv_zoology,{config.mixer}",
      "mixers": {"base_conv_zoology": {"kernel_size": 3}, config.mixer: dict(config.mixer_fields)},
      "mlp": "zoology_identity", "norm": "layernorm", "norm_eps": 1e-5, "max_positions": 0,
      "tie_embeddings": True, "init_std": 0.02, "scale_out_init": False, "dtype": "float32"})


def build_model(config: MQARConfig) -> LanguageModel:
  return LanguageModel(model_config(config), rngs=nnx.Rngs(config.model_seed))


def decode_state_bytes(model: LanguageModel, max_len: int) -> int:
  """Decode-state bytes of one sequence of ``max_len`` tokens (the sweep's x-axis): each mixer's
  ``state_bytes``; one without a constant-size state (SANATAN p >= 2) as the KV cache it decodes
  from, ``max_len · H · (d + dv) · 4``. Our BaseConv keeps 2 inputs (2·D·4 bytes); zoology counts 3."""
  total = 0
  for block in model.blocks:
    try:
      total += block.mixer.state_bytes(1, max_len)
    except ValueError:
      c = block.mixer.config
      total += max_len * c.n_heads * (c.head_dim + c.dv) * 4
  return total


def query_logits(model: LanguageModel, tokens_BxT: jax.Array, positions_BxQ: jax.Array) -> jax.Array:
  """fp32 logits [B, Q, V] at the labelled positions only (the rest never reach the head)."""
  h_BxTxD, _ = model.hidden_states(tokens_BxT)
  return model.logits(jnp.take_along_axis(h_BxTxD, positions_BxQ[..., None], axis=1))


def batch_loss(model: LanguageModel, batch: dict[str, jax.Array]) -> jax.Array:
  """Cross-entropy averaged over the labelled positions of the batch (torch ignore_index -100)."""
  logits_BxQxV = query_logits(model, batch["tokens"], batch["positions"])
  nll_BxQ = optax.softmax_cross_entropy_with_integer_labels(logits_BxQxV, batch["targets"])
  return (nll_BxQ * batch["weights"]).sum() / jnp.maximum(batch["weights"].sum(), 1.0)


def example_accuracy(model: LanguageModel, batch: dict[str, jax.Array]) -> jax.Array:
  """Per example: the fraction of its query positions where argmax == value, [B] (0 for padding)."""
  logits_BxQxV = query_logits(model, batch["tokens"], batch["positions"])
  correct_BxQ = (jnp.argmax(logits_BxQxV, axis=-1) == batch["targets"]) * batch["weights"]
  return correct_BxQ.sum(-1) / jnp.maximum(batch["weights"].sum(-1), 1.0)


@dataclasses.dataclass(frozen=True)
class AdamW:
  """Static AdamW hyper-parameters; the learning rate is a traced per-member input."""

  b1: float
  b2: float
  eps: float
  weight_decay: float

  def transform(self) -> optax.GradientTransformation:
    """u = m̂ / (√v̂ + eps) + wd · p; the step is p ← p − lr · u (torch AdamW's decoupled decay)."""
    return optax.chain(optax.scale_by_adam(self.b1, self.b2, self.eps),
                       optax.add_decayed_weights(self.weight_decay))


@functools.partial(jax.jit, static_argnames=("graphdef", "adamw"), donate_argnames=("params", "opt_state"))
def train_segment(graphdef, adamw: AdamW, params, opt_state, rest, lr_R, batches):
  """One pass over a segment's batches (``lax.scan``), every member (leading axis R) a step per batch
  at its ``lr_R`` (0 freezes it). Returns (params, opt_state, loss [Nb, R]); compiled once per
  (sequence length, batches)."""
  tx = adamw.transform()

  def member_step(params, opt_state, lr, batch):
    loss, grads = jax.value_and_grad(
        lambda p: batch_loss(nnx.merge(graphdef, p, rest), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda p, u: p - lr * u, params, updates), opt_state, loss

  def step(carry, batch):
    params, opt_state, loss_R = jax.vmap(member_step, in_axes=(0, 0, 0, None))(*carry, lr_R, batch)
    return (params, opt_state), loss_R

  (params, opt_state), loss_NbxR = jax.lax.scan(step, (params, opt_state), batches)
  return params, opt_state, loss_NbxR


@functools.partial(jax.jit, static_argnames=("graphdef",))
def eval_segment(graphdef, params, rest, batches):
  """Per-example accuracy [R, Nb, B] of every member on a segment's batches."""
  def accuracy_R(batch):
    return jax.vmap(lambda p: example_accuracy(nnx.merge(graphdef, p, rest), batch))(params)
  return jnp.moveaxis(jax.lax.map(accuracy_R, batches), 1, 0)


@dataclasses.dataclass
class MQARData:
  """Train and test segments as device-resident batches (generated once per run)."""

  train: list[tuple[mqar_data.SegmentSpec, dict[str, jax.Array], int]]
  test: list[tuple[mqar_data.SegmentSpec, dict[str, jax.Array], np.ndarray]]

  @property
  def num_train_examples(self) -> int:
    return sum(spec.num_examples for spec, _, _ in self.train)


def _device_batches(batches: mqar_data.Batches) -> dict[str, jax.Array]:
  return {name: jnp.asarray(getattr(batches, name)) for name in ("tokens", "positions", "targets", "weights")}


def build_data(config: MQARConfig) -> MQARData:
  """zoology's per-segment seeds; train batches of 256, test batches of 32, one dict per segment."""
  train_specs = mqar_data.scale_specs(config.train_segments, config.train_examples_scale)
  train_seeds, test_seeds = mqar_data.segment_seeds(config.seed, len(train_specs), len(config.test_segments))
  kwargs = dict(vocab_size=config.vocab_size, power_a=config.power_a)
  train = []
  for segment in mqar_data.build_segments(train_specs, train_seeds, **kwargs):
    train.append((segment.spec, _device_batches(mqar_data.make_batches(segment, config.train_batch_size)),
                  segment.spec.num_examples))
  test = []
  for segment in mqar_data.build_segments(config.test_segments, test_seeds, **kwargs):
    batches = mqar_data.make_batches(segment, config.eval_batch_size)
    valid_NbxB = batches.weights.sum(-1) > 0
    test.append((segment.spec, _device_batches(batches), valid_NbxB))
  return MQARData(train, test)


def evaluate(graphdef, params, rest, data: MQARData) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """(overall accuracy [R], {slice name: accuracy [R]}): means of per-example accuracies."""
  per_example, slices = [], {}
  for spec, batches, valid_NbxB in data.test:
    acc_RxN = np.asarray(eval_segment(graphdef, params, rest, batches))[:, valid_NbxB]
    slices[spec.name] = acc_RxN.mean(axis=1)
    per_example.append(acc_RxN)
  return np.concatenate(per_example, axis=1).mean(axis=1), slices


def cosine_factor(epoch: int, epochs: int) -> float:
  """torch CosineAnnealingLR(T_max=epochs, eta_min=0) stepped once per epoch: (1 + cos(π e / T)) / 2."""
  return 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))


@dataclasses.dataclass
class MemberResult:
  """One learning rate's outcome: the metrics of the epoch it stopped at (early stop or the last)."""

  learning_rate: float
  accuracy: float = 0.0
  slice_accuracy: dict[str, float] = dataclasses.field(default_factory=dict)
  train_loss: float = float("nan")
  epochs_run: int = 0
  stopped_early: bool = False


@dataclasses.dataclass
class RunResult:
  config: MQARConfig
  members: list[MemberResult]
  state_bytes: int
  params: int
  wall_time_s: float
  device: str
  date: str


def device_name() -> str:
  device = jax.devices()[0]
  return f"{device.platform}:{device.device_kind}"


def _stack(tree, n: int):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)


def _progress(epoch: int, config: MQARConfig, members: list[MemberResult], losses: np.ndarray,
              accuracy: np.ndarray, examples_per_s: float, epoch_s: float, eta_s: float) -> str:
  """Per learning rate: train loss and test accuracy ('*' once stopped early); train speed; ETA."""
  per_lr = "  ".join(
      f"lr {m.learning_rate:.3g}: loss {loss:.3f} acc {acc:.3f}{'*' if m.stopped_early else ''}"
      for m, loss, acc in zip(members, losses, accuracy))
  return (f"[{config.label} d={config.d_model}] epoch {epoch}/{config.epochs}  {per_lr}  "
          f"{examples_per_s:,.0f} ex/s  {epoch_s:.1f}s/epoch  ETA {eta_s:.0f}s")


def train(config: MQARConfig, *, data: MQARData | None = None,
          log: Callable[[str], Any] = print) -> RunResult:
  """Trains every learning rate of ``config`` side by side; returns each one's metrics at its stop."""
  start = time.time()
  data = data or build_data(config)
  model = build_model(config)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  lrs = np.asarray(config.learning_rates, np.float32)
  members = [MemberResult(float(lr)) for lr in config.learning_rates]
  adamw = AdamW(config.b1, config.b2, config.adam_eps, config.weight_decay)
  params = _stack(params, len(lrs))
  opt_state = jax.vmap(adamw.transform().init)(params)
  epoch_times = []
  with jax.default_matmul_precision(config.matmul_precision):
    for epoch in range(config.epochs):
      active = np.asarray([not m.stopped_early for m in members])
      lr_R = jnp.asarray(lrs * cosine_factor(epoch, config.epochs) * active)
      t0 = time.time()
      losses = []
      for _, batches, _ in data.train:
        params, opt_state, loss_NbxR = train_segment(graphdef, adamw, params, opt_state, rest, lr_R, batches)
        losses.append(loss_NbxR)
      loss_R = np.asarray(jnp.concatenate(losses).mean(axis=0))
      train_s = time.time() - t0
      accuracy_R, slices = evaluate(graphdef, params, rest, data)
      epoch_times.append(time.time() - t0)
      _record(members, active, epoch + 1, loss_R, accuracy_R, slices, config.early_stop_accuracy)
      eta = np.mean(epoch_times[1:] or epoch_times) * (config.epochs - epoch - 1)
      log(_progress(epoch + 1, config, members, loss_R, accuracy_R, data.num_train_examples / train_s,
                    epoch_times[-1], eta))
      if all(m.stopped_early for m in members):
        break
  return RunResult(config, members, decode_state_bytes(model, config.state_max_len), count_params(model),
                   time.time() - start, device_name(),
                   datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _record(members: Sequence[MemberResult], active: np.ndarray, epoch: int, loss_R: np.ndarray,
            accuracy_R: np.ndarray, slices: dict[str, np.ndarray], threshold: float) -> None:
  """Updates the still-active members; one whose accuracy exceeds ``threshold`` stops here."""
  for r, member in enumerate(members):
    if not active[r]:
      continue
    member.accuracy, member.train_loss, member.epochs_run = float(accuracy_R[r]), float(loss_R[r]), epoch
    member.slice_accuracy = {name: float(acc[r]) for name, acc in slices.items()}
    member.stopped_early = member.accuracy > threshold
