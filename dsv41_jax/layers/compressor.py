"""Compressor of a KV source: pooled latents (ratio 2, with a tail) or per-token latents (ratio 1).

See docs/architecture.md, "Compressors". Ratio 2 runs in fp32 with fp32 weights: a per-channel
softmax over the 2 tokens of a group (tokens {2j, 2j+1}), then a bf16 cast and the RMSNorm. An
unfinished pair waits in the compressor tail (fp32 kv and score) until its second token arrives,
possibly in a later chunk. Ratio 1 is a bf16 GEMM with no gate. Latents are returned pre-RoPE and
pre-quantisation.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dsv41_jax.layers.linear import linear, rms_norm
from dsv41_jax.state import CompressorTail
from dsv41_jax.dtypes import BF16, F32


def compress(x: Float[Array, "B S D"], p: dict, ratio: int, p0: Int[Array, "B"], n: Int[Array, "B"],
             tail: CompressorTail | None, eps: float, journal: bool = False):
    """Latents completed by this chunk.

    Args:
      x: bf16 [B, S, D] attention input of the chunk (positions ``p0 + s``; ``s < n`` valid).
      p: compressor params ``wkv`` (and ``wgate`` for ratio 2), ``norm``.
      tail: the :class:`~dsv41_jax.state.CompressorTail` (fp32 [B, K] kv and score) for ratio 2
        (valid iff ``p0`` is odd); ``None`` for ratio 1.

    Returns ``(latent bf16 [B, G, K], entry_ids int32 [B, G], valid bool [B, G], new_tail)``:
    entry ``j`` stands for tokens ``j*ratio ..`` and is rotated at position ``j*ratio``.
    ``journal`` (ratio 2): the new tail also carries the tail after each count ``c = 1..S`` of
    the chunk's positions (``kv_by_count`` / ``score_by_count`` [B, S, K]), from which
    :func:`dsv41_jax.model.verify` commits a shorter prefix.
    """
    B, S, _ = x.shape
    if ratio == 1:
        lat = rms_norm(linear(x, p["wkv"]), p["norm"]["weight"], eps)
        ids = p0[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
        valid = jnp.arange(S)[None, :] < n[:, None]
        return lat, ids, valid, None
    if ratio != 2:
        raise ValueError(f"compress ratio {ratio} is not supported (1 or 2)")
    kv = linear(x, p["wkv"])             # fp32 weights -> fp32 [B, S, K]
    sc = linear(x, p["wgate"])
    ext_kv = jnp.concatenate([tail.kv[:, None], kv], axis=1)     # [B, S+1, K]
    ext_sc = jnp.concatenate([tail.score[:, None], sc], axis=1)  # index 0 = pos p0-1
    G = S // 2 + 1
    e = jnp.mod(p0, 2)
    first = (1 - e)[:, None] + 2 * jnp.arange(G, dtype=jnp.int32)[None, :]   # [B, G]
    ids = (p0 // 2)[:, None] + jnp.arange(G, dtype=jnp.int32)[None, :]
    valid = 2 * ids + 1 <= (p0 + n - 1)[:, None]

    def take(a, i):
        return jnp.take_along_axis(a, jnp.clip(i, 0, S)[..., None], axis=1)

    k0, k1 = take(ext_kv, first), take(ext_kv, first + 1)
    s0, s1 = take(ext_sc, first), take(ext_sc, first + 1)
    m = jnp.maximum(s0, s1)
    e0, e1 = jnp.exp(s0 - m), jnp.exp(s1 - m)
    den = e0 + e1
    pooled = k0 * (e0 / den) + k1 * (e1 / den)
    lat = rms_norm(pooled.astype(BF16), p["norm"]["weight"], eps)
    odd = jnp.mod(p0 + n, 2) == 1
    last = jnp.clip(n, 0, S)[:, None, None]
    new_tail = CompressorTail(
        kv=jnp.where(odd[:, None], jnp.take_along_axis(ext_kv, last, 1)[:, 0], tail.kv),
        score=jnp.where(odd[:, None], jnp.take_along_axis(ext_sc, last, 1)[:, 0], tail.score))
    if journal:
        # after c positions the tail is the newest unpaired one: row c if p0 + c is odd, else
        # row c - 1 (row 0: the tail before the chunk)
        c = jnp.arange(1, S + 1, dtype=jnp.int32)[None, :]
        src = jnp.where(jnp.mod(p0[:, None] + c, 2) == 1, c, c - 1)[:, :, None]
        new_tail = CompressorTail(kv=new_tail.kv, score=new_tail.score,
                                  kv_by_count=jnp.take_along_axis(ext_kv, src, 1),
                                  score_by_count=jnp.take_along_axis(ext_sc, src, 1))
    return lat, ids, valid, new_tail
