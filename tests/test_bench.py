"""The kernel-benchmark library on CPU: rows, ratios, table, and a stopped run that continues."""

import fcntl
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from based_jax.ops.taylor_attention import pallas_triton_blocked as taylor_blocked
from benchmarks import harness as bench


def test_rows_are_logged_as_measured_and_not_measured_again(tmp_path, monkeypatch):
  jsonl = tmp_path / "bench" / "kernels.jsonl"
  rows = bench.run_all(ops=["softmax", "gated"], lengths=[64], tokens=128, dtype="float32", repeats=1,
                       fla_ops=["gated"], jsonl=str(jsonl))
  by_impl = {r.impl: r for r in rows}
  assert set(by_impl) == {"softmax (xla)", "pallas_triton", "chunked (xla)", "parallel (reference)"}
  assert by_impl["chunked (xla)"].fwdbwd_ms > 0 and by_impl["chunked (xla)"].batch == 2
  assert by_impl["pallas_triton"].fwdbwd_ms > 0  # interpreted off GPU
  assert by_impl["parallel (reference)"].reference == "gated/chunked (xla)"
  assert by_impl["chunked (xla)"].vs_softmax is not None
  assert len(jsonl.read_text().splitlines()) == 4
  assert json.loads(jsonl.read_text().splitlines()[0])["op"] == "softmax"

  def must_not_run(*args, **kwargs):
    raise AssertionError("a row already in the JSONL was measured again")

  monkeypatch.setattr(bench, "time_fwd_bwd", must_not_run)
  again = bench.run_all(ops=["softmax", "gated"], lengths=[64], tokens=128, dtype="float32", repeats=1,
                        fla_ops=[], jsonl=str(jsonl))
  assert [(r.impl, r.fwdbwd_ms) for r in again] == [(r.impl, r.fwdbwd_ms) for r in rows]
  table = bench.format_table(again)
  assert table.count("\n") == 1 + len(again) and "| gated | chunked (xla) | 64 | 2 |" in table


def test_a_failed_row_is_tried_again_and_the_last_row_wins(tmp_path):
  jsonl = str(tmp_path / "kernels.jsonl")
  bench.RowLog(jsonl).add(bench.Row("gated", "pallas (split)", 64, 2, None, None, 0.0, note="XlaRuntimeError: OOM"))
  reloaded = bench.RowLog(jsonl)
  assert not reloaded.has("gated", "pallas (split)", 64)
  reloaded.add(bench.Row("gated", "pallas (split)", 64, 2, 1.0, 3.0, 10.0))
  final = bench.RowLog(jsonl)
  assert final.has("gated", "pallas (split)", 64)
  assert [(r.impl, r.fwdbwd_ms, r.note) for r in final.rows] == [("pallas (split)", 3.0, "")]


def test_exclusive_holds_the_lock_only_inside(tmp_path):
  lock = tmp_path / "bench.lock"
  with bench.exclusive(str(lock)), open(lock) as other:
    with pytest.raises(BlockingIOError):  # a second holder (another process) has to wait
      fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
  with open(lock) as other:
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_shared_holders_overlap_and_keep_the_timer_out(tmp_path):
  lock = str(tmp_path / "bench.lock")
  with bench.shared(lock), bench.shared(lock), open(lock) as timer:  # two compiling processes at once
    with pytest.raises(BlockingIOError):  # a timing process has to wait for both
      fcntl.flock(timer, fcntl.LOCK_EX | fcntl.LOCK_NB)
  with bench.exclusive(lock), open(lock) as compiler:
    with pytest.raises(BlockingIOError):  # and a compile waits while one times
      fcntl.flock(compiler, fcntl.LOCK_SH | fcntl.LOCK_NB)


def test_tuning_settings_compute_the_default_kernels_function():
  """Every TUNING setting is a valid call of its kernel (chunk, value tile and warps change only how
  it runs), named by its setting and credited FLOPs at its own chunk; checked on one length-64 case per
  op against the defaults (interpreted off GPU)."""
  for op_name in bench.TUNING:
    args, cases, flops = bench.tuning_cases(op_name, 1, 64, "float32")
    _, defaults, _ = bench.OPS[op_name](1, 64, "float32")
    want = defaults["pallas_triton"](*args)
    assert len(cases) == len(bench.TUNING[op_name])
    for (name, fn), setting in zip(cases.items(), bench.TUNING[op_name]):
      assert name.startswith(f"pallas_triton (C={setting['chunk_size']}, {setting['num_warps']} warps")
      assert flops[name] == bench.chunked_flops(1, 64, bench.HEADS, bench.HEAD_DIM, bench.HEAD_DIM,
                                                chunk=setting["chunk_size"])
      got = fn(*args)
      assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5, (op_name, name)
  with pytest.raises(ValueError, match="no tuning settings for op 'taylor'"):
    bench.tuning_cases("taylor", 1, 64, "float32")


