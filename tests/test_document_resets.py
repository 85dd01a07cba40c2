"""Packed documents (MATH §6.4): for every op and every implementation that takes segment ids, a row
that packs several documents gives exactly what running each document on its own gives.

The reference is the op's plainest form run once per document (no segment ids at all), the first
document of a row continuing the row's incoming state and every later one starting from zero. The
packed call must match it in outputs, final state and gradients (of a random projection of outputs
and final state, with respect to every input, the incoming state and shared parameters).

Resets must be tested where forgetting is slow. Each head runs its own decay regime: none (log gate
0), weak (log gate about -1e-3) and strong (-0.01 to -2). With strong decay a state carried across a
boundary has all but vanished by the time it is read, so a missing reset goes unnoticed; without
decay it is read at full weight. Layout (T = 40, chunks of 16): documents end mid-chunk, at a chunk
start, are one token long (at a row's start and in its middle), cross chunk boundaries, and row 1
reuses an id for two documents that are not adjacent (a document is a run of equal ids).

Implementations come from each op's registry at collection time. The Pallas kernels run in interpret
mode here (slow), so they get one case each. Tolerance: relative L2 per head, fp32 (the forms differ
in summation order only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.ops.taylor_attention import api as taylor_api
from based_jax.ops.taylor_attention import taylor_linear_attention
from based_jax.taylor import taylor_features
from lmcore.numerics import relative_l2
from lmcore.ops.common.backend import ChunkTiles
from lmcore.ops.gated_delta_rule import api as delta_api
from lmcore.ops.gated_delta_rule import gated_delta_rule
from lmcore.ops.gated_linear_attention import api as gla_api
from lmcore.ops.gated_linear_attention import gated_linear_attention
from sanatan_jax.ops.sanatan_attention import api as sanatan_api
from sanatan_jax.ops.sanatan_attention import Problem as SanatanProblem
from sanatan_jax.ops.sanatan_attention import sanatan_attention
from sanatan_jax.ops.sanatan_attention.xla import ParallelTiles

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
OUT_TOL, GRAD_TOL = 1e-5, 1e-4
CHUNK = 16
# Document lengths and segment ids per row (T = 40). Row 0: ends at 5 (mid-chunk), 16 (a chunk
# start), a one-token document, then 23 tokens across the chunk boundary at 32. Row 1: a one-token
# document continuing the incoming state, then ids 9 and 4 again (a new document: the id changed).
LENGTHS = ((5, 11, 1, 23), (1, 16, 23))
IDS = ((3, 8, 1, 6), (4, 9, 4))
T = 40
B = len(LENGTHS)
REGIMES = ("none", "weak", "strong")  # the decay of heads 0, 1, 2
# The defining forms (masks over a T x T matrix, or a state zeroed token by token) get the first case
# and no gradient check (their backward is autodiff of the definition); the chunked forms (document
# masks inside chunks, states handed between chunks) and the kernels (custom backward passes) get
# every case and gradients.
REFERENCE_FORMS = ("reference", "recurrent", "parallel")


def _documents():
  """(row, start, length, is_first, is_last) of every document."""
  docs = []
  for row, lengths in enumerate(LENGTHS):
    starts = np.cumsum((0,) + lengths[:-1])
    for i, (start, length) in enumerate(zip(starts, lengths)):
      docs.append((row, int(start), length, i == 0, i == len(lengths) - 1))
  return docs


DOCS = _documents()
L = max(length for _, _, length, _, _ in DOCS)
assert all(sum(lengths) == T for lengths in LENGTHS)
# The reference runs every document in its own row of L tokens, the document first (later tokens
# cannot change earlier outputs); the last document of each row is L long, so its final state is
# the state after the document's last token.
assert all(length == L for _, _, length, _, last in DOCS if last)
SEGMENT_IDS = jnp.asarray([np.repeat(ids, lengths) for ids, lengths in zip(IDS, LENGTHS)], jnp.int32)


def implementations(api) -> list[str]:
  """Every backend name of an op's registry."""
  return list(api.REGISTRY.names)


def chunk_tiles(api, implementation: str, chunk: int = CHUNK):
  """The backend's tiles at chunks of ``chunk`` tokens where it has tiles, else None."""
  tiled = api.REGISTRY.backends[implementation].tiles_type is not None
  return api.REGISTRY.tiles(implementation, {"chunk": chunk}, "test") if tiled else None


