"""The XLA forms TPUs run, each beside what it should keep up with, timed in one process
(``benchmarks/xla_forms.py``): SANATAN p = 1 "chunked" at chunks of 64 and 128 with and without
``chunked_remat`` against the plain einsum form, Taylor "chunked" at chunks of 128 and 256 (and
without its recomputing backward) against its kernel, GLA "chunked" at wide heads against FLA's
``chunk_gla``. Forward+backward is ``benchmarks.harness.time_fwd_bwd``'s (the value and gradient of
Σ o · do), as in every op benchmark.

    python scripts/bench_xla_forms.py [--ops=sanatan_p1,taylor,gla] [--lengths=2048,32768] \
        [--tokens=16384] [--queue=8] [--out=runs/xla_forms] [--tiny]

A GPU stands in for a TPU here (the forms are the same XLA programs). Prints a Markdown table; with
``--out`` every row (with the device and this command) is appended to ``<out>/xla_forms.jsonl`` as it is
measured, and rows already timed there are not timed again. ``--tiny`` runs every case at toy sizes on any
host (a check that the script works, not a measurement).
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import xla_forms  # noqa: E402

_OPS = flags.DEFINE_list("ops", list(xla_forms.OPS), f"Ops to time: {', '.join(xla_forms.OPS)}.")
_LENGTHS = flags.DEFINE_list("lengths", [str(t) for t in xla_forms.LENGTHS], "Sequence lengths T.")
_TOKENS = flags.DEFINE_integer("tokens", xla_forms.TOKENS, "Tokens per batch (B = tokens // T, at least 1).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Input dtype: bfloat16 or float32.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed samples per form (the median is reported).")
_QUEUE = flags.DEFINE_integer("queue", 8, "Calls enqueued per wait (benchmarks.rows.time_fn).")
_OUT = flags.DEFINE_string("out", "", "Directory whose xla_forms.jsonl the rows are appended to as they are "
                           "measured; rows already timed there are not timed again ('' = none).")
_TINY = flags.DEFINE_bool("tiny", False, f"Toy sizes (T = {xla_forms.TINY_LENGTH}, 256 tokens, narrow heads, "
                          "one sample): checks the script on any host.")


def main(argv):
  del argv
  unknown = [op for op in _OPS.value if op not in xla_forms.OPS]
  if unknown:
    raise app.UsageError(f"--ops: unknown op {unknown[0]!r}; valid: {', '.join(xla_forms.OPS)}")
  if not all(x.isdigit() and int(x) > 0 for x in _LENGTHS.value):
    raise app.UsageError(f"--lengths={','.join(_LENGTHS.value)}: give positive integers, e.g. 2048,32768")
  if _DTYPE.value not in ("bfloat16", "float32"):
    raise app.UsageError(f"--dtype={_DTYPE.value!r}: give bfloat16 or float32")
  lengths = [xla_forms.TINY_LENGTH] if _TINY.value else [int(x) for x in _LENGTHS.value]
  sizes = dict(tokens=2 * xla_forms.TINY_LENGTH, repeats=1, queue=1) if _TINY.value else dict(
      tokens=_TOKENS.value, repeats=_REPEATS.value, queue=_QUEUE.value)
  jsonl = os.path.join(_OUT.value, "xla_forms.jsonl") if _OUT.value else ""
  found = xla_forms.run(ops=_OPS.value, lengths=lengths, dtype=_DTYPE.value, tiny=_TINY.value,
                        jsonl=jsonl, command="python " + " ".join(sys.argv), **sizes)
  print(xla_forms.format_table(found), flush=True)


if __name__ == "__main__":
  app.run(main)