def test_blocked_taylor_tuning_settings_compute_the_ops_function():
  """Every TAYLOR_BLOCKED_TUNING setting is named by its blocks, warps and stages, credited the blocked
  kernel's FLOPs and its rows go to the op "taylor"; the first computes the XLA chunked path's output
  (T = 32: the blocks are capped at 32, the rest are the same interpreted function; the kernels' own
  tests cover the block sizes)."""
  args, cases, flops = bench.tuning_cases("taylor_blocked", 1, 32, "float32")
  _, defaults, default_flops = bench.OPS["taylor"](1, 32, "float32")
  assert len(cases) == len(bench.TAYLOR_BLOCKED_TUNING)
  assert bench.TAYLOR_BLOCKED_TUNING[0] == (64, 64, 4, taylor_blocked.STAGES[2])  # the bf16 default
  for name, (block_q, block_k, warps, stages) in zip(cases, bench.TAYLOR_BLOCKED_TUNING):
    assert name == f"pallas_blocked ({block_q}x{block_k} {warps}w {stages}s)"
    assert flops[name] == default_flops["pallas_blocked"]
  want = defaults["chunked (xla)"](*args)
  got = next(iter(cases.values()))(*args)
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5
  assert bench.TUNED_OPS["taylor_blocked"] == "taylor"


def test_fused_taylor_tuning_settings_compute_the_ops_function():
  """Every TAYLOR_FUSED_TUNING tiling is named by its fields and credited the fused kernel's FLOPs; the
  first is the kernel's default tiling and computes the XLA chunked path's output (T = 32); its rows go
  to the op "taylor"."""
  from based_jax.ops.taylor_attention.pallas_triton_fused import FusedTiles

  args, cases, flops = bench.tuning_cases("taylor_fused", 1, 32, "float32")
  _, defaults, default_flops = bench.OPS["taylor"](1, 32, "float32")
  assert len(cases) == len(bench.TAYLOR_FUSED_TUNING)
  assert FusedTiles(*bench.TAYLOR_FUSED_TUNING[0]) == FusedTiles()
  for name, entry in zip(cases, bench.TAYLOR_FUSED_TUNING):
    assert name.startswith(f"pallas_fused (C={entry[0]}, F={entry[1]}, BV={entry[2]}, fwd {entry[3][0]}w")
    assert flops[name] == default_flops["pallas_fused"]
  want = defaults["chunked (xla)"](*args)
  got = next(iter(cases.values()))(*args)
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5
  assert bench.TUNED_OPS["taylor_fused"] == "taylor"


def test_chunk_scan_benchmark_times_every_setting_and_appends_its_table(tmp_path):
  """scripts/bench_chunk_scan.py on CPU (interpreted): one row per setting, timed, then one dated block."""
  out = tmp_path / "BENCH.md"
  script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "bench_chunk_scan.py")
  subprocess.run([sys.executable, script, "--stacks=gated", "--lengths=32", "--tokens=32", "--repeats=1",
                  f"--out={out}"], check=True, capture_output=True, text=True)
  rows = [line for line in out.read_text().splitlines() if line.startswith("| gated | 32 | 1 |")]
  assert len(rows) == 8
  assert all(" — " not in row and row.split(" | ")[4] != "—" for row in rows), rows
  assert "(chunk scan)" in out.read_text()


def test_sanatan_xla_cases_compute_the_reference_function():
  """The XLA cases of the SANATAN benchmarks (chunked at two chunk sizes, the plain chunked baseline,
  the parallel form with its custom VJP) equal the materialised reference on one fp32 case of 64
  tokens, the chunked ones credited their own chunks."""
  _, _, flops = bench.OPS["sanatan_p1"](1, 64, "float32")
  assert bench.SANATAN_CHUNKED == "chunked (xla, C=128)"
  assert flops[bench.SANATAN_CHUNKED] == bench.chunked_flops(1, 64, bench.HEADS, 6 * bench.HEAD_DIM,
                                                             bench.HEAD_DIM, chunk=128)
  assert flops["chunked (xla)"] == flops["plain chunked (baseline)"] == bench.chunked_flops(
      1, 64, bench.HEADS, 6 * bench.HEAD_DIM, bench.HEAD_DIM, chunk=bench.CHUNK)
  for op_name, names in (("sanatan_p1", ("chunked (xla)", bench.SANATAN_CHUNKED, "plain chunked (baseline)")),
                         ("sanatan_p2", ("parallel (xla)",))):
    args, cases, _ = bench.OPS[op_name](1, 64, "float32")
    want = cases["parallel (reference)"](*args)
    for name in names:
      got = cases[name](*args)
      assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5, (op_name, name)


