"""What libtpu's compiler says about the attention ops' TPU paths, compiled on any host with libtpu
(``scripts/bench_tpu_aot.py``).

Each case is one op's forward+backward, ``benchmarks.harness.fwd_bwd`` (the value and gradient of
Σ o · do with respect to every array argument, as every op benchmark times it), lowered with abstract inputs for every chip of a TPU
slice and compiled by libtpu on the CPU; no TPU is needed. The batch is split over the slice's chips
(a "data" mesh axis, ``batch`` rows per chip), so the Mosaic kernels run under their ``shard_map``
as in training and every number is per chip. Per case: compile seconds (tracing, lowering and
compiling), the executable's ``cost_analysis()`` (FLOPs, transcendentals, bytes accessed, and
libtpu's own time estimate "optimal_seconds"), ``memory_analysis()``'s temporaries, and a roofline
max(FLOPs / peak, bytes / HBM bandwidth) from ``CHIPS``.

How far to trust it. None of this is a timing. XLA's cost model sees nothing inside a Mosaic
kernel (a custom call) except the ``pl.CostEstimate`` the kernel passes: the matmul FLOPs its blocks
do, padding included, its transcendentals and the bytes its blocks move; rows whose program holds
a kernel ("kernel estimate" in the table) add those estimates to XLA's count of the code around the
kernels. XLA counts the body of a while loop once, whatever its trip count (a ``lax.scan`` of 16
matmuls costs what one does), which would undercount the XLA forms that loop over chunks or blocks:
``loop_costs`` adds each body's cost (XLA's own analysis of that computation) times its trip count
less one, nested loops multiplied through, and the table lists the trip counts. A ``lax.cond`` is
counted as its costlier branch.
libtpu's "optimal_seconds" is reported as it comes (each loop body once; negative where libtpu has
no estimate for some instruction of the program).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from based_jax.ops.taylor_attention import xla as taylor_xla
from benchmarks import harness
from benchmarks.rows import append_row, fmt
from lmcore.errors import UserError

F32 = jnp.float32
DATA = "data"  # the mesh axis the batch is split over (one of shard_map.BATCH_AXES)
TAYLOR_XLA = f"chunked (XLA, C={taylor_xla.CHUNK})"  # Taylor's XLA form at its default chunk


@dataclasses.dataclass(frozen=True)
class Chip:
  peak_flops: float  # dense bf16 FLOP/s
  hbm_bytes_per_s: float


# Per-chip peaks from Google Cloud's TPU system-architecture pages (cloud.google.com/tpu/docs/v4,
# /v5e, /v5p, /v6e): bf16 TFLOP/s and HBM bandwidth, keyed by the device_kind libtpu reports.
CHIPS = {
    "TPU v4": Chip(275e12, 1.2e12),
    "TPU v5 lite": Chip(197e12, 0.819e12),
    "TPU v5": Chip(459e12, 2.765e12),
    "TPU v6 lite": Chip(918e12, 1.64e12),
}


@dataclasses.dataclass(frozen=True)
class Case:
  """One op's implementation: ``fn(*args) -> o``, its arguments' per-chip shapes and which of them
  are split over the chips (their first axis is the batch)."""

  op: str
  impl: str
  fn: Callable
  args: tuple  # ShapeDtypeStructs without shardings, one chip's batch
  batched: tuple[bool, ...]


@dataclasses.dataclass
class Result:
  """One compiled case, per chip. ``flops``, ``transcendentals`` and ``bytes_accessed`` count every
  while body once per iteration where the trip counts are known (``loops_counted``); ``xla_flops``
  and ``xla_bytes`` are ``cost_analysis()`` as reported (each body once); ``kernel_flops`` and
  ``kernel_bytes`` the part that comes from the Mosaic kernels' ``pl.CostEstimate``."""

  op: str
  impl: str
  length: int
  batch: int  # per chip
  topology: str
  devices: int
  device_kind: str = ""
  compile_s: float | None = None
  flops: float | None = None
  transcendentals: float | None = None
  bytes_accessed: float | None = None
  xla_flops: float | None = None
  xla_bytes: float | None = None
  kernel_flops: float = 0.0
  kernel_bytes: float = 0.0
  optimal_s: float | None = None  # libtpu's "optimal_seconds" as reported (negative: no estimate)
  roofline_s: float | None = None
  bound: str = ""  # "compute" or "memory": the larger roofline term
  temp_bytes: int | None = None
  loops: list[int] = dataclasses.field(default_factory=list)  # trip counts of the while loops (0: unknown)
  loops_counted: bool = True
  cost_keys: list[str] = dataclasses.field(default_factory=list)  # cost_analysis()'s own keys
  note: str = ""

  @property
  def key(self) -> tuple:
    return self.op, self.impl, self.length, self.batch, self.topology


