"""Small configs the tests share."""

from __future__ import annotations

from benchmarks.config import tiny_config
from dsv41_jax.config import ModelConfig


def scanned_tiny_config() -> ModelConfig:
    """The tiny config (dim 64, no Engram) on 14 layers whose units repeat: SWA-only x 2, then
    2 x (ratio-2 Full + 2 Reuse) as one scanned group, ratio-1 Full + 2 Reuse (the candidate
    source), Reindex + 2 Reuse. Stacked parameters then have [units 2, layers 2] leading axes,
    so code that indexes a stack (``u * length + j``) is exercised with both above 1."""
    cfg, _ = tiny_config("drop")
    return cfg.replace(n_layers=14, compress_ratios=(0, 0, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1),
                       kv_source_layers=(2, 5, 8), index_source_layers=(2, 5, 8, 11),
                       candidate_source_layer=8)
