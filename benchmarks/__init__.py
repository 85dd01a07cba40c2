"""Benchmark and kernel-check tooling used by scripts/ (not part of the library; may import torch)."""
