"""Decode speed of the paper models, in one process (``scripts/bench_decode.py``).

Each model (random parameters: speed does not depend on them) is run through the compiled generation
loop of ``lmcore/eval/generate.py`` exactly as ``eval.py --prompt`` runs it. One row is a batch size B
and a context C: a decode state sized for C tokens is prefilled with C − N uniform random tokens (in
calls of N tokens), then one timed ``decode`` call samples N tokens greedily per row (N − 1 of them fed
back through the model), positions C − N … C − 1. A row reports

* ms/token: the wall time of that call (median of ``repeats`` calls after a warm-up one, each on a
  copy of the prefilled state) over N; tokens/s: B · N over the same time;
* state bytes per sequence: every array of ``model.init_state(1, C)`` (counters included);
* weights MB: the bytes decoding reads per token, the compute-dtype weights and head (the embedding
  tables' rows read by the lookup aside), and floor ms: those bytes plus the state of B sequences read
  once, at the device's memory bandwidth (``HBM_BYTES_PER_S``): a lower bound a step cannot beat;
* kernels / token: the instructions of the compiled loop's body and condition that launch work, read
  off the optimised HLO (``loop_kernel_kinds``: fusions, library calls, copies, …, by kind; a command
  buffer counted by what it holds); on a GPU, kernels per generated token;
* compile s: the wall time of compiling every prefill and decode call of the model's rows, in parallel
  threads before the first row runs (the same for all of them).

The main grid is every model at every batch and context. Long contexts run at ``long_batches`` only
and without a learned position table (``model.max_positions=0``; speed does not depend on the table,
whose length would cap the context): the fixed-state models' per-token time should stay flat while the
softmax KV cache's grows with C.

``run_paper`` is the BASED paper's setting (``--setting=paper``): batch 128, prompts of 4,096 tokens
whose prefill is timed on its own, 1,024 generated tokens, each model against the Transformer++ of its
size (``PaperRow``, ``paper_notes``).

Each model can run once per set of XLA options of its decode program (``DECODE_XLA``; rows name it).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import gc
import os
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import plots, train_step
from benchmarks.rows import append_row, fmt

# Memory bandwidth per chip (vendors' data sheets), matched against ``device_kind`` (first match wins).
HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12))

# name -> (a preset of benchmarks.train_step or "<config file>:<preset>", looked up when the model runs;
# model overrides). The 184M models, BASED 360M and 1.3B, CyFA, and the Transformer++ of each size (its
# KV cache in bf16, as the BASED paper's FlashAttention-2 baseline keeps it in 16 bits). The softmax
# 184M model twice: its KV cache in fp32 (the default) and in bf16 (half the bytes per step).
BF16_CACHE = (("model.mixers.softmax.cache_dtype", "bfloat16"),)
PRESETS = {
    "sanatan_p1_184m": ("sanatan_p1_184m", ()),
    "softmax_184m": ("softmax_184m", ()),
    "softmax_184m_bf16_cache": ("softmax_184m", BF16_CACHE),
    "based_360m": ("based_360m", ()),
    "gla_182m": ("gla_182m", ()),
    "cyfa": ("cyfa", ()),
    "based_1p3b": ("based_1p3b", ()),
    "transformer_pp_184m": ("baselines:transformer_pp_184m", BF16_CACHE),
    "transformer_pp_360m": ("baselines:transformer_pp_360m", BF16_CACHE),
    "transformer_pp_1p3b": ("baselines:transformer_pp_1p3b", BF16_CACHE),
}
# The models of the main grid when --models is not given.
GRID_MODELS = ("sanatan_p1_184m", "softmax_184m", "softmax_184m_bf16_cache", "based_360m", "gla_182m", "cyfa")
# The same names on the tiny presets (CPU tests and smoke runs); patterns without a count follow
# ``model.n_layers``.
_TINY_SOFTMAX = ("sanatan:tiny_p1_scratch", (("model.pattern", "softmax"),
                                             ("model.mixers", {"softmax": {"n_heads": 8, "rope": False}})))
_TINY_TRANSFORMER_PP = ("sanatan:tiny_p1_scratch", (
    ("model.pattern", "softmax"), ("model.max_positions", 0),
    ("model.mixers", {"softmax": {"n_heads": 8, "cache_dtype": "bfloat16"}})))
TINY_PRESETS = {
    "sanatan_p1_184m": ("sanatan:tiny_p1_scratch", (("model.pattern", "sanatan"),)),
    "softmax_184m": _TINY_SOFTMAX,
    "softmax_184m_bf16_cache": ("sanatan:tiny_p1_scratch", (
        ("model.pattern", "softmax"),
        ("model.mixers", {"softmax": {"n_heads": 8, "rope": False, "cache_dtype": "bfloat16"}}))),
    "based_360m": ("based:tiny", ()),
    "gla_182m": ("baselines:gla_tiny", ()),
    "cyfa": ("baselines:cyfa_tiny", ()),
    "based_1p3b": ("based:tiny", ()),
    "transformer_pp_184m": _TINY_TRANSFORMER_PP,
    "transformer_pp_360m": _TINY_TRANSFORMER_PP,
    "transformer_pp_1p3b": _TINY_TRANSFORMER_PP,
}
NO_POSITION_TABLE = (("model.max_positions", 0),)
# XLA options of the decode loop's program by name (``Generator(decode_options=...)``; rows carry the
# name): "graph_loop" records the loop itself into the GPU command buffer (WHILE, CONDITIONAL: one CUDA
# graph per call instead of the host launching each trip's graphs) besides what XLA records by default;
# "triton_gemm" runs the projections as XLA's Triton GEMM fusions, which can take in the norms, casts
# and residual adds around them (the entry points keep cuBLAS: ``lmcore/xla_flags.py``).
_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
DECODE_XLA = {
    "default": {},
    "graph_loop": {"xla_gpu_enable_command_buffer": _COMMAND_BUFFER + ",WHILE,CONDITIONAL"},
    "triton_gemm": {"xla_gpu_enable_triton_gemm": True},
    "graph_loop_triton_gemm": {"xla_gpu_enable_command_buffer": _COMMAND_BUFFER + ",WHILE,CONDITIONAL",
                               "xla_gpu_enable_triton_gemm": True},
}


# A flag a user can fix (the message names it and the fix); one class with the train-step benchmark's.
BenchError = train_step.BenchError


@dataclasses.dataclass
class DecodeRow:
  model: str
  mixers: str  # the mixer kinds, "+"-joined
  params: int
  batch: int
  context: int
  decode_tokens: int
  position_table: bool  # the model has a learned absolute position table
  grid: str = "main"  # "main" (batches x contexts) or "long" (long_batches x long_contexts)
  ms_per_token: float | None = None
  tokens_per_s: float | None = None
  state_bytes_per_seq: int | None = None
  weight_bytes: int | None = None
  floor_ms: float | None = None
  kernels_per_token: int | None = None
  kernel_kinds: dict[str, int] | None = None  # opcode -> count of the kernels per token
  compile_s: float | None = None
  xla: str = "default"  # the decode program's XLA options (``DECODE_XLA``)
  note: str = ""


def hbm_bytes_per_s(device: jax.Device | None = None) -> float | None:
  """The device's memory bandwidth (bytes/s) from ``HBM_BYTES_PER_S``, None when not listed (CPUs)."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return None
  kind = getattr(device, "device_kind", "")
  return next((bw for name, bw in HBM_BYTES_PER_S if name.lower() in kind.lower()), None)


