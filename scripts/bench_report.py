"""docs/BENCHMARKS.md, generated from the bench records in docs/bench/: the current tables only.

    python scripts/bench_report.py              # rewrites docs/BENCHMARKS.md from docs/bench/
    python scripts/bench_report.py --check      # exit 1 when docs/BENCHMARKS.md is not what it generates
    python scripts/bench_report.py DIR [--plot=PATH]   # prints the kernel and agreement tables of a new
                                                # run (``bash scripts/bench_gpu.sh DIR``); writes nothing else

``TABLES`` lists every current table: its title, the records it reads (a directory of docs/bench/, files
in it, the command that wrote them) and a builder that lays the rows out. The device comes from the
directory's README ("Device: ..."), the date from its name. A table that compares rows takes them from
one run; a table of several runs marks each row with its run. ``NAMES`` maps the implementation names a
record was taken with to the current ones; rows of deleted implementations are left out.

To add a measurement: copy its rows to ``docs/bench/<date>-<device>-<topic>/`` with a README (device,
commands), point the table's sources at it (the older directory goes once no table cites it) and run
this script.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics
import sys
from typing import Callable

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "docs", "bench")
OUT = os.path.join(REPO, "docs", "BENCHMARKS.md")

_CHECK = flags.DEFINE_bool("check", False, "Exit 1 if docs/BENCHMARKS.md differs from what the records give.")
_PLOT = flags.DEFINE_string("plot", "", "With DIR: a PNG of fwd+bwd tokens/s against T ('' = none).")

# Old implementation names -> current ones (None: the implementation is deleted). Names not listed are
# current already.
NAMES = {
    "softmax": {"softmax (cudnn)": "cuDNN"},
    "sanatan_p1": {
        "chunked (xla, C=128)": "chunked", "chunked (xla)": "chunked (chunk 64)",
        "chunked (XLA, C=128)": "chunked", "chunked (XLA, C=64)": "chunked (chunk 64)",
        "parallel (reference)": "parallel", "plain chunked (baseline)": "plain chunked einsums",
        "plain chunked (XLA baseline, C=64)": "plain chunked einsums",
        "FLA chunk_linear_attn (features precomputed)": "FLA chunk_linear_attn",
        "pallas (Mosaic, C=128)": "pallas_tpu", "pallas": None, "pallas (tf32)": None,
        "pallas (float32)": None, "chunked_scan (xla)": None, "chunked_scan (XLA, C=64)": None},
    "sanatan_p2": {
        "parallel (xla)": "parallel", "parallel (XLA)": "parallel", "parallel (reference)": "parallel",
        "pallas_flash (xla features)": "pallas_flash, XLA's features", "blocked (xla)": None,
        "blocked (XLA, 128)": None, "pallas": None, "pallas (tf32)": None, "pallas (float32)": None,
        "pallas (Mosaic, 512×512 blocks)": None},
    "gated": {
        "chunked (xla)": "chunked", "chunked (XLA, C=64)": "chunked", "parallel (reference)": "parallel",
        "pallas": "pallas_triton", "pallas (tf32)": "pallas_triton, tf32", "pallas (float32)":
        "pallas_triton, float32", "pallas (Mosaic, C=128)": "pallas_tpu"},
    "taylor": {
        "chunked (xla)": "chunked", "chunked (XLA, C=64)": "chunked", "parallel (reference)": "parallel",
        "pallas (Mosaic, C=128)": "pallas_tpu", "pallas": None, "pallas (tf32)": None,
        "pallas (float32)": None},
}
# The name a deleted implementation keeps where it is a kept row's reference (agreement checks).
REFERENCE_NAMES = {("sanatan_p2", "blocked (xla)"): "blocked (an XLA form not in the code)",
                   ("sanatan_p1", "chunked (xla)"): "chunked"}
# Records cited by other docs (docs/REPRODUCTION.md), not by a table here.
OTHER_RECORDS = ("2026-12-01-h200-reproduce/results.json",)
OPS = {"softmax": "softmax", "sanatan_p1": "SANATAN p = 1", "sanatan_p2": "SANATAN p = 2",
       "gated": "gated linear attention", "taylor": "Taylor (BASED)"}
REFERENCE = {"sanatan_p1": "chunked", "sanatan_p2": "parallel", "gated": "chunked", "taylor": "chunked"}


def current_name(op: str, impl: str) -> str | None:
  """The current name of implementation ``impl`` of ``op`` (None: deleted)."""
  return NAMES.get(op, {}).get(impl, impl)


@dataclasses.dataclass(frozen=True)
class Source:
  """Records of one run: ``files`` (globs) in ``docs/bench/<directory>/``, written by ``command``."""
  directory: str
  files: tuple[str, ...]
  command: str
  keep: Callable[[dict], bool] | None = None  # the rows the table cites (all when None)

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
    """Every row of the files, in file order; each row knows its file's name as ``_file``."""
    rows = []
    for pattern in self.files:
      paths = sorted(glob.glob(os.path.join(root, self.directory, pattern)))
      if not paths:
        raise FileNotFoundError(f"no {pattern} in docs/bench/{self.directory}; a table cites it")
      for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        rows += [{**row, "_file": name} for row in (markdown_rows(path) if path.endswith(".md") else
                                                    jsonl_rows(path))]
    return [r for r in rows if self.keep is None or self.keep(r)]


