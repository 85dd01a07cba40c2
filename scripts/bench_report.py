"""docs/BENCHMARKS.md, generated from the bench records in docs/bench/: only tables measured on the current code.

    python scripts/bench_report.py              # rewrites docs/BENCHMARKS.md from docs/bench/
    python scripts/bench_report.py --check      # exit 1 when docs/BENCHMARKS.md is not what it generates
    python scripts/bench_report.py DIR [--kernels_plot=PATH]   # prints the kernel and agreement tables of a new
                                                # run (``bash scripts/bench_gpu.sh DIR``); writes nothing else

``TABLES`` lists every table: its title, the command that measures it, its renderer (one per kind of row:
train step, kernel timing, kernel agreement, decode, XLA form, TPU AOT, goodput) and its records
(``Source``: a directory of docs/bench/, the files in it, the command that wrote them). The device comes
from the directory's README ("Device: ..."), the date from its name. A table compares rows of one record
only; a table without a record is listed under "Not run on the current code" with its command.

To add a measurement: copy its rows into ``docs/bench/<date>-<device>-<topic>/`` with a README (a
``Device:`` line, the command), add one ``Source`` line to the table's ``sources`` and run this script.
A record the code has since replaced goes with its table entry (git keeps both; ``EARLIER`` names them).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import sys
from typing import Callable

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "docs", "bench")
OUT = os.path.join(REPO, "docs", "BENCHMARKS.md")

_CHECK = flags.DEFINE_bool("check", False, "Exit 1 if docs/BENCHMARKS.md differs from what the records give.")
_PLOT = flags.DEFINE_string("kernels_plot", "", "With DIR: a PNG of fwd+bwd tokens/s against T ('' = none).")

OPS = {"softmax": "softmax", "sanatan_p1": "SANATAN p = 1", "sanatan_p2": "SANATAN p = 2",
       "gated": "gated linear attention", "gla": "gated linear attention", "taylor": "Taylor (BASED)"}
# Each op's reference among the kernel rows: ``benchmarks.harness.REFERENCE``, else the XLA form of its
# ``AUTO_CASES`` (``--auto_only`` runs); and among the TPU rows, ``benchmarks.tpu_aot.REFERENCE``.
KERNEL_REFERENCE = {"sanatan_p1": ("chunked (xla)", "chunked (xla, C=128)"),
                    "sanatan_p2": ("parallel (xla)", "parallel (xla)"),
                    "gated": ("chunked (xla)", "chunked (xla)"), "taylor": ("chunked (xla)", "chunked (xla)")}
TPU_REFERENCE = {"sanatan_p1": "chunked (XLA, C=64)", "sanatan_p2": "parallel (XLA)",
                 "gated": "chunked (XLA, C=64)", "taylor": "chunked (XLA, C=128)"}
# Records (globs) cited by other docs (docs/REPRODUCTION.md), not by a table here.
REPRODUCE = "2026-12-07-reproduce"
OTHER_RECORDS = (f"{REPRODUCE}/results.md", f"{REPRODUCE}/results.json", f"{REPRODUCE}/loss_curves.png",
                 f"{REPRODUCE}/records/s*/*.json")


@dataclasses.dataclass(frozen=True)
class Source:
  """Records of one run: ``files`` (globs) in ``docs/bench/<directory>/``, written by ``command``."""
  directory: str
  files: tuple[str, ...]
  command: str

  @property
  def date(self) -> str:
    return self.directory[:10]

  def device(self, root: str) -> str:
    """The "Device:" line of the directory's README."""
    path = os.path.join(root, self.directory.split("/")[0], "README.md")
    with open(path) as f:
      for line in f:
        if line.startswith("Device:"):
          return line.split(":", 1)[1].strip()
    raise ValueError(f"{path} has no 'Device:' line; add one naming the device the rows were measured on")

  def rows(self, root: str) -> list[dict]:
    """Every row of the files, in file order."""
    rows = []
    for pattern in self.files:
      paths = sorted(glob.glob(os.path.join(root, self.directory, pattern)))
      if not paths:
        raise FileNotFoundError(f"no {pattern} in docs/bench/{self.directory}; a table cites it")
      for path in paths:
        rows += jsonl_rows(path)
    return rows


