"""Decode benchmark: ms/token and tokens/s of the compiled generation loop, per model, batch and context.

One process: every model at every batch and context, then the long contexts (without a learned position
table) at ``--long_batches``; prints the table and the decode targets, writes the rows as JSONL, plots
tokens/s vs batch (``--plot``) and, with ``--markdown``, appends them as a dated block to that file. See
``benchmarks/decode.py`` for what a row measures.

    python scripts/bench_decode.py [--models=sanatan_p1_184m,softmax_184m,softmax_184m_bf16_cache,...] \
        [--batches=1,8,64,256] [--contexts=1024,2048] [--long_contexts=4096,8192,16384,32768] \
        [--long_batches=1] [--decode_tokens=128] [--repeats=3] [--max_seconds=0] [--decode_xla=default] \
        [--jsonl=runs/bench_decode/decode.jsonl] [--plot=runs/bench_decode/decode.png] [--markdown=NOTES.md]

``--setting=paper``: the BASED paper's setting instead (batch 128, prompts of 4,096 tokens whose prefill
is timed on its own, 1,024 generated tokens), each model against its Transformer++ of the same size:

    python scripts/bench_decode.py --setting=paper [--paper_models=based_360m,transformer_pp_360m,...] \
        [--paper_batch=128] [--paper_prompt=4096] [--paper_tokens=1024] [--paper_prefill_chunk=0] \
        [--repeats=3] [--jsonl=runs/bench_decode/decode_paper.jsonl] [--markdown=NOTES.md]

``--setting=grid,paper`` runs both in one process, the grid first. ``--out=DIR`` writes the rows to
``DIR/decode.jsonl`` and ``DIR/decode_paper.jsonl`` and every compiled decode loop's optimised HLO to
``DIR/hlo/`` (the kernels per token are read off it). ``--decode_xla`` / ``--paper_decode_xla`` run each
model once per named set of XLA options of its decode program (``benchmarks.decode.DECODE_XLA``).
``--tiny`` runs the same model names on the tiny presets (CPU smoke runs and tests).
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import decode  # noqa: E402
from lmcore import xla_flags  # noqa: E402

_SETTING = flags.DEFINE_list("setting", ["grid"], "grid: batches × contexts; paper: the BASED paper's "
                             "batch, prompt and generated tokens, against Transformer++; grid,paper: both.")
_MODELS = flags.DEFINE_list("models", [], f"Models of the grid, in this order (default: "
                            f"{', '.join(decode.GRID_MODELS)}); with --setting=paper alone also of the "
                            f"papers' setting: some of {', '.join(decode.PRESETS)}.")
_PAPER_MODELS = flags.DEFINE_list("paper_models", [], f"Models of the papers' setting (default: --models "
                                  f"with --setting=paper alone, else {', '.join(decode.PAPER_MODELS)}).")
_DECODE_XLA = flags.DEFINE_list("decode_xla", ["default"], f"The grid's decode programs: some of "
                                f"{', '.join(decode.DECODE_XLA)} (each model runs once per name).")
_PAPER_DECODE_XLA = flags.DEFINE_list("paper_decode_xla", ["default"], "The papers' setting's decode "
                                      "programs, as --decode_xla.")
_OUT = flags.DEFINE_string("out", "", "Folder for the JSONL rows (decode.jsonl, decode_paper.jsonl) and the "
                           "compiled decode loops' HLO (hlo/); overrides --jsonl.")
_BATCHES = flags.DEFINE_string("batches", "1,8,64,256", "Batch sizes of the main grid.")
_CONTEXTS = flags.DEFINE_string("contexts", "1024,2048", "Contexts (tokens in the state when the last "
                                "timed token is fed) of the main grid.")
_LONG_CONTEXTS = flags.DEFINE_string("long_contexts", "4096,8192,16384,32768", "Contexts past the position "
                                     "tables, run without them ('' = none).")
_LONG_BATCHES = flags.DEFINE_string("long_batches", "1", "Batch sizes of the long contexts.")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 128, "Tokens sampled per row in the timed call (also "
                                      "the prefill call length).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per row (after a compiling one); the median "
                                "counts.")
_PAPER_BATCH = flags.DEFINE_integer("paper_batch", decode.PAPER_BATCH, "--setting=paper: rows decoded "
                                    "together.")
_PAPER_PROMPT = flags.DEFINE_integer("paper_prompt", decode.PAPER_PROMPT, "--setting=paper: prompt tokens "
                                     "per row.")
_PAPER_TOKENS = flags.DEFINE_integer("paper_tokens", decode.PAPER_TOKENS, "--setting=paper: generated tokens "
                                     "per row.")
_PAPER_PREFILL_CHUNK = flags.DEFINE_integer("paper_prefill_chunk", 0, "--setting=paper: prompt tokens per "
                                            "prefill call (0: the whole prompt in one call); the calls "
                                            "after the first attend over the softmax KV cache.")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "KEY=VALUE set in every model that has KEY (e.g. "
                                      "model.mixers.sanatan.decode_implementation=recurrent); repeatable.")
_TINY = flags.DEFINE_bool("tiny", False, "The tiny presets under the same model names (CPU).")
_MAX_SECONDS = flags.DEFINE_float("max_seconds", 0.0, "Start no row after this many seconds (0: no limit); "
                                  "the rows left are listed as skipped.")
_JSONL = flags.DEFINE_string("jsonl", None, "Rows appended as JSON lines ('' = none; default "
                             "runs/bench_decode/decode.jsonl, with --setting=paper decode_paper.jsonl "
                             "there).")
_PLOT = flags.DEFINE_string("plot", "", "PNG of tokens/s vs batch ('' = none).")
_MARKDOWN = flags.DEFINE_string("markdown", "", "File the dated block is appended to "
                                "('' = none).")


def main(argv):
  del argv
  command = "python " + " ".join(sys.argv)
  settings = _SETTING.value
  if not settings or set(settings) - {"grid", "paper"}:
    sys.exit(f"error: --setting={','.join(settings)}: use grid, paper or grid,paper.")
  out = _OUT.value
  jsonl = lambda name: os.path.join(out, name) if out else (
      f"runs/bench_decode/{name}" if _JSONL.value is None else _JSONL.value)
  hlo_dir = os.path.join(out, "hlo") if out else ""
  try:
    if "grid" in settings:
      rows = decode.run(
          _MODELS.value or list(decode.GRID_MODELS), batches=decode.parse_ints(_BATCHES.value, "batches"),
          contexts=decode.parse_ints(_CONTEXTS.value, "contexts"),
          long_contexts=decode.parse_ints(_LONG_CONTEXTS.value, "long_contexts"),
          long_batches=decode.parse_ints(_LONG_BATCHES.value, "long_batches"),
          decode_tokens=_DECODE_TOKENS.value, repeats=_REPEATS.value, tiny=_TINY.value,
          overrides=_OVERRIDE.value, max_seconds=_MAX_SECONDS.value, jsonl=jsonl("decode.jsonl"),
          xla=_DECODE_XLA.value, hlo_dir=hlo_dir)
      decode.report(rows, markdown=_MARKDOWN.value, plot=_PLOT.value, command=command,
                    decode_tokens=_DECODE_TOKENS.value)
    if "paper" in settings:
      alone = _MODELS.value if settings == ["paper"] else []
      rows = decode.run_paper(
          _PAPER_MODELS.value or alone or list(decode.PAPER_MODELS), batch=_PAPER_BATCH.value,
          prompt=_PAPER_PROMPT.value, tokens=_PAPER_TOKENS.value,
          prefill_chunk=_PAPER_PREFILL_CHUNK.value, repeats=_REPEATS.value, tiny=_TINY.value,
          overrides=_OVERRIDE.value, jsonl=jsonl("decode_paper.jsonl"), max_seconds=_MAX_SECONDS.value,
          xla=_PAPER_DECODE_XLA.value, hlo_dir=hlo_dir)
      decode.report_paper(rows, markdown=_MARKDOWN.value, command=command)
  except decode.BenchError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  xla_flags.apply_defaults()  # before JAX starts
  app.run(main)
