"""What libtpu's compiler says about each attention op's TPU paths, compiled on this host (no TPU needed).

For every op and T: the Mosaic kernels (SANATAN p = 1: "pallas_tpu") and the op's XLA forms,
forward+backward (``benchmarks.harness.fwd_bwd``: the value and gradient of Σ o · do), compiled for
every chip of a TPU slice with ``--batch`` rows per chip (the batch split over the chips, the kernels
under their shard_map, as in training).
Prints per chip: compile seconds,
the compiler's FLOPs and bytes accessed (loop bodies counted once per iteration; the kernels' share from
their ``pl.CostEstimate``), a roofline time max(FLOPs / peak, bytes / HBM bandwidth) and its ratio to
the op's reference XLA form, libtpu's own "optimal_seconds", temporaries, and with ``--out`` appends the
table to that Markdown file with the date and command. Estimates, not timings: ``benchmarks/tpu_aot.py`` says
what each number counts.

    python scripts/bench_tpu_aot.py [--ops=sanatan_p1,sanatan_p2,gated,taylor] [--lengths=2048,8192] \
        [--batch=8] [--topology=v4-8] [--dtype=bfloat16] [--jsonl=runs/bench/tpu_aot.jsonl] \
        [--out=NOTES.md]

Needs libtpu (``make aot``). With ``--jsonl``, rows already compiled there are not
compiled again (a stopped run continues).
"""

import datetime
import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# libtpu takes a machine-wide lock when it loads; another process compiling for a TPU on this host would
# otherwise make the compile fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

from benchmarks import harness, tpu_aot  # noqa: E402
from lmcore import cli  # noqa: E402
from lmcore.tpu_slices import tpu_devices  # noqa: E402

_OPS = flags.DEFINE_list("ops", list(tpu_aot.OPS), f"Ops to compile: {', '.join(tpu_aot.OPS)}.")
_LENGTHS = flags.DEFINE_list("lengths", ["2048", "8192"], "Sequence lengths T.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch rows per chip (the global batch is this times the chips).")
_TOPOLOGY = flags.DEFINE_string("topology", "v4-8", "TPU slice: a name of lmcore.tpu_slices.TPU_SLICES "
                                "(v4-8, v5p-8, ...) or a topology like v4:2x2x1.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Dtype of q, k, v: bfloat16 or float32.")
_JSONL = flags.DEFINE_string("jsonl", "", "Rows are appended here as they are compiled; rows already in "
                             "it are not compiled again.")
_OUT = flags.DEFINE_string("out", "", "Markdown file the table is appended to ('' = none).")


def main(argv):
  del argv
  lengths = tpu_aot.parse_lengths(_LENGTHS.value)
  tpu_aot.check_options(ops=_OPS.value, batch=_BATCH.value, dtype=_DTYPE.value)
  jax.config.update("jax_platforms", "cpu")  # the host only compiles; its own backend stays CPU
  devices = tpu_devices(_TOPOLOGY.value)
  rows = tpu_aot.run(ops=_OPS.value, lengths=lengths, batch=_BATCH.value, devices=devices,
                     topology=_TOPOLOGY.value, dtype=_DTYPE.value, jsonl=_JSONL.value)
  table = tpu_aot.format_table(rows)
  print(table, flush=True)
  if _OUT.value:
    device = f"{len(devices)} × {devices[0].device_kind} ({_TOPOLOGY.value})"
    harness.append_markdown(_OUT.value, [table, tpu_aot.LEGEND], datetime.date.today().isoformat(), device,
                            ["python " + " ".join(sys.argv)], via="AOT on a CPU host",
                            topic="compile-time cost of the attention ops")


if __name__ == "__main__":
  cli.run(main)