def model_config(name: str, *, tiny: bool = False, overrides=()):
  """The typed ``ModelConfig`` of a model of ``PRESETS`` (or ``TINY_PRESETS``), then ``overrides``
  ((dotted key, value) pairs; keys the preset lacks are skipped)."""
  from lmcore import config as cfg_lib

  table = TINY_PRESETS if tiny else PRESETS
  if name not in table:
    raise BenchError(f"--models: unknown model {name!r}; use some of {', '.join(table)}.")
  preset, preset_overrides = table[name]
  cd = train_step.preset_config(preset)
  for key, value in preset_overrides:
    if key == "model.mixers":  # replaces the whole mapping (a new mixer kind)
      cd.model.mixers = value
  train_step.apply_overrides(cd, [kv for kv in preset_overrides if kv[0] != "model.mixers"] + list(overrides))
  try:
    return cfg_lib.model_config(cd.model)
  except cfg_lib.ConfigError as e:
    raise BenchError(f"model {name}: {e}") from None


def _state_bytes_per_seq(model, context: int) -> int:
  shapes = jax.eval_shape(lambda: model.init_state(1, context))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def _weight_bytes(weights) -> int:
  """Bytes of the decode weights a token reads: all but the embedding tables (the lookup reads B rows)."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path((weights.params, weights.unembed_DxV))[0]:
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if not {"embed", "pos_embed"} & set(keys):
      total += leaf.size * leaf.dtype.itemsize
  return total


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _prefill_lengths(context: int, decode_tokens: int) -> list[int]:
  """The lengths of the prefill calls: C − N tokens in calls of N."""
  prefill = context - decode_tokens
  return [min(decode_tokens, prefill - start) for start in range(0, prefill, decode_tokens)]


def compile_grid(gen, grid, decode_tokens: int, workers: int = 0,
                 hlo_path=None) -> tuple[float, dict[tuple[int, int], dict[str, int]]]:
  """Compiles prefill and decode for every (batch, context) of ``grid`` (shapes deduplicated) in parallel
  threads before anything runs; returns the wall seconds and each (batch, context)'s kernels per token
  by kind (``loop_kernel_kinds`` of its compiled decode loop). ``hlo_path(batch, context)``: a file each
  compiled decode's optimised HLO is written to (None: none)."""
  import concurrent.futures

  from lmcore.eval.generate import Sampling

  jobs = {}
  for _, batch, context in grid:
    state = jax.eval_shape(lambda: gen.init_state(batch, context))
    key = (batch, str(jax.tree.map(lambda x: (x.shape, x.dtype), state)))
    job = jobs.setdefault(key, (batch, context, set(), []))
    job[2].update(_prefill_lengths(context, decode_tokens))
    job[3].append((batch, context))
  workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2) // 2))
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    compile = lambda batch, context, lengths: gen.compile(
        batch, context, continued_lengths=sorted(lengths), max_new_tokens=decode_tokens,
        sampling=Sampling(temperature=0))
    futures = [(batch, context, rows, pool.submit(compile, batch, context, lengths))
               for batch, context, lengths, rows in jobs.values()]
    kinds = {}
    for batch, context, rows, future in futures:
      text = future.result().as_text()
      if hlo_path:
        write_text(hlo_path(batch, context), text)
      kinds.update({row: loop_kernel_kinds(text) for row in rows})
  return time.perf_counter() - start, kinds


