"""Evaluation and generation from trained parameters."""
