"""Pure-jnp references of the lightning indexer's ops: the bf16 scores over the (dequantised)
indexer K and the top-k selection (by sorting, and the radix selection without a sort that
the selection kernel reproduces bit for bit).

Scores follow the reference model's bf16 roundings: ``dot = bf16(q_i . k)``,
``score = bf16(sum_h bf16(relu(dot) * w_h))``; entries at or past a query's ``visible``
count score ``-inf``. The top-k is re-sorted ascending by position; missing picks are -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt8

from pallas_kernels.fp4.reference import fp4_dequantize, unpack_nibbles
from pallas_kernels.indexer.common import BF16, F32, NEG_INF, bf16_order_key

__all__ = ["dequant_index_k", "index_scores", "select_topk", "select_topk_radix"]


def dequant_index_k(codes: UInt8[Array, "B T J2"], scale: UInt8[Array, "B T G"]
                    ) -> Float[Array, "B T J"]:
    """Packed indexer K (e2m1 pairs, element 2j in the low nibble + E8M0 bytes per 32) ->
    bf16 [B, T, J] (exact)."""
    return fp4_dequantize(unpack_nibbles(codes), scale, 32, BF16)



def index_scores(q: Float[Array, "B S I J"], w: Float[Array, "B S I"], k: Float[Array, "B T J"],
                 visible: Int[Array, "B S"]) -> Float[Array, "B S T"]:
    """bf16-rounded scores; entries ``t >= visible[b, s]`` are -inf (the causal mask;
    docs/architecture.md, "Indexer")."""
    dot = jnp.einsum("bsij,btj->bsit", q, k, preferred_element_type=F32).astype(BF16)
    prod = (jnp.maximum(dot, 0).astype(F32) * w.astype(F32)[..., None]).astype(BF16)
    score = jnp.sum(prod.astype(F32), axis=2).astype(BF16).astype(F32)
    t = jnp.arange(k.shape[1], dtype=jnp.int32)
    return jnp.where(t[None, None, :] < visible[..., None], score, NEG_INF)


def select_topk(score: Float[Array, "B S T"], k: int) -> Int[Array, "B S k"]:
    """Top-``k`` positions, re-sorted ascending, -inf picks -> -1 (at the end). See
    docs/architecture.md, "Top-k selection".

    Ties go to the lower position (the reference's choice is implementation-defined).
    """
    k = min(k, score.shape[-1])
    score = jnp.where(jnp.isnan(score), NEG_INF, score)  # NaN never takes a slot (B06)
    vals, idx = jax.lax.top_k(score, k)
    big = jnp.int32(score.shape[-1] + 1)
    idx = jnp.where(vals > NEG_INF, idx.astype(jnp.int32), big)
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == big, -1, idx)


def _chunked_rank(mask: Bool[Array, "R T"], chunk: int) -> Int[Array, "R T"]:
    """Inclusive running count of ``mask`` along T (T a multiple of ``chunk``): a cumsum
    inside chunks plus the exclusive cumsum of the chunk totals (two short scans, not one
    over T)."""
    R, T = mask.shape
    m = mask.reshape(R, T // chunk, chunk).astype(jnp.int32)
    inner = jnp.cumsum(m, axis=2)
    offset = jnp.cumsum(inner[:, :, -1], axis=1) - inner[:, :, -1]
    return (inner + offset[:, :, None]).reshape(R, T)


def select_topk_radix(score: Float[Array, "B S T"], k: int) -> Int[Array, "B S k"]:
    """:func:`select_topk` without sorting, for fp32 scores that are bf16-representable (the
    indexer's, see :func:`index_scores`; ``-inf`` and NaN allowed). Same result, bit for bit.
    The precondition is not checked (the values are traced): other fp32 scores are ranked by
    their upper 16 bits, so near-ties can pick differently from ``select_topk``.

    The k-th largest score is found on 16-bit order keys (IEEE total order, like
    ``lax.top_k``) by a 16-way search: four rounds, each counting the entries at or above 15
    candidate keys in one fused pass over the row. The picks are every entry above it plus the
    lowest positions equal to it, compacted in position order with a chunked running count.
    """
    B, S, T = score.shape
    k = min(k, T)
    if T == 0:   # nothing to select (an empty KV source), as select_topk
        return jnp.zeros((B, S, 0), jnp.int32)
    chunk = 256 if T > 256 else T
    pad = -T % chunk
    score = jnp.where(jnp.isnan(score), NEG_INF, score).reshape(B * S, T)
    score = jnp.pad(score, ((0, 0), (0, pad)), constant_values=NEG_INF)   # -inf: never picked
    key = bf16_order_key(score)
    v = jnp.zeros((B * S, 1), jnp.int32)
    for shift in (12, 8, 4, 0):
        cand = v + (jnp.arange(1, 16, dtype=jnp.int32) << shift)[None, :]       # [R, 15]
        count = jnp.sum(key[:, None, :] >= cand[:, :, None], axis=2)             # [R, 15]
        v = v + (jnp.sum(count >= k, axis=1, keepdims=True) << shift)
    above = jnp.sum(key > v, axis=1, keepdims=True)
    eq = key == v
    sel = ((key > v) | (eq & (_chunked_rank(eq, chunk) <= k - above))) & (score > NEG_INF)
    slot = jnp.where(sel, _chunked_rank(sel, chunk) - 1, k)                      # k: dropped
    t = jnp.broadcast_to(jnp.arange(T + pad, dtype=jnp.int32), key.shape)
    out = jnp.full((B * S, k), -1, jnp.int32).at[jnp.arange(B * S)[:, None], slot].set(
        t, mode="drop")
    return out.reshape(B, S, k)
