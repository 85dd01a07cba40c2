"""Tiny models whose mixers run every Mosaic TPU kernel, for compiling on a v4 topology in tests
(``scripts/aot_compile.py --config=tests/scale/aot_presets.py:<preset>``).

  kernels    SANATAN p = 1 (its Mosaic kernels, "pallas_tpu"), gated linear attention (GLA) and Taylor
             attention
  p2         SANATAN p = 2 (XLA "parallel", the TPU path; no Mosaic kernel runs p = 2)
"""

from configs import common

MODEL = dict(vocab_size=512, d_model=128, mlp_hidden=256, dtype="bfloat16")
TRAIN = dict(batch_size=8, grad_accum=2, steps=10, warmup_steps=1)
DATA = dict(seq_len=384)  # no parameter has a dimension of 384: a gathered array with one is an activation
MESH = dict(data=2, fsdp=2, tensor=1)  # a v4-8 has 4 devices


def kernels():
  return common.experiment(
      model=dict(MODEL, n_layers=3, pattern="sanatan*1,gla*1,taylor*1"),
      mixers={"sanatan": dict(n_heads=2, head_dim=64, p=1, implementation="pallas_tpu"),
              "gla": dict(n_heads=2, implementation="pallas_tpu"),
              "taylor": dict(n_heads=2, feature_dim=16, implementation="pallas_tpu")},
      train=TRAIN, data=DATA, mesh=MESH)


def p2():
  return common.experiment(
      model=dict(MODEL, n_layers=1, pattern="sanatan*1"),
      mixers={"sanatan": dict(n_heads=2, head_dim=64, p=2, implementation="parallel")},
      train=TRAIN, data=DATA, mesh=MESH)


PRESETS = {"kernels": kernels, "p2": p2}


def get_config(arg=None):
  return common.select(PRESETS, arg, default="kernels")