def _preset_heads(module: str, name: str) -> set[tuple[str, "bench.HeadShape"]]:
  """(benchmark op, head shape) of every mixer of ``module``'s preset ``name`` that runs a timed op,
  read from the mixers built abstractly at the preset's width."""
  import importlib

  from flax import nnx

  from lmcore import config as cfg_lib
  from lmcore.mixers.base import InitSpec
  from lmcore.registry import mixer_class

  model = cfg_lib.experiment_config(importlib.import_module(f"configs.{module}").get_config(name)).model
  heads = set()
  for kind, config in model.mixers.items():
    cls = mixer_class(kind)
    m = nnx.eval_shape(lambda: cls(config, d_model=model.d_model, init=InitSpec(), rngs=nnx.Rngs(0)))
    c = m.config
    if kind == "sanatan":
      op = "sanatan_p1" if c.p == 1 and c.channels == 6 else "sanatan_p2"
      heads.add((op, bench.HeadShape(c.n_heads, c.head_dim, c.v_head_dim or c.head_dim)))
    elif kind == "gla":
      heads.add(("gated", bench.HeadShape(c.n_heads, m.head_k_dim, m.head_v_dim, "channel")))
    elif kind == "cyfa":
      heads.add(("gated", bench.HeadShape(c.n_heads, c.head_dim, c.v_head_dim, c.forget)))
    elif kind == "taylor":
      heads.add(("taylor", bench.HeadShape(c.n_heads, c.feature_dim, m.head_dim)))
  return heads


def test_preset_shapes_are_the_heads_of_the_paper_presets():
  """``--shapes=preset`` times exactly the heads the paper presets of configs/ give each op."""
  import importlib

  found = set()
  for module in ("sanatan", "based", "baselines"):
    for name in importlib.import_module(f"configs.{module}").PRESETS:
      if "tiny" not in name:
        found |= _preset_heads(module, name)
  for op_name in ("sanatan_p1", "sanatan_p2", "gated", "taylor"):
    assert {shape for op, shape in found if op == op_name} == set(bench.PRESET_SHAPES[op_name]), op_name


def test_shape_sets_give_each_op_its_heads_once():
  gated = bench.shapes_for("gated", ["preset", "wide"])
  assert {(s.key, s.value) for s in gated} >= {(k, v) for k in bench.WIDE for v in bench.WIDE}
  assert all(s.heads * s.value == bench.WIDE_TOTAL for s in bench.WIDE_SHAPES["gated"])
  assert bench.shapes_for("sanatan_p2", ["default", "preset"]) == [bench.HeadShape(12, 64, 64),
                                                                    bench.HeadShape(8, 64, 64)]
  assert bench.shapes_for("softmax", ["preset", "wide"]) == [bench.DEFAULT_SHAPES["softmax"]]
  assert bench.shape_label("sanatan_p1", bench.HeadShape(12, 64, 64)) == ""
  assert bench.shape_label("gated", bench.HeadShape(4, 128, 128, "head")) == "H=4 K=128 V=128 gate=head"
  with pytest.raises(ValueError, match="set 'huge' in --shapes; valid: default, preset, wide"):
    bench.shapes_for("gated", ["huge"])


@pytest.mark.parametrize("op_name", ["sanatan_p1", "sanatan_p2", "gated", "taylor"])
def test_shaped_cases_take_inputs_of_their_heads(op_name):
  """At the widest "wide" shape every form "auto" chooses between traces on inputs of those heads."""
  shape = bench.WIDE_SHAPES[op_name][-1]
  args, cases, flops = bench.OPS[op_name](1, 16, "float32", shape)
  assert args[0].shape == (1, 16, shape.heads, shape.key)
  assert args[2].shape == (1, 16, shape.heads, shape.value)
  for name in bench.AUTO_CASES[op_name]:
    if isinstance(cases[name], str):  # a kernel that does not take these heads (a row with this note)
      continue
    assert jax.eval_shape(cases[name], *args).shape == args[2].shape, name
    assert flops[name] > 0