def jsonl_rows(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def markdown_rows(path: str) -> list[dict]:
  """The rows of the first markdown table in ``path``, keyed by its header's cells."""
  with open(path) as f:
    lines = [line.strip() for line in f if line.strip().startswith("|")]
  cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
  return [dict(zip(cells[0], row)) for row in cells[2:]]


@dataclasses.dataclass(frozen=True)
class Table:
  """A current table under the heading ``part``: ``build(each source's rows) -> (header, rows of cells)``."""
  part: str
  title: str
  about: str
  sources: tuple[Source, ...]
  build: Callable[[list[list[dict]]], tuple[list[str], list[list[str]]]]


# ---- cells


def ms(x: float | None) -> str:
  return "—" if x is None else f"{x:.2f}"


def sci(x: float | None) -> str:
  return "" if x is None else f"{x:.1e}"


def failure(note: str) -> str:
  """A failed row's note, short."""
  if "Shared memory" in note:
    return "exceeds shared memory"
  if "out of memory" in note or "RESOURCE_EXHAUSTED" in note:
    return "out of memory"
  return "not supported" if note.startswith("ValueError") else note[:40]


def median_by(rows: list[dict], key: Callable[[dict], tuple], value: str) -> dict[tuple, float]:
  """The median of ``row[value]`` over the rows of each key, in order of first appearance."""
  groups: dict[tuple, list[float]] = {}
  for r in rows:
    if r.get(value) is not None:
      groups.setdefault(key(r), []).append(r[value])
  return {k: statistics.median(v) for k, v in groups.items()}


def shape_name(batch: int, length: int) -> str:
  return f"{batch} × {length}"


def heads(shape: str, op: str) -> str:
  """"H=4 K=96 V=192 gate=channel" -> "4 × 96 × 192, per-key gates"; "" -> the op's default heads."""
  if not shape:
    shape = {"sanatan_p1": "H=12 K=64 V=64", "sanatan_p2": "H=12 K=64 V=64", "gated": "H=12 K=64 V=64",
             "taylor": "H=16 K=16 V=64"}[op]
  fields = dict(part.split("=") for part in shape.split())
  text = f"{fields['H']} × {fields['K']} × {fields['V']}"
  gate = {"channel": ", per-key gates", "head": ", per-head gates"}.get(fields.get("gate", ""), "")
  return text + gate


def op_rank(op: str) -> int:
  """The place of ``op`` in the tables (``OPS``' order; unknown ops last)."""
  return list(OPS).index(op) if op in OPS else len(OPS)


def latest(rows: list[dict], key: Callable[[dict], tuple]) -> list[dict]:
  """The last row of each key (a rerun's retry wins), in order of first appearance."""
  merged: dict[tuple, dict] = {}
  for r in rows:
    merged[key(r)] = r  # an existing key keeps its place
  return list(merged.values())


# ---- kernel timing rows (benchmarks.rows.Row)


def kernel_rows(rows: list[dict], ops: tuple[str, ...] = (),
                drop: tuple[tuple[str, str], ...] = ()) -> list[dict]:
  """Timing rows under their current names, the deleted implementations' and ``drop``'s (op, current
  name) left out, the last of each key kept."""
  out = []
  for r in rows:
    if ops and r["op"] not in ops:
      continue
    name = current_name(r["op"], r["impl"])
    if name is None or (r["op"], name) in drop:
      continue
    out.append({**r, "impl": name})
  return latest(out, lambda r: (r["op"], r["impl"], r["length"], r.get("shape", ""), r.get("queue", 1)))


def kernel_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
  """One row per (op, implementation, heads, calls per wait); per (B, T): fwd / fwd+bwd ms and, in
  brackets, the op's reference's fwd+bwd time over the row's (``REFERENCE``: same run, heads and
  calls per wait)."""
  sizes = sorted({(r["length"], r["batch"]) for r in rows})
  by_key = {(r["op"], r["impl"], r.get("shape", ""), r.get("queue", 1), r["length"]): r for r in rows}
  queued = len({r.get("queue", 1) for r in rows}) > 1
  header = ["op", "implementation"] + [f"{shape_name(b, t)} fwd / fwd+bwd" for t, b in sizes]
  table = []
  kinds = dict.fromkeys((r["op"], r["impl"], r.get("shape", ""), r.get("queue", 1)) for r in rows)
  for op, impl, shape, queue in sorted(kinds, key=lambda k: op_rank(k[0])):
    name = f"`{impl}`" + (f" ({heads(shape, op)})" if shape else "")
    name += f", {queue} per wait" if queued else ""
    cells = [OPS.get(op, op), name]
    for t, _ in sizes:
      r = by_key.get((op, impl, shape, queue, t))
      ref = by_key.get((op, REFERENCE.get(op), shape, queue, t))
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


def kernels(ops=(), drop=()):
  return lambda runs: kernel_table(kernel_rows(runs[0], ops, drop))


# ---- kernel agreement rows (benchmarks.kernel_check.Agreement)


def agreement(ops_per_run: tuple[tuple[str, ...], ...]):
  """One row per kernel of the ops each run is cited for: output / worst gradient relative L2 for fp32
  and for bf16 inputs, the XLA form's own bf16 error and whether every check passes."""
  def build(runs):
    several = len(runs) > 1
    header = ["op", "kernel", "vs (fp32)", "fp32 inputs (limit 1e-5)", "bf16 inputs (limit 2e-3)",
              "XLA's own in bf16", "passes"] + ["run"] * several
    table = []
    for run, (rows, ops) in enumerate(zip(runs, ops_per_run)):
      rows = latest([r for r in rows if r["op"] in ops], lambda r: (r["op"], r["impl"], r["dtype"]))
      by_key = {(r["op"], r["impl"], r["dtype"]): r for r in rows}
      pairs = dict.fromkeys((r["op"], r["impl"]) for r in rows if current_name(r["op"], r["impl"]))
      for op, impl in sorted(pairs, key=lambda pair: op_rank(pair[0])):
        checks = [by_key.get((op, impl, dtype)) for dtype in ("float32", "bfloat16")]
        first = next(r for r in checks if r)
        ref = REFERENCE_NAMES.get((op, first["reference"])) or current_name(op, first["reference"])
        cells = [f"{sci(r['output_rel'])} / {sci(max(r['grad_rel'].values()))}" if r else "" for r in checks]
        passed = all(max(r["output_rel"], *r["grad_rel"].values()) <= max(r["limit"], r["xla_worst"] or 0.0)
                     for r in checks if r)
        table.append([OPS[op], f"`{current_name(op, impl)}`", f"`{ref}`", *cells,
                      sci(checks[1] and checks[1]["xla_worst"]), "yes" if passed else "**no**"]
                     + [RUNS[run]] * several)
    return header, table
  return build


RUNS = "abcdefgh"


# ---- train-step rows (benchmarks.train_step.TrainRow)


def train(labels: dict[str, str] | None = None, memory: bool = True):
  """One row per step; "vs softmax": tok/s over the mean of its run's softmax rows."""
  def build(runs):
    header = ["preset", "variant", "B × T (accum)", "params", "step ms", "tok/s", "vs softmax", "MFU",
              "compile s"] + (["XLA plan GiB"] if memory else []) + (["run"] if len(runs) > 1 else [])
    table = []
    for run, rows in enumerate(runs):
      softmax = [r["tokens_per_s"] for r in rows if r["mixers"] == "softmax" and r["tokens_per_s"]]
      for r in rows:
        label = (labels or {}).get(r["_file"], "")
        variant = ", ".join(v for v in (f"`{r['variant']}`" if r["variant"] else "", label) if v)
        ratio = f"{r['tokens_per_s'] / statistics.mean(softmax):.3f}×" if softmax else ""
        cells = [r["preset"], variant, f"{r['batch']} × {r['seq_len']} ({r['grad_accum']})",
                 f"{r['params'] / 1e6:.1f}M", f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}", ratio,
                 f"{r['mfu']:.1%}", f"{r['compile_s']:.0f}" if r["compile_s"] else ""]
        table.append(cells + ([f"{r['xla_memory_gib']:.2f}"] if memory else [])
                     + ([RUNS[run]] if len(runs) > 1 else []))
    return header, table
  return build