def jsonl_rows(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


Render = Callable[[list[dict]], tuple[list[str], list[list[str]]]]


@dataclasses.dataclass(frozen=True)
class Table:
  """A table under the heading ``part``: ``render(one record's rows) -> (header, rows of cells)``, once
  per source; ``command`` measures it on the current code."""
  part: str
  title: str
  about: str
  command: str
  render: Render
  sources: tuple[Source, ...] = ()
  # Rows its records lack, each "what: `command`", listed under "Not run on the current code".
  rows_missing: tuple[str, ...] = ()


# ---- cells


def ms(x: float | None, spec: str = ".2f") -> str:
  return "—" if x is None else format(x, spec)


def sci(x: float | None) -> str:
  return "" if x is None else f"{x:.1e}"


def failure(note: str) -> str:
  """A failed row's note, short."""
  if "Shared memory" in note:
    return "exceeds shared memory"
  if "out of memory" in note or "RESOURCE_EXHAUSTED" in note:
    return "out of memory"
  return "not supported" if note.startswith("ValueError") else note[:60]


def op_rank(op: str) -> int:
  return list(OPS).index(op) if op in OPS else len(OPS)


def latest(rows: list[dict], key: Callable[[dict], tuple]) -> list[dict]:
  """The last row of each key (a rerun's retry wins), in order of first appearance."""
  merged: dict[tuple, dict] = {}
  for r in rows:
    merged[key(r)] = r  # an existing key keeps its place
  return list(merged.values())


def nearest(candidates: list[dict], params: int) -> dict | None:
  """The candidate whose ``params`` are nearest ``params`` (by ratio): the reference of the same size."""
  return min(candidates, key=lambda c: abs(math.log(max(c["params"], 1) / max(params, 1))), default=None)


def drop_empty(header: list[str], table: list[list[str]]) -> tuple[list[str], list[list[str]]]:
  """Without the columns no row fills."""
  keep = [i for i in range(len(header)) if any(row[i] for row in table)]
  return [header[i] for i in keep], [[row[i] for i in keep] for row in table]


# ---- train step rows (benchmarks.train_step.TrainRow)


def train(rows: list[dict]):
  """One row per step; "vs Transformer++": tok/s over that of the Transformer++ row (preset
  ``transformer_pp_*``) of the same length and sweep value, the nearest in parameters."""
  header = ["preset", "variant", "positions", "B × T (accum)", "params", "step ms", "tok/s",
            "vs Transformer++", "MFU %", "compile s", "XLA plan GiB", "device peak GiB", "note"]
  pp = [r for r in rows if r["preset"].startswith("transformer_pp") and r["tokens_per_s"]]
  table = []
  for r in rows:
    same = [p for p in pp if p["seq_len"] == r["seq_len"]]
    ref = nearest([p for p in same if p["variant"] == r["variant"]]
                  or [p for p in same if not p["variant"]], r["params"])
    ratio = ("" if ref is None or not r["tokens_per_s"] else "reference" if ref is r
             else f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}× {ref['preset']}")
    table.append([r["preset"], r["variant"], r.get("positions", ""),
                  f"{r['batch']} × {r['seq_len']} ({r['grad_accum']})",
                  f"{r['params'] / 1e6:.1f}M" if r["params"] else "", ms(r["step_ms"], ".1f"),
                  ms(r["tokens_per_s"], ",.0f"), ratio, ms(r["mfu"] and 100 * r["mfu"], ".1f"),
                  ms(r["compile_s"], ".0f"), ms(r["xla_memory_gib"]), ms(r.get("peak_memory_gib")),
                  failure(r["note"]) if r["note"] else ""])
  return drop_empty(header, table)


# ---- kernel timing rows (benchmarks.rows.Row)


def kernel_rows(rows: list[dict]) -> list[dict]:
  """Timing rows, the last of each key kept."""
  return latest([r for r in rows if "fwdbwd_ms" in r],
                lambda r: (r["op"], r["impl"], r["length"], r.get("shape", ""), r.get("queue", 1)))


def kernels(rows: list[dict]):
  """One row per (op, implementation, heads, calls per wait); per B × T: fwd / fwd+bwd ms and, in
  brackets, the op's reference's fwd+bwd time over the row's (``KERNEL_REFERENCE``: same run, heads
  and calls per wait)."""
  rows = kernel_rows(rows)
  sizes = sorted({(r["length"], r["batch"]) for r in rows})
  by_key = {(r["op"], r["impl"], r.get("shape", ""), r.get("queue", 1), r["length"]): r for r in rows}
  queued = len({r.get("queue", 1) for r in rows}) > 1
  header = ["op", "implementation"] + [f"{b} × {t} fwd / fwd+bwd" for t, b in sizes]
  table = []
  kinds = dict.fromkeys((r["op"], r["impl"], r.get("shape", ""), r.get("queue", 1)) for r in rows)
  for op, impl, shape, queue in sorted(kinds, key=lambda k: op_rank(k[0])):
    name = f"`{impl}`" + (f" ({shape})" if shape else "") + (f", {queue} per wait" if queued else "")
    cells = [OPS.get(op, op), name]
    for t, _ in sizes:
      r = by_key.get((op, impl, shape, queue, t))
      ref = next((by_key[k] for k in ((op, i, shape, queue, t) for i in KERNEL_REFERENCE.get(op, ()))
                  if k in by_key), None)
      if r is None:
        cells.append("")
      elif r["fwdbwd_ms"] is None:
        cells.append(failure(r["note"]))
      else:
        ratio = (f" ({ref['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}×)" if ref and ref is not r and ref["fwdbwd_ms"]
                 else "")
        cells.append(f"{ms(r['fwd_ms'])} / **{ms(r['fwdbwd_ms'])}**{ratio}")
    table.append(cells)
  return header, table


# ---- kernel agreement rows (benchmarks.kernel_check.Agreement)


def agreement(rows: list[dict]):
  """One row per kernel: output / worst gradient relative L2 for fp32 and for bf16 inputs, the XLA
  form's own bf16 error and whether every check passes."""
  header = ["op", "kernel", "vs (fp32)", "fp32 inputs (limit 1e-5)", "bf16 inputs (limit 2e-3)",
            "XLA's own in bf16", "passes"]
  rows = latest(rows, lambda r: (r["op"], r["impl"], r["dtype"]))
  by_key = {(r["op"], r["impl"], r["dtype"]): r for r in rows}
  table = []
  for op, impl in sorted(dict.fromkeys((r["op"], r["impl"]) for r in rows), key=lambda k: op_rank(k[0])):
    checks = [by_key.get((op, impl, dtype)) for dtype in ("float32", "bfloat16")]
    first = next(r for r in checks if r)
    cells = [f"{sci(r['output_rel'])} / {sci(max(r['grad_rel'].values()))}" if r and r["output_rel"] is not None
             else failure(r["note"]) if r else "" for r in checks]
    passed = all(r["output_rel"] is not None and max(r["output_rel"], *r["grad_rel"].values())
                 <= max(r["limit"], r["xla_worst"] or 0.0) for r in checks if r)
    table.append([OPS.get(op, op), f"`{impl}`", f"`{first['reference']}`", *cells,
                  sci(checks[1] and checks[1]["xla_worst"]), "yes" if passed else "**no**"])
  return header, table


# ---- decode rows (benchmarks.decode.DecodeRow, and PaperRow of --setting=paper)


def decode(rows: list[dict]):
  """One row per timed case: ms/token (the floor), tokens/s and, for the papers' setting, prefill
  tokens/ms, each over the Transformer++ row's (``transformer_pp_*``) of the same batch, context and
  decode program, the nearest in parameters; state per sequence; kernels per token."""
  def case(r):
    return (r["batch"], r.get("context"), r.get("prompt"), r.get("tokens"), r.get("xla", "default"))

  header = ["model", "B × context", "ms/token (floor)", "tokens/s", "prefill tokens/ms", "vs Transformer++",
            "state MB / seq", "kernels / token", "note"]
  pp = [r for r in rows if r["model"].startswith("transformer_pp") and r["ms_per_token"]]
  table = []
  for r in rows:
    xla = r.get("xla", "default")
    context = f"{r['context']:,}" if "context" in r else f"{r['prompt']:,} + {r['tokens']:,}"
    ref = nearest([p for p in pp if case(p) == case(r)], r["params"])
    ratio = "" if ref is None or not r["ms_per_token"] else "reference" if ref is r else (
        f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}×"
        + (f", prefill {r['prefill_tokens_per_ms'] / ref['prefill_tokens_per_ms']:.2f}×"
           if r.get("prefill_tokens_per_ms") else "") + f" {ref['model']}")
    floor = f" ({r['floor_ms']:.3f})" if r["ms_per_token"] and r.get("floor_ms") else ""
    table.append([r["model"] + ("" if xla == "default" else f" [{xla}]"), f"{r['batch']} × {context}",
                  ms(r["ms_per_token"], ".3f") + floor, ms(r["tokens_per_s"], ",.0f"),
                  ms(r.get("prefill_tokens_per_ms"), ",.1f") if "prompt" in r else "", ratio,
                  ms(r["state_bytes_per_seq"] and r["state_bytes_per_seq"] / 1e6),
                  ms(r.get("kernels_per_token"), ".0f") if r.get("kernels_per_token") else "",
                  failure(r["note"]) if r["note"] else ""])
  return drop_empty(header, table)


