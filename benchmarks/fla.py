"""flash-linear-attention (PyTorch/Triton) on the benchmark's shapes, for side-by-side timing.

Its cases run only when torch and fla are installed (the GPU machine, wheels carried); ``fwd_bwd_ms``
also times ``benchmarks.xla_forms``'s FLA row.
Inputs are random bf16 tensors in FLA's [B, T, H, D] layout; times are medians of CUDA-event timings
after warm-up (FLA autotunes on first calls), each over ``queue`` calls launched back to back (divided
by ``queue``), as ``rows.time_fn`` does for the JAX rows.
"""

from __future__ import annotations

import statistics

from benchmarks import rows

HEADS, HEAD_DIM, SANATAN_FEATURES = 12, 64, 384
TAYLOR_HEADS, TAYLOR_DIM = 16, 16


def _time(torch, fn, repeats: int, queue: int) -> float:
  for _ in range(5):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(queue):
      fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / queue)
  return statistics.median(times)


def fwd_bwd_ms(torch, op, tensors, repeats: int, queue: int) -> tuple[float, float]:
  """(forward ms, forward+backward ms) of torch ``op`` on CUDA ``tensors``: medians of ``repeats`` CUDA-event
  timings of ``queue`` queued calls, after five warm-up calls (FLA autotunes on its first calls)."""
  def forward():
    with torch.no_grad():
      op(*tensors)

  grads = [t.requires_grad_(True) for t in tensors]

  def forward_backward():
    out = op(*grads)
    out.float().sum().backward()
    for g in grads:
      g.grad = None

  return _time(torch, forward, repeats, queue), _time(torch, forward_backward, repeats, queue)


def run(log, ops, length, tokens, repeats, lock="", queue=1):
  """Times FLA's kernels for ``ops`` (of "sanatan_p1", "gated", "taylor") into ``log``
  (``benchmarks.rows.RowLog``), ``queue`` calls per timing; rows it already has are skipped before any
  tensor is made. Warm-up (FLA's autotuning) and timing hold ``lock`` (``benchmarks.rows.exclusive``)."""
  import torch
  from fla.ops.based import fused_chunk_based, parallel_based
  from fla.ops.gla import chunk_gla
  from fla.ops.linear_attn import chunk_linear_attn

  batch = max(1, tokens // length)
  dev, bf16 = "cuda", torch.bfloat16

  def randn(*shape, scale=1.0):
    return (scale * torch.randn(*shape, device=dev, dtype=torch.float32)).to(bf16)

  def add(op_name, impl, op, make_tensors, flops):
    if op_name in ops:
      rows.measure(log, op_name, impl, length, batch, op,
                   lambda op: timed(op, make_tensors()), flops, queue=queue)

  def timed(op, tensors):
    with rows.exclusive(lock):
      return fwd_bwd_ms(torch, op, tensors, repeats, queue)

  # SANATAN p = 1 on precomputed 6d features (K = 384): FLA cannot fuse the feature map.
  phi_shape = (batch, length, HEADS, SANATAN_FEATURES)
  add("sanatan_p1", "FLA chunk_linear_attn (features precomputed)",
      lambda q, k, v: chunk_linear_attn(q, k, v, scale=1.0, normalize=True)[0],
      lambda: [randn(*phi_shape).abs() * 0.1, randn(*phi_shape).abs() * 0.1,
               randn(batch, length, HEADS, HEAD_DIM)],
      rows.chunked_flops(batch, length, HEADS, SANATAN_FEATURES, HEAD_DIM))
  gla_shape = (batch, length, HEADS, HEAD_DIM)
  add("gated", "FLA chunk_gla",
      lambda q, k, v, g: chunk_gla(q, k, v, g)[0],
      lambda: [randn(*gla_shape, scale=0.125), randn(*gla_shape, scale=0.125), randn(*gla_shape),
               torch.nn.functional.logsigmoid(torch.randn(*gla_shape, device=dev) + 4.0) / 16],
      rows.chunked_flops(batch, length, HEADS, HEAD_DIM, HEAD_DIM))
  taylor_qk = (batch, length, TAYLOR_HEADS, TAYLOR_DIM)
  taylor_v = (batch, length, TAYLOR_HEADS, HEAD_DIM)
  for name, fn in (("FLA parallel_based", parallel_based), ("FLA fused_chunk_based", fused_chunk_based)):
    add("taylor", name, lambda q, k, v, fn=fn: fn(q, k, v, use_norm=True),
        lambda: [randn(*taylor_qk, scale=0.5), randn(*taylor_qk, scale=0.5), randn(*taylor_v)],
        rows.chunked_flops(batch, length, TAYLOR_HEADS, 153, HEAD_DIM))
