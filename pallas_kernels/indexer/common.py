"""Primitives shared by the lightning indexer's reference and kernels: dtype constants and
the 16-bit order key of bf16-representable scores that the top-k selections rank by."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32
NEG_INF = -jnp.inf


def bf16_order_key(score: Float[Array, "..."]) -> Int[Array, "..."]:
    """bf16-representable fp32 -> int32 key in [0, 65535] in IEEE total order (-0 < +0): the
    upper 16 bits, sign-folded (other fp32 values are ranked by their upper 16 bits)."""
    u = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(score, jnp.int32), 16)
    return jnp.where(u >= 0x8000, 0xFFFF - u, u | 0x8000)