def test_taylor_cases_are_the_backends_that_take_the_heads():
  """The Triton kernels by their backend names (Mosaic's "pallas_tpu" only on a TPU); a kernel that does
  not take the heads is a note naming what it needs: dv 512 is past the blocked kernels, d' 64 past the
  fused-chunk ones."""
  _, cases, flops = bench.OPS["taylor"](1, 16, "bfloat16")
  kernels = {f"{name}{variant}" for name in ("pallas_blocked", "pallas_fused")
             for variant in ("", " (tf32)", " (float32)")}
  assert set(cases) == kernels | {"chunked (xla)", "parallel (reference)"}
  assert flops["pallas_blocked (tf32)"] == flops["parallel (reference)"] != flops["pallas_fused"]
  _, cases, _ = bench.OPS["taylor"](1, 16, "float32", bench.HeadShape(2, 16, 512))
  assert cases["pallas_blocked"] == "pallas_blocked needs no decay ablation and value dims up to 256"
  _, cases, _ = bench.OPS["taylor"](1, 16, "float32", bench.HeadShape(8, 64, 128))
  assert cases["pallas_fused"] == "pallas_fused needs no decay ablation and key dims up to 32"
  assert callable(cases["pallas_blocked"])


def test_gated_cases_take_a_gate_per_head_or_per_key_channel():
  per_head = bench.HeadShape(4, 128, 128, "head")
  args, cases, _ = bench.OPS["gated"](1, 16, "float32", per_head)
  assert args[3].shape == (1, 16, 4)
  assert jax.eval_shape(cases["pallas_triton"], *args).shape == (1, 16, 4, 128)
  args, _, _ = bench.OPS["gated"](1, 16, "float32", bench.HeadShape(2, 32, 16, "channel"))
  assert args[3].shape == (1, 16, 2, 32)


def test_rows_record_their_head_shape_and_compare_within_it(tmp_path, monkeypatch):
  """``--shapes=default,preset --auto_only`` on CPU with the timer replaced (a case "takes" K + V ms):
  a row per form and shape, the shape in the row, ratios against the same shape's XLA form, a heads
  column in the table; rows written before shapes existed read as default-shape rows."""
  monkeypatch.setattr(bench, "time_fwd_bwd",
                      lambda fn, args, repeats, lock="", queue=1: (1.0, float(args[0].shape[-1]
                                                                             + args[2].shape[-1])))
  jsonl = tmp_path / "kernels_16.jsonl"
  rows = bench.run_all(ops=["softmax", "gated"], lengths=[16], tokens=16, dtype="float32", repeats=1,
                       fla_ops=[], jsonl=str(jsonl), shapes=["default", "preset"], auto_only=True)
  labels = ["", *(s.label for s in bench.PRESET_SHAPES["gated"])]
  gated = [r for r in rows if r.op == "gated"]
  assert [(r.shape, r.impl) for r in gated] == [(label, impl) for label in labels
                                                for impl in ("chunked (xla)", "pallas_triton")]
  kernels = [r for r in gated if r.impl == "pallas_triton"]
  assert all(r.ratio_fwdbwd == 1.0 and r.reference == "gated/chunked (xla)" for r in kernels)
  assert [r.shape for r in rows if r.op == "softmax"] == [""]
  table = bench.format_table(rows)
  assert "| gated | pallas_triton | H=4 K=96 V=192 gate=channel | 16 | 1 |" in table
  assert "| gated | pallas_triton | H=12 K=64 V=64 gate=channel | 16 | 1 |" in table  # the default, named
  old = {"op": "gated", "impl": "pallas_triton", "length": 16, "batch": 1, "fwd_ms": 2.0, "fwdbwd_ms": 6.0,
         "flops_fwd": 1.0}
  (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
  loaded = bench.load_rows(str(tmp_path))  # old.jsonl is read after kernels_16.jsonl: its row wins
  assert [(r.shape, r.fwdbwd_ms) for r in loaded if r.op == "gated" and r.impl == "pallas_triton"][:2] == [
      ("", 6.0), ("H=4 K=96 V=192 gate=channel", 288.0)]


def test_only_the_named_cases_are_timed(tmp_path, monkeypatch):
  """``--case`` keeps the cases of those names (here XLA chunked at C = 64 beside the plain
  baseline), on CPU with the timer replaced."""
  monkeypatch.setattr(bench, "time_fwd_bwd", lambda fn, args, repeats, lock="", queue=1: (1.0, 2.0))
  only = ("chunked (xla)", "plain chunked (baseline)")
  rows = bench.run_all(ops=["sanatan_p1"], lengths=[16], tokens=16, dtype="float32", repeats=1,
                       fla_ops=[], jsonl=str(tmp_path / "rows.jsonl"), only=only)
  assert [r.impl for r in rows] == list(only)


def test_the_forms_auto_chooses_between_are_timed_first(tmp_path, monkeypatch):
  """Each op's AUTO_CASES, then its REFERENCE, then the rest: a time limit cuts the least needed rows."""
  monkeypatch.setattr(bench, "time_fwd_bwd", lambda fn, args, repeats, lock="", queue=1: (1.0, 2.0))
  rows = bench.run_all(ops=["sanatan_p2"], lengths=[16], tokens=16, dtype="float32", repeats=1,
                       fla_ops=[], jsonl=str(tmp_path / "rows.jsonl"))
  impls = [r.impl for r in rows]
  first = list(dict.fromkeys([*bench.AUTO_CASES["sanatan_p2"], bench.REFERENCE["sanatan_p2"]]))
  assert impls[:len(first)] == first == ["parallel (xla)", "pallas_flash"], impls
  assert impls[len(first):] == ["parallel (reference)"]  # after the decisive forms


def test_fwd_bwd_is_the_loss_and_its_gradient_and_keeps_a_recomputed_forward():
  """``fwd_bwd`` returns Σ o · do and its gradient with respect to every argument; for an op whose
  backward recomputes its forward (``jax.checkpoint``) the compiled program still runs the forward (two
  64³ matmuls more than the gradient alone, which XLA may compute without it)."""
  x = jax.random.normal(jax.random.key(0), (64, 64))
  w = jax.random.normal(jax.random.key(1), (64, 64)) / 8
  op = jax.checkpoint(lambda x, w: jnp.sin(x @ w) @ w)
  do = bench.cotangent(op, (x, w))
  loss, grads = jax.jit(bench.fwd_bwd(op, 2))(do, x, w)
  gradient_alone = jax.grad(lambda do, x, w: jnp.sum(op(x, w) * do), argnums=(1, 2))
  assert jnp.allclose(loss, jnp.sum(op(x, w) * do), rtol=1e-5)
  assert all(jnp.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(grads, gradient_alone(do, x, w)))

  def flops(fn):
    cost = jax.jit(fn).lower(do, x, w).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]

  assert flops(bench.fwd_bwd(op, 2)) >= flops(gradient_alone) + 2 * 2 * 64 ** 3


