"""Shared settings for tests that start processes."""


def compilation_cache_env(path) -> dict:
  """Environment that gives a test's processes one persistent JAX compilation cache of their own at
  ``path``, keeping every program however quick to compile (later processes load what earlier ones
  compiled, as a restarted run does)."""
  return {"JAX_COMPILATION_CACHE_DIR": str(path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def fast_compile_env() -> dict:
  """Environment in which a test's processes compile as the test process does (conftest.py): without
  most of XLA's optimisations, the same functions in about half the compile time. For processes that
  run a few steps, where compiling is most of their time and no test reads the optimised program."""
  return {"JAX_DISABLE_MOST_OPTIMIZATIONS": "true"}
