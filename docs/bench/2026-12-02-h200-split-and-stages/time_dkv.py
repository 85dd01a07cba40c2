"""Fused p=1 op fwd+bwd ms with dk/dv kernel variants (base, a, b), one process, two rounds."""
import sys, json, jax, jax.numpy as jnp
sys.path.insert(0, ".dev")
import fused_v
from benchmarks import harness as bench
lock = sys.argv[1] if len(sys.argv) > 1 else ""
kernels = {"base": fused_v._dkv_kernel, "a": fused_v._dkv_kernel_a, "b": fused_v._dkv_kernel_b}
out = open(sys.argv[2], "a") if len(sys.argv) > 2 else sys.stdout
for B, T in ((32, 2048), (8, 2048)):
  args = bench._sanatan_args(B, T, jnp.bfloat16)
  for rnd in range(2):
    for name, kern in kernels.items():
      fused_v._dkv_kernel = kern
      fn = lambda q, k, v, w, l, name=name, rnd=rnd: fused_v.sanatan_fused_pallas(q, k, v, w, l)[0]
      fwd, fb = bench._fwd_and_fwdbwd(fn, args, 20, lock)
      print(json.dumps(dict(B=B, T=T, variant=name, round=rnd, fwd_ms=fwd, fwdbwd_ms=fb)), file=out, flush=True)
