"""Test and benchmark support: reference fixtures and parity checks (not part of the model)."""
