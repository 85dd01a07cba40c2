"""Compiled gated kernel agreement (bf16 vs fp32 XLA highest), default shape, L=1000 B=2, variants."""
import sys, json, jax, jax.numpy as jnp
from benchmarks import harness as bench
from benchmarks.kernel_check import output_and_grads
from lmcore.ops.gated_linear_attention import pallas_triton as pallas
from lmcore.ops.gated_linear_attention import gated_linear_attention
out = open(sys.argv[1], "a") if len(sys.argv) > 1 else sys.stdout
args = bench._gated_args(2, 1000, jnp.bfloat16, None)
ref_args = tuple(a.astype(jnp.float32) for a in args)
xla = lambda q, k, v, g: gated_linear_attention(q, k, v, g, implementation="chunked", chunk_size=bench.CHUNK)[0]
ro, rg = output_and_grads(xla, ref_args, "highest")
rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel()) / jnp.linalg.norm(b.ravel()))
def report(name, fn):
  o, g = output_and_grads(fn, args)
  print(json.dumps(dict(name=name, o=rel(o, ro), grads=[rel(a, b) for a, b in zip(g, rg)])), file=out, flush=True)
report("xla bf16", xla)
for kw in ({}, {"split": True}, {"separate": True}, {"split": True, "separate": True}):
  report(f"pallas {kw}", lambda q, k, v, g, kw=kw: pallas.gated_linear_attention_pallas(q, k, v, g, **kw)[0])