# ---- XLA form rows (benchmarks.xla_forms.FormRow)


def xla_forms(rows: list[dict]):
  """One row per (op, form, heads); per B × T: fwd / fwd+bwd ms and, in brackets, the row's reference's
  fwd+bwd time over its own (its ``reference`` field: same run, length and heads)."""
  rows = latest(rows, lambda r: (r["op"], r["form"], r["length"], r["heads"]))
  sizes = sorted({(r["length"], r["batch"]) for r in rows})
  by_key = {(r["op"], r["form"], r["heads"], r["length"]): r for r in rows}
  header = ["op", "form", "heads"] + [f"{b} × {t} fwd / fwd+bwd" for t, b in sizes]
  table = []
  for op, form, heads in dict.fromkeys((r["op"], r["form"], r["heads"]) for r in rows):
    cells = [OPS.get(op, op), f"`{form}`", heads]
    for t, _ in sizes:
      r = by_key.get((op, form, heads, t))
      ref = r and by_key.get((op, r["reference"], heads, t))
      if r is None:
        cells.append("")
      elif r["fwdbwd_ms"] is None:
        cells.append(failure(r["note"]))
      else:
        ratio = f" ({ref['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}× `{r['reference']}`)" if ref and ref["fwdbwd_ms"] else ""
        cells.append(f"{ms(r['fwd_ms'])} / **{ms(r['fwdbwd_ms'])}**{ratio}")
    table.append(cells)
  return header, table


