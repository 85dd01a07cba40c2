"""Where the kernel time of a traced train step goes, from a ``jax.profiler`` trace (``scripts/bench_train.py
--profile``).

``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes ``dir/plugins/profile/<run>/`` with
``<host>.xplane.pb``, ``<host>.trace.json.gz`` and ``perfetto_trace.json.gz``: Chrome trace events
(``{"traceEvents": [...]}``). Metadata events (``"ph": "M"``) name each process (``process_name``: one
per device, ``/device:GPU:0``, and one per host, ``/host:CPU``) and each of its threads (``thread_name``);
complete events (``"ph": "X"``, ``ts`` and ``dur`` in µs) are the work. The rows that hold device work:

  * GPU: the ``Stream #N(...)`` threads of a ``/device:GPU:*`` process, one CUPTI event per kernel,
    memcpy or memset, named after the CUDA kernel, with the HLO instruction (``hlo_op``) and module
    (``hlo_module``) of XLA's launch annotation in its args. Other threads of the process (``XLA Ops``,
    ``XLA Modules``, ``Steps``, …) summarise the same time and are skipped. While a trace is active XLA
    runs its command buffers (CUDA graphs) op by op, so that each kernel keeps its annotation: the gaps
    between kernels can differ from the timed steps', the kernels themselves are the same;
  * TPU: the ``XLA Ops`` thread of a ``/device:TPU:*`` process;
  * CPU backend (no device process): the XLA ops run on host threads, the events whose args carry
    ``hlo_op``.

Each op is put in one category by the first row of ``CATEGORY_PATTERNS`` whose pattern matches, and in
one scope by ``SCOPE_PATTERNS``; both read the op's HLO instruction in the compiled step
(``compiled.as_text()``): its opcode, custom-call target and fusion kind, and its ``op_name``, the JAX
name stack, which carries the named scopes of the model (``mixer``, ``mlp``), the loss
(``cross_entropy``) and the update (``optimizer``), and ``transpose(...)`` for the backward pass.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
from typing import Any

# (category, field, pattern): an op takes the category of the first row whose regular expression is found
# (case-insensitive) in the field. "kernel": the kernel's (or CPU op's) name, its HLO instruction's name,
# opcode, custom-call target and fusion kind, e.g. "nvjet_tst_128x256 custom-call.3 custom-call
# __cublas$gemm"; "scope": the instruction's op_name, e.g. "jit(train_step)/transpose(jvp(mixer))/mul".
# The scope rows come before "matmul": the loss's and the update's matmuls count as loss and optimizer.
CATEGORY_PATTERNS = (
    ("collective", "kernel", r"nccl|all-?reduce|all-?gather|reduce-?scatter|all-?to-?all|collective-?permute"
                             r"|(^|\W)(send|recv)(\W|$)"),
    ("pallas/triton", "kernel", r"__gpu\$xla\.gpu\.triton|mosaic|tpu_custom_call|pallas"
                                r"|^_\w+_kernel(_\d*)?\b"),  # a Pallas kernel's function name (_dkv_kernel;
    # a second call of one kernel in a step may carry a suffix, _factors_kernel_)
    ("pallas/triton", "scope", r"pallas_call"),
    ("attention", "kernel", r"cudnn|fmha|flash|sdpa|dot_product_attention"),
    ("loss", "scope", r"\bcross_entropy\b"),
    ("optimizer", "scope", r"\boptimizer\b"),
    ("matmul", "kernel", r"gemm|cublas|cutlass|xmma|nvjet|wgmma|matmul|(^|\W|_)dot(\W|_|$)"
                         r"|ynn_fusion|onednn"),
    ("copy/transpose", "kernel", r"copy|transpose|memcpy|memset|concatenate|dynamic[-_]?update[-_]?slice"
                                 r"|(^|\W|_)(slice|pad)(\W|_|$)"),
    ("elementwise/reduction", "kernel", r"fusion|reduce|wrapped_|convert|broadcast|iota|select|scatter|gather"
                                        r"|add|multiply|subtract|divide|exp|log|tanh|sqrt|negate|maximum"
                                        r"|minimum|compare|power|softmax"),
)
OTHER = "other"
CATEGORIES = tuple(dict.fromkeys(c for c, _, _ in CATEGORY_PATTERNS)) + (OTHER,)

# (scope, pattern on the op_name): the part of the step an op belongs to; ``OTHER`` for the rest
# (embeddings, the final norm, gradient accumulation and norm).
SCOPE_PATTERNS = (
    ("mixer", r"\bmixer\b"),
    ("mlp", r"\bmlp\b"),
    ("loss", r"\bcross_entropy\b"),
    ("optimizer", r"\boptimizer\b"),
)
SCOPES = tuple(s for s, _ in SCOPE_PATTERNS) + (OTHER,)


@dataclasses.dataclass(frozen=True)
class Op:
  """One device op (kernel) of the trace: where it ran, when (µs) and what it was."""
  row: tuple[Any, Any]  # (pid, tid)
  ts: float
  dur: float
  name: str
  hlo_op: str = ""
  hlo_module: str = ""
  op_name: str = ""  # from the trace's args (a GPU kernel's annotation), used where the HLO has none


@dataclasses.dataclass(frozen=True)
class HloOp:
  """What the compiled module says about one instruction."""
  kind: str  # opcode, custom-call target and fusion kind, space-joined
  op_name: str  # the metadata's op_name ("" without metadata)


@dataclasses.dataclass
class Breakdown:
  """Kernel time per traced step and device (the mean over devices), in ms, by category, by scope and by
  kernel."""
  source: str  # which trace rows were read
  steps: int
  devices: int  # devices with ops (1 on the CPU backend)
  rows: int
  op_ms: float  # Σ op durations per step
  busy_ms: float  # their union over time per step (ops on parallel rows of a device overlap)
  ops_per_step: float
  categories: list[dict[str, Any]]  # category, ms, share, count (per step)
  scopes: list[dict[str, Any]]  # scope, ms, share, forward_ms, backward_ms, outside_ms
  top: list[dict[str, Any]]  # kernel, category, scope, count, ms, mean_us, share
  step_ms: float | None = None  # the timed step, for comparison
  note: str = ""


def load_trace(log_dir: str) -> dict[str, Any]:
  """The trace JSON of the newest run under ``log_dir/plugins/profile/`` (``perfetto_trace.json.gz``,
  else ``*.trace.json.gz``)."""
  runs = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*")), key=os.path.getmtime)
  for run in reversed(runs):
    for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):
      files = sorted(glob.glob(os.path.join(run, pattern)))
      if files:
        with gzip.open(files[0], "rt") as f:
          return json.load(f)
  raise FileNotFoundError(f"no trace JSON under {os.path.join(log_dir, 'plugins', 'profile')}")


def row_names(events: list[dict]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
  """Process names by pid and thread names by (pid, tid), from the metadata events."""
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    name = str(e.get("args", {}).get("name", ""))
    if e.get("name") == "process_name":
      processes[e.get("pid")] = name
    elif e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = name
  return processes, threads


_DEVICE_PROCESS = re.compile(r"^/device:(GPU|TPU)", re.I)


def device_rows(events: list[dict]) -> tuple[set[tuple[Any, Any]] | None, str]:
  """The (pid, tid) rows that hold device ops and what they are; ``None`` when the trace has no GPU or
  TPU process (the CPU backend: ops are the host events that name an HLO op)."""
  processes, threads = row_names(events)
  devices = {pid for pid, name in processes.items() if _DEVICE_PROCESS.match(name)}
  if not devices:
    return None, "host threads running XLA ops (CPU backend)"
  for prefix, what in (("Stream", "GPU streams"), ("XLA Ops", "XLA Ops rows")):
    rows = {row for row, name in threads.items() if row[0] in devices and name.startswith(prefix)}
    if rows:
      return rows, f"{what} of {', '.join(sorted(processes[pid] for pid in devices))}"
  return set(), f"no op rows in {', '.join(sorted(processes[pid] for pid in devices))}"


def op_events(events: list[dict], rows: set[tuple[Any, Any]] | None, module: str = "") -> list[Op]:
  """The device ops of ``rows`` (``None``: host events naming an HLO op), innermost only (an event that
  contains another of its row is a container, e.g. a while loop on the CPU backend); of ``module``
  only where the events name their module and some are of it."""
  ops = []
  for e in events:
    if e.get("ph") != "X" or not e.get("dur"):
      continue
    row, args = (e.get("pid"), e.get("tid")), e.get("args") or {}
    if rows is None:
      if "hlo_op" not in args:
        continue
    elif row not in rows:
      continue
    ops.append(Op(row, float(e["ts"]), float(e["dur"]), str(e.get("name", "")), str(args.get("hlo_op", "")),
                  str(args.get("hlo_module", "")), _trace_op_name(args)))
  if module and any(op.hlo_module == module for op in ops):
    ops = [op for op in ops if op.hlo_module in (module, "")]
  return _innermost(ops)


def _trace_op_name(args: dict) -> str:
  """The op_name a GPU kernel's annotation carries (``name``: the op_name less the module's common
  prefix), if any: a name stack, not an instruction's text."""
  for key in ("name", "tf_op"):
    value = str(args.get(key, ""))
    if "/" in value and " = " not in value:
      return value
  return ""


