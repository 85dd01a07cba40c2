"""The architecture as tests: imports go downward (entry points -> families -> lmcore; inside an op,
api -> backends -> base -> lmcore.ops.common), there are no import cycles, lmcore names no model
family and no benchmark code, no module uses another module's private names, every module of an op is
reachable from its registry, and every mixer knob reaches the backend that runs."""

import ast
import dataclasses
import importlib
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from lmcore.errors import ConfigError
from lmcore.mixers.base import InitSpec
from lmcore.registry import mixer_class, mixer_kinds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("lmcore", "sanatan_jax", "based_jax", "benchmarks", "configs")
FAMILIES = ("sanatan_jax", "based_jax")


def _modules() -> dict[str, str]:
  """Dotted module name -> file path for every project module."""
  found = {}
  for package in PACKAGES:
    for root, _, files in os.walk(os.path.join(REPO, package)):
      for name in files:
        if name.endswith(".py"):
          rel = os.path.relpath(os.path.join(root, name), REPO)[:-3].replace(os.sep, ".")
          found[rel.removesuffix(".__init__")] = os.path.join(root, name)
  return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
  """The project module an imported dotted name refers to (itself or its longest module prefix)."""
  while name:
    if name in MODULES:
      return name
    name = name.rpartition(".")[0]
  return None


def _imports(module: str) -> list[tuple[str, str]]:
  """(imported project module, imported name or "") for every import statement of ``module``."""
  tree = ast.parse(open(MODULES[module]).read())
  package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [(target, "") for alias in node.names if (target := _resolve(alias.name))]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      for alias in node.names:
        target = _resolve(f"{base}.{alias.name}") or _resolve(base)
        if target:
          out.append((target, "" if target == f"{base}.{alias.name}" else alias.name))
  return out


GRAPH = {m: sorted({t for t, _ in _imports(m) if t != m}) for m in MODULES}


def _is_package_of(a: str, b: str) -> bool:
  return b.startswith(a + ".")


def test_there_are_no_import_cycles():
  """Edges from a package's ``__init__`` to its own submodules are how packages re-export; every
  other edge must point to a module that never leads back."""
  edges = {m: [t for t in ts if not _is_package_of(m, t)] for m, ts in GRAPH.items()}
  state: dict[str, int] = {}
  cycles = []

  def visit(m, path):
    state[m] = 1
    for t in edges[m]:
      if state.get(t) == 1:
        cycles.append(" -> ".join(path[path.index(t):] + [t]))
      elif t not in state:
        visit(t, path + [t])
    state[m] = 2

  for m in MODULES:
    if m not in state:
      visit(m, [m])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_lmcore_imports_no_model_family_and_no_benchmark_code():
  bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith("lmcore")
         for t in ts if t.startswith(FAMILIES + ("benchmarks", "configs"))]
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("op", ["lmcore.ops.gated_linear_attention", "lmcore.ops.gated_delta_rule",
                                "sanatan_jax.ops.sanatan_attention", "based_jax.ops.taylor_attention"])
def test_op_backends_import_base_and_common_never_api(op):
  members = [m for m in MODULES if m.startswith(op + ".")]
  assert {f"{op}.api", f"{op}.base", f"{op}.reference", f"{op}.xla"} <= set(members)
  bad = []
  for m in members:
    if m.endswith(".api"):
      continue
    for t in GRAPH[m]:
      if t == f"{op}.api" or (m.endswith(".base") and t.startswith(op + ".")):
        bad.append(f"{m} imports {t}")
      if t.startswith(("lmcore.mixers", "lmcore.train", "lmcore.eval", "lmcore.model")):
        bad.append(f"{m} imports {t} (an op must not import the layers above it)")
  assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_names():
  bad = [f"{m} imports {t}.{name}" for m in MODULES for t, name in _imports(m)
         if name.startswith("_") and not name.startswith("__") and t != m]
  for m, path in MODULES.items():
    aliases = {}
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        for alias in node.names:
          if _resolve(f"{node.module}.{alias.name}") == f"{node.module}.{alias.name}":
            aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if alias.asname and _resolve(alias.name) == alias.name:
            aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")):
        bad.append(f"{m} uses {aliases[node.value.id]}.{node.attr}")
  assert not bad, "\n".join(sorted(set(bad)))


OPS = {"lmcore.ops.gated_linear_attention": "gated linear attention",
       "lmcore.ops.gated_delta_rule": "gated delta rule",
       "sanatan_jax.ops.sanatan_attention": "SANATAN attention",
       "based_jax.ops.taylor_attention": "Taylor attention"}


@pytest.mark.parametrize("op", OPS)
def test_every_module_of_an_op_is_reachable_from_its_registry(op):
  """No kernel (or form) sits in an op's folder unselectable: each module but api, base and the package
  is a registered backend's module or imported by one (a helper such as the SANATAN factor kernels)."""
  registry = importlib.import_module(f"{op}.api").REGISTRY
  reached = {type(backend).__module__ for backend in registry.backends.values()}
  frontier = list(reached)
  while frontier:
    for target in GRAPH[frontier.pop()]:
      if target.startswith(op + ".") and target not in reached:
        reached.add(target)
        frontier.append(target)
  members = {m for m in MODULES if m.startswith(op + ".")} - {f"{op}.api", f"{op}.base"}
  assert members <= reached, f"modules no backend of {op} reaches: {sorted(members - reached)}"