def write_text(path: str, text: str) -> None:
  """``text`` into ``path`` (replaced; its folder created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


# Instructions of a compiled HLO computation that launch no kernel of their own.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
              "partition-id", "replica-id", "add-dependency"}


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines (``ENTRY`` for the entry computation)."""
  found, name = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name = "ENTRY" if head.group(1) else head.group(2)
      found[name] = []
    elif line.startswith("}"):
      name = None
    elif name and " = " in line:
      found[name].append(line)
  return found


def _opcode(line: str) -> str:
  """The opcode of an instruction line ``%x = <shape> opcode(...)``; tuple shapes hold spaces."""
  rest = line.split(" = ", 1)[1]
  if rest.startswith("("):  # skip the balanced tuple shape
    depth = 0
    for i, c in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(c, 0)
      if depth == 0:
        rest = rest[i + 1:]
        break
  else:
    rest = rest.split(" ", 1)[1]
  return rest.strip().split("(", 1)[0]


def _called(line: str, key: str) -> list[str]:
  """The computations an instruction line names under ``key`` (``to_apply=%c`` or ``key={%a, %b}``)."""
  found = re.search(rf"{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", line)
  return re.findall(r"[\w.\-]+", found.group(1).replace("%", " ")) if found else []


def _kernel_kinds(computations: dict[str, list[str]], name: str) -> collections.Counter:
  """Opcode -> count of the instructions of computation ``name`` that launch work each time it runs:
  everything but bookkeeping (``_NO_KERNEL``) and the second half of async pairs; a ``call`` (on a
  GPU, a command buffer) counts what it calls, a ``conditional`` its largest branch, a nested
  ``while`` one trip of its body and condition."""
  kinds = collections.Counter()
  for line in computations.get(name, []):
    op = _opcode(line)
    if op in _NO_KERNEL or op.endswith("-done") or op.endswith("-update"):
      continue
    if op == "call":
      kinds += _kernel_kinds(computations, _called(line, "to_apply")[0])
    elif op == "conditional":
      branches = _called(line, "branch_computations") or (
          _called(line, "true_computation") + _called(line, "false_computation"))
      kinds += max((_kernel_kinds(computations, b) for b in branches), key=lambda c: sum(c.values()))
    elif op == "while":
      kinds += _kernel_kinds(computations, _called(line, "condition")[0])
      kinds += _kernel_kinds(computations, _called(line, "body")[0])
    else:
      kinds[op.removesuffix("-start")] += 1
  return kinds


def loop_kernel_kinds(hlo_text: str) -> dict[str, int]:
  """Opcode -> instructions launching work per token in a compiled decode loop (``_kernel_kinds`` of
  the body and condition of the program's largest ``while``, wherever it sits). On a GPU each is one
  kernel (a fusion, a library call such as a cuBLAS GEMM, a copy), whether it is launched alone or
  from a command buffer; on a CPU the same count measures the step's op granularity."""
  computations = _computations(hlo_text)
  loops = [(_called(line, "condition")[0], _called(line, "body")[0])
           for lines in computations.values() for line in lines if _opcode(line) == "while"]
  if not loops:
    raise ValueError("the compiled decode has no while loop")
  per_loop = [_kernel_kinds(computations, condition) + _kernel_kinds(computations, body)
              for condition, body in loops]
  return dict(max(per_loop, key=lambda kinds: sum(kinds.values())).most_common())


def kernels_per_token(hlo_text: str) -> int:
  """The kernels a compiled decode loop launches per token: the sum of ``loop_kernel_kinds``."""
  return sum(loop_kernel_kinds(hlo_text).values())


def measure(gen, row: DecodeRow, *, repeats: int, bandwidth: float | None, seed: int = 0) -> DecodeRow:
  """Prefills a state for ``row.context`` and times ``row.decode_tokens`` greedy tokens (module docstring)."""
  from lmcore.eval.generate import Sampling

  B, C, N = row.batch, row.context, row.decode_tokens
  state = gen.init_state(B, C)
  rng = np.random.default_rng(seed)
  logits = None
  for length in _prefill_lengths(C, N):
    logits, state = gen.prefill(rng.integers(0, gen.config.vocab_size, (B, length), dtype=np.int32), state)
  jax.block_until_ready((logits, state))
  greedy = Sampling(temperature=0)
  times = []
  for _ in range(repeats + 1):
    fresh = _copy(state)
    jax.block_until_ready(fresh)
    start = time.perf_counter()
    out, n_new, end_state = gen.decode(logits, fresh, max_new_tokens=N, sampling=greedy)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
    del out, n_new, end_state
  decode_s = statistics.median(times[1:])
  row.ms_per_token = decode_s / N * 1e3
  row.tokens_per_s = B * N / decode_s
  if bandwidth:
    row.floor_ms = (row.weight_bytes + B * row.state_bytes_per_seq) / bandwidth * 1e3
  return row