def _innermost(ops: list[Op]) -> list[Op]:
  """``ops`` less those that contain another op of their row, in time order."""
  by_row = collections.defaultdict(list)
  for op in ops:
    by_row[op.row].append(op)
  kept = []
  for row_ops in by_row.values():
    row_ops.sort(key=lambda op: (op.ts, -op.dur))
    containers, stack = set(), []
    for i, op in enumerate(row_ops):
      while stack and row_ops[stack[-1]].ts + row_ops[stack[-1]].dur <= op.ts:
        stack.pop()
      if stack and op.ts + op.dur <= row_ops[stack[-1]].ts + row_ops[stack[-1]].dur + 1e-3:
        containers.add(stack[-1])
      stack.append(i)
    kept += [op for i, op in enumerate(row_ops) if i not in containers]
  return sorted(kept, key=lambda op: op.ts)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|[\s})\]])([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r'"kind":"([^"]*)"')


def hlo_ops(hlo_text: str) -> tuple[str, dict[str, HloOp]]:
  """The module name and every instruction of an HLO module's text (``compiled.as_text()``)."""
  module = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
  ops = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m or line.lstrip().startswith(("HloModule", "ENTRY")):
      continue
    name, rest = m.groups()
    kind = [x.group(1) for x in (_OPCODE.search(rest), _TARGET.search(rest), _FUSION_KIND.search(rest)) if x]
    op_name = _OP_NAME.search(rest)
    ops[name] = HloOp(" ".join(kind), op_name.group(1) if op_name else "")
  return (module.group(1) if module else ""), ops


def categorize(kernel: str, scope: str) -> str:
  """The category of an op from ``CATEGORY_PATTERNS`` (``kernel`` and ``scope`` as described there)."""
  fields = {"kernel": kernel, "scope": scope}
  for category, field, pattern in CATEGORY_PATTERNS:
    if re.search(pattern, fields[field], re.I):
      return category
  return OTHER


def scope_of(op_name: str) -> str:
  """The part of the step (``SCOPE_PATTERNS``) an op_name belongs to."""
  for scope, pattern in SCOPE_PATTERNS:
    if re.search(pattern, op_name):
      return scope
  return OTHER


def direction(op_name: str) -> str:
  """"backward" under ``transpose(...)`` (the VJP, with remat's recomputation), "forward" under
  ``jvp(...)``, else "outside" the gradient (the update, gradient accumulation, metrics)."""
  if "transpose(" in op_name:
    return "backward"
  return "forward" if "jvp(" in op_name else "outside"


def kernel_family(name: str) -> str:
  """A kernel's name less an instance number (``loop_add_fusion_12``, ``fusion.3`` -> ``fusion``)."""
  return re.sub(r"[._]\d+$", "", name)


def union_us(ops: list[Op]) -> float:
  """The time (µs) during which at least one op ran."""
  total, end = 0.0, float("-inf")
  for op in sorted(ops, key=lambda op: op.ts):
    start, stop = max(op.ts, end), op.ts + op.dur
    if stop > start:
      total += stop - start
    end = max(end, stop)
  return total


def classify(op: Op, hlo: dict[str, HloOp]) -> tuple[str, str, str]:
  """(category, scope, direction) of an op, from its kernel name and its HLO instruction in ``hlo``."""
  info = hlo.get(op.hlo_op, HloOp("", ""))
  op_name = info.op_name or op.op_name
  kernel = " ".join(x for x in (op.name, op.hlo_op, info.kind) if x)
  return categorize(kernel, op_name), scope_of(op_name), direction(op_name)


def summarize(trace: dict[str, Any] | list[dict], *, steps: int, hlo_text: str = "", top: int = 15,
              step_ms: float | None = None) -> Breakdown:
  """The kernel time of ``steps`` traced steps (``trace``: the JSON or its events), per step and device,
  by category, scope and kernel; ``hlo_text``: the compiled step's HLO (names the ops' scopes)."""
  events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
  module, hlo = hlo_ops(hlo_text) if hlo_text else ("", {})
  rows, source = device_rows(events)
  ops = op_events(events, rows, module)
  by_device = collections.defaultdict(list)
  for op in ops:
    by_device[op.row[0] if rows is not None else 0].append(op)
  per_step = 1.0 / (max(steps, 1) * max(len(by_device), 1))
  total_us = sum(op.dur for op in ops)
  by_category, by_scope, by_kernel = (collections.defaultdict(collections.Counter) for _ in range(3))
  for op in ops:
    category, scope, side = classify(op, hlo)
    by_category[category].update(us=op.dur, n=1)
    by_scope[scope].update({"us": op.dur, side: op.dur})
    by_kernel[(kernel_family(op.name), category, scope)].update(us=op.dur, n=1)

  def ms(us):
    return us * per_step / 1e3

  def share(us):
    return us / total_us if total_us else 0.0

  categories = [{"category": c, "ms": ms(t["us"]), "share": share(t["us"]), "count": t["n"] * per_step}
                for c, t in sorted(by_category.items(), key=lambda kv: CATEGORIES.index(kv[0]))]
  scopes = [{"scope": s, "ms": ms(t["us"]), "share": share(t["us"]), "forward_ms": ms(t["forward"]),
             "backward_ms": ms(t["backward"]), "outside_ms": ms(t["outside"])}
            for s, t in sorted(by_scope.items(), key=lambda kv: SCOPES.index(kv[0]))]
  ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1]["us"])[:top]
  kernels = [{"kernel": name, "category": category, "scope": scope, "count": t["n"] * per_step,
              "ms": ms(t["us"]), "mean_us": t["us"] / t["n"], "share": share(t["us"])}
             for (name, category, scope), t in ranked]
  busy_us = sum(union_us(device_ops) for device_ops in by_device.values())
  note = "" if ops else f"no device ops found ({source}); was the device tracer (CUPTI on GPUs) available?"
  return Breakdown(source, steps, max(len(by_device), 1), len({op.row for op in ops}), ms(total_us),
                   ms(busy_us), len(ops) * per_step, categories, scopes, kernels, step_ms, note)