def _shapes(batch: int, length: int, heads: int, *widths: int, dtype) -> tuple:
  return tuple(jax.ShapeDtypeStruct((batch, length, heads, w), dtype) for w in widths)


def sanatan_p1_cases(batch: int, length: int, dtype) -> list[Case]:
  """SANATAN p = 1: the Mosaic kernels ("pallas_tpu", chunk 128, state carried in VMEM) against XLA
  "chunked" (every chunk at once; C = 64 and its heuristic chunk) and the plain einsum chunked
  baseline (``benchmarks.plain_chunked``, C = 64)."""
  from benchmarks.plain_chunked import plain_chunked
  from lmcore.ops.common.backend import ChunkTiles
  from sanatan_jax import sanatan_attention
  from sanatan_jax.ops.sanatan_attention import xla

  H, d = harness.HEADS, harness.HEAD_DIM
  args = _shapes(batch, length, H, d, d, d, dtype=dtype) + (jax.ShapeDtypeStruct((H, d), F32),) * 2

  def op(impl, tiles=None):
    return lambda q, k, v, w, l: sanatan_attention(q, k, v, w, l, implementation=impl, tiles=tiles)[0]

  impls = {"pallas_tpu (Mosaic, C=128)": op("pallas_tpu"),
           "chunked (XLA, C=64)": op("chunked", ChunkTiles(harness.CHUNK)),
           f"chunked (XLA, C={xla.CHUNK})": op("chunked"),
           "plain chunked (XLA baseline, C=64)": plain_chunked}
  return [Case("sanatan_p1", name, fn, args, (True,) * 3 + (False,) * 2) for name, fn in impls.items()]


def sanatan_p2_cases(batch: int, length: int, dtype) -> list[Case]:
  """SANATAN p = 2: XLA "parallel" (query-row blocks, recomputing backward), the TPU path; no Mosaic
  kernel runs p = 2."""
  from sanatan_jax import sanatan_attention

  H, d = harness.HEADS, harness.HEAD_DIM
  args = _shapes(batch, length, H, d, d, d, dtype=dtype) + (jax.ShapeDtypeStruct((H, d), F32),) * 2
  fn = lambda q, k, v, w, l: sanatan_attention(q, k, v, w, l, p=2, implementation="parallel")[0]
  return [Case("sanatan_p2", "parallel (XLA)", fn, args, (True,) * 3 + (False,) * 2)]


def gated_cases(batch: int, length: int, dtype) -> list[Case]:
  """Gated linear attention with per-key-channel gates: the Mosaic kernels (chunk 128, sub-chunks of
  16) against XLA "chunked" (C = 64)."""
  from lmcore.ops.common.backend import ChunkTiles
  from lmcore.ops.gated_linear_attention import gated_linear_attention
  from lmcore.ops.gated_linear_attention.pallas_mosaic_tpu import LANES, MosaicTiles

  H, K = harness.HEADS, harness.HEAD_DIM
  args = _shapes(batch, length, H, K, K, K, dtype=dtype) + _shapes(batch, length, H, K, dtype=F32)

  def op(impl, tiles):
    return lambda q, k, v, g: gated_linear_attention(q, k, v, g, implementation=impl, tiles=tiles)[0]

  impls = {"pallas_tpu (Mosaic, C=128)": op("pallas_tpu", MosaicTiles(chunk=LANES)),
           "chunked (XLA, C=64)": op("chunked", ChunkTiles(harness.CHUNK))}
  return [Case("gated", name, fn, args, (True,) * 4) for name, fn in impls.items()]