def check_xla(xla: list[str]) -> list[str]:
  """``xla`` (names of ``DECODE_XLA``), or a BenchError naming the unknown one."""
  for name in xla:
    if name not in DECODE_XLA:
      raise BenchError(f"--decode_xla: unknown {name!r}; use some of {', '.join(DECODE_XLA)}.")
  return list(xla) or ["default"]


def run(models: list[str], *, batches: list[int], contexts: list[int], long_contexts: list[int] = (),
        long_batches: list[int] = (1,), decode_tokens: int = 128, repeats: int = 3, tiny: bool = False,
        overrides: list[str] = (), jsonl: str = "", max_seconds: float = 0.0, xla: list[str] = ("default",),
        hlo_dir: str = "") -> list[DecodeRow]:
  """Every model at every (batch, context), then at ``long_batches`` × ``long_contexts`` without a
  position table; one after another in this process, each model once per decode program of ``xla``
  (``DECODE_XLA``). A row that fails (out of memory, say) keeps its error as a note; rows not started
  within ``max_seconds`` (0: no limit) are noted as skipped. Rows are appended to ``jsonl`` as they are
  measured; ``hlo_dir``: each compiled decode's optimised HLO goes there ('' = nowhere)."""
  from lmcore.eval.generate import Generator
  from lmcore.model import LanguageModel, count_params

  if decode_tokens < 1 or repeats < 1:
    raise BenchError(f"--decode_tokens={decode_tokens} and --repeats={repeats} must both be >= 1.")
  xla = check_xla(xla)
  parsed = [train_step.parse_override(o) for o in overrides]
  for c in list(contexts) + list(long_contexts):
    if c <= decode_tokens:
      raise BenchError(f"--contexts/--long_contexts: {c} must exceed --decode_tokens={decode_tokens}.")
  plans = []  # (name, config, [(grid, batch, context)]): one model and its compilations per plan
  for name in models:
    config = model_config(name, tiny=tiny, overrides=parsed)
    main = [("main", b, c) for b in batches for c in contexts]
    long = [("long", b, c) for b in long_batches for c in long_contexts]
    if config.max_positions and long:
      plans += [(name, config, main),
                (name, model_config(name, tiny=tiny, overrides=parsed + list(NO_POSITION_TABLE)), long)]
    else:
      plans.append((name, config, main + long))
  plans = [(name, config, grid, variant) for name, config, grid in plans for variant in xla]
  bandwidth = hbm_bytes_per_s()
  started, rows = time.perf_counter(), []
  out_of_time = lambda: max_seconds and time.perf_counter() - started > max_seconds
  for name, config, grid, variant in plans:
    mixers = "+".join(sorted(set(config.layer_kinds())))
    model = gen = None
    if not out_of_time():
      model = LanguageModel(config, rngs=nnx.Rngs(0))
      gen = Generator(model, decode_options=DECODE_XLA[variant])
      stem = f"{name}{'' if config.max_positions else '_no_table'}_{variant}"
      hlo_path = (lambda b, c: os.path.join(hlo_dir, f"{stem}_b{b}_c{c}.hlo.txt")) if hlo_dir else None
      try:
        compile_s, kinds = compile_grid(gen, grid, decode_tokens, hlo_path=hlo_path)
        print(f"{name} ({variant}): compiled the prefill and decode of {len(grid)} rows in {compile_s:.1f} s",
              flush=True)
      except Exception as e:  # each row compiles (and fails) on its own then, with its own note
        compile_s, kinds = None, {}
        print(f"{name} ({variant}): ahead-of-time compilation failed ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:200] if str(e) else ''}); rows compile as they run", flush=True)
    for grid_name, batch, context in grid:
      row = DecodeRow(name, mixers, 0, batch, context, decode_tokens, bool(config.max_positions), grid_name,
                      xla=variant)
      if gen is None or out_of_time():
        row.note = f"skipped: past --max_seconds={max_seconds:g}"
      else:
        row.params, row.weight_bytes = count_params(model), _weight_bytes(gen.weights)
        row.state_bytes_per_seq, row.compile_s = _state_bytes_per_seq(model, context), compile_s
        row.kernel_kinds = kinds.get((batch, context))
        row.kernels_per_token = sum(row.kernel_kinds.values()) if row.kernel_kinds else None
        try:
          measure(gen, row, repeats=repeats, bandwidth=bandwidth)
        except BenchError:
          raise
        except Exception as e:  # out of memory: report it and go on
          row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
      print(f"  {format_row_line(row)}", flush=True)
      rows.append(row)
      if jsonl:
        append_row(jsonl, row)
    del model, gen
    gc.collect()
    jax.clear_caches()
  return rows


def _label(model: str, xla: str) -> str:
  """The model's name, with its decode program's XLA options when they are not the default."""
  return model if xla == "default" else f"{model} [{xla}]"


