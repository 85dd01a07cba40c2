"""Helpers shared by the Pallas kernels: backend choice, interpret mode, padding, in-kernel dots.

Triton blocks are powers of two (a dot's sides >= 16), so callers pad time to whole chunks and features
to ``block_size`` with zeros that the kernels mask or that contribute nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

TPU_LANES, TPU_SUBLANES = 128, 8  # a TPU vector register is (8 sublanes, 128 lanes)
MIN_DOT = 16  # the smallest side of a Triton tensor-core dot
# The GPU kernels' ``precision``: "input" (dot operands and outputs in the inputs' dtype), "tf32" and
# "float32" (the kernels run on fp32 copies and return fp32; fp32 dots on TF32 cores, or IEEE).
PRECISIONS = ("input", "tf32", "float32")


_ASSUMED_BACKEND: list[str] = []


@contextlib.contextmanager
def assume_backend(platform: str):
  """Within the block ``backend()`` says ``platform`` (tests reach a platform's paths from a CPU)."""
  _ASSUMED_BACKEND.append(platform)
  try:
    yield
  finally:
    _ASSUMED_BACKEND.pop()


def backend() -> str:
  """The platform kernels compile for: ``assume_backend``, else an abstract mesh's device, else JAX's."""
  if _ASSUMED_BACKEND:
    return _ASSUMED_BACKEND[-1]
  device = jax.sharding.get_abstract_mesh().abstract_device
  return jax.default_backend() if device is None else device.platform


def resolve_interpret(interpret: bool | None) -> bool:
  """The Triton kernels' interpret mode: None means wherever there is no GPU."""
  return backend() != "gpu" if interpret is None else interpret


def check_backend(interpret: bool, op: str, fallback: str) -> None:
  """Raises NotImplementedError when compiling for a backend these kernels do not target."""
  if not interpret and backend() != "gpu":
    raise NotImplementedError(
        f"{op}: the Pallas kernels target GPUs (Triton lowering); on {backend()!r} use "
        f"{fallback} or pass interpret=True")


def resolve_tpu_interpret(interpret, op: str, fallback: str):
  """The Mosaic kernels' ``interpret``: True (Pallas' interpreter), a ``pltpu.InterpretParams`` (the TPU
  simulator), None (interpret off TPU) or False (compile: TPUs only, else NotImplementedError)."""
  if interpret is None:
    interpret = backend() != "tpu"
  if interpret:
    return interpret
  if backend() != "tpu":
    raise NotImplementedError(f"{op}: the Mosaic kernels compile only for TPUs, not {backend()!r}; "
                              f"use {fallback} (XLA) or pass interpret=True")
  return False


def compiler_params(interpret: bool, num_warps: int, num_stages: int):
  """Triton compiler parameters; passing them is what selects the Triton lowering on JAX >= 0.9."""
  if interpret:
    return None
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def block_size(n: int, interpret: bool) -> int:
  """The power of two >= n that a kernel block of n channels is padded to (>= 16 when compiled)."""
  return max(pl.next_power_of_2(n), 1 if interpret else MIN_DOT)


def pad_axis(x: jax.Array, axis: int, size: int, mode: str = "constant") -> jax.Array:
  """Pads ``axis`` of ``x`` at the end up to ``size`` (zeros unless ``mode`` says otherwise)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, mode=mode)


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of ``multiple`` that is >= n."""
  return -(-n // multiple) * multiple


def check_precision(precision: str, op: str) -> None:
  if precision not in PRECISIONS:
    raise ValueError(f"{op}: unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")


def check_tpu_precision(precision: str, op: str) -> None:
  """Raises ValueError unless ``precision`` is "input", the only one the Mosaic kernels take."""
  if precision != "input":
    raise ValueError(f"{op}: kernel_precision={precision!r} is for the GPU kernels; the TPU "
                     f"kernels compute in the inputs' dtype: use kernel_precision='input', or pass "
                     f"fp32 inputs")


def kernel_options(precision: str, op: str) -> dict:
  """The keyword arguments that run an op's kernel at ``precision`` on this backend."""
  check_precision(precision, op)
  if backend() != "tpu":
    return {"precision": precision}
  check_tpu_precision(precision, op)
  return {}


def output_dtype(dtype, precision: str):
  """The dtype a kernel's output comes in: the inputs' ``dtype`` at "input", else fp32."""
  return dtype if precision == "input" else jnp.float32


def operands(precision: str, *xs: jax.Array) -> tuple[jax.Array, ...]:
  """``xs`` unchanged for "input", else fp32 copies (whose transpose casts the gradients back)."""
  return xs if precision == "input" else tuple(x.astype(jnp.float32) for x in xs)


# The precision of fp32 dots in the kernel being traced ("tf32" or IEEE), set by ``call``.
_FP32_DOTS: list[str] = []


@contextlib.contextmanager
def _fp32_dots(precision: str):
  _FP32_DOTS.append(precision)
  try:
    yield
  finally:
    _FP32_DOTS.pop()


def call(kernel, cfg, grid, in_specs, out_specs, out_shape, *args):
  """``pl.pallas_call`` of ``kernel(*refs, cfg=cfg)`` over ``grid`` with cfg's interpret flag,
  Triton warps and stages; its fp32 dots (``dot``) are traced at cfg's ``precision``."""
  with _fp32_dots(cfg.precision):
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=cfg.interpret,
        compiler_params=compiler_params(cfg.interpret, cfg.num_warps, cfg.num_stages))(*args)


def block_bytes(spec: pl.BlockSpec, x) -> int:
  """Bytes of one block of ``x`` (an array or ShapeDtypeStruct) under ``spec`` (None: a squeezed
  dimension of size 1)."""
  return math.prod(b if isinstance(b, int) else 1 for b in spec.block_shape) * jnp.dtype(x.dtype).itemsize


def pipeline_bytes(grid: tuple[int, ...], specs, arrays) -> int:
  """HBM bytes a ``pallas_call`` over ``grid`` copies for ``arrays`` in blocks ``specs`` (for its
  ``pl.CostEstimate``): a block is copied at every step of the innermost axis its index map moves
  with, probed one step along each axis from the origin (not for clamped maps)."""
  origin = (0,) * len(grid)
  total = 0
  for spec, x in zip(specs, arrays):
    base = tuple(spec.index_map(*origin))
    moved = [a for a in range(len(grid)) if grid[a] > 1
             and tuple(spec.index_map(*(int(b == a) for b in range(len(grid))))) != base]
    total += block_bytes(spec, x) * (math.prod(grid[:moved[-1] + 1]) if moved else 1)
  return total


def einsum_f32(spec: str, *operands: jax.Array) -> jax.Array:
  """``jnp.einsum`` accumulating (and returning) float32, for the XLA forms: low-precision operands
  (bf16) multiply as they are, float32 ones at full precision. On a CPU every operand is widened to
  float32 first (its dot has no bf16 x bf16 -> fp32 kernel for every layout)."""
  if backend() == "cpu":
    operands = tuple(x.astype(jnp.float32) for x in operands)
  full = any(x.dtype == jnp.float32 for x in operands)
  return jnp.einsum(spec, *operands, preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST if full else jax.lax.Precision.DEFAULT)


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
  """``a @ b`` (optionally transposing a 2-D operand) accumulated in fp32 inside a kernel; fp32
  operands in IEEE precision unless the kernel runs at "tf32" (``Precision.DEFAULT`` in Triton)."""
  contract = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  precision = None
  if a.dtype == jnp.float32:
    tf32 = _FP32_DOTS and _FP32_DOTS[-1] == "tf32"
    precision = jax.lax.Precision.DEFAULT if tf32 else jax.lax.Precision.HIGHEST
  return jax.lax.dot_general(a, b, contract, precision=precision,
                             preferred_element_type=jnp.float32)


def _parts(x: jax.Array, dtype, split: bool) -> tuple[jax.Array, ...]:
  """x as dot operands of ``dtype``: (x rounded), or with ``split`` an fp32 x as (hi, lo), hi = x
  rounded and lo = (x - hi) rounded."""
  hi = x.astype(dtype)
  if not split or x.dtype != jnp.float32 or jnp.dtype(dtype) == jnp.float32:
    return (hi,)
  return hi, (x - hi.astype(jnp.float32)).astype(dtype)


def split_dot(a: jax.Array, b: jax.Array, dtype, split: bool, *, trans_a: bool = False,
              trans_b: bool = False) -> jax.Array:
  """a @ b (``dot``) with operands of ``dtype``. With ``split``, each fp32 operand enters as two parts,
  hi = round(x) and lo = round(x - hi), and the products of the parts but lo · lo are summed: about
  twice the mantissa of ``dtype`` (bf16: 16 bits instead of 8) for two or three dots instead of one."""
  pairs = [(x, y) for i, x in enumerate(_parts(a, dtype, split))
           for j, y in enumerate(_parts(b, dtype, split)) if i + j < 2]
  return sum(dot(x, y, trans_a=trans_a, trans_b=trans_b) for x, y in pairs)


def _aligned(start, size: int):
  """Tells the compiler a traced row offset is a multiple of the block size (aligned loads)."""
  return start if isinstance(start, int) else pl.multiple_of(start, size)


def rows(ref, start, size: int):
  """Rows ``start : start + size`` of a kernel ref; ``start`` is a multiple of ``size``."""
  return ref[pl.ds(_aligned(start, size), size)]


def store_rows(ref, start, value: jax.Array) -> None:
  """Writes ``value`` into the rows of ``ref`` from ``start`` on (a multiple of its row count)."""
  size = value.shape[0]
  ref[pl.ds(_aligned(start, size), size)] = value


def lower_for_gpu(fn, *args, device_kind: str = "NVIDIA H200"):
  """Lowers ``jax.jit(fn)(*args)`` (args may be ShapeDtypeStructs) for a CUDA GPU from any host, through
  an abstract mesh whose device ``backend()`` sees: the Triton lowering runs without a GPU."""
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def lower_for_tpu(fn, *args, device_kind: str = "TPU v5p"):
  """``lower_for_gpu`` for a TPU: the Pallas Mosaic lowering (not libtpu's layout passes)."""
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="tpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