# ---- TPU AOT rows (benchmarks.tpu_aot.Result)


def tpu(rows: list[dict]):
  """One row per (op, implementation); per T: the roofline ms, GB accessed, the op's reference XLA
  form's roofline over the row's (``TPU_REFERENCE``) and the temporaries; compile seconds per T."""
  rows = latest(rows, lambda r: (r["op"], r["impl"], r["length"], r["batch"], r["topology"]))
  lengths = sorted({r["length"] for r in rows})
  by_key = {(r["op"], r["impl"], r["length"]): r for r in rows}
  header = (["op", "implementation"] + [f"T = {t}: roofline ms, GB, vs XLA, temporaries MiB" for t in lengths]
            + ["compile s (" + ", ".join(f"T = {t}" for t in lengths) + ")"])
  table = []
  for op, impl in dict.fromkeys((r["op"], r["impl"]) for r in rows):
    cells, compile_s = [], []
    for t in lengths:
      r, ref = by_key.get((op, impl, t)), by_key.get((op, TPU_REFERENCE.get(op), t))
      compile_s.append(ms(r and r["compile_s"], ".0f"))
      if r is None or r["roofline_s"] is None:
        cells.append(failure(r["note"]) if r else "")
        continue
      ratio = f"{ref['roofline_s'] / r['roofline_s']:.2f}×" if ref and ref is not r and ref["roofline_s"] else "–"
      cells.append(f"{r['roofline_s'] * 1e3:.1f} ({r['bound']}), {r['bytes_accessed'] / 1e9:.1f}, {ratio}, "
                   f"{r['temp_bytes'] / 2 ** 20:,.0f}")
    table.append([OPS.get(op, op), f"`{impl}`"] + cells + [", ".join(compile_s)])
  return header, table


