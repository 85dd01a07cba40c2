"""SANATAN ops: plain functions on arrays, one folder per op."""