def format_row_line(r: DecodeRow) -> str:
  table = "" if r.position_table else " (no position table)"
  head = f"{_label(r.model, r.xla)}{table} B={r.batch} C={r.context}: "
  if r.ms_per_token is None:
    return head + (r.note or "failed")
  return (head + f"{r.ms_per_token:.3f} ms/token, {r.tokens_per_s:,.0f} tok/s, state "
          f"{fmt(r.state_bytes_per_seq, ',.0f')} B/seq, floor {fmt(r.floor_ms, '.3f')} ms, "
          f"{r.kernels_per_token} kernels/token {r.kernel_kinds or ''}")


def format_table(rows: list[DecodeRow]) -> str:
  lines = ["| model | mixers | params | position table | batch | context | ms/token | tokens/s | "
           "state bytes / seq | weights MB | floor ms | kernels / token | compile s | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {_label(r.model, r.xla)} | {r.mixers} | {fmt(r.params or None, ',.1f', 1e-6)}M | "
        f"{'yes' if r.position_table else 'no'} | {r.batch} | {r.context:,} | {fmt(r.ms_per_token, '.3f')} | "
        f"{fmt(r.tokens_per_s, ',.0f')} | {fmt(r.state_bytes_per_seq, ',.0f')} | "
        f"{fmt(r.weight_bytes, ',.1f', 1e-6)} | {fmt(r.floor_ms, '.3f')} | "
        f"{fmt(r.kernels_per_token, '.0f')} | {fmt(r.compile_s, '.1f')} | {r.note} |")
  return "\n".join(lines)


def _timed(rows, model, batch=None, context=None):
  return [r for r in rows if r.model == model and r.ms_per_token is not None
          and (batch is None or r.batch == batch) and (context is None or r.context == context)]


def target_lines(rows: list[DecodeRow], *, model: str = "sanatan_p1_184m",
                 references=("softmax_184m", "softmax_184m_bf16_cache")) -> list[str]:
  """The decode targets read off the rows, per decode program (``DecodeRow.xla``): ``model`` at batch 1
  ≤ 0.3 ms/token, and within ± 10 % of its median over every measured context; at batch 64, context
  2048, ≥ 4× the tokens/s of each of ``references``."""
  lines = []
  for xla in dict.fromkeys(r.xla for r in rows):
    lines += [line if xla == "default" else f"- [{xla}] {line[2:]}"
              for line in _target_lines([r for r in rows if r.xla == xla], model, references)]
  return lines


def _target_lines(rows: list[DecodeRow], model: str, references) -> list[str]:
  lines = []
  batch1 = sorted(_timed(rows, model, batch=1), key=lambda r: r.context)
  if batch1:
    worst = max(r.ms_per_token for r in batch1)
    lines.append(f"- {model}, batch 1: {worst:.3f} ms/token at worst over contexts "
                 f"{batch1[0].context:,}–{batch1[-1].context:,} (target ≤ 0.3: "
                 f"{'met' if worst <= 0.3 else 'not met'}).")
    median = statistics.median(r.ms_per_token for r in batch1)
    spread = max(abs(r.ms_per_token / median - 1) for r in batch1)
    lines.append(f"- {model}, batch 1, flat over context: {min(r.ms_per_token for r in batch1):.3f}–"
                 f"{worst:.3f} ms/token, at most {spread:.1%} from the median "
                 f"(target ± 10 %: {'met' if spread <= 0.1 else 'not met'}).")
  ours = _timed(rows, model, 64, 2048)
  for reference in references:
    theirs = _timed(rows, reference, 64, 2048)
    if ours and theirs:
      ratio = ours[0].tokens_per_s / theirs[0].tokens_per_s
      lines.append(f"- batch 64, context 2,048: {model} {ours[0].tokens_per_s:,.0f} tokens/s, {reference} "
                   f"{theirs[0].tokens_per_s:,.0f}: {ratio:.2f}× (target ≥ 4×: "
                   f"{'met' if ratio >= 4 else 'not met'}).")
  return lines


def notes(decode_tokens: int) -> str:
  """What the columns mean, under the table."""
  return (f"Each row prefills C − {decode_tokens} random tokens, then one compiled `decode` call samples "
          f"{decode_tokens} tokens greedily per row (`lmcore/eval/generate.py`); ms/token is that call's "
          "median time (after a warm-up call) over the tokens, tokens/s = batch × tokens / time. State "
          "bytes: every array of the decode state of one sequence. Weights MB: the compute-dtype weights "
          "and head read per token. Floor: weights plus the state of the batch read once at the device's "
          "memory bandwidth. Compile s: all of a model's prefill and decode calls, compiled in parallel "
          "threads before its rows. Kernels / token: the instructions of the compiled loop's body and "
          "condition that launch work (`loop_kernel_kinds`). The long-context rows run without a learned "
          "position table (`model.max_positions=0`; position table: no); a model name in brackets is "
          "followed by the decode program's XLA options (`DECODE_XLA`).")