def is_kernel(name: str) -> bool:
  return name.startswith("pallas")


def document_positions(first_position_B) -> jnp.ndarray:
  """Positions restarting at 0 with every document; the first continues from ``first_position``."""
  positions = np.zeros((B, T), np.int32)
  for row, start, length, first, _ in DOCS:
    positions[row, start:start + length] = np.arange(length) + (first_position_B[row] if first else 0)
  return jnp.asarray(positions)


def _gather_rows():
  """Index arrays [D, L] that cut each document's row out of [B, T] (the document first, then
  the tokens after it, wrapping round: real inputs, whose outputs are never compared)."""
  rows = np.asarray([[row] * L for row, *_ in DOCS])
  cols = np.asarray([(start + np.arange(L)) % T for _, start, *_ in DOCS])
  return rows, cols


def to_documents(x_BxT):
  rows, cols = _gather_rows()
  return x_BxT[rows, cols]


def from_documents(x_DxL):
  """The inverse of ``to_documents`` on each document's own tokens: [D, L, ...] -> [B, T, ...]."""
  out = np.zeros((B, T) + x_DxL.shape[2:], np.float64)
  for d, (row, start, length, _, _) in enumerate(DOCS):
    out[row, start:start + length] = x_DxL[d, :length]
  return out


def first_rows(x_Bx):
  """Row state per document: the row's for its first document, zeros for the others."""
  rows = np.asarray([row for row, *_ in DOCS])
  first = np.asarray([f for *_, f, _ in DOCS])
  x = x_Bx[rows]
  return jnp.where(first.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


def _by_row(x_Dx, pick):
  """Rows of a per-document array selected by ``pick(first, last)``, in row order -> [B, ...]."""
  out = [None] * B
  for d, (row, _, _, first, last) in enumerate(DOCS):
    if pick(first, last):
      out[row] = np.asarray(x_Dx[d])
  return np.stack(out)


def _document_output_weights(w_BxT):
  """Output weights on each document's own tokens, zero on the tokens after it."""
  w = np.array(to_documents(w_BxT))
  for d, (_, _, length, _, _) in enumerate(DOCS):
    w[d, length:] = 0.0
  return jnp.asarray(w)


def _document_state_weights(w_Bx):
  """Final-state weights: the row's on its last document, zero elsewhere."""
  rows = np.asarray([row for row, *_ in DOCS])
  last = np.asarray([last for *_, last in DOCS])
  w = w_Bx[rows]
  return jnp.where(last.reshape((-1,) + (1,) * (w.ndim - 1)), w, jnp.zeros_like(w))


@functools.cache
def _jitted(call, grads: bool):
  """jit of <o, w_o> + sum <S_i, w_S_i> over the float leaves of the final state, and with ``grads``
  its gradient with respect to the per-token inputs, shared parameters and the float leaves of the
  incoming state."""

  def loss(tokens, shared, state, int_state, weights, segment_ids, positions):
    o, new = call(tokens, shared, {**state, **int_state}, segment_ids, positions)
    total = (o.astype(jnp.float32) * weights["o"]).sum()
    new = {} if new is None else new
    for name, w in weights["state"].items():
      total += (new[name] * w).sum()
    return total, (o, new)

  if not grads:
    return jax.jit(lambda *args: (loss(*args), ({}, {}, {})), compiler_options=FAST_COMPILE)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                 compiler_options=FAST_COMPILE)


def _run(call, tokens, shared, state, weights, segment_ids, positions, grads=True):
  """(o, final state, (d tokens, d shared, d state)); the gradients empty without ``grads``."""
  float_state = {k: v for k, v in state.items() if jnp.issubdtype(v.dtype, jnp.floating)}
  int_state = {k: v for k, v in state.items() if k not in float_state}
  (_, (o, new)), gradients = _jitted(call, grads)(tokens, shared, float_state, int_state, weights,
                                                  segment_ids, positions)
  return jax.device_get((o, new, gradients))


