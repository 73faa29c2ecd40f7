"""Partial, interleaved rotary embedding with per-layer YaRN (docs/architecture.md,
"Rotary embedding" and "Output projection").

A layer's table is "base" (``rope_theta``, no YaRN: SWA-only layers and DSpark stages) or
"compress" (``compress_rope_theta`` with YaRN when ``original_seq_len > 0``: every layer that
reads compressed KV). One table serves every branch of a layer (query, window KV, compressed KV,
indexer q/k). RoPE acts on the LAST ``rope_head_dim`` channels, on interleaved pairs
``(2j, 2j+1)``; there is no mscale.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dsv41_jax.config import ModelConfig, yarn_correction_range
from dsv41_jax.dtypes import F32


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


def rope_angles(positions: Int[Array, "..."], freqs: np.ndarray
                ) -> tuple[Float[Array, "... R2"], Float[Array, "... R2"]]:
    """``(cos, sin)`` fp32 of ``theta[p, i] = f32(p) * f_i``."""
    theta = positions.astype(F32)[..., None] * jnp.asarray(freqs, F32)
    return jnp.cos(theta), jnp.sin(theta)


def apply_rope(x: Float[Array, "... K"], cos: Float[Array, "... R2"], sin: Float[Array, "... R2"],
               inverse: bool = False) -> Float[Array, "... K"]:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` (interleaved pairs), fp32 math.

    ``cos``/``sin`` broadcast against ``x[..., 0]`` (e.g. ``[B, S, 1, R/2]`` for ``[B,S,H,K]``).
    ``inverse=True`` multiplies by the conjugate (the output de-rotation; docs/architecture.md,
    "Output projection"). Returns ``x.dtype``.
    """
    r = 2 * cos.shape[-1]
    head, tail = x[..., :-r], x[..., -r:]
    t = tail.astype(F32).reshape(*tail.shape[:-1], r // 2, 2)
    a, b = t[..., 0], t[..., 1]
    if inverse:
        sin = -sin
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    out = out.reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, out], axis=-1)
