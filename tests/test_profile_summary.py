"""The kernel-time breakdown of a traced step (benchmarks/profile_summary.py) on synthetic traces: which
rows hold device ops (GPU streams, not the summary rows of the device or the host's launches; host ops
on the CPU backend, innermost only), the category and scope of each op from its kernel name and its
HLO instruction, per-step totals, the top kernels and the markdown and JSON files."""

import gzip
import json
import os
import time

import pytest

from benchmarks import profile_summary as ps

HLO = """HloModule jit_train_step, is_scheduled=true

%fused_computation.1 (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %multiply.1 = f32[8]{0} multiply(%param_0, %param_0), metadata={op_name="jit(train_step)/jvp(cross_entropy)/mul"}
}

ENTRY %main.9 (p: f32[8,8]) -> (f32[8,8], f32[]) {
  %p = f32[8,8]{1,0} parameter(0)
  %custom-call.3 = (bf16[8,8]{1,0}, s8[64]{0}) custom-call(%p, %p), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/jvp(mlp)/dot_general" stack_frame_id=3}
  %custom-call.5 = bf16[8,8]{1,0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"_forward_kernel"}, metadata={op_name="jit(train_step)/jvp(mixer)/pallas_call"}
  %custom-call.6 = bf16[8,8]{1,0} custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(train_step)/jvp(mixer)/dot_product_attention"}
  %loop_multiply_fusion = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(train_step)/jvp(cross_entropy)/mul"}
  %loop_add_fusion.2 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(train_step)/optimizer/add"}
  %input_reduce_fusion = f32[8]{0} fusion(%p), kind=kInput, calls=%fused_computation.1, metadata={op_name="jit(train_step)/transpose(jvp(mixer))/reduce_sum"}
  %gemm_fusion_dot.1 = bf16[8,8]{1,0} fusion(%p), kind=kCustom, calls=%fused_computation.1, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}, metadata={op_name="jit(train_step)/transpose(jvp(mlp))/dot_general"}
  %copy.4 = f32[8,8]{0,1} copy(%p)
  %all-reduce-start = f32[8,8]{1,0} all-reduce-start(%p), metadata={op_name="jit(train_step)/psum"}
  ROOT %tuple = (f32[8,8]{1,0}, f32[]) tuple(%p, %p)
}
"""