# ---- goodput rows (scripts/bench_goodput.py)


def goodput(rows: list[dict]):
  """One row per run of ``scripts/bench_goodput.py``: wall seconds, goodput and each phase's seconds
  (the parts of start-up, evaluation and shutdown beside their phase)."""
  phases = ("startup", "compile", "steps", "data_wait", "checkpoint", "eval", "shutdown")
  header = (["control", "corpus", "steps", "tokens/step", "wall s", "goodput"]
            + [p.replace("_", " ") + " s" for p in phases])
  table = []
  for r in rows:
    parts = r.get("parts", {})
    cells = []
    for phase in phases:
      cell = f"{r['phases'].get(phase, 0.0):.1f}"
      if parts.get(phase):
        cell += " (" + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in parts[phase].items()) + ")"
      cells.append(cell)
    table.append([r["control"], r["corpus"], f"{r['steps']:,}", f"{r['tokens_per_step']:,}",
                  f"{r['wall_s']:.0f}", f"{100 * r['goodput']:.0f} %"] + cells)
  return header, table


# ---- the tables, by part of the document

TRAIN_2K = "python scripts/bench_train.py --steps=8 --out=DIR"
TRAIN_LONG = ("python scripts/bench_train.py --steps=6 --out=DIR --presets=transformer_pp_184m_8k,"
              "sanatan_p1_184m_8k,gla_182m_8k,transformer_pp_184m_32k,sanatan_p1_184m_32k,gla_182m_32k")
DECODE = ("python scripts/bench_decode.py --setting=grid,paper --out=DIR --models=sanatan_p1_184m,"
          "transformer_pp_184m,softmax_184m,softmax_184m_bf16_cache,gla_182m,cyfa,based_360m,transformer_pp_360m")
# What the published decode rows ran: the grid of the 184M pair, and the papers' setting.
DECODE_RUN = ("python scripts/bench_decode.py --setting=grid,paper --out=DIR --models=sanatan_p1_184m,"
              "transformer_pp_184m --batches=1,64 --contexts=2048 --long_contexts=32768 --long_batches=1 "
              "--decode_tokens=128 --decode_xla=default,graph_loop --repeats=2 --paper_models=sanatan_p1_184m,"
              "transformer_pp_184m,based_360m,transformer_pp_360m --paper_tokens=256 --max_seconds=110")
GPU_KERNELS = "bash scripts/bench_gpu.sh DIR"

