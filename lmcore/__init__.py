"""Shared machinery for fixed-state attention language models: backbone, data, training, evaluation."""