def taylor_cases(batch: int, length: int, dtype) -> list[Case]:
  """BASED Taylor attention: the Mosaic kernels ("pallas_tpu", chunk 128, compact features 153 → 256
  lanes) against XLA "chunked" (every chunk at once, at its default chunk)."""
  from based_jax import taylor_linear_attention
  from based_jax.ops.taylor_attention.pallas_mosaic_tpu import LANES, MosaicTiles

  H, d, dv = harness.TAYLOR_HEADS, harness.TAYLOR_DIM, harness.HEAD_DIM
  args = _shapes(batch, length, H, d, d, dv, dtype=dtype)

  def op(impl, tiles):
    return lambda q, k, v: taylor_linear_attention(q, k, v, implementation=impl, tiles=tiles)[0]

  impls = {"pallas_tpu (Mosaic, C=128)": op("pallas_tpu", MosaicTiles(chunk=LANES)),
           TAYLOR_XLA: op("chunked", None)}
  return [Case("taylor", name, fn, args, (True,) * 3) for name, fn in impls.items()]


OPS = {"sanatan_p1": sanatan_p1_cases, "sanatan_p2": sanatan_p2_cases, "gated": gated_cases,
       "taylor": taylor_cases}
# Each op's XLA form the table's "vs reference" compares the others with.
REFERENCE = {"sanatan_p1": "chunked (XLA, C=64)", "sanatan_p2": "parallel (XLA)",
             "gated": "chunked (XLA, C=64)", "taylor": TAYLOR_XLA}


DTYPES = ("bfloat16", "float32")


def check_options(*, ops: list[str], batch: int, dtype: str) -> None:
  """Raises UserError (one line naming the flag and the fix) for options ``run`` cannot use."""
  unknown = [op for op in ops if op not in OPS]
  if unknown or not ops:
    raise UserError(f"--ops: unknown op(s) {', '.join(unknown) or '(none given)'}; choose from "
                    f"{', '.join(OPS)}.")
  if batch < 1:
    raise UserError(f"--batch={batch}: give the rows per chip, at least 1.")
  if dtype not in DTYPES:
    raise UserError(f"--dtype={dtype!r}: give one of {', '.join(DTYPES)}.")


def parse_lengths(values: list[str]) -> list[int]:
  """``--lengths`` as positive integers, or UserError."""
  try:
    lengths = [int(v) for v in values]
  except ValueError:
    lengths = []
  if not lengths or min(lengths) < 1:
    raise UserError(f"--lengths={','.join(values)}: give positive integers, e.g. --lengths=2048,8192.")
  return lengths


def chip(device) -> Chip:
  if device.device_kind not in CHIPS:
    raise UserError(f"no peak FLOP/s and HBM bandwidth known for {device.device_kind!r}; add them to "
                    f"benchmarks/tpu_aot.py's CHIPS.")
  return CHIPS[device.device_kind]


def _sharded(case: Case, mesh) -> tuple:
  batch_spec = NamedSharding(mesh, P(DATA))
  replicated = NamedSharding(mesh, P())
  return tuple(
      jax.ShapeDtypeStruct((a.shape[0] * mesh.size, *a.shape[1:]), a.dtype, sharding=batch_spec) if b
      else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
      for a, b in zip(case.args, case.batched))