def gemms(runs):
  """One row per preset: step ms and tok/s (vs its run's softmax) with XLA's Triton GEMMs (run a) and
  with cuBLAS (run b)."""
  header = ["preset", "Triton GEMMs (run a): step ms, tok/s (vs softmax)", "cuBLAS (run b)"]
  cells: dict[str, list[str]] = {}
  for rows in runs:
    softmax = statistics.mean(r["tokens_per_s"] for r in rows if r["mixers"] == "softmax")
    for r in latest(rows, lambda r: r["preset"]):
      cells.setdefault(r["preset"], []).append(
          f"{r['step_ms']:.1f}, {r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / softmax:.2f}×)")
  return header, [[preset] + row for preset, row in cells.items()]


# ---- head shapes and lengths: which implementation is fastest


def shapes(cases: dict[str, tuple[str, ...]], columns: tuple[str, ...]):
  """One row per (op, heads, T) of each run: fwd+bwd ms of the op's implementations ``cases[op]`` under
  ``columns``, the fastest in bold; shapes with a single timed implementation are left out."""
  def build(runs):
    ops = ["op"] * (len(cases) > 1)
    header = ops + ["heads H × K × V", "B × T"] + list(columns) + ["run"] * (len(runs) > 1)
    table = []
    for run, rows in enumerate(runs):
      rows = kernel_rows(rows, tuple(cases))
      by_key = {(r["op"], r.get("shape", ""), r["length"], r["impl"]): r for r in rows}
      for op, shape, length in dict.fromkeys((r["op"], r.get("shape", ""), r["length"]) for r in rows):
        found = [by_key.get((op, shape, length, i)) for i in cases[op]]
        times = [r["fwdbwd_ms"] for r in found if r and r["fwdbwd_ms"]]
        if len(times) < 2 and not (times and any(r and r["fwdbwd_ms"] is None for r in found)):
          continue
        batch = next(r["batch"] for r in found if r)
        cells = ["" if r is None else failure(r["note"]) if r["fwdbwd_ms"] is None else
                 f"**{ms(r['fwdbwd_ms'])}**" if r["fwdbwd_ms"] == min(times) else ms(r["fwdbwd_ms"])
                 for r in found]
        table.append([OPS[op]] * bool(ops) + [heads(shape, op), shape_name(batch, length)] + cells
                     + [RUNS[run]] * (len(runs) > 1))
    return header, table
  return build


# ---- A/B rounds: medians over alternating rounds


def rounds(specs: tuple[tuple[str, str, dict[str, str]], ...], columns: tuple[str, ...]):
  """A/B rows timed in alternating rounds: per run a spec (label key, time key, {record label: shown
  label}, in order) and per shape of ``columns`` the median time over the rounds."""
  def build(runs):
    several = len(runs) > 1
    header = ["variant"] + [c.replace("x", " × ") + " ms" for c in columns] + ["run"] * several
    table = []
    for run, (rows, (label, value, labels)) in enumerate(zip(runs, specs)):
      cited = [r for r in rows if r.get(label) in labels]
      medians = median_by(cited, lambda r: (r[label], r["shape"]), value)
      for old, shown in labels.items():
        table.append([shown] + [ms(medians.get((old, c))) for c in columns] + [RUNS[run]] * several)
    return header, table
  return build


# ---- the tables' own layouts


def bf16_parts(runs):
  """Time (median of rounds) and errors (o, worst gradient) per variant at each shape."""
  rows = runs[0]
  times = median_by([r for r in rows if "fwd_bwd_ms" in r], lambda r: (r["case"], r["shape"]), "fwd_bwd_ms")
  key = "err_o_dq_dk_dv_domega_dlam"
  errors = {(r["case"], r["shape"]): r[key] for r in rows if key in r}
  cases = {"fp32 parts, tanhf": "fp32 parts, libdevice tanh",
           "bf16 parts, tanhf": "bf16 parts, libdevice tanh",
           "bf16 parts, exp2 tanh": "bf16 parts, tanh by exp2 (the constants)"}
  sizes = list(dict.fromkeys(s for _, s in times))
  header = ["variant"] + [s.replace("x", " × ") + " ms" for s in sizes]
  header.append("o / worst gradient at 32 × 2048")
  table = [[shown] + [ms(times.get((case, s))) for s in sizes]
           + [f"{sci(errors[case, '32x2048'][0])} / {sci(max(errors[case, '32x2048'][1:]))}"]
           for case, shown in cases.items()]
  return header, table


def fast_factors(runs):
  """The op with exact and approximate factor functions; the factor kernels alone at 1 × 32768."""
  rows = runs[0]
  op = median_by([r for r in rows if r["what"] == "op"], lambda r: (r["variant"], r["B"], r["T"]),
                 "fwdbwd_ms")
  kernel = median_by([r for r in rows if r["what"] == "time"], lambda r: (r["kernel"], r["fast"]), "ms")
  sizes = sorted({(b, t) for _, b, t in op}, key=lambda size: (size[1], size[0]))
  header = ["variant"] + [f"{shape_name(b, t)} ms" for b, t in sizes]
  header.append("factors / VJP kernels, 1 × 32768 ms")
  variants = {"constant skipped, exact": (False, "exact sine, cosine, division"),
              "constant skipped, fast": (True, "approximate (the constants for 16-bit operands)")}
  table = [[shown] + [ms(op[variant, b, t]) for b, t in sizes]
           + [f"{ms(kernel['factors', fast])} / {ms(kernel['factor_grads', fast])}"]
           for variant, (fast, shown) in variants.items()]
  return header, table