TABLES = (
    Table(
        "Training", "Train step at 2,048 tokens",
        "`lmcore.train` step (model, fused loss, AdamW) of every preset `scripts/bench_train.py` times by "
        "default, on synthetic tokens, batch 32 × 2048, each at its own micro-batch and `implementation=\"auto\"`; "
        "\"vs Transformer++\": tok/s over the Transformer++ row's of the same size. Rows: "
        "`DIR/train_step.jsonl`.",
        TRAIN_2K, train,
        (Source("2026-12-07-h100-train/2k", ("train_step.jsonl",),
                "python scripts/bench_train.py --steps=8 --presets=transformer_pp_184m,softmax_184m,"
                "sanatan_p1_184m,sanatan_p2_184m,gla_182m,cyfa,transformer_pp_360m,based_360m --out=DIR"),),
        ("the 1.3B presets: `python scripts/bench_train.py --steps=8 --out=DIR "
         "--presets=transformer_pp_1p3b,based_1p3b`",)),
    Table(
        "Training", "Train step at 8K and 32K tokens",
        "The 184M models without a position table at 8 × 8192 and 2 × 32768 tokens per step, one "
        "micro-batch; \"vs Transformer++\" at the same length. Rows: `DIR/train_step.jsonl`.",
        TRAIN_LONG, train, (Source("2026-12-07-h100-train/long", ("train_step.jsonl",), TRAIN_LONG),)),
    Table(
        "Training", "Goodput of a reproduction run",
        "Wall seconds by phase of reproduction-size runs: the runs of a `scripts/reproduce.py` chain in "
        "the order one process trained them (the chain's `--workdir/goodput.jsonl`), and single controls "
        "of `scripts/bench_goodput.py` (rows: `DIR/goodput.jsonl`). Goodput: step seconds over wall "
        "seconds; steps include fetching the next batch while the device still runs a step (\"data "
        "overlapped\"); data wait is a fetch the device waited for.",
        "python scripts/bench_goodput.py --corpus=runs/linux --stage1_steps=1200 --out=DIR", goodput,
        (Source(REPRODUCE, ("goodput.jsonl",),
                "python scripts/reproduce.py --workdir=runs/reproduce_v2 --stage1_steps=1200 "
                "--runs=softmax_table,softmax_nope --seeds=0,1"),
         Source("2026-12-07-cpu-goodput", ("goodput.jsonl",),
                "python scripts/bench_goodput.py --corpus=runs/linux14 --stage1_steps=302 "
                "--out=runs/bench_goodput_cpu4 --override=model.d_model=64 --override=model.n_layers=2 "
                "--override=model.pattern='softmax*2' --override=model.mlp_hidden=192 "
                "--override=model.mixers.softmax.n_heads=4 --override=model.mixers.softmax.head_dim=16 "
                "--override=train.batch_size=8 --override=data.seq_len=256 --override=model.max_positions=256 "
                "--override=data.heldout.num_sequences=64 --override=wandb.mode=disabled"),)),
    Table(
        "Decode", "Decode grid",
        "Prefill C − 128 random tokens, then one compiled `decode` call samples 128 tokens per row "
        "(`lmcore/eval/generate.py`); ms/token is that call's median; floor: the weights and the batch's "
        "state read once at the HBM bandwidth; contexts past 2,048 run without a position table. Rows: "
        "`DIR/decode.jsonl`.",
        DECODE, decode, (Source("2026-12-07-h100-decode", ("decode.jsonl",), DECODE_RUN),),
        ("the other models (the 184M softmax with a table, in fp32 and bf16 caches, GLA, CyFA, BASED 360M) "
         "beside Transformer++: `python scripts/bench_decode.py --setting=grid --out=DIR --models=transformer_pp_184m,"
         "softmax_184m,softmax_184m_bf16_cache,gla_182m,cyfa,based_360m,transformer_pp_360m`",)),
    Table(
        "Decode", "Decode in the BASED paper's setting",
        "Batch 128, prompts of 4,096 tokens prefilled in one timed call, then the generated tokens "
        "(1,024 unless the row says otherwise); each model against the Transformer++ of its size. Rows: "
        "`DIR/decode_paper.jsonl` (the same process as the grid).",
        DECODE, decode, (Source("2026-12-07-h100-decode", ("decode_paper.jsonl",), DECODE_RUN),),
        ("BASED 360M beside Transformer++ 360M, whose cache needs more than JAX's default share of the "
         "card (the record's README): "
         "`XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python scripts/bench_decode.py --setting=paper --out=DIR "
         "--paper_models=based_360m,transformer_pp_360m`",)),
    Table(
        "Ops", "Kernels against XLA, FLA and cuDNN",
        "fwd / **fwd+bwd** ms, bf16, 16,384 tokens per call, 8 calls per wait; in brackets the op's XLA "
        "form's fwd+bwd time over the row's. Rows: `DIR/kernels_*.jsonl`, `DIR/fla.jsonl`.",
        GPU_KERNELS, kernels),
    Table(
        "Ops", "Kernel agreement",
        "Each compiled kernel against the op's XLA form in fp32 at full matmul precision, T = 1000, B = 2: "
        "relative L2 of the output / the worst input gradient. Rows: `DIR/agreement.jsonl` (the same "
        "run as the kernels).",
        GPU_KERNELS, agreement),
    Table(
        "Ops", "XLA forms",
        "The XLA forms TPUs and CPUs run, each beside the form it should keep up with: fwd / **fwd+bwd** "
        "ms, bf16, 16,384 tokens per call. Rows: `DIR/xla_forms.jsonl`.",
        "python scripts/bench_xla_forms.py --out=DIR", xla_forms,
        (Source("2026-12-07-h100-xla-forms", ("xla_forms.jsonl",),
                "python scripts/bench_xla_forms.py --ops=taylor,sanatan_p1 --lengths=2048,32768 --out=DIR"),)),
    Table(
        "Ops", "TPU v4 ahead of time",
        "Compiled by libtpu for the 4 chips of a v4-8 on a CPU host, forward + backward, 8 rows of T per "
        "chip, bf16: the program's FLOPs and bytes (each loop body times its trips; a kernel's own "
        "`pl.CostEstimate`), the roofline (275 TFLOP/s, 1.2 TB/s) and the op's XLA form's roofline over "
        "the row's, temporaries, compile seconds on the host. Estimates from the compiler's cost model, "
        "not timings.",
        "python scripts/bench_tpu_aot.py --jsonl=DIR/tpu_aot.jsonl", tpu,
        (Source("2026-12-07-tpu-v4-aot", ("tpu_aot.jsonl",),
                "python scripts/bench_tpu_aot.py --jsonl=docs/bench/2026-12-07-tpu-v4-aot/tpu_aot.jsonl"),)),
)

