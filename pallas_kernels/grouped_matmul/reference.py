"""Pure-jnp reference of the FP4 grouped matmul (:mod:`pallas_kernels.grouped_matmul`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, Int, UInt8

from pallas_kernels.fp4.reference import BF16, F32, e8m0_to_f32, e2m1_decode, unpack_nibbles


def dequant_experts(codes: UInt8[Array, "E N K2"], scale: UInt8[Array, "E N G"]
                    ) -> BFloat16[Array, "E N K"]:
    """Stacked FP4 expert weights (packed e2m1, element ``2j`` in the low nibble; one E8M0
    scale per 32 inputs) -> bf16 ``[E, N, K]`` (exact)."""
    v = e2m1_decode(unpack_nibbles(codes))                       # fp32 [E, N, K]
    E, N, K = v.shape
    s = e8m0_to_f32(scale)
    return (v.reshape(E, N, K // 32, 32) * s[..., None]).reshape(E, N, K).astype(BF16)


def fp4_grouped_matmul(x: BFloat16[Array, "P K"], codes: UInt8[Array, "E N K2"],
                       scale: UInt8[Array, "E N G"], group_sizes: Int[Array, "E"]
                       ) -> BFloat16[Array, "P N"]:
    """``y[p] = x[p] @ W[e(p)]^T`` with fp32 accumulation, bf16 out, where row ``p`` belongs
    to expert ``e(p)``: the rows are grouped by expert in increasing id, ``group_sizes[e]``
    rows each; rows past ``sum(group_sizes)`` give 0."""
    w = jnp.swapaxes(dequant_experts(codes, scale), 1, 2)        # [E, K, N]
    y = jax.lax.ragged_dot(x.astype(BF16), w, group_sizes.astype(jnp.int32),
                           preferred_element_type=F32)
    return y.astype(BF16)