def split_state(runs):
  """Errors of the gated kernel's state dots against fp32 (one run) and its time (another run)."""
  errors, timing = runs
  names = {"xla bf16": "`chunked` in bf16 (the limit)", "pallas {}": "one bf16 rounding",
           "pallas {'split': True}": "two bf16 parts (`kernel_split_state`, the default)"}
  times = {r["impl"]: r for r in timing if r["length"] == 2048}
  long = {r["impl"]: r for r in timing if r["length"] == 32768}
  impls = {"xla bf16": "chunked (xla)", "pallas {}": "pallas",
           "pallas {'split': True}": "pallas (C=16, 8 warps, split True)"}
  header = ["state dots", "o", "worst of dq, dk, dv", "d gate", "8 × 2048 ms", "1 × 32768 ms"]
  table = []
  for r in errors:
    if r["name"] in names:
      impl = impls[r["name"]]
      table.append([names[r["name"]], sci(r["o"]), sci(max(r["grads"][:3])), sci(r["grads"][3]),
                    ms(times[impl]["fwdbwd_ms"]), ms(long[impl]["fwdbwd_ms"])])
  return header, table


def tiles(labels: tuple[dict[str, str], ...]):
  """Kernel settings against B × T: per run ``labels`` (record name -> shown setting, in order), the
  median fwd+bwd ms of the setting's rows (several processes give several rows)."""
  def build(runs):
    several = len(runs) > 1
    medians = [median_by([r for r in rows if r["impl"] in names],
                         lambda r: (r["impl"], r["batch"], r["length"]), "fwdbwd_ms")
               for rows, names in zip(runs, labels)]
    sizes = sorted({(b, t) for m in medians for _, b, t in m}, key=lambda size: size[1])
    header = ["setting"] + [f"{shape_name(b, t)} ms" for b, t in sizes] + ["run"] * several
    table = [[shown] + [ms(m.get((old, b, t))) if (old, b, t) in m else "" for b, t in sizes]
             + [RUNS[run]] * several
             for run, (m, names) in enumerate(zip(medians, labels)) for old, shown in names.items()]
    return header, table
  return build


def flash_tiles(runs):
  """SANATAN p = 2 flash tilings at 8 × 2048, the median over the rounds of the last process (its rows
  start at its "default" row)."""
  header = ["change to the default tiling", "8 × 2048 ms"]
  first = [i for i, r in enumerate(runs[0]) if r["variant"] == "default"][-1]
  return header, [[r["variant"], ms(r["median"])] for r in runs[0][first:] if r["variant"] in FLASH_SHOWN]


FLASH_SHOWN = ("default", "fwd 4w + dq loop 64 2s", "fwd 4w + dq loop 64 2s + dkv 4s", "dkv loop 64 2s",
               "dq loop 64 1s")


def spans(runs):
  """One row per (op, B × T): fwd+bwd ms with each row cut into G spans (run a), then with the spans'
  totals summed over parts of 512 to 2048 tokens (run b, medians over rounds)."""
  tuned, parts = runs
  tuned = [r for r in tuned if "(spans=" in r["impl"]]
  by_key = {(r["op"], r["batch"], r["length"], int(r["impl"].split("=")[1].rstrip(")"))): r for r in tuned}
  counts = sorted({g for *_, g in by_key})
  medians = median_by(parts, lambda r: (r["op"], r["shape"], r["part_length"]), "fwdbwd_ms")
  lengths = sorted({p for *_, p in medians})
  header = (["op", "B × T"] + [f"G = {g}" for g in counts]
            + [f"parts of {p} (run b)" for p in lengths])
  table = []
  for op, b, t in dict.fromkeys(k[:3] for k in sorted(by_key, key=lambda k: (k[0], k[2]))):
    cells = [ms(by_key[op, b, t, g]["fwdbwd_ms"]) if (op, b, t, g) in by_key else "" for g in counts]
    cells += [ms(medians.get((op, f"{b}x{t}", p))) if (op, f"{b}x{t}", p) in medians else "" for p in lengths]
    table.append([OPS[op], shape_name(b, t)] + cells)
  return header, table


def chunk_scan(runs):
  """The chunk scan alone: XLA's associative scan against the Pallas kernel's default tiles."""
  header = ["state stack", "B × T", "XLA associative scan ms", "Pallas scan ms (8 rows, 16 chunks)",
            "Pallas GB/s"]
  rows = runs[0]
  table = []
  for r in rows:
    if r["scan"] == "pallas, block_rows 8, unroll 16":
      xla = next(x for x in rows if x["scan"] == "xla" and (x["stack"], x["T"]) == (r["stack"], r["T"]))
      table.append([OPS[r["stack"]], shape_name(r["B"], r["T"]), xla["ms"], r["ms"],
                    r["GB/s (Pallas bytes)"]])
  return header, table


def backends(runs):
  """ms (TFLOP/s) of each backend per T, one run."""
  rows = runs[0]
  lengths = sorted({r["length"] for r in rows})
  by_key = {(r["backend"], r["length"]): r for r in rows}
  header = ["backend"] + [f"T = {t} ms (TFLOP/s)" for t in lengths] + ["rel L2"]
  table = [[b] + [f"{by_key[b, t]['ms']:.2f} ({by_key[b, t]['tflops']:.0f})" for t in lengths]
           + [sci(by_key[b, lengths[0]]["rel_l2"])] for b in dict.fromkeys(r["backend"] for r in rows)]
  return header, table


def decode(runs):
  """One row per model: ms per token (and the floor) per batch × context, tokens/s at the largest batch."""
  names = {"sanatan_p1_184m": "SANATAN p = 1 184M", "softmax_184m": "softmax 184M, fp32 cache",
           "softmax_184m_bf16_cache": "softmax 184M, bf16 cache", "gla_182m": "GLA 182M"}
  # A decode program other than the default (``DECODE_XLA``) is a model of its own.
  rows = [{**r, "model": r["model"] if r.get("xla", "default") == "default" else f"{r['model']} [{r['xla']}]"}
          for r in runs[0]]
  grid = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
  by_key = {(r["model"], r["batch"], r["context"]): r for r in rows}
  header = ["model"] + [f"{b} × {c:,}: ms/token (floor)" for b, c in grid] + ["tokens/s, largest batch",
                                                                            "state MB / sequence"]
  table = []
  for model in dict.fromkeys(r["model"] for r in rows):
    cells = [f"{by_key[model, b, c]['ms_per_token']:.3f} ({by_key[model, b, c]['floor_ms']:.3f})"
             for b, c in grid]
    own = [r for r in rows if r["model"] == model]
    widest = max(own, key=lambda r: (r["batch"], -r["context"]))
    states = sorted({r["state_bytes_per_seq"] / 1e6 for r in own})
    state = " – ".join(f"{x:.1f}" for x in dict.fromkeys((states[0], states[-1])))
    table.append([names.get(model, model)] + cells + [f"{widest['tokens_per_s']:,.0f}", state])
  return header, table


