"""Every test sees every mixer kind registered, installed project or not (``lmcore.registry``). The tests
marked ``slow`` run first (otherwise in collection order): under pytest-xdist (``make test``) the workers
share the long tests from the start and finish together on the short ones.

In the test processes XLA compiles without most of its optimisations (``jax_disable_most_optimizations``):
the programs compute the same functions, and compiling them takes about half the time. Tests of what the
optimised program is (its memory, its instructions) are marked ``xla_optimized`` and compile with every
optimisation; processes a test starts compile as users' do, unless the test says otherwise."""

import jax
import pytest

import based_jax  # noqa: F401
import sanatan_jax  # noqa: F401

jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True)
def _xla_optimisations(request):
  optimized = request.node.get_closest_marker("xla_optimized") is not None
  jax.config.update("jax_disable_most_optimizations", not optimized)
  yield
  jax.config.update("jax_disable_most_optimizations", True)


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # a stable sort
