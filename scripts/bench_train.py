"""Whole-step benchmark: the real train step of the paper presets on synthetic tokens, in one process.

Prints, per preset: ms per step, tokens/s (and the ratio to the softmax reference of the same run and
length: Transformer++ where it was measured), how the model sees positions, MFU, compile seconds, XLA's
memory plan of the step and the device's peak memory; writes the rows to ``<out>/train_step.jsonl``,
plots tokens/s per preset (``<out>/train_step.png``) and, with ``--markdown``, appends the table as a
dated block to that file. See ``benchmarks/train_step.py`` for what is measured.

    python scripts/bench_train.py [--presets=transformer_pp_184m,sanatan_p1_184m,...] [--batch=32] \
        [--seq_len=2048] [--steps=10] [--override=train.loss_impl=materialized] \
        [--sweep=train.loss_impl=fused,materialized] [--out=runs/bench_train] [--profile=DIR]

Long context, the 184M models without a position table at 8 × 8192 and 2 × 32768 tokens per step
(one micro-batch each; ``NAME@model.remat=True`` or ``NAME@train.grad_accum=2`` where memory runs out):

    python scripts/bench_train.py --steps=6 --presets=transformer_pp_184m_8k,sanatan_p1_184m_8k,gla_182m_8k,\
transformer_pp_184m_32k,sanatan_p1_184m_32k,gla_182m_32k

Presets: the names in ``benchmarks.train_step.PRESETS`` or any ``<config file>:<preset>`` of configs/
(e.g. ``sanatan:tiny``). Each keeps its own micro-batch (grad_accum = batch / micro-batch).
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import train_step  # noqa: E402
from lmcore import xla_flags  # noqa: E402

_PRESETS = flags.DEFINE_list("presets", train_step.DEFAULT_PRESETS, "Presets to time, in this order; "
                              "NAME@KEY=VALUE@... gives one preset its own overrides, e.g. "
                              "sanatan_p2_184m@train.grad_accum=1.")
_BATCH = flags.DEFINE_integer("batch", None, "Global sequences per step (default: 32; a long-context preset "
                              "its own).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Tokens per sequence (default: 2048; a long-context preset "
                                "its own).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (after the warm-up steps).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "KEY=VALUE set in every preset that has KEY "
                                      "(e.g. train.loss_impl=materialized, model.mixers.sanatan.implementation="
                                      "chunked); repeatable.")
_SWEEP = flags.DEFINE_string("sweep", "", "KEY=V1,V2: every preset once per value, e.g. "
                             "train.loss_impl=fused,materialized.")
_OUT = flags.DEFINE_string("out", "runs/bench_train", "Directory of train_step.jsonl and train_step.png.")
_PROFILE = flags.DEFINE_string("profile", "", "Directory: after each preset's timed steps, trace "
                               "--profile_steps more with jax.profiler and write <DIR>/<preset>_breakdown.md "
                               "and .json (kernel time by category, scope and kernel; traces and the compiled "
                               "HLO in <DIR>/trace).")
_PROFILE_STEPS = flags.DEFINE_integer("profile_steps", 2, "Steps traced per preset with --profile.")
_MARKDOWN = flags.DEFINE_string("markdown", "", "File the dated table is appended to "
                                "('' = none).")


def main(argv):
  del argv
  out = _OUT.value
  try:
    rows = train_step.run(_PRESETS.value, batch=_BATCH.value, seq_len=_SEQ_LEN.value, steps=_STEPS.value,
                          warmup=_WARMUP.value, overrides=_OVERRIDE.value, sweep=_SWEEP.value,
                          jsonl=os.path.join(out, "train_step.jsonl"), profile=_PROFILE.value,
                          profile_steps=_PROFILE_STEPS.value)
  except train_step.BenchError as e:
    sys.exit(f"error: {e}")
  train_step.report(rows, out=out, markdown=_MARKDOWN.value, command="python " + " ".join(sys.argv))


if __name__ == "__main__":
  xla_flags.apply_defaults()  # before JAX starts
  app.run(main)