def tpu(runs):
  """One row per (op, implementation); per T: the roofline ms, GB accessed, the ratio of the op's XLA
  form's roofline to the row's, and the temporaries; compile seconds at the shorter T."""
  rows = kernel_rows(runs[0])
  lengths = sorted({r["length"] for r in rows})
  by_key = {(r["op"], r["impl"], r["length"]): r for r in rows}
  header = (["op", "implementation"] + [f"T = {t}: roofline ms, GB, vs XLA, temporaries MiB" for t in lengths]
            + [f"compile s (T = {lengths[0]})"])
  table = []
  for op, impl in dict.fromkeys((r["op"], r["impl"]) for r in rows):
    cells = []
    for t in lengths:
      r, ref = by_key[op, impl, t], by_key.get((op, REFERENCE[op], t))
      ratio = f"{ref['roofline_s'] / r['roofline_s']:.2f}×" if ref and ref is not r else "–"
      cells.append(f"{r['roofline_s'] * 1e3:.1f} ({r['bound']}), {r['bytes_accessed'] / 1e9:.1f}, {ratio}, "
                   f"{r['temp_bytes'] / 2 ** 20:,.0f}")
    table.append([OPS[op], f"`{impl}`"] + cells + [f"{by_key[op, impl, lengths[0]]['compile_s']:.0f}"])
  return header, table


def goodput(runs):
  """One row per run of ``scripts/bench_goodput.py``: wall seconds, goodput and each phase's seconds
  (the parts of start-up, evaluation and shutdown beside their phase)."""
  rows = runs[0]
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


# ---- the current tables, by part of the document

ONE_RUN, PARTS = "2026-12-04-h200-one-run", "2026-12-04-h200-p1-bf16-parts"
ATOMIC, QUEUED = "2026-12-04-h200-atomic-parts", "2026-12-03-h200-queued-timing"
TAYLOR_GRADS = "2026-12-03-h200-taylor-grads-projection-scale"
SCAN, SPLIT = "2026-11-29-h200-chunk-scan", "2026-12-02-h200-split-and-stages"
FUSED_AUTO, TAYLOR_FUSED = "2026-12-01-h200-fused-auto", "2026-12-02-h200-taylor-fused"
AB = "a one-off A/B script: each variant compiled once, timed in alternating rounds, 8 calls per wait"
SHAPES_2048 = ("python scripts/bench_kernels.py --ops=gated,sanatan_p1,sanatan_p2,taylor "
               "--shapes=preset,wide --lengths=2048 --auto_only --fla_ops=")
GATED_TUNE = ("python scripts/bench_kernels.py --ops=gated --case=pallas --case=\"chunked (xla)\" "
              "--tune=gated --lengths=2048,32768")
P1_STEPS = {"softmax": "", "p1_fp32_parts": "fp32 parts, libdevice tanh",
            "p1_bf16_parts": "bf16 parts, libdevice tanh", "p1_bf16_parts_exp2_tanh": "bf16 parts, exp2 tanh",
            "p1_bf16_parts_exp2_tanh_kept_factors": "bf16 parts, exp2 tanh", "softmax_again": "again"}
P1_WALKS = (
    ("variant", "fwdbwd_ms", {v: v for v in ("default", "fwd 128 8w3s", "dq 32 2w3s", "dkv 128 8w2s",
                                            "dkv 32 2w3s")}),
    ("variant", "fwdbwd_ms", {v: v for v in ("default", "fwd c6 C32 v64 8w2s", "dq c6 C32 v64 8w2s",
                                            "dkv c6 C32 v32 4w2s")}),
    ("variant", "fwdbwd_ms", {"xla sums": "default (XLA sums the channel groups' parts)",
                              "atomic": "parts added by atomic adds"}),
    ("case", "ms", {"fused (main)": "default",
                    "dim-split r64x16x4x3": "programs by 16 head dims, all channels"}))
GATED_TILES = {"pallas": "chunk 16, 8 warps, Pallas chunk scan (the tiles)",
               "pallas (C=32, 8 warps)": "chunk 32",
               "pallas (C=16, 8 warps, scan xla)": "XLA's scan",
               "pallas (C=32, 8 warps, scan xla)": "chunk 32, XLA's scan",
               "pallas (C=16, 8 warps, separate True)": "dq and dk/dv from separate kernels",
               "chunked (xla)": "`chunked`"}
BLOCKED_TILES = ("64x64 4w 3s", "64x64 4w 2s", "64x64 4w 4s", "64x32 4w 3s", "128x64 8w 3s")
FUSED_TILES = tuple(f"C={c}, F={f}, BV={v}, fwd {a}, dq {q}, dkv {b}, intra {i}" for c, f, v, a, q, b, i in (
    (128, 64, 64, "8w 3s", "8w 3s", "8w 3s", "8w 2s"), (64, 64, 64, "4w 3s", "4w 3s", "8w 3s", "4w 2s"),
    (64, 64, 64, "4w 4s", "4w 4s", "8w 3s", "4w 2s"), (64, 64, 64, "4w 2s", "4w 2s", "8w 2s", "4w 2s"),
    (64, 32, 64, "4w 3s", "4w 3s", "8w 3s", "4w 2s"), (64, 32, 32, "4w 3s", "4w 3s", "4w 3s", "4w 2s")))
FLASH_FEATURES = {"pallas_flash": "the factor kernels' features (6 channels)",
                  "pallas_flash (xla features)": "XLA's features (4 and 3 channels)"}

