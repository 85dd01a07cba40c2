"""The presets of docs/SCALING.md's roofline table, for ``scripts/aot_compile.py --config=<this file>:NAME``.

``NAME`` is ``<model>_<length>``: a model of ``benchmarks.train_step.PRESETS`` (``softmax_184m``,
``sanatan_p1_184m``, ``sanatan_p2_184m``, ``gla_182m``, ``based_360m``) at one of ``LENGTHS``, with
``TOKENS_PER_CHIP`` tokens per chip and step of a v4-8 (4 chips, data parallel, the preset's own remat),
in micro-batches of at most ``MICRO_TOKENS_PER_CHIP`` (at least one sequence), and the position table,
where the model has one, stretched to the length. Every model compiles its "auto" implementation: on
a TPU the XLA forms (softmax: ``jax.nn.dot_product_attention``'s XLA form, which materialises the
T x T scores).
"""

from __future__ import annotations

import ml_collections

from benchmarks import train_step

MODELS = ("softmax_184m", "sanatan_p1_184m", "sanatan_p2_184m", "gla_182m", "based_360m")
LENGTHS = {"2k": 2048, "8k": 8192, "32k": 32768}
CHIPS = 4  # a v4-8
TOKENS_PER_CHIP = 16_384  # 32 x 2048 over the slice, the presets' own batch; at least one sequence a chip
# Softmax's XLA form keeps 8 x 2048-token rows' fp32 scores of every layer over a v4 chip's HBM.
MICRO_TOKENS_PER_CHIP = 8192


def scaled(model: str, seq_len: int) -> ml_collections.ConfigDict:
  """``model`` at ``seq_len`` tokens per sequence with ``TOKENS_PER_CHIP`` tokens per chip."""
  cd = train_step.preset_config(model)
  cd.data.seq_len = seq_len
  rows = max(1, TOKENS_PER_CHIP // seq_len)
  cd.train.batch_size = CHIPS * rows
  cd.train.grad_accum = max(1, min(rows, rows * seq_len // MICRO_TOKENS_PER_CHIP))
  cd.mesh.data, cd.mesh.fsdp, cd.mesh.tensor = -1, 1, 1
  if cd.model.max_positions:
    cd.model.max_positions = max(cd.model.max_positions, seq_len)
  cd.name = f"{model}_{next(k for k, v in LENGTHS.items() if v == seq_len)}"
  return cd


PRESETS = {f"{model}_{name}": (lambda m=model, t=length: scaled(m, t))
           for model in MODELS for name, length in LENGTHS.items()}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  from configs import common
  return common.select(PRESETS, arg, default="sanatan_p1_184m_2k")