def plot_tokens_per_s(rows: list[DecodeRow], path: str, title: str = "") -> None:
  """tokens/s vs batch (log-log), one line per model and context (the main grid's contexts)."""
  plt = plots.pyplot()

  timed = [r for r in rows if r.tokens_per_s and r.grid == "main"]
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  palette = plt.get_cmap("tab10")
  models = list(dict.fromkeys(r.model for r in timed))
  contexts = sorted({r.context for r in timed})
  styles = ["-", "--", ":", "-."]
  for i, model in enumerate(models):
    for j, context in enumerate(contexts):
      series = sorted({r.batch: r for r in timed if r.model == model and r.context == context}.values(),
                      key=lambda r: r.batch)
      if len(series) > 1:
        ax.plot([r.batch for r in series], [r.tokens_per_s for r in series], styles[j % len(styles)],
                marker="o", color=palette(i % 10), label=f"{model}, context {context:,}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  batches = sorted({r.batch for r in timed})
  ax.set_xticks(batches, [str(b) for b in batches])
  ax.set_xlabel("batch (sequences decoded together)")
  ax.set_ylabel("generated tokens/s")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize="x-small")
  plots.save(fig, path, title)


def report(rows: list[DecodeRow], *, markdown: str, plot: str, command: str, decode_tokens: int) -> str:
  """Prints the table and the target lines, appends them (with the command) as a dated block to
  ``markdown`` ('' = none) and plots tokens/s vs batch into ``plot`` ('' = none); returns the table."""
  from benchmarks import harness

  table = format_table(rows)
  targets = target_lines(rows)
  print(table + ("\n\n" + "\n".join(targets) if targets else ""), flush=True)
  device = harness.device_name()
  if markdown:
    blocks = [table, notes(decode_tokens)] + (["\n".join(targets)] if targets else [])
    harness.append_markdown(markdown, blocks, datetime.date.today().isoformat(), device, [command],
                            topic="decode")
  if plot:
    plot_tokens_per_s(rows, plot, title=f"decode on {device}")
    print(f"wrote {plot}", flush=True)
  return table


def parse_ints(text: Any, flag: str) -> list[int]:
  """"1,8,64" -> [1, 8, 64]; a BenchError naming ``flag`` otherwise."""
  try:
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    values = [int(v) for v in items if str(v).strip()]
  except ValueError:
    raise BenchError(f"--{flag}={text!r}: give comma-separated positive integers, e.g. 1,8,64.") from None
  if any(v < 1 for v in values):
    raise BenchError(f"--{flag}={text!r}: every value must be >= 1.")
  return values


# ------------------------------------------------------------------ the papers' setting

# The BASED paper's decode setting (Arora et al., 2024): batch 128, prompts of 4,096 tokens whose prefill
# is timed on its own, then 1,024 generated tokens.
PAPER_BATCH, PAPER_PROMPT, PAPER_TOKENS = 128, 4096, 1024
PAPER_MODELS = ("based_360m", "transformer_pp_360m", "based_1p3b", "transformer_pp_1p3b", "sanatan_p1_184m",
                "transformer_pp_184m")
# Each model's Transformer++ of the same size: the denominator of its ratios.
TRANSFORMER_PP = {"sanatan_p1_184m": "transformer_pp_184m", "softmax_184m": "transformer_pp_184m",
                  "softmax_184m_bf16_cache": "transformer_pp_184m", "gla_182m": "transformer_pp_184m",
                  "based_360m": "transformer_pp_360m", "based_1p3b": "transformer_pp_1p3b"}
# What the BASED paper reports in this setting (its FlashAttention-2 Transformer++, CUDA graphs, prefill
# excluded from the decode time): generated tokens/s over the Transformer++'s, and prefill tokens/ms.
PAPER_REPORTS = {"based_1p3b": {"decode_ratio": 24.0, "prefill_tokens_per_ms": 161.7}}


@dataclasses.dataclass
class PaperRow:
  model: str
  mixers: str
  params: int
  batch: int
  prompt: int
  tokens: int  # generated per row
  position_table: bool
  prefill_chunk: int = 0  # prompt tokens per prefill call (0: the whole prompt in one call)
  prefill_ms: float | None = None  # the whole batch's prompts
  prefill_tokens_per_ms: float | None = None
  ms_per_token: float | None = None  # one loop step: a token for every row
  tokens_per_s: float | None = None
  state_bytes_per_seq: int | None = None  # at the mean context a generated token reads
  weight_bytes: int | None = None
  floor_ms: float | None = None
  kernels_per_token: int | None = None
  kernel_kinds: dict[str, int] | None = None  # opcode -> count of the kernels per token
  compile_s: float | None = None
  xla: str = "default"  # the decode program's XLA options (``DECODE_XLA``)
  reference: str = ""  # the Transformer++ of the same size
  decode_ratio: float | None = None  # tokens/s over the reference's
  prefill_ratio: float | None = None  # prefill tokens/ms over the reference's
  note: str = ""


def paper_config(name: str, *, prompt: int, tokens: int, tiny: bool = False, overrides=()):
  """``model_config``, without the learned position table when it is shorter than prompt + tokens."""
  config = model_config(name, tiny=tiny, overrides=overrides)
  if config.max_positions and config.max_positions < prompt + tokens:
    config = model_config(name, tiny=tiny, overrides=list(overrides) + list(NO_POSITION_TABLE))
  return config


def _chunks(prompt: int, chunk: int) -> list[int]:
  """The lengths of the prefill calls of a ``prompt``-token prompt, ``chunk`` tokens each (0: one call)."""
  chunk = chunk or prompt
  return [min(chunk, prompt - start) for start in range(0, prompt, chunk)]