TABLES = (
    Table(
        "Training", "Train step of the paper presets",
        "`lmcore.train` step (model, fused loss, AdamW) on synthetic tokens, batch 32 × 2048, 8 timed steps "
        "after 2; each preset at its own micro-batch; every mixer at `implementation=\"auto\"` unless the "
        "variant says otherwise; \"vs softmax\": tok/s over the softmax row's.",
        (Source(f"{ONE_RUN}/train", ("train_step.jsonl",),
                "python scripts/bench_train.py --steps=8 --presets=softmax_184m,sanatan_p1_184m,"
                "sanatan_p2_184m,gla_182m,cyfa,based_360m,"
                "sanatan_p1_184m@model.mixers.sanatan.implementation=chunked,"
                "based_1p3b@train.grad_accum=2"),),
        train()),
    Table(
        "Training", "SANATAN p = 1 train step",
        "The 184M p = 1 step against softmax's, batch 32 × 2048, 10 timed steps. Run b times the channel "
        "groups' parts in fp32 or bf16, tanh by libdevice or by exp2 (the kernels' constants: bf16 parts, "
        "exp2 tanh) and kept factors (`chunked_remat=False`), without the entry points' XLA flags; \"vs "
        "softmax\" over the mean of its two softmax rows.",
        (Source(PARTS, ("train_step_profiled.jsonl",),
                "python scripts/bench_train.py --presets=softmax_184m,sanatan_p1_184m --steps=10 "
                "--profile=DIR"),
         Source(f"{PARTS}/step_second", tuple(f"{name}.jsonl" for name in P1_STEPS),
                AB + " (`benchmarks.train_step.run`)")),
        train(P1_STEPS)),
    Table(
        "Training", "XLA's GEMMs on cuBLAS",
        "The same steps with XLA's Triton GEMMs (run a) and with cuBLAS (run b, "
        "`--xla_gpu_enable_triton_gemm=false`, which `lmcore/xla_flags.py` sets); the cuBLAS rows were "
        "transcribed from the run's printed lines.",
        (Source(FUSED_AUTO, ("train_step.jsonl",),
                "python scripts/bench_train.py --steps=6 --presets=softmax_184m,sanatan_p1_184m,"
                "sanatan_p2_184m@model.mixers.sanatan.implementation=pallas_flash@train.grad_accum=1",
                keep=lambda r: r["preset"] != "sanatan_p2_184m"),
         Source(FUSED_AUTO, ("train_step_cublas.jsonl",),
                "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python scripts/bench_train.py ...",
                keep=lambda r: r["preset"] != "sanatan_p2_184m")),
        gemms),
    Table(
        "Training", "Decode",
        "Prefill C − 128 random tokens, then one compiled `decode` call samples 128 tokens per row "
        "(`lmcore/eval/generate.py`); ms/token is that call's median. Floor: the bf16 weights and the "
        "batch's state read once at the HBM bandwidth. The 32,768-token rows drop the position table.",
        (Source("2026-12-01-h200-train-decode", ("decode.jsonl",),
                "python scripts/bench_decode.py "
                "--models=sanatan_p1_184m,softmax_184m,softmax_184m_bf16_cache,gla_182m --batches=1,64 "
                "--contexts=1024,2048 --long_contexts=32768 --max_seconds=200",
                keep=lambda r: r["context"] != 1024),),
        decode),
    Table(
        "GPU kernels", "SANATAN p = 1 kernels",
        "fwd / **fwd+bwd** ms, 12 heads of 64, bf16, 16,384 tokens per call; in brackets `chunked`'s fwd+bwd "
        "time over the row's.",
        (Source(PARTS, ("kernels.jsonl",),
                "python scripts/bench_kernels.py --ops=sanatan_p1,softmax --lengths=2048,8192,32768 "
                "--auto_only "
                "--fla_ops= --repeats=20"),),
        kernels()),
    Table(
        "GPU kernels", "Kernels against XLA, FLA and cuDNN",
        "fwd / **fwd+bwd** ms, bf16, 16,384 tokens per call; heads: softmax, SANATAN and gated 12 × 64 × 64 "
        "(per-key gates), Taylor 16 × d' 16 × dv 64; FLA 0.6.0 on the same inputs. In brackets: the op's XLA "
        "form's fwd+bwd time over the row's (SANATAN p = 2: `parallel`, the rest `chunked`). SANATAN p = 1's "
        "`pallas_fused` is in the table above (its current kernels, a later run).",
        (Source(ONE_RUN, ("kernels_*.jsonl", "fla.jsonl"),
                "bash scripts/bench_gpu.sh DIR 545, then CHECK_OPS= FLA_OPS= bash scripts/bench_gpu.sh DIR "
                "420"),),
        kernels(drop=(("sanatan_p1", "pallas_fused"), ("sanatan_p2", "pallas_flash, XLA's features"),
                      ("sanatan_p1", "parallel"), ("taylor", "parallel")))),
    Table(
        "GPU kernels", "Kernel agreement",
        "Each compiled kernel against the op's XLA form in fp32 at full matmul precision, T = 1000, B = 2: "
        "relative L2 of the output / the worst input gradient. Limit 1e-5 (fp32 inputs), 2e-3 or the XLA "
        "form's own bf16 error (bf16 inputs); `tf32` / `float32`: `kernel_precision`.",
        (Source(PARTS, ("agreement.jsonl",), "python scripts/check_kernels.py --ops=sanatan_p1 --length=1000 "
                "--batch=2"),
         Source(ONE_RUN, ("agreement.jsonl",), "python scripts/check_kernels.py --length=1000 --batch=2 (in "
                "bash scripts/bench_gpu.sh)")),
        agreement((("sanatan_p1",), ("sanatan_p2", "gated", "taylor")))),
    Table(
        "GPU kernels", "Pallas-Triton against Mosaic GPU",
        "One op written for both GPU backends (`benchmarks/backend_probe.py`: the intra-chunk block "
        "mask(q kᵀ) v, C = 64, K = V = 64, bf16), 6,291,456 tokens, XLA alongside.",
        (Source(SCAN, ("backends.jsonl",),
                "python scripts/bench_backends.py --tokens=6291456 --repeats=50"),),
        backends),
    Table(
        'What "auto" prefers', "Gated linear attention heads",
        "fwd+bwd ms at 8 × 2048, the kernel against `chunked` per head shape H × K × V; run b: the paper "
        "presets' heads.",
        (Source("2026-12-02-h200-wide-heads", ("gated.jsonl",), "python scripts/bench_kernels.py --ops=gated "
                "--shapes=wide --lengths=2048 --auto_only --fla_ops="),
         Source(FUSED_AUTO, ("shapes_2048.jsonl",), SHAPES_2048)),
        shapes({"gated": ("pallas_triton", "chunked")}, ("`pallas_triton`", "`chunked`"))),
    Table(
        'What "auto" prefers', "SANATAN heads",
        "fwd+bwd ms at 8 × 2048, the kernel against the XLA form \"auto\" falls back to (p = 1: "
        "`pallas_fused` / `chunked`; p = 2: `pallas_flash` / `parallel`).",
        (Source(FUSED_AUTO, ("shapes_2048.jsonl",), SHAPES_2048),),
        shapes({"sanatan_p1": ("pallas_fused", "chunked"), "sanatan_p2": ("pallas_flash", "parallel")},
               ("kernel", "XLA"))),
    Table(
        'What "auto" prefers', "Taylor heads and lengths",
        "fwd+bwd ms, 16,384 tokens: the blocked kernels against the fused-chunk ones by length at the BASED "
        "presets' heads (run a), at wide heads (run b) and with `chunked` (run c).",
        (Source(TAYLOR_GRADS, ("blocked_vs_fused.jsonl",),
                "python scripts/bench_kernels.py --lengths=4096,8192,2048 --ops=taylor --fla_ops= "
                "--case=pallas_blocked --case=pallas_fused --shapes=preset --queue=8 --repeats=20"),
         Source(TAYLOR_GRADS, ("wide_4096.jsonl",), "the same at --lengths=4096 --shapes=wide"),
         Source(TAYLOR_FUSED, ("shapes.jsonl",), "python scripts/bench_kernels.py --ops=taylor --fla_ops= "
                "--shapes=preset,wide --lengths=8192,2048 --repeats=10", keep=lambda r: r["length"] == 8192)),
        shapes({"taylor": ("pallas_blocked", "pallas_fused", "chunked")},
               ("`pallas_blocked`", "`pallas_fused`", "`chunked`"))),
    Table(
        'What "auto" prefers', "Spans",
        "fwd+bwd ms of the fused-chunk kernels with each row cut into G spans (run a), and with the spans' "
        "totals summed over parts of 512 to 2048 tokens (run b, medians of ten rounds). \"auto\" takes the "
        "smallest power of two G with B · H · G ≥ 128 and spans of at least 2048 tokens.",
        (Source("2026-12-03-h200-spans", ("kernels.jsonl",),
                "python scripts/bench_kernels.py --ops=sanatan_p1,taylor,softmax --fla_ops=sanatan_p1,taylor "
                "--lengths=2048,8192,32768 --case=pallas_fused --case=pallas_blocked --case=\"softmax "
                "(cudnn)\" "
                "--tune=sanatan_p1_spans,taylor_spans --repeats=20"),
         Source("2026-12-03-h200-spans-parts", ("part_length_ops.jsonl",),
                AB + " (`spans.PART_LENGTH` set before lowering)")),
        spans),
    Table(
        "Kernel tilings", "Gated linear attention kernel tiles",
        "`pallas_triton` at 12 heads of 64, per-key gates, bf16, fwd+bwd ms, one run (its state dots in one "
        "bf16 rounding).",
        (Source(SPLIT, ("gated.jsonl",), GATED_TUNE),),
        tiles((GATED_TILES,))),
    Table(
        "Kernel tilings", "SANATAN p = 1 walks: tilings and layouts",
        "`pallas_fused` fwd+bwd ms, medians of alternating rounds; each run's first row is the default "
        "tiling of its code. fwd / dq / dkv: the walk changed; 128, 32: tokens per chunk; v32: value tile; "
        "c6: six channels per program; Nw Ms: warps, stages.",
        (Source(ATOMIC, ("walk_tilings.jsonl",), AB),
         Source(f"{ONE_RUN}/alone", ("p1_six_channels_per_program.jsonl",), AB),
         Source(ATOMIC, ("atomic_ab.jsonl",), AB),
         Source("2026-12-04-h200-p1-dim-split", ("factors_read.jsonl",), AB)),
        rounds(P1_WALKS, ("32x2048", "8x2048"))),
    Table(
        "Kernel tilings", "SANATAN p = 2 flash tilings",
        "`pallas_flash` fwd+bwd ms at 8 × 2048, 12 heads of 64, medians of eight alternating rounds. The "
        "default of the run: forward 128 × 64 on 8 warps, dq and dk/dv 128 × 32 on 8 warps, 3 stages each; "
        "the tiles: \"fwd 4w + dq loop 64 2s + dkv 4s\".",
        (Source(QUEUED, ("p2_tilings.jsonl",), AB),),
        flash_tiles),
    Table(
        "Kernel tilings", "Taylor kernel tilings",
        "fwd+bwd ms, 16 heads of d' 16, dv 64; each kernel's first row is its tiles. `pallas_blocked` (run "
        "a, the median of three processes): query × key block, warps, stages. `pallas_fused` (run b): chunk "
        "C, feature rows F, value tile BV, then warps and stages of the forward, dq, dk/dv and intra-chunk "
        "kernels.",
        (Source(QUEUED, ("taylor_blocked.jsonl",), "python scripts/bench_kernels.py --ops= --fla_ops= "
                "--lengths=2048 --tune=taylor_blocked --queue=8"),
         Source(TAYLOR_FUSED, ("fused_tune_8192.jsonl", "fused_tune_32768.jsonl"),
                "python scripts/bench_kernels.py --ops= --tune=taylor_fused --lengths=8192,32768")),
        tiles(({f"pallas_blocked ({t})": f"`pallas_blocked` {t}" for t in BLOCKED_TILES},
               {f"pallas_fused ({t})": f"`pallas_fused` {t}" for t in FUSED_TILES}))),
    Table(
        "Kernel tilings", "Chunk scan",
        "The between-chunk recurrence alone (`lmcore/ops/common/chunk_scan.py`) on the state stacks of a "
        "chunk-parallel kernel, forward, states written in bf16.",
        (Source(SCAN, ("chunk_scan.md",), "python scripts/bench_chunk_scan.py"),),
        chunk_scan),
    Table(
        "Fixed choices", "SANATAN p = 1: bf16 parts and fast tanh",
        "`pallas_fused` fwd+bwd ms, 12 heads of 64, bf16, medians of four alternating rounds, and the "
        "relative L2 error against the fp32 `chunked` op.",
        (Source(PARTS, ("op_parts_tanh.jsonl",), AB),),
        bf16_parts),
    Table(
        "Fixed choices", "SANATAN p = 1: fast sine and cosine",
        "`pallas_fused` fwd+bwd ms with the factor kernels' exact or approximate sine, cosine and division "
        "(16-bit operands), medians of two rounds; the factor kernels alone at 1 × 32768.",
        (Source("2026-12-03-h200-constant-channel-fast-factors", ("ab_fast.jsonl",), AB),),
        fast_factors),
    Table(
        "Fixed choices", "SANATAN p = 2: flash features",
        "`pallas_flash` fwd+bwd ms with each feature path, alone on the device, medians of four alternating "
        "rounds.",
        (Source(f"{ONE_RUN}/alone", ("p2_flash_features_alone.jsonl",), AB),),
        rounds((("case", "fwdbwd_ms", FLASH_FEATURES),), ("8x2048", "1x32768"))),
    Table(
        "Fixed choices", "Gated linear attention: split state dots",
        "Relative L2 against the fp32 `chunked` op at T = 1000, B = 2 (run a), and fwd+bwd ms of the same "
        "kernels (run b, 12 heads of 64, per-key gates, bf16).",
        (Source(SPLIT, ("gate_err.jsonl",),
                "a one-off copy of scripts/check_kernels.py's check for each variant"),
         Source(SPLIT, ("gated.jsonl",), GATED_TUNE)),
        split_state),
    Table(
        "TPU kernels", "TPU v4 ahead of time",
        "Compiled by libtpu for the 4 chips of a v4-8 on a CPU host, forward + backward, 8 rows of T per "
        "chip, bf16: the program's FLOPs and bytes (each loop body times its trips; a kernel's own "
        "`pl.CostEstimate`), the roofline (275 TFLOP/s, 1.2 TB/s) and its ratio to the op's XLA form, "
        "temporaries, compile seconds. Estimates from the compiler's cost model, not timings.",
        (Source("2026-12-02-tpu-v4-aot", ("tpu_aot.jsonl",), "python scripts/bench_tpu_aot.py",
                keep=lambda r: r["op"] != "sanatan_p1" or "C=64" not in r["impl"]),),
        tpu),
)

