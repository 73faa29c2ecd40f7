"""Pure-jnp reference of :func:`pallas_kernels.sinkhorn.sinkhorn_pairs`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def sinkhorn_pairs(c: Float[Array, "*batch hc hc"], pairs: int, eps: float, *,
                   loop: bool = False) -> Float[Array, "*batch hc hc"]:
    """``pairs`` (row, column) normalisations of ``c`` (see :mod:`pallas_kernels.sinkhorn`);
    unrolled, or a ``fori_loop`` when ``loop``."""
    def row_col(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    if loop:
        return jax.lax.fori_loop(0, pairs, row_col, c)
    for i in range(pairs):
        c = row_col(i, c)
    return c