def compile_fwdbwd(case: Case, mesh):
  """(compiled executable, seconds to trace, lower and compile) of ``harness.fwd_bwd`` of ``case``, the
  batch split over ``mesh``'s chips."""
  args = _sharded(case, mesh)
  step = jax.jit(harness.fwd_bwd(case.fn, len(args)))
  start = time.perf_counter()
  # Lowering reads the mesh from the context: the kernels' shard_map needs it, and from a CPU host
  # only the abstract mesh reaches them.
  with jax.set_mesh(mesh), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    out = jax.eval_shape(case.fn, *args)
    do = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=NamedSharding(mesh, P(DATA)))
    lowered = step.lower(do, *args)
  compiled = lowered.compile()
  return compiled, time.perf_counter() - start


# Compiled HLO text: a computation runs from its header line (at column 0, "{" last) to a "}" line.
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_CALLEES = re.compile(r"(?:calls|to_apply|condition|body|true_computation|false_computation)=%?([\w.\-]+)"
                      r"|branch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\swhile\(.*\bcondition=%?([\w.\-]+), body=%?([\w.\-]+)")
COST_KEYS = ("flops", "transcendentals", "bytes accessed")


@dataclasses.dataclass(frozen=True)
class Hlo:
  """A compiled module's computations (name -> lines, header to closing brace) and its entry."""

  blocks: dict
  entry: str

  @classmethod
  def parse(cls, text: str) -> Hlo:
    blocks, entry, name = {}, "", None
    for line in text.splitlines():
      if name is None:
        match = _HEADER.match(line)
        if match:
          name, entry = match.group(2), match.group(2) if match.group(1) else entry
          blocks[name] = [line]
      else:
        blocks[name].append(line)
        if line == "}":
          name = None
    return cls(blocks, entry)

  def callees(self, name: str, loops: bool = True) -> list[str]:
    """Computations ``name`` calls; without ``loops``, not the condition and body of its whiles."""
    found = []
    for line in self.blocks[name][1:]:
      loop = _WHILE.search(line)
      for match in _CALLEES.finditer(line):
        names = [match.group(1)] if match.group(1) else re.findall(r"%?([\w.\-]+)", match.group(2))
        found += [n for n in names if loops or not loop or n not in loop.groups()]
    return [n for n in found if n in self.blocks]

  def whiles(self, name: str) -> list[tuple[str, str]]:
    """(condition, body) of every while loop ``name`` runs directly or through non-loop callees."""
    found, todo, seen = [], [name], set()
    while todo:
      current = todo.pop()
      if current in seen:
        continue
      seen.add(current)
      found += [m.groups() for m in map(_WHILE.search, self.blocks[current]) if m]
      todo += self.callees(current, loops=False)
    return found

  def trip_count(self, condition: str) -> int:
    """The loop's trip count: the one integer constant its condition compares with (scans count
    from 0 to it), else 0 (unknown)."""
    text = "\n".join(self.blocks[condition])
    bounds = re.findall(r"s32\[\]\S* constant\((\d+)\)", text)
    return int(bounds[0]) if len(bounds) == 1 and "direction=LT" in text else 0

  def module_with_entry(self, name: str) -> str:
    """HLO text of a module whose entry is computation ``name`` (and what it calls)."""
    keep, todo = [], [name]
    while todo:
      current = todo.pop()
      if current not in keep:
        keep.append(current)
        todo += self.callees(current)
    lines = ["HloModule computation"]
    for block_name, block in self.blocks.items():
      if block_name in keep:
        header = block[0].removeprefix("ENTRY ")
        lines += [("ENTRY " if block_name == name else "") + header, *block[1:], ""]
    # Source locations point into the full module's stack-frame table, which this text lacks.
    return re.sub(r" stack_frame_id=\d+", "", "\n".join(lines))


def computation_cost(module_text: str) -> dict[str, float] | None:
  """XLA's HloCostAnalysis (the count ``cost_analysis()`` reports, without the TPU time estimate) of
  an HLO module's text, run on the host's CPU client; None where this jaxlib lacks the bindings.
  No public JAX API counts a single computation, hence the private module."""
  try:
    from jax._src.lib import hlo, xla_client
    analysis = xla_client._xla.hlo_module_cost_analysis(
        jax.devices("cpu")[0].client, hlo.hlo_module_from_text(module_text))
  except Exception:  # a jaxlib without these bindings, or text its parser rejects
    return None
  return {key: float(analysis.get(key, 0.0)) for key in COST_KEYS}