def _meta(pid, name, tid=None):
  if tid is None:
    return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
  return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _op(pid, tid, ts, dur, name, hlo_op="", module="jit_train_step", **args):
  if hlo_op:
    args = {"hlo_op": hlo_op, "hlo_module": module, **args}
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def gpu_trace():
  """Two steps on GPU 0: kernels on two streams (one overlap), the device's summary rows (which repeat
  the same time), the host's launch events (which name HLO ops too) and a kernel of another module."""
  kernels = [  # (stream, name, hlo_op, µs)
      (7, "nvjet_tst_128x256_64x4_2x1_v_bz", "custom-call.3", 100),
      (9, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all-reduce-start", 30),
      (7, "_forward_kernel", "custom-call.5", 60),
      (7, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "custom-call.6", 50),
      (7, "loop_multiply_fusion", "loop_multiply_fusion", 40),
      (7, "loop_add_fusion_2", "loop_add_fusion.2", 30),
      (7, "input_reduce_fusion", "input_reduce_fusion", 20),
      (7, "triton_gemm_dot_1", "gemm_fusion_dot.1", 80),
      (7, "copy_4", "copy.4", 10),
      (7, "mystery", "", 5),
  ]
  events = [_meta(1, "/device:GPU:0"), _meta(1, "Stream #7(Kernel,MemcpyD2D)", 7),
            _meta(1, "Stream #9(Kernel)", 9), _meta(1, "XLA Ops", 100), _meta(1, "XLA Modules", 101),
            _meta(2, "/host:CPU"), _meta(2, "python", 5)]
  for step in range(2):
    t = 10_000.0 * step
    events.append(_op(1, 101, t, 500, "jit_train_step(1)"))
    for stream, name, hlo_op, us in kernels:
      start = t + 5 if stream == 9 else t  # the collective overlaps the stream-7 kernel running then
      events.append(_op(1, stream, start, us, name, hlo_op))
      events.append(_op(1, 100, start, us, hlo_op or name, hlo_op))
      events.append(_op(2, 5, start, 2, "Thunk", hlo_op or "x"))
      t += 0 if stream == 9 else us
    events.append(_op(1, 7, t + 1, 1000, "other_module_kernel", "fusion", module="jit_init"))
  return {"displayTimeUnit": "ns", "traceEvents": events}


def test_gpu_streams_are_the_device_rows():
  rows, source = ps.device_rows(gpu_trace()["traceEvents"])
  assert rows == {(1, 7), (1, 9)} and source.startswith("GPU streams of /device:GPU:0")


def test_categories_scopes_and_totals_of_a_gpu_trace():
  b = ps.summarize(gpu_trace(), steps=2, hlo_text=HLO, step_ms=1.0)
  by_category = {c["category"]: c for c in b.categories}
  assert {k: v["ms"] * 1e3 for k, v in by_category.items()} == pytest.approx({
      "matmul": 180, "pallas/triton": 60, "attention": 50, "loss": 40, "optimizer": 30,
      "elementwise/reduction": 20, "copy/transpose": 10, "collective": 30, "other": 5})
  assert b.op_ms == pytest.approx(0.425) and b.ops_per_step == 10 and b.rows == 2
  assert b.busy_ms == pytest.approx(0.395)  # the collective ran during another kernel
  assert sum(c["share"] for c in b.categories) == pytest.approx(1.0)
  scopes = {s["scope"]: s for s in b.scopes}
  assert (scopes["mlp"]["forward_ms"], scopes["mlp"]["backward_ms"]) == pytest.approx((0.1, 0.08))
  assert (scopes["mixer"]["ms"], scopes["mixer"]["backward_ms"]) == pytest.approx((0.13, 0.02))
  assert (scopes["optimizer"]["outside_ms"], scopes["loss"]["forward_ms"]) == pytest.approx((0.03, 0.04))
  assert b.top[0] == {"kernel": "nvjet_tst_128x256_64x4_2x1_v_bz", "category": "matmul", "scope": "mlp",
                      "count": 1, "ms": pytest.approx(0.1), "mean_us": 100, "share": pytest.approx(100 / 425)}
  assert {"_forward_kernel", "loop_add_fusion", "triton_gemm_dot"} <= {k["kernel"] for k in b.top}
  assert len(ps.summarize(gpu_trace(), steps=2, hlo_text=HLO, top=3).top) == 3


def test_the_kernel_name_alone_categorizes_without_the_hlo():
  assert ps.categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "") == "matmul"
  assert ps.categorize("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "") == "attention"
  assert ps.categorize("MemcpyD2D", "") == "copy/transpose"
  assert ps.categorize("loop_transpose_fusion", "") == "copy/transpose"
  assert ps.categorize("input_reduce_fusion", "") == "elementwise/reduction"
  assert ps.categorize("loop_multiply_fusion", "jit(train_step)/transpose(jvp(cross_entropy))/mul") == "loss"
  assert ps.categorize("some_kernel", "jit(train_step)/jvp(mixer)/pallas_call") == "pallas/triton"
  assert ps.categorize("some_kernel", "") == "other"
  assert ps.categorize("_dkv_kernel", "") == "pallas/triton"  # a Pallas kernel's function name (H200 trace)
  assert ps.categorize("_factors_kernel_", "") == "pallas/triton"  # its second call in the step
  assert ps.scope_of("jit(train_step)/transpose(jvp(jvp()))/checkpoint/rematted_computation/mlp/mul") == "mlp"
  assert ps.scope_of("jit(train_step)/jvp(mixer_norm)/mul") == "other"


def test_the_kernels_annotation_gives_the_scope_without_the_hlo():
  b = ps.summarize(gpu_trace(), steps=2)
  assert {s["scope"] for s in b.scopes} == {"other"}
  trace = gpu_trace()
  for e in trace["traceEvents"]:
    if e.get("tid") == 7 and e["name"] == "loop_multiply_fusion":
      e["args"]["name"] = "transpose(jvp(cross_entropy))/mul"
  b = ps.summarize(trace, steps=2)
  assert {c["category"]: c["ms"] for c in b.categories}["loss"] == pytest.approx(0.04)


def test_cpu_backend_reads_host_ops_innermost_only():
  events = [_meta(1, "/device:CUSTOM:Megascale Trace"), _meta(2, "/host:CPU"), _meta(2, "tf_XLAEigen/1", 3),
            _op(2, 3, 0, 100, "while.2", "while.2"), _op(2, 3, 10, 30, "dot.1", "dot.1"),
            _op(2, 3, 50, 40, "wrapped_tanh", "wrapped_tanh"), _op(2, 3, 90, 0.5, "end: wrapped_tanh"),
            _op(2, 3, 200, 5, "ThreadpoolListener::Record")]
  rows, source = ps.device_rows(events)
  assert rows is None and "CPU backend" in source
  ops = ps.op_events(events, rows)
  assert [op.name for op in ops] == ["dot.1", "wrapped_tanh"]
  b = ps.summarize(events, steps=1)
  assert b.op_ms == pytest.approx(0.07) and [c["category"] for c in b.categories] == [
      "matmul", "elementwise/reduction"]


def test_a_device_without_op_rows_says_so():
  events = [_meta(1, "/device:GPU:0"), _meta(1, "XLA Modules", 1), _op(1, 1, 0, 10, "jit_train_step(1)"),
            _meta(2, "/host:CPU"), _meta(2, "main", 2), _op(2, 2, 0, 5, "Thunk", "fusion.1")]
  b = ps.summarize(events, steps=2)
  assert b.op_ms == 0 and not b.categories and "no device ops found" in b.note
  assert "no device ops found" in ps.to_markdown(b, "x")


def test_hlo_instructions_give_kind_and_op_name():
  module, ops = ps.hlo_ops(HLO)
  assert module == "jit_train_step"
  assert ops["custom-call.3"] == ps.HloOp("custom-call __cublas$gemm", "jit(train_step)/jvp(mlp)/dot_general")
  assert ops["gemm_fusion_dot.1"].kind == "fusion __triton_gemm"
  assert ops["multiply.1"].op_name == "jit(train_step)/jvp(cross_entropy)/mul"
  assert ops["copy.4"] == ps.HloOp("copy", "")


def test_markdown_and_json_files(tmp_path):
  b = ps.summarize(gpu_trace(), steps=2, hlo_text=HLO, step_ms=1.25)
  md, js = ps.write(b, str(tmp_path), ps.file_stem("sanatan:tiny", "train.loss_impl=fused"), "sanatan:tiny")
  assert md.endswith("sanatan_tiny_train.loss_impl=fused_breakdown.md")
  text = open(md).read()
  assert "### Kernel time per train step: sanatan:tiny" in text and "the timed step took 1.25 ms" in text
  assert "| matmul | 0.180 | 42.4% | 2 |" in text and "| total | 0.425 | 100% | 10 |" in text
  assert "| mlp | 0.180 | 42.4% | 0.100 | 0.080 | 0.000 |" in text
  assert "| `nvjet_tst_128x256_64x4_2x1_v_bz` | matmul | mlp | 1 | 0.100 | 100.0 | 23.5% |" in text
  data = json.load(open(js))
  assert data["steps"] == 2 and data["categories"][0]["category"] == "collective"


def test_load_trace_reads_the_newest_run(tmp_path):
  for i, run in enumerate(["old", "new"]):
    folder = tmp_path / "plugins" / "profile" / run
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
      json.dump({"traceEvents": [{"ph": "M", "name": run}]}, f)
    os.utime(folder, (time.time() + i, time.time() + i))
  assert ps.load_trace(str(tmp_path))["traceEvents"][0]["name"] == "new"
  with pytest.raises(FileNotFoundError, match="no trace JSON"):
    ps.load_trace(str(tmp_path / "nothing"))
