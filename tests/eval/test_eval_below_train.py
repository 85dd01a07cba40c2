"""Evaluation sits below training: ``lmcore.eval`` imports nothing from ``lmcore.train`` (training runs
evaluations, not the other way round), and neither package imports a project module inside a function,
where an import would hide a cycle from the module-level check of tests/test_layering.py."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECT = ("lmcore", "sanatan_jax", "based_jax", "benchmarks", "configs")


def _imports(package: str):
  """(file, line, imported module, inside a function) of every import in ``package``'s files."""
  for root, _, files in os.walk(os.path.join(REPO, *package.split("."))):
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(root, name)
      tree = ast.parse(open(path).read())
      local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
               for n in ast.walk(f)}
      for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
          modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
          modules = [a.name for a in node.names]
        else:
          continue
        for module in modules:
          yield os.path.relpath(path, REPO), node.lineno, module, id(node) in local


def test_evaluation_imports_nothing_from_training():
  bad = [f"{path}:{line} imports {module}" for path, line, module, _ in _imports("lmcore.eval")
         if module == "lmcore.train" or module.startswith("lmcore.train.")]
  assert not bad, "\n".join(bad)


def test_training_and_evaluation_import_project_modules_only_at_module_level():
  bad = [f"{path}:{line} imports {module} inside a function"
         for package in ("lmcore.train", "lmcore.eval") for path, line, module, local in _imports(package)
         if local and module.split(".")[0] in PROJECT]
  assert not bad, "\n".join(bad)