def loop_costs(text: str) -> tuple[dict[str, float] | None, list[int]]:
  """(what XLA's count of a compiled module leaves out by counting every while body once, the loops'
  trip counts): each body's cost times (trip count − 1), nested loops multiplied through. None when
  a trip count is unknown or the bindings are missing; ({0...}, []) for a module without loops."""
  module = Hlo.parse(text)
  trips = []
  bodies: dict[str, dict[str, float] | None] = {}

  def extra(name: str) -> dict[str, float] | None:
    total = dict.fromkeys(COST_KEYS, 0.0)
    for condition, body in module.whiles(name):
      n = module.trip_count(condition)
      trips.append(n)
      if body not in bodies:
        bodies[body] = computation_cost(module.module_with_entry(body))
      inner = extra(body)
      if not n or bodies[body] is None or inner is None:
        total = None
      if total is not None:
        for key in COST_KEYS:
          total[key] += (n - 1) * bodies[body][key] + n * inner[key]
    return total

  missing = extra(module.entry)
  return missing, trips


def kernel_costs(text: str) -> dict[str, float]:
  """The sum of the ``pl.CostEstimate``s the Mosaic kernels of a compiled module pass (backend
  configs of its tpu_custom_calls)."""
  total = dict.fromkeys(COST_KEYS, 0.0)
  pattern = r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)","bytes_accessed":"(\d+)"'
  for flops, transcendentals, bytes_accessed in re.findall(pattern, text):
    total["flops"] += float(flops)
    total["transcendentals"] += float(transcendentals)
    total["bytes accessed"] += float(bytes_accessed)
  return total


def analyse(result: Result, compiled, chip_numbers: Chip) -> Result:
  """Fills ``result`` from a compiled executable's cost and memory analyses and its HLO text."""
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  result.cost_keys = sorted(k for k in cost if "{" not in k)  # not the per-operand "bytes accessed0{}"
  result.xla_flops, result.xla_bytes = cost.get("flops", 0.0), cost.get("bytes accessed", 0.0)
  result.optimal_s = cost.get("optimal_seconds")
  text = compiled.as_text()
  missing, result.loops = loop_costs(text)
  result.loops_counted = missing is not None
  missing = missing or dict.fromkeys(COST_KEYS, 0.0)
  result.flops = result.xla_flops + missing["flops"]
  result.transcendentals = cost.get("transcendentals", 0.0) + missing["transcendentals"]
  result.bytes_accessed = result.xla_bytes + missing["bytes accessed"]
  kernels = kernel_costs(text)
  result.kernel_flops, result.kernel_bytes = kernels["flops"], kernels["bytes accessed"]
  compute_s = result.flops / chip_numbers.peak_flops
  memory_s = result.bytes_accessed / chip_numbers.hbm_bytes_per_s
  result.roofline_s = max(compute_s, memory_s)
  result.bound = "compute" if compute_s >= memory_s else "memory"
  result.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
  return result


def measure(case: Case, length: int, batch: int, topology: str, mesh) -> Result:
  """One row; a failure to lower or compile becomes the row's note."""
  device = mesh.devices.flat[0]
  result = Result(case.op, case.impl, length, batch, topology, mesh.size, device.device_kind)
  try:
    compiled, result.compile_s = compile_fwdbwd(case, mesh)
  except Exception as e:  # a kernel libtpu rejects, an out-of-memory plan: report it, keep going.
    result.note = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return result
  return analyse(result, compiled, chip(device))


def load(path: str) -> dict[tuple, Result]:
  """Rows of a JSONL file by key (the last of each key wins); {} for no file."""
  rows = {}
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = Result(**json.loads(line))
          rows[row.key] = row
  return rows


