"""Gated delta rule (MATH §4, Gated DeltaNet): ``gated_delta_rule`` and its ``DeltaRuleState``."""

from lmcore.ops.gated_delta_rule.api import REGISTRY, Implementation, gated_delta_rule
from lmcore.ops.gated_delta_rule.base import DeltaRuleState, Problem

__all__ = ["REGISTRY", "DeltaRuleState", "Implementation", "Problem", "gated_delta_rule"]
