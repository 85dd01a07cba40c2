"""Gated delta rule (MATH §4, Gated DeltaNet): ``gated_delta_rule`` and its ``DeltaRuleState``."""

from lmcore.ops.gated_delta_rule.api import (IMPLEMENTATIONS, Implementation, gated_delta_rule,
                                             resolve_implementation)
from lmcore.ops.gated_delta_rule.base import DeltaRuleState

__all__ = ["IMPLEMENTATIONS", "DeltaRuleState", "Implementation", "gated_delta_rule",
           "resolve_implementation"]