def test_time_fn_queues_calls_and_divides():
  """``queue`` calls are enqueued per sample, and the sample is divided by ``queue``."""
  calls = []
  assert bench.time_fn(lambda x: calls.append(x) or x, jnp.ones(2), repeats=3, queue=5) >= 0.0
  assert len(calls) == 4 + 3 * 5


def test_rows_per_queue_depth_compare_within_their_depth(tmp_path, monkeypatch):
  """``--queue=1,8``: a row per case and depth, each compared with softmax timed at its own depth (a
  softmax case "takes" 1 / queue ms, a gated one 4 / queue), a "calls per wait" column in the table;
  the second depth times the first one's compiled functions."""
  fake = lambda fn, args, repeats, lock="", queue=1: (1.0, (1.0 if len(args) == 3 else 4.0) / queue)
  monkeypatch.setattr(bench, "time_fwd_bwd", fake)
  rows = bench.run_all(ops=["softmax", "gated"], lengths=[16], tokens=16, dtype="float32", repeats=1,
                       fla_ops=[], jsonl=str(tmp_path / "rows.jsonl"), queues=(1, 8),
                       only=("softmax (xla)", "chunked (xla)"))
  assert [(r.op, r.queue) for r in rows] == [("softmax", 1), ("softmax", 8), ("gated", 1), ("gated", 8)]
  assert [r.vs_softmax for r in rows if r.op == "gated"] == [0.25, 0.25]
  table = bench.format_table(rows)
  assert "calls per wait" in table and "| gated | chunked (xla) | 16 | 1 | 8 | 1.000 | 0.500 |" in table
  assert len(bench.load_rows(str(tmp_path))) == 4
  op, args = (lambda x: 2.0 * x), (jnp.ones(4),)
  first, again = bench.compile_fwd_bwd(op, args), bench.compile_fwd_bwd(op, args)
  assert all(a is b for a, b in zip(first, again))
