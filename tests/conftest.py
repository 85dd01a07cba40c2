"""Every test sees every mixer kind registered, installed project or not (``lmcore.registry``)."""

import based_jax  # noqa: F401
import sanatan_jax  # noqa: F401
