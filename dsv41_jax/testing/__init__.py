"""Test and parity support: comparisons against the reference fixtures (not used by the model)."""
