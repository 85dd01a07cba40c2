"""Shared settings for tests that start processes."""


def compilation_cache_env(path) -> dict:
  """Environment that gives a test's processes one persistent JAX compilation cache of their own at
  ``path``, keeping every program however quick to compile (later processes load what earlier ones
  compiled, as a restarted run does)."""
  return {"JAX_COMPILATION_CACHE_DIR": str(path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
