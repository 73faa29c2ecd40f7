"""The rotary embedding's formulas in jnp, the one copy (:func:`rope_angles`,
:func:`apply_rope`): :mod:`dsv41_jax.layers.rope` re-exports them, and the window ring kernel's
reference (:mod:`pallas_kernels.window_ring.reference`) rotates its rows with them (this package
imports nothing from the model)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

F32 = jnp.float32


def rope_angles(positions: Int[Array, "..."], freqs: np.ndarray | Float[Array, "R2"]
                ) -> tuple[Float[Array, "... R2"], Float[Array, "... R2"]]:
    """``(cos, sin)`` fp32 of ``theta[p, i] = f32(p) * f_i`` (``freqs``: fp32 ``[R/2]``, a
    table of :func:`dsv41_jax.layers.rope.rope_frequencies`). See docs/architecture.md,
    "Rotary embedding"."""
    theta = positions.astype(F32)[..., None] * jnp.asarray(freqs, F32)
    return jnp.cos(theta), jnp.sin(theta)


def apply_rope(x: Float[Array, "... K"], cos: Float[Array, "... R2"], sin: Float[Array, "... R2"],
               inverse: bool = False) -> Float[Array, "... K"]:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` (interleaved pairs ``(2j,
    2j+1)``), fp32 math: ``(a cos - b sin, a sin + b cos)``.

    ``cos``/``sin`` broadcast against ``x[..., 0]`` (e.g. ``[B, S, 1, R/2]`` for ``[B,S,H,K]``).
    ``inverse=True`` multiplies by the conjugate (the output de-rotation; docs/architecture.md,
    "Output projection"). Returns ``x.dtype``. See docs/architecture.md, "Rotary embedding".
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
