"""Gated delta rule (SPEC §4, Gated DeltaNet): ``gated_delta_rule`` and its ``DeltaRuleState``."""

from lmcore.ops.gated_delta_rule.api import IMPLEMENTATIONS, DeltaRuleState, gated_delta_rule

__all__ = ["IMPLEMENTATIONS", "DeltaRuleState", "gated_delta_rule"]