@functools.cache
def separate_documents(op: str, case: str, reference: str):
  """Outputs, final states and gradients of each document run alone, scattered back to [B, T]."""
  problem = PROBLEMS[op](case)
  weights = problem["weights"]
  doc_weights = {"o": _document_output_weights(weights["o"]),
                 "state": {k: _document_state_weights(w) for k, w in weights["state"].items()}}
  doc_tokens = {k: to_documents(v) for k, v in problem["tokens"].items()}
  doc_state = {k: first_rows(v) for k, v in problem["state"].items()}
  o, new, (g_tokens, g_shared, g_state) = _run(problem["call"](reference), doc_tokens,
                                               problem["shared"], doc_state, doc_weights, None, None)
  return {"o": from_documents(o),
          "state": {k: _by_row(v, lambda first, last: last) for k, v in new.items()},
          "grad_tokens": {k: from_documents(v) for k, v in g_tokens.items()},
          "grad_shared": g_shared,
          "grad_state": {k: _by_row(v, lambda first, last: first) for k, v in g_state.items()}}


def assert_equals_separate_documents(op: str, case: str, implementation: str, reference: str,
                                     heads=REGIMES):
  """Outputs and final state per head (regime); gradients too, except for the reference forms."""
  problem = PROBLEMS[op](case)
  want = separate_documents(op, case, reference)
  state = problem["state"]
  positions = document_positions(np.asarray(state["position"]) if "position" in state
                                 else np.zeros(B, np.int32))
  o, new, (g_tokens, g_shared, g_state) = _run(
      problem["call"](implementation), problem["tokens"], problem["shared"], state, problem["weights"],
      SEGMENT_IDS, positions, grads=implementation not in REFERENCE_FORMS)
  compared = {"o": (o, want["o"], 2, OUT_TOL)}
  compared.update({f"final {k}": (new[k], want["state"][k], 1, OUT_TOL) for k in want["state"]
                   if k != "position"})
  compared.update({f"d{k}": (g_tokens[k], want["grad_tokens"][k], 2, GRAD_TOL) for k in g_tokens})
  compared.update({f"d{k}": (g_shared[k], want["grad_shared"][k], 0, GRAD_TOL) for k in g_shared})
  compared.update({f"d state.{k}": (g_state[k], want["grad_state"][k], 1, GRAD_TOL) for k in g_state})
  if "position" in want["state"]:
    np.testing.assert_array_equal(new["position"], want["state"]["position"])
  errors = {}
  for name, (got, expected, head_axis, tol) in compared.items():
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    for h, label in enumerate(heads):
      e = relative_l2(np.take(got, h, head_axis), np.take(expected, h, head_axis))
      if not e <= tol:
        errors[f"{name} [{label}]"] = e
  assert not errors, (f"{op} {case} implementation={implementation!r}: packed documents differ from "
                      f"the documents run separately (relative L2 per head): {errors}")


# --------------------------------------------------------------------------------------- problems


