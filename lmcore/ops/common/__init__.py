"""Helpers every op shares: segment ids, head layout and padding, kernel precision, Pallas calls."""
