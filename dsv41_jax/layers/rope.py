"""Partial, interleaved rotary embedding with per-layer YaRN (docs/architecture.md,
"Rotary embedding" and "Output projection").

A layer's table is "base" (``rope_theta``, no YaRN: SWA-only layers and DSpark stages) or
"compress" (``compress_rope_theta`` with YaRN when ``original_seq_len > 0``: every layer that
reads compressed KV). One table serves every branch of a layer (query, window KV, compressed KV,
indexer q/k). RoPE acts on the LAST ``rope_head_dim`` channels, on interleaved pairs
``(2j, 2j+1)``; there is no mscale.
"""

from __future__ import annotations

import numpy as np

from dsv41_jax.config import ModelConfig, yarn_correction_range
# the formulas live in pallas_kernels.rope (one copy, shared with the kernels' references)
from pallas_kernels.rope import apply_rope, rope_angles  # noqa: F401


def rope_frequencies(cfg: ModelConfig, kind: str) -> np.ndarray:
    """fp32 ``[rope_head_dim // 2]`` inverse frequencies of a table kind ("base"/"compress")."""
    r = cfg.rope_head_dim
    if kind == "base":
        base, yarn = cfg.rope_theta, False
    elif kind == "compress":
        base, yarn = cfg.compress_rope_theta, cfg.original_seq_len > 0
    else:
        raise ValueError(f"RoPE table kind must be 'base' or 'compress', got {kind!r}")
    expo = np.arange(0, r, 2, dtype=np.float32) / np.float32(r)
    f = (np.float32(1.0) / np.power(np.float32(base), expo)).astype(np.float32)
    if yarn:
        low, high = yarn_correction_range(cfg)
        ramp = np.clip((np.arange(r // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
        ramp = ramp.astype(np.float32)
        f = (f / np.float32(cfg.rope_factor) * ramp + f * (np.float32(1) - ramp)).astype(np.float32)
    return f