def _normal(rng, *shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _log_gates(rng, *shape):
  """Log forget gates [B, T, 3, ...]: head 0 none, head 1 weak (~ -1e-3), head 2 strong."""
  weak = -rng.uniform(5e-4, 2e-3, size=shape)
  strong = -rng.uniform(0.01, 2.0, size=shape)
  g = np.stack([np.zeros(shape), weak, strong], axis=2)
  return jnp.asarray(g, jnp.float32)


def _weights(rng, o_shape, state_shapes):
  return {"o": _normal(rng, *o_shape), "state": {k: _normal(rng, *s) for k, s in state_shapes.items()}}


@functools.cache
def gla_problem(case: str):
  """case "channel": per-key-channel gates, normalised (z in the state); "head": a scalar gate per
  head, not normalised."""
  rng = np.random.default_rng(1)
  H, K, V = 3, 8, 5
  normalize = case == "channel"
  q, k = _normal(rng, B, T, H, K), _normal(rng, B, T, H, K)
  if normalize:  # positive features, as the feature maps of normalised attention give
    q, k = jnp.abs(q) + 0.1, jnp.abs(k) + 0.1
  gates = _log_gates(rng, B, T, K) if case == "channel" else _log_gates(rng, B, T)
  state = {"S": _normal(rng, B, H, K, V)}
  state["z"] = (jnp.asarray(rng.uniform(0.5, 2.0, (B, H, K)), jnp.float32) if normalize
                else jnp.zeros((B, H, K), jnp.float32))
  shapes = {"S": (B, H, K, V), "z": (B, H, K)} if normalize else {"S": (B, H, K, V)}

  def call(implementation):
    def run(tokens, shared, state, segment_ids, positions):
      o, new = gated_linear_attention(
          tokens["q"], tokens["k"], tokens["v"], tokens["log_forget"], implementation=implementation,
          state=gla_api.LinearAttentionState(state["S"], state["z"]),
          tiles=chunk_tiles(gla_api, implementation),
          normalize=normalize, segment_ids=segment_ids)
      return o, {"S": new.S, "z": new.z}
    return run

  return {"tokens": {"q": q, "k": k, "v": _normal(rng, B, T, H, V), "log_forget": gates},
          "shared": {}, "state": state, "weights": _weights(rng, (B, T, H, V), shapes), "call": call}


@functools.cache
def delta_problem(case: str):
  rng = np.random.default_rng(2)
  H, K, V = 3, 8, 5
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  tokens = {"q": unit(_normal(rng, B, T, H, K)), "k": unit(_normal(rng, B, T, H, K)),
            "v": _normal(rng, B, T, H, V), "log_alpha": _log_gates(rng, B, T),
            "beta": jax.nn.sigmoid(_normal(rng, B, T, H))}

  def call(implementation):
    def run(tokens, shared, state, segment_ids, positions):
      o, new = gated_delta_rule(tokens["q"], tokens["k"], tokens["v"], tokens["log_alpha"],
                                tokens["beta"], implementation=implementation,
                                state=delta_api.DeltaRuleState(state["S"]),
                                tiles=chunk_tiles(delta_api, implementation),
                                segment_ids=segment_ids)
      return o, {"S": new.S}
    return run

  return {"tokens": tokens, "shared": {}, "state": {"S": _normal(rng, B, H, K, V)},
          "weights": _weights(rng, (B, T, H, V), {"S": (B, H, K, V)}), "call": call}


@functools.cache
def sanatan_problem(case: str):
  """case "p1": p = 1, six channels, continuing a state built from a 7-token prefix; "p2": p = 2
  (no state: every row starts at position 0)."""
  rng = np.random.default_rng(3)
  H, d, dv = 2, 4, 5
  p = 1 if case == "p1" else 2
  tokens = {"q": _normal(rng, B, T, H, d) / d**0.5, "k": _normal(rng, B, T, H, d) / d**0.5,
            "v": _normal(rng, B, T, H, dv)}
  shared = {"omega": _normal(rng, H, d), "lam_raw": _normal(rng, H, d) - 2.0}
  state, shapes = {}, {}
  if p == 1:
    prefix = [_normal(rng, B, 7, H, n) for n in (d, d, dv)]
    _, after_prefix = sanatan_attention(*prefix, shared["omega"], shared["lam_raw"],
                                        implementation="recurrent")
    state = after_prefix._asdict()
    shapes = {"S": state["S"].shape, "z": state["z"].shape}

  tiles = {"chunked": ChunkTiles(CHUNK), "parallel": ParallelTiles(CHUNK)}

  def call(implementation):
    def run(tokens, shared, state, segment_ids, positions):
      incoming = sanatan_api.SanatanState(**state) if state else None
      o, new = sanatan_attention(tokens["q"], tokens["k"], tokens["v"], shared["omega"],
                                 shared["lam_raw"], positions=positions, segment_ids=segment_ids,
                                 p=p, implementation=implementation, state=incoming,
                                 tiles=tiles.get(implementation))
      return o, (None if new is None else new._asdict())
    return run

  return {"tokens": tokens, "shared": shared, "state": state,
          "weights": _weights(rng, (B, T, H, dv), shapes), "call": call}


# Taylor's tiled backends at chunks or blocks of CHUNK tokens.
TAYLOR_TILES = {"chunked": {"chunk": CHUNK}, "pallas_blocked": {"block_q": CHUNK, "block_k": CHUNK},
                "pallas_fused": {"chunk": CHUNK}, "pallas_tpu": {"chunk": CHUNK}}


@functools.cache
def taylor_problem(case: str):
  """case "decay": the decay ablation, gamma per head 1 (none), exp(-1e-3) (weak), exp(-1)
  (strong), with dt; "plain": no decay (the released models, and all the kernels take)."""
  rng = np.random.default_rng(4)
  H, d, dv = 3, 4, 5
  tokens = {"q": _normal(rng, B, T, H, d), "k": _normal(rng, B, T, H, d), "v": _normal(rng, B, T, H, dv)}
  shared = {}
  if case == "decay":
    tokens["dt"] = jnp.asarray(rng.uniform(0.5, 1.5, (B, T, H)), jnp.float32)
    shared["decay"] = jnp.exp(jnp.asarray([0.0, -1e-3, -1.0], jnp.float32))
  phi_k = taylor_features(_normal(rng, B, 6, H, d))
  state = {"S": jnp.einsum("bthf,bthv->bhfv", phi_k, _normal(rng, B, 6, H, dv)), "z": phi_k.sum(1)}

  def call(implementation):
    tiles = taylor_api.REGISTRY.tiles(implementation, TAYLOR_TILES.get(implementation), "Taylor tiles")

    def run(tokens, shared, state, segment_ids, positions):
      o, new = taylor_linear_attention(tokens["q"], tokens["k"], tokens["v"],
                                       implementation=implementation,
                                       state=taylor_api.TaylorState(state["S"], state["z"]),
                                       tiles=tiles, decay=shared.get("decay"),
                                       dt=tokens.get("dt"), segment_ids=segment_ids)
      return o, {"S": new.S, "z": new.z}
    return run

  return {"tokens": tokens, "shared": shared, "state": state,
          "weights": _weights(rng, (B, T, H, dv), {"S": state["S"].shape, "z": state["z"].shape}),
          "call": call}


PROBLEMS = {"gla": gla_problem, "delta": delta_problem, "sanatan": sanatan_problem,
            "taylor": taylor_problem}


# ------------------------------------------------------------------------------------------ tests


def _cases(api, cases, kernel_case):
  """(implementation, case) pairs: every case for the chunked XLA forms, the first for the
  reference forms, ``kernel_case`` for a kernel."""
  def cases_of(name):
    return (kernel_case,) if is_kernel(name) else cases[:1] if name in REFERENCE_FORMS else cases
  return [pytest.param(name, case, id=f"{name}-{case}") for name in implementations(api)
          for case in cases_of(name)]


@pytest.mark.parametrize("implementation,case", _cases(gla_api, ("channel", "head"), "channel"))
def test_gated_linear_attention_packed_equals_separate_documents(implementation, case):
  assert_equals_separate_documents("gla", case, implementation,
                                   reference="recurrent")


@pytest.mark.parametrize("implementation", implementations(delta_api))
def test_gated_delta_rule_packed_equals_separate_documents(implementation):
  assert_equals_separate_documents("delta", "default", implementation,
                                   reference="recurrent")


def _sanatan_cases():
  """Every backend at the one case it runs: p = 1 (six channels, with a state) where it computes it,
  else p = 2 (the flash kernels; the XLA parallel form shares its document masks between p = 1 and
  p = 2)."""
  p1 = SanatanProblem("cpu", p=1)
  return [pytest.param(name, "p1" if backend.supports(p1) else "p2",
                       id=f"{name}-{'p1' if backend.supports(p1) else 'p2'}")
          for name, backend in sanatan_api.REGISTRY.backends.items()]


@pytest.mark.parametrize("implementation,case", _sanatan_cases())
def test_sanatan_packed_equals_separate_documents(implementation, case):
  # p = 2 has no recurrence: the materialised form is its definition.
  reference = "recurrent" if case == "p1" else "parallel"
  assert_equals_separate_documents("sanatan", case, implementation, reference=reference,
                                   heads=("head 0", "head 1"))


def _taylor_cases():
  """Every backend of the registry: the decay ablation for the XLA forms, the plain case for the
  kernels, which do not take it."""
  return [pytest.param(name, case, id=f"{name}-{case}") for name in taylor_api.REGISTRY.names
          for case in (("plain",) if is_kernel(name) else ("decay",))]


@pytest.mark.parametrize("implementation,case", _taylor_cases())
def test_taylor_packed_equals_separate_documents(implementation, case):
  problem = taylor_problem(case)
  call = problem["call"](implementation)
  try:
    jax.eval_shape(lambda: call(problem["tokens"], problem["shared"], problem["state"], SEGMENT_IDS,
                                None))
  except ValueError as e:
    # A backend that does not take segment ids must say so and name the ones that do.
    assert "segment_ids" in str(e) and "recurrent" in str(e), e
    return
  assert_equals_separate_documents("taylor", case, implementation, reference="recurrent")
