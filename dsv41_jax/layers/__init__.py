"""Model layers: one module per concern (see the package README)."""