def measure_paper(gen, row: PaperRow, *, repeats: int, bandwidth: float | None, seed: int = 0) -> PaperRow:
  """Times, ``repeats`` times after a warm-up: a prefill of B prompts of P uniform random tokens into a
  new state made in the first call (one call, or calls of ``row.prefill_chunk`` tokens), then one
  ``decode`` call of N greedy tokens per row; medians."""
  from lmcore.eval.generate import Sampling

  B, P, N = row.batch, row.prompt, row.tokens
  tokens_BxP = np.random.default_rng(seed).integers(0, gen.config.vocab_size, (B, P), dtype=np.int32)
  prefill_s, decode_s = [], []
  for _ in range(repeats + 1):
    start, fed, state = time.perf_counter(), 0, None
    for length in _chunks(P, row.prefill_chunk):
      logits, state = gen.prefill(tokens_BxP[:, fed:fed + length], state, max_len=P + N)
      fed += length
    jax.block_until_ready((logits, state))
    middle = time.perf_counter()
    out, _, state = gen.decode(logits, state, max_new_tokens=N, sampling=Sampling(temperature=0))
    jax.block_until_ready(out)
    prefill_s.append(middle - start)
    decode_s.append(time.perf_counter() - middle)
    del logits, state, out
  row.prefill_ms = statistics.median(prefill_s[1:]) * 1e3
  row.prefill_tokens_per_ms = B * P / row.prefill_ms
  row.ms_per_token = statistics.median(decode_s[1:]) / N * 1e3
  row.tokens_per_s = B / row.ms_per_token * 1e3
  if bandwidth:
    row.floor_ms = (row.weight_bytes + B * row.state_bytes_per_seq) / bandwidth * 1e3
  return row