def run(*, ops: list[str], lengths: list[int], batch: int, devices: list, topology: str,
        dtype: str = "bfloat16", jsonl: str = "") -> list[Result]:
  """Every case of ``ops`` at every length, compiled for ``devices`` (one TPU slice); rows already
  in ``jsonl`` (compiled, not failed) are kept, new ones appended as they are compiled."""
  check_options(ops=ops, batch=batch, dtype=dtype)
  chip(devices[0])
  mesh = None
  done = load(jsonl)
  rows = []
  for length in lengths:
    for op in ops:
      for case in OPS[op](batch, length, jnp.dtype(dtype)):
        key = (case.op, case.impl, length, batch, topology)
        if key in done and not done[key].note:
          rows.append(done[key])
          continue
        mesh = mesh or jax.sharding.Mesh(devices, (DATA,))
        row = measure(case, length, batch, topology, mesh)
        print(f"  {row.op} {row.impl} T={length}: {fmt(row.compile_s, '.1f')} s compile, "
              f"{fmt(row.flops, '.3g')} FLOPs, {fmt(row.bytes_accessed, '.3g')} bytes {row.note}", flush=True)
        if jsonl:
          append_row(jsonl, row)
        rows.append(row)
  return rows


def cost_source(row: Result) -> str:
  """Where a row's cost comes from, for the table."""
  if row.kernel_bytes:
    share = row.kernel_bytes / row.bytes_accessed if row.bytes_accessed else 0.0
    source = f"kernel estimate ({100 * share:.0f}% of bytes) + XLA"
  else:
    source = "XLA"
  if row.loops and not row.loops_counted:
    return source + ", loop bodies once (undercounted)"
  return source + (", loop bodies × trips" if row.loops else "")


def format_table(rows: list[Result]) -> str:
  """A markdown table; "vs reference" is the op's reference XLA form's roofline time over this row's."""
  roofline = {(r.op, r.impl, r.length): r.roofline_s for r in rows}
  lines = ["| op | implementation | T | B/chip | compile s | GFLOP | GB accessed | roofline ms (bound) | "
           "vs reference | libtpu optimal ms | temp MiB | cost from | loops (trips) | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    reference = roofline.get((r.op, REFERENCE.get(r.op, ""), r.length))
    ratio = f"{reference / r.roofline_s:.2f}×" if reference and r.roofline_s else ""
    optimal = "—" if r.optimal_s is None else "n/a" if r.optimal_s < 0 else f"{r.optimal_s * 1e3:.3f}"
    time = "—" if r.roofline_s is None else f"{r.roofline_s * 1e3:.3f} ({r.bound})"
    source = "" if r.compile_s is None else cost_source(r)
    loops = ", ".join(str(n) for n in r.loops) if r.loops else "none"
    lines.append(
        f"| {r.op} | {r.impl} | {r.length} | {r.batch} | {fmt(r.compile_s, '.1f')} | "
        f"{fmt(r.flops, '.1f', 1e-9)} | {fmt(r.bytes_accessed, '.2f', 1e-9)} | {time} | {ratio} | "
        f"{optimal} | {fmt(r.temp_bytes, '.0f', 2 ** -20)} | {source} | {loops} | {r.note} |")
  return "\n".join(lines)


LEGEND = (
    "Per chip, forward+backward. GFLOP, GB accessed: the compiled program's cost analysis, each while "
    "loop's body counted once per iteration (\"loops\": their trip counts); where the program holds "
    "Mosaic kernels, their part is the kernels' own `pl.CostEstimate` (\"cost from\"). Roofline: "
    "max(FLOPs / peak, bytes / HBM bandwidth) from `benchmarks/tpu_aot.py`'s `CHIPS`; \"vs reference\": "
    "the op's reference XLA form's roofline over the row's. libtpu optimal ms: the compiler's "
    "\"optimal_seconds\" as reported (each loop body once; n/a where it reports none). Temp: "
    "`memory_analysis()` temporaries. Compile seconds: tracing, lowering and compiling on this host. "
    "Estimates from the compiler's cost model, not timings.")