# Tables of code since replaced, by part: their rows and records are in git at this commit.
EARLIER_COMMIT = "750921f"
EARLIER = {
    "Training": ("Train step of the paper presets", "SANATAN p = 1 train step", "XLA's GEMMs on cuBLAS",
                 "Decode"),
    "GPU kernels": ("SANATAN p = 1 kernels", "Kernels against XLA, FLA and cuDNN", "Kernel agreement",
                    "Pallas-Triton against Mosaic GPU"),
    'What "auto" prefers': ("Gated linear attention heads", "SANATAN heads", "Taylor heads and lengths",
                            "Spans"),
    "Kernel tilings": ("Gated linear attention kernel tiles", "SANATAN p = 1 walks: tilings and layouts",
                       "SANATAN p = 2 flash tilings", "Taylor kernel tilings", "Chunk scan"),
    "Fixed choices": ("SANATAN p = 1: bf16 parts and fast tanh", "SANATAN p = 1: fast sine and cosine",
                      "SANATAN p = 2: flash features", "Gated linear attention: split state dots"),
}

INTRO = """\
# Benchmarks

Tables measured on the current code only, each with its device, date and the command that wrote its
rows (`docs/bench/<run>/`, whose README says how). Generated by `python scripts/bench_report.py`; do not
edit by hand. A comparison is made within one run."""

HOW_TO = """\
## How to measure

Kernel and XLA-form rows time 16,384 tokens per call (B = 16384 / T), bf16 inputs, fp32 accumulation,
each function compiled first: the median of 20 samples after 4 warm-up calls, a sample enqueuing 8 calls
and waiting once (`benchmarks/rows.py`'s `time_fn`). `bash scripts/bench_gpu.sh DIR` runs the kernel
agreement check and the kernel timings side by side on one GPU, and `python scripts/bench_report.py DIR`
prints them in the layout below. To publish a run: copy its rows into
`docs/bench/<date>-<device>-<topic>/` with a README (a `Device:` line, the command), add a `Source` for
it to the table's `sources` in `scripts/bench_report.py` and run `python scripts/bench_report.py`
(`tests/test_bench_report.py` checks that this file is what it gives and that every record is cited)."""


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def render_table(table: Table, root: str) -> list[str]:
  lines = [f"### {table.title}", table.about]
  for source in table.sources:
    lines += ["", f"{source.device(root)}, {source.date}: `{source.command}` (`docs/bench/{source.directory}/`)",
              "", *markdown(*table.render(source.rows(root)))]
  return lines + [""]