def run_paper(models: list[str], *, batch: int = PAPER_BATCH, prompt: int = PAPER_PROMPT,
              tokens: int = PAPER_TOKENS, prefill_chunk: int = 0, repeats: int = 1, tiny: bool = False,
              overrides: list[str] = (), jsonl: str = "", max_seconds: float = 0.0,
              xla: list[str] = ("default",), hlo_dir: str = "") -> list[PaperRow]:
  """Every model in the papers' setting, one after another in this process (``measure_paper``), each
  once per decode program of ``xla`` (``DECODE_XLA``), then each model's ratios to its Transformer++
  (``TRANSFORMER_PP``, the same decode program) where both were timed. A row that fails (out of
  memory, say) keeps its error as a note; rows not started within ``max_seconds`` (0: no limit) are
  noted as skipped. Rows are appended to ``jsonl`` as they are measured, the ratios filled in the
  returned rows; ``hlo_dir``: each compiled decode's optimised HLO goes there ('' = nowhere)."""
  from lmcore.eval.generate import Generator, Sampling
  from lmcore.model import LanguageModel, count_params

  if min(batch, prompt, tokens, repeats) < 1 or prefill_chunk < 0:
    raise BenchError(f"--paper_batch={batch}, --paper_prompt={prompt}, --paper_tokens={tokens} and "
                     f"--repeats={repeats} must all be >= 1, --paper_prefill_chunk={prefill_chunk} >= 0.")
  xla = check_xla(xla)
  parsed = [train_step.parse_override(o) for o in overrides]
  configs = [(name, paper_config(name, prompt=prompt, tokens=tokens, tiny=tiny, overrides=parsed), variant)
             for name in models for variant in xla]
  bandwidth, started, rows = hbm_bytes_per_s(), time.perf_counter(), []
  for name, config, variant in configs:
    row = PaperRow(name, "+".join(sorted(set(config.layer_kinds()))), 0, batch, prompt, tokens,
                   bool(config.max_positions), prefill_chunk, xla=variant)
    if max_seconds and time.perf_counter() - started > max_seconds:
      row.note = f"skipped: past --max_seconds={max_seconds:g}"
    else:
      try:
        model = LanguageModel(config, rngs=nnx.Rngs(0))
        gen = Generator(model, decode_options=DECODE_XLA[variant])
        row.params, row.weight_bytes = count_params(model), _weight_bytes(gen.weights)
        row.state_bytes_per_seq = _state_bytes_per_seq(model, prompt + tokens // 2)
        start = time.perf_counter()
        first, *rest = _chunks(prompt, prefill_chunk)
        compiled = gen.compile(batch, prompt + tokens, prefill_lengths=[first],
                               continued_lengths=sorted(set(rest)), max_new_tokens=tokens,
                               sampling=Sampling(temperature=0))
        row.compile_s = time.perf_counter() - start
        text = compiled.as_text()
        if hlo_dir:
          write_text(os.path.join(hlo_dir, f"{name}_{variant}_paper_b{batch}_p{prompt}.hlo.txt"), text)
        row.kernel_kinds = loop_kernel_kinds(text)
        row.kernels_per_token = sum(row.kernel_kinds.values())
        measure_paper(gen, row, repeats=repeats, bandwidth=bandwidth)
      except Exception as e:  # out of memory: report it and go on
        row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
      model = gen = compiled = None
      gc.collect()
      jax.clear_caches()
    print(f"  {format_paper_line(row)}", flush=True)
    rows.append(row)
    if jsonl:
      append_row(jsonl, row)
  return with_paper_ratios(rows)


def with_paper_ratios(rows: list[PaperRow]) -> list[PaperRow]:
  """Fills each row's ratios to its Transformer++ (``TRANSFORMER_PP``, the row of the same decode
  program) where both rows were timed."""
  timed = {(r.model, r.xla): r for r in rows if r.ms_per_token is not None}
  for r in rows:
    ref = timed.get((TRANSFORMER_PP.get(r.model, ""), r.xla))
    r.reference = TRANSFORMER_PP.get(r.model, "")
    if ref and r.ms_per_token is not None:
      r.decode_ratio = r.tokens_per_s / ref.tokens_per_s
      r.prefill_ratio = r.prefill_tokens_per_ms / ref.prefill_tokens_per_ms
  return rows


def format_paper_line(r: PaperRow) -> str:
  head = f"{_label(r.model, r.xla)} B={r.batch} prompt={r.prompt} tokens={r.tokens}: "
  if r.ms_per_token is None:
    return head + (r.note or "failed")
  return (head + f"prefill {r.prefill_tokens_per_ms:,.1f} tokens/ms, decode {r.ms_per_token:.3f} ms/token "
          f"({r.tokens_per_s:,.0f} tok/s), floor {fmt(r.floor_ms, '.3f')} ms, "
          f"{r.kernels_per_token} kernels/token {r.kernel_kinds or ''}")


def _paper_cell(model: str) -> str:
  reported = PAPER_REPORTS.get(model)
  if not reported:
    return ""
  return f"{reported['decode_ratio']:g}×, {reported['prefill_tokens_per_ms']:g} tokens/ms"


def format_paper_table(rows: list[PaperRow]) -> str:
  lines = ["| model | mixers | params | position table | batch | prompt | generated | prefill ms | "
           "prefill tokens/ms | ms/token | tokens/s | state MB / seq | weights MB | floor ms | × floor | "
           "kernels / token | vs Transformer++ (decode, prefill) | paper (decode, prefill) | note |",
           "|" + "---|" * 19]
  for r in rows:
    above = r.ms_per_token / r.floor_ms if r.ms_per_token and r.floor_ms else None
    ratios = (f"{r.decode_ratio:.2f}×, {r.prefill_ratio:.2f}× ({r.reference})" if r.decode_ratio is not None
              else "")
    lines.append(
        f"| {_label(r.model, r.xla)} | {r.mixers} | {fmt(r.params or None, ',.1f', 1e-6)}M | "
        f"{'yes' if r.position_table else 'no'} | {r.batch} | {r.prompt:,} | {r.tokens:,} | "
        f"{fmt(r.prefill_ms, ',.1f')} | {fmt(r.prefill_tokens_per_ms, ',.1f')} | "
        f"{fmt(r.ms_per_token, '.3f')} | "
        f"{fmt(r.tokens_per_s, ',.0f')} | {fmt(r.state_bytes_per_seq, ',.2f', 1e-6)} | "
        f"{fmt(r.weight_bytes, ',.1f', 1e-6)} | {fmt(r.floor_ms, '.3f')} | {fmt(above, '.1f')} | "
        f"{fmt(r.kernels_per_token, '.0f')} | {ratios} | {_paper_cell(r.model)} | {r.note} |")
  return "\n".join(lines)


def paper_notes(bandwidth: float | None) -> str:
  """What the papers' table's columns mean and what makes its setting differ from the paper's."""
  at = f"{bandwidth / 1e12:g} TB/s (`HBM_BYTES_PER_S`)" if bandwidth else "the device's memory bandwidth"
  return ("Each row prefills the batch's random prompts (in one call, or in calls of "
          "`--paper_prefill_chunk` tokens; prefill tokens/ms = batch × prompt / time), then one compiled "
          "`decode` call generates the tokens greedily (ms/token: that call's time over the tokens; "
          "tokens/s = batch / ms/token); medians after a warm-up. State MB: the decode state of one "
          "sequence at the mean context a generated token reads (prompt + generated / 2). Floor: the "
          f"weights read per token plus the batch's state, at {at}; × floor: ms/token over it. Kernels / "
          "token: the instructions of the compiled loop's body and condition that launch work "
          "(`loop_kernel_kinds`). vs Transformer++: tokens/s and prefill tokens/ms over those of the "
          "Transformer++ of the same size (bf16 KV cache). The paper's ratio is against FlashAttention-2 "
          "with CUDA graphs; here every model runs through XLA in one process, and the weights are random "
          "(speed does not depend on them). The first prefill call makes the zero state (its time "
          "included); in it the Transformer++ runs the prompt through its training forward's attention "
          "(cuDNN's flash attention on a GPU) and writes the KV cache from its keys and values; later "
          "calls and the decode attend over the preallocated cache.")


def report_paper(rows: list[PaperRow], *, markdown: str, command: str) -> str:
  """Prints the papers' table, appends it with its notes and command as a dated block to ``markdown``
  ('' = none); returns the table."""
  from benchmarks import harness

  table = format_paper_table(rows)
  print(table, flush=True)
  if markdown:
    harness.append_markdown(markdown, [table, paper_notes(hbm_bytes_per_s())],
                            datetime.date.today().isoformat(), harness.device_name(), [command],
                            topic="decode in the papers' setting")
  return table
