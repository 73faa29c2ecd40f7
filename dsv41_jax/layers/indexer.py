"""Lightning indexer: bf16 scores over the FP4 indexer K, top-k, and the candidate pool.

Spec 3.6, 3.7. Scores follow the reference's bf16 roundings:
``dot = bf16(q_i . k)``, ``score = bf16(sum_h bf16(relu(dot) * w_h))`` with ``w`` from
``weights_proj(x)`` scaled by ``(J*I)^-1/2``. A query at position p sees entry t iff
``t < (p+1) // ratio``. The top-k is re-sorted ascending by position; unreachable picks are -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.linear import linear
from dsv41_jax.layers.rope import apply_rope

F32 = jnp.float32
BF16 = jnp.bfloat16
NEG_INF = -jnp.inf


def index_queries(x: Float[Array, "B S D"], qr: Float[Array, "B S Q"], p: dict, cfg: ModelConfig,
                  cos, sin):
    """Indexer queries (FP4-QDQ'd, RoPE'd) ``[B,S,I,J]`` and head weights ``[B,S,I]`` (bf16)."""
    B, S, _ = x.shape
    I, J = cfg.index_n_heads, cfg.index_head_dim
    q = linear(qr, p["wq_b"]).reshape(B, S, I, J)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    q = quant.fp4_qdq(q, 32, "e8m0")
    w = linear(x, p["weights_proj"]).astype(F32) * (J ** -0.5 * I ** -0.5)
    return q, w.astype(BF16)


def index_scores(q: Float[Array, "B S I J"], w: Float[Array, "B S I"], k: Float[Array, "B T J"],
                 visible: Int[Array, "B S"]) -> Float[Array, "B S T"]:
    """bf16-rounded scores; entries ``t >= visible[b, s]`` are -inf (causal mask, spec 3.6d)."""
    dot = jnp.einsum("bsij,btj->bsit", q, k, preferred_element_type=F32).astype(BF16)
    prod = (jnp.maximum(dot, 0).astype(F32) * w.astype(F32)[..., None]).astype(BF16)
    score = jnp.sum(prod.astype(F32), axis=2).astype(BF16).astype(F32)
    t = jnp.arange(k.shape[1], dtype=jnp.int32)
    return jnp.where(t[None, None, :] < visible[..., None], score, NEG_INF)


def select_topk(score: Float[Array, "B S T"], k: int) -> Int[Array, "B S k"]:
    """Top-``k`` positions, re-sorted ascending, -inf picks -> -1 (at the end). Spec 3.6f.

    Ties go to the lower position (the reference's choice is implementation-defined).
    """
    k = min(k, score.shape[-1])
    score = jnp.where(jnp.isnan(score), NEG_INF, score)  # NaN never takes a slot (B06)
    vals, idx = jax.lax.top_k(score, k)
    big = jnp.int32(score.shape[-1] + 1)
    idx = jnp.where(vals > NEG_INF, idx.astype(jnp.int32), big)
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == big, -1, idx)


def _bf16_order_key(score: Float[Array, "..."]) -> Int[Array, "..."]:
    """bf16-representable fp32 -> int32 key in [0, 65535] in IEEE total order (-0 < +0)."""
    u = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(score, jnp.int32), 16)
    return jnp.where(u >= 0x8000, 0xFFFF - u, u | 0x8000)


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
    key = _bf16_order_key(score)
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


def candidate_pool(score: Float[Array, "B S T"], visible: Int[Array, "B S"], n_blocks: int,
                   block: int, select=None
                   ) -> tuple[Bool[Array, "B S T"], Float[Array, "B S NB"]]:
    """Block-max candidate pool (spec 3.7): ``(mask [B,S,T], block scores [B,S,NB])``.

    Block score = max over its positions (-inf padded); the block of the newest visible position
    is pinned with +inf; the top ``n_blocks`` blocks are kept unless their score is -inf.

    ``select``: None (``lax.top_k`` over the block scores, the reference), or a top-k selection
    with :func:`select_topk`'s contract (``select(scores, k)`` -> int32 positions, -1 for no
    pick; ties to the lower position, -inf never picked), e.g. the GPU selection kernel
    (``pallas_kernels.indexer.select_topk``): it keeps the same blocks, since the block scores
    of bf16 index scores are bf16-representable.
    """
    B, S, T = score.shape
    nb = -(-T // block)
    pad = nb * block - T
    sp = jnp.pad(score, ((0, 0), (0, 0), (0, pad)), constant_values=NEG_INF)
    sp = jnp.where(jnp.isnan(sp), NEG_INF, sp)  # a NaN block never displaces a finite one
    bs = jnp.max(sp.reshape(B, S, nb, block), axis=-1)
    last = (visible - 1) // block
    bs = jnp.where(jnp.arange(nb)[None, None, :] == last[..., None], jnp.inf, bs)
    if select is None:
        vals, bidx = jax.lax.top_k(bs, min(n_blocks, nb))
        keep = vals > NEG_INF
    else:
        picks = select(bs, min(n_blocks, nb))
        keep, bidx = picks >= 0, jnp.maximum(picks, 0)
    bmask = jnp.zeros((B, S, nb), bool)
    bmask = bmask.at[jnp.arange(B)[:, None, None], jnp.arange(S)[None, :, None], bidx].max(keep)
    mask = jnp.repeat(bmask, block, axis=-1)[..., :T]
    return mask, bs