INTRO = """\
# Benchmarks

The current measurements, one table per topic, each with its device, date and the command that wrote its
rows (`docs/bench/<run>/`, whose README says how). Generated by `python scripts/bench_report.py`; do not
edit by hand. A comparison is made within one run; a "run" column marks a table that gathers several."""

HOW_TO = """\
## How to measure

GPU rows: one NVIDIA H200, JAX 0.11.2 (Pallas-Triton kernels), bf16 inputs, fp32 accumulation unless a row
says otherwise. Kernel rows time 16,384 tokens per call (B = 16384 / T), each function compiled first: the
median of 20 samples after 4 warm-up calls, a sample enqueuing 8 calls and waiting once (GPU time,
`benchmarks/rows.py`'s `time_fn`). FLA 0.6.0 (torch 2.11, Triton 3.6) runs on the same inputs.
`bash scripts/bench_gpu.sh DIR` runs the kernel agreement check and the kernel timings side by side on one
GPU and `python scripts/bench_report.py DIR` prints them in the layout below; `scripts/bench_kernels.py`
(`--ops`, `--lengths`, `--shapes=preset,wide`, `--auto_only`, `--tune=OP`), `scripts/check_kernels.py`,
`scripts/bench_train.py`, `scripts/bench_decode.py` and `scripts/bench_tpu_aot.py` write JSONL rows. To
replace a table, copy the rows into `docs/bench/<date>-<device>-<topic>/` with a README (a `Device:` line,
the commands), point the table's sources in `scripts/bench_report.py` at them, delete the directory no
table cites any more and run `python scripts/bench_report.py` (`tests/test_bench_report.py` checks that
this file is what it gives)."""