def not_run() -> list[str]:
  """The tables without a record, with the commands that measure them."""
  missing = [t for t in TABLES if not t.sources]
  partial = [t for t in TABLES if t.sources and t.rows_missing]
  if not missing and not partial:
    return []
  lines = ["## Not run on the current code", "",
           "No record of these tables, or of these rows, has been measured on the current code (GPU rows: "
           "one GPU, `DIR` a fresh folder). Each command writes the rows its table reads; publish them as "
           "\"How to measure\" says.", ""]
  for command in dict.fromkeys(t.command for t in missing):
    titles = " and ".join(f"**{t.title}**" for t in missing if t.command == command)
    lines.append(f"- {titles}: `{command}`")
  lines += [f"- **{t.title}**, {what}" for t in partial for what in t.rows_missing]
  return lines + [""]


def earlier() -> list[str]:
  return ["## Measured on earlier code", "",
          f"These tables were measured on code since replaced; they are in git with their records (`git show "
          f"{EARLIER_COMMIT}:docs/BENCHMARKS.md`, `git show {EARLIER_COMMIT}:docs/bench/`).", "",
          *(f"- {part}: {', '.join(titles)}" for part, titles in EARLIER.items()), ""]


def generate(root: str = BENCH) -> str:
  """The whole of docs/BENCHMARKS.md from the records under ``root``."""
  lines, part = [INTRO, "", HOW_TO, ""], ""
  for table in (t for t in TABLES if t.sources):
    if table.part != part:
      lines.append(f"## {table.part}")
      part = table.part
    lines += render_table(table, root)
  return "\n".join(lines + not_run() + earlier())


def print_run(directory: str) -> None:
  """The kernel and agreement tables of a new run directory (``bash scripts/bench_gpu.sh DIR``)."""
  paths = sorted(glob.glob(os.path.join(directory, "*.jsonl")))
  rows = {os.path.basename(p): jsonl_rows(p) for p in paths}
  timing = [r for name, rs in rows.items() if name != "agreement.jsonl" for r in rs if "fwdbwd_ms" in r]
  checks = rows.get("agreement.jsonl", [])
  if not timing and not checks:
    raise app.UsageError(f"no rows in {directory}; run `bash scripts/bench_gpu.sh {directory}` first")
  if checks:
    print("\n".join(markdown(*agreement(checks))), end="\n\n")
  if timing:
    print("\n".join(markdown(*kernels(timing))), flush=True)
  if _PLOT.value and timing:
    from types import SimpleNamespace
    from benchmarks import plots
    plots.plot_tokens_per_s([SimpleNamespace(**r) for r in kernel_rows(timing)], _PLOT.value,
                            title=f"kernels, {directory}")
    print(f"wrote {_PLOT.value}")


def main(argv):
  if len(argv) > 2:
    raise app.UsageError("usage: python scripts/bench_report.py [--check] | "
                         "python scripts/bench_report.py DIR [--kernels_plot=PATH]")
  if len(argv) == 2:
    if not os.path.isdir(argv[1]):
      raise app.UsageError(f"{argv[1]} is not a directory; give the DIR of `bash scripts/bench_gpu.sh DIR`")
    print_run(argv[1])
    return
  text = generate()
  if _CHECK.value:
    with open(OUT) as f:
      if f.read() != text:
        sys.exit("docs/BENCHMARKS.md is not what the records give; run `python scripts/bench_report.py`")
    print("docs/BENCHMARKS.md matches the records")
    return
  with open(OUT, "w") as f:
    f.write(text)
  print(f"wrote {OUT} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
  sys.path.insert(0, REPO)
  app.run(main)
