"""Lightning indexer: bf16 scores over the FP4 indexer K, top-k, and the candidate pool.

See docs/architecture.md, "Indexer" and "Candidate pool". Scores follow the reference's bf16
roundings: ``dot = bf16(q_i . k)``, ``score = bf16(sum_h bf16(relu(dot) * w_h))`` with ``w`` from
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
# the scores and top-k selections are the indexer kernels' references, kept beside them
from pallas_kernels.indexer.common import BF16, F32, NEG_INF
from pallas_kernels.indexer.common import bf16_order_key as _bf16_order_key  # noqa: F401
from pallas_kernels.indexer.reference import (_chunked_rank, index_scores,  # noqa: F401
                                              select_topk, select_topk_radix)


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


def candidate_pool(score: Float[Array, "B S T"], visible: Int[Array, "B S"], n_blocks: int,
                   block: int, select=None
                   ) -> tuple[Bool[Array, "B S T"], Float[Array, "B S NB"]]:
    """Block-max candidate pool (docs/architecture.md, "Candidate pool"):
    ``(mask [B,S,T], block scores [B,S,NB])``.

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