HISTORY = """\
## History

Each table holds the latest measurement of its topic; earlier measurements, the rows of variants not kept
and the narrative that went with them are in git history (`git log -p -- docs/bench docs/BENCHMARKS.md`)."""


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def timing(rows: list[dict]) -> str:
  """", each call waited on alone" for kernel timing rows taken one call per wait (``queue`` 1 or absent)."""
  queues = {r.get("queue") or 1 for r in rows if "fwdbwd_ms" in r and "op" in r and "impl" in r}
  return ", each call waited on alone" if queues == {1} else ""


def source_line(source: Source, rows: list[dict], root: str, run: str) -> str:
  command = source.command if source.command.startswith("a one-off") else f"`{source.command}`"
  return (f"- {run}{source.device(root)}, {source.date}: {command}{timing(rows)} "
          f"(`docs/bench/{source.directory}/`)")


def render_table(table: Table, root: str) -> list[str]:
  runs = [source.rows(root) for source in table.sources]
  header, rows = table.build(runs)
  several = len(runs) > 1
  sources = [source_line(s, r, root, f"run {RUNS[i]}: " if several else "")
             for i, (s, r) in enumerate(zip(table.sources, runs))]
  return [f"### {table.title}", table.about, *sources, "", *markdown(header, rows), ""]


def generate(root: str = BENCH) -> str:
  """The whole of docs/BENCHMARKS.md from the records under ``root``."""
  lines, part = [INTRO, "", HOW_TO, ""], ""
  for table in TABLES:
    if table.part != part:
      lines.append(f"## {table.part}")
      part = table.part
    lines += render_table(table, root)
  return "\n".join(lines + [HISTORY, ""])


def print_run(directory: str) -> None:
  """The kernel and agreement tables of a new run directory (``bash scripts/bench_gpu.sh DIR``)."""
  paths = sorted(glob.glob(os.path.join(directory, "*.jsonl")))
  rows = {os.path.basename(p): jsonl_rows(p) for p in paths}
  timing = [r for name, rs in rows.items() if name != "agreement.jsonl" for r in rs if "fwdbwd_ms" in r]
  checks = rows.get("agreement.jsonl", [])
  if not timing and not checks:
    raise app.UsageError(f"no rows in {directory}; run `bash scripts/bench_gpu.sh {directory}` first")
  if checks:
    ops = tuple(dict.fromkeys(r["op"] for r in checks))
    print("\n".join(markdown(*agreement((ops,))([checks]))), end="\n\n")
  if timing:
    print("\n".join(markdown(*kernel_table(kernel_rows(timing)))), flush=True)
  if _PLOT.value and timing:
    from types import SimpleNamespace
    from benchmarks import plots
    plots.plot_tokens_per_s([SimpleNamespace(**r) for r in kernel_rows(timing)], _PLOT.value,
                            title=f"kernels, {directory}")
    print(f"wrote {_PLOT.value}")


def main(argv):
  if len(argv) > 2:
    raise app.UsageError("usage: python scripts/bench_report.py [--check] | "
                         "python scripts/bench_report.py DIR [--plot=PATH]")
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
