"""flash-linear-attention (PyTorch/Triton) on the benchmark's shapes, for side-by-side timing.

Its cases run only when torch and fla are installed (the GPU machine, wheels carried). Inputs are random
bf16 tensors in FLA's [B, T, H, D] layout, timed by ``harness.time_fwd_bwd`` as the JAX rows are (the
value and gradient of Σ o · do; CUDA-event medians after warm-up, FLA autotuning on its first calls).
"""

from __future__ import annotations

from benchmarks import rows

HEADS, HEAD_DIM, SANATAN_FEATURES = 12, 64, 384
TAYLOR_HEADS, TAYLOR_DIM = 16, 16


def run(log, ops, length, tokens, repeats, timer, lock="", queue=1):
  """Times FLA's kernels for ``ops`` (of "sanatan_p1", "gated", "taylor") into ``log``
  (``benchmarks.rows.RowLog``) by ``timer`` (``harness.time_fwd_bwd``, which the harness passes: it
  imports this module), ``queue`` calls per timing; rows it already has are skipped before any tensor is
  made. Warm-up (FLA's autotuning) and timing hold ``lock`` (``benchmarks.rows.exclusive``)."""
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
                   lambda op: timer(op, make_tensors(), repeats, lock, queue), flops,
                   queue=queue)

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
