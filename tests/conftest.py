"""Every test sees every mixer kind registered, installed project or not (``lmcore.registry``). The tests
marked ``slow`` run first (otherwise in collection order): under pytest-xdist (``make test``) the workers
share the long tests from the start and finish together on the short ones."""

import based_jax  # noqa: F401
import sanatan_jax  # noqa: F401


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # a stable sort