def _attributes_read(module: str) -> set[str]:
  """The attribute names ``module`` reads anywhere (``x.name`` in a load context)."""
  tree = ast.parse(open(MODULES[module]).read())
  return {node.attr for node in ast.walk(tree)
          if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)}


def test_every_mixer_knob_is_read_by_its_mixer():
  """A field of a mixer's Config that its module never reads is a knob that changes nothing."""
  unread = []
  for kind in mixer_kinds():
    cls = mixer_class(kind)
    config_fields = {f.name for f in dataclasses.fields(cls.Config)}
    modules = {cls.__module__, cls.Config.__module__}
    read = set().union(*(_attributes_read(m) for m in modules if m in MODULES))
    unread += [f"{kind}.{name}" for name in sorted(config_fields - read)]
  assert not unread, f"mixer config fields no code reads: {unread}"


# Each mixer kind with an op, the op's package and small config fields.
MIXER_OPS = {
    "sanatan": ("sanatan_jax.ops.sanatan_attention", dict(n_heads=2, head_dim=4)),
    "taylor": ("based_jax.ops.taylor_attention", dict(n_heads=2, feature_dim=4)),
    "gla": ("lmcore.ops.gated_linear_attention", dict(n_heads=2)),
    "cyfa": ("lmcore.ops.gated_linear_attention", dict(n_heads=2, head_dim=4, v_head_dim=4)),
    "linear_transformer": ("lmcore.ops.gated_linear_attention", dict(n_heads=2, head_dim=4)),
    "performer": ("lmcore.ops.gated_linear_attention", dict(n_heads=2, head_dim=4, n_features=8)),
    "cosformer": ("lmcore.ops.gated_linear_attention", dict(n_heads=2, head_dim=4, max_len=16)),
    "gdn": ("lmcore.ops.gated_delta_rule", dict(n_heads=2, head_dim=4)),
}
# Mixer knobs -> (a value other than the default, the field of the ``options`` a backend receives).
OPTION_KNOBS = {"kernel_precision": ("tf32", "precision"), "chunked_remat": (False, "remat"),
                "kernel_split_state": (False, "split_state")}


class _Reached(Exception):
  pass


def _changed(tiles):
  """``tiles`` with its first integer field (nested tilings too) doubled."""
  for field in dataclasses.fields(tiles):
    value = getattr(tiles, field.name)
    if dataclasses.is_dataclass(value):
      return dataclasses.replace(tiles, **{field.name: _changed(value)})
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
      return dataclasses.replace(tiles, **{field.name: 2 * value})
  raise AssertionError(f"{tiles!r} has no integer field")


def _backend_kwargs(monkeypatch, kind: str, backend, **fields) -> dict:
  """The keyword arguments ``backend`` receives when a ``kind`` mixer built from ``fields`` runs (traced
  only: the backend stops the trace)."""
  seen = {}

  def spy(self, *args, **kwargs):
    seen.update(kwargs)
    raise _Reached

  monkeypatch.setattr(type(backend), "__call__", spy)
  cls = mixer_class(kind)
  mixer = cls(cls.Config(**MIXER_OPS[kind][1], **fields), d_model=8, init=InitSpec(), rngs=nnx.Rngs(0))
  with pytest.raises(_Reached):
    jax.eval_shape(lambda x: mixer(x)[0], jax.ShapeDtypeStruct((1, 16, 8), jnp.float32))
  return seen


def _runs(registry, name: str, kind: str) -> bool:
  try:
    mixer_class(kind).Config(**MIXER_OPS[kind][1], implementation=name)
  except ConfigError:  # a backend the mixer's own variant cannot use (e.g. SANATAN p = 1's flash)
    return False
  return "cpu" in registry.backends[name].platforms


@pytest.mark.parametrize("kind", MIXER_OPS)
def test_every_mixer_knob_reaches_the_backend_that_runs(kind, monkeypatch):
  """For every backend a mixer can name, a non-default ``tiles`` value is the tiling that backend is
  called with, and the kernel knobs the mixer has (precision, recomputation, split state dots) arrive
  in the options it is called with: no knob of a mixer stops short of what runs."""
  registry = importlib.import_module(f"{MIXER_OPS[kind][0]}.api").REGISTRY
  knobs = {f.name for f in dataclasses.fields(mixer_class(kind).Config)} & set(OPTION_KNOBS)
  checked = []
  for name, backend in registry.backends.items():
    if backend.tiles_type is None or not _runs(registry, name, kind):
      continue
    tiles = _changed(registry.tiles(name, {}, "test"))
    options = {knob: OPTION_KNOBS[knob][0] for knob in knobs}
    if name == "pallas_tpu":
      options.pop("kernel_precision", None)  # the TPU kernels take "input" only
    kwargs = _backend_kwargs(monkeypatch, kind, backend, implementation=name, tiles=tiles, **options)
    assert kwargs["tiles"] == tiles, (kind, name)
    for knob, value in options.items():
      assert getattr(kwargs["options"], OPTION_KNOBS[knob][1]) == value, (kind, name, knob)
    checked.append(name)
  assert checked, f"{kind}: no backend with tiles"