def _cell(text: str, width: int = 90) -> str:
  text = text.replace("|", "\\|")
  return text if len(text) <= width else text[:width - 1] + "…"


def to_markdown(b: Breakdown, title: str) -> str:
  """The breakdown as a heading, a summary line and three tables (category, scope, top kernels)."""
  timed = "" if b.step_ms is None else f"; the timed step took {b.step_ms:.2f} ms"
  devices = "" if b.devices == 1 else f", per device (the mean of {b.devices})"
  lines = [f"### Kernel time per train step: {title}", "",
           f"{b.steps} traced steps, {b.source} ({b.rows} rows){devices}: ops {b.op_ms:.3f} ms/step "
           f"(Σ durations, {b.ops_per_step:.0f} ops), busy {b.busy_ms:.3f} ms/step (their union){timed}."]
  if b.note:
    lines += ["", b.note]
  lines += ["", "| category | ms/step | share | ops/step |", "|---|---|---|---|"]
  lines += [f"| {c['category']} | {c['ms']:.3f} | {c['share']:.1%} | {c['count']:.0f} |"
            for c in b.categories]
  lines.append(f"| total | {b.op_ms:.3f} | {1 if b.categories else 0:.0%} | {b.ops_per_step:.0f} |")
  lines += ["", "| scope | ms/step | share | forward ms | backward ms | outside the gradient ms |",
            "|---|---|---|---|---|---|"]
  lines += [f"| {s['scope']} | {s['ms']:.3f} | {s['share']:.1%} | {s['forward_ms']:.3f} | "
            f"{s['backward_ms']:.3f} | {s['outside_ms']:.3f} |" for s in b.scopes]
  lines += ["", f"Top {len(b.top)} kernels:", "",
            "| kernel | category | scope | calls/step | ms/step | mean µs | share |",
            "|---|---|---|---|---|---|---|"]
  lines += [f"| `{_cell(k['kernel'])}` | {k['category']} | {k['scope']} | {k['count']:g} | {k['ms']:.3f} | "
            f"{k['mean_us']:.1f} | {k['share']:.1%} |" for k in b.top]
  lines += ["", "Categories: the first match in `benchmarks/profile_summary.py`'s `CATEGORY_PATTERNS` (the "
            "loss's and the update's matmuls count as loss and optimizer); scopes: the named scopes in the "
            "ops' op_name; backward: ops under `transpose(…)` (with remat's recomputation)."]
  return "\n".join(lines)


def write(b: Breakdown, out_dir: str, stem: str, title: str) -> tuple[str, str]:
  """``<out_dir>/<stem>_breakdown.md`` and ``.json``; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  md, js = (os.path.join(out_dir, f"{stem}_breakdown.{ext}") for ext in ("md", "json"))
  with open(md, "w") as f:
    f.write(to_markdown(b, title) + "\n")
  with open(js, "w") as f:
    json.dump(dataclasses.asdict(b), f, indent=1)
  return md, js


def file_stem(*parts: str) -> str:
  """A file name from a preset and variant ("sanatan:tiny", "train.loss_impl=fused" -> ...)."""
  return re.sub(r"[^\w.\-=]+", "_", "_".join(p for p in parts if p)).strip("_")
