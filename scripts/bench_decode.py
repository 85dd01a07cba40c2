"""Decode benchmark: ms/token and tokens/s of the compiled generation loop, per model, batch and context.

One process: every model at every batch and context, then the long contexts (without a learned position
table) at ``--long_batches``; prints the table and the decode targets, writes the rows as JSONL, plots
tokens/s vs batch (``--plot``) and, with ``--markdown``, appends them as a dated block to that file. See ``benchmarks/decode.py``
for what a row measures.

    python scripts/bench_decode.py [--models=sanatan_p1_184m,softmax_184m,softmax_184m_bf16_cache,...] \
        [--batches=1,8,64,256] [--contexts=1024,2048] [--long_contexts=4096,8192,16384,32768] \
        [--long_batches=1] [--decode_tokens=128] [--repeats=3] [--max_seconds=0] \
        [--jsonl=runs/bench_decode/decode.jsonl] [--plot=runs/bench_decode/decode.png] [--markdown=NOTES.md]

``--tiny`` runs the same model names on the tiny presets (CPU smoke runs and tests).
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import decode  # noqa: E402
from lmcore import xla_flags  # noqa: E402

_MODELS = flags.DEFINE_list("models", list(decode.PRESETS), f"Models to time, in this order: some of "
                            f"{', '.join(decode.PRESETS)}.")
_BATCHES = flags.DEFINE_string("batches", "1,8,64,256", "Batch sizes of the main grid.")
_CONTEXTS = flags.DEFINE_string("contexts", "1024,2048", "Contexts (tokens in the state when the last "
                                "timed token is fed) of the main grid.")
_LONG_CONTEXTS = flags.DEFINE_string("long_contexts", "4096,8192,16384,32768", "Contexts past the position "
                                     "tables, run without them ('' = none).")
_LONG_BATCHES = flags.DEFINE_string("long_batches", "1", "Batch sizes of the long contexts.")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 128, "Tokens sampled per row in the timed call (also "
                                      "the prefill call length).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per row (after a compiling one); the median counts.")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "KEY=VALUE set in every model that has KEY (e.g. "
                                      "model.mixers.sanatan.decode_implementation=recurrent); repeatable.")
_TINY = flags.DEFINE_bool("tiny", False, "The tiny presets under the same model names (CPU).")
_MAX_SECONDS = flags.DEFINE_float("max_seconds", 0.0, "Start no row after this many seconds (0: no limit); "
                                  "the rows left are listed as skipped.")
_JSONL = flags.DEFINE_string("jsonl", "runs/bench_decode/decode.jsonl", "Rows appended as JSON lines ('' = none).")
_PLOT = flags.DEFINE_string("plot", "", "PNG of tokens/s vs batch ('' = none).")
_MARKDOWN = flags.DEFINE_string("markdown", "", "File the dated block is appended to "
                                "('' = none).")


def main(argv):
  del argv
  try:
    rows = decode.run(
        _MODELS.value, batches=decode.parse_ints(_BATCHES.value, "batches"),
        contexts=decode.parse_ints(_CONTEXTS.value, "contexts"),
        long_contexts=decode.parse_ints(_LONG_CONTEXTS.value, "long_contexts"),
        long_batches=decode.parse_ints(_LONG_BATCHES.value, "long_batches"),
        decode_tokens=_DECODE_TOKENS.value, repeats=_REPEATS.value, tiny=_TINY.value,
        overrides=_OVERRIDE.value, jsonl=_JSONL.value, max_seconds=_MAX_SECONDS.value)
  except decode.BenchError as e:
    sys.exit(f"error: {e}")
  decode.report(rows, markdown=_MARKDOWN.value, plot=_PLOT.value, command="python " + " ".join(sys.argv),
                decode_tokens=_DECODE_TOKENS.value)


if __name__ == "__main__":
  xla_flags.apply_defaults()  # before JAX starts
  app.run(main)
