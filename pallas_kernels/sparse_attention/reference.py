"""Pure-jnp reference of the CSA2 sparse attention op (docs/architecture.md, "Joint sink softmax");
also the XLA implementation.

The op attends each query ``q[b, s, h]`` over one joint list of KV rows (K = V, MQA: the heads
of a query share its list):

* the **window list** ``win_idx[b, s]``: rows of ``win_kv[b]``, the FP8 window rows (the SWA
  ring followed by the chunk's own rows), e4m3 codes with one E8M0 scale byte per 32 values;
* the **global list** ``topk[b, s]``: entries of the packed FP4 main KV ``main[b]`` (two e2m1
  codes per byte, element ``2j`` in the low nibble) with one E4M3 scale per 16 values.

Index -1 means "no entry" (score -inf, row treated as zero). The softmax is the reference
kernel's (here in closed form: per-block running maxima by ``cummax``, equal to the online
recursion up to fp32 rounding): online over blocks of 64 list entries in list order, running max from -1e30,
``bf16(P)`` in the PV product and fp32 ``P`` in the denominator, the sink ``e^{sink_h}`` added to
the denominator only (unscaled, no value row), ``o = bf16(acc / l)``. A query with no valid
entry gives exactly 0. The list is the window list followed by the global list, blocked from its
start as the reference kernel blocks its concatenated index row.

The log-sum-exp returned beside ``o`` is ``log(sum_j e^{s_j} + e^{sink_h})`` (natural log, fp32,
``s_j`` the scaled scores); it equals ``sink_h`` for a query with no valid entry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt8

from pallas_kernels.fp4.common import exp2_int
from pallas_kernels.sparse_attention.common import (BF16, E2M1_LUT, F32, SOFTMAX_BLOCK,
                                                    lse_with_sink, pad_list)

__all__ = ["E2M1_LUT", "SOFTMAX_BLOCK", "blocked_sink_softmax", "dequant_main", "dequant_window",
           "gather_rows", "lse_with_sink", "pad_list", "sparse_attention_xla"]


def blocked_sink_softmax(q: Float[Array, "B S H K"], kv: Float[Array, "B S N K"],
                         valid: Bool[Array, "B S N"], sink: Float[Array, "H"], scale: float
                         ) -> tuple[Float[Array, "B S H K"], Float[Array, "B S H"]]:
    """Joint sink softmax over per-query gathered rows ``kv`` (bf16, K = V). See
    docs/architecture.md, "Joint sink softmax".

    Emulates the reference kernel's 64-entry online-softmax blocks in list order (see the module
    docstring). Returns ``(o bf16 [B,S,H,K], lse fp32 [B,S,H])``.
    """
    B, S, N, K = kv.shape
    H = q.shape[2]
    if N == 0:  # nothing to attend to: o = 0, lse = sink
        return (jnp.zeros((B, S, H, K), BF16),
                jnp.broadcast_to(sink.astype(F32), (B, S, H)))
    s = jnp.einsum("bshk,bsnk->bshn", q, kv, preferred_element_type=F32) * scale
    s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
    nb = -(-N // SOFTMAX_BLOCK)
    pad = nb * SOFTMAX_BLOCK - N
    if pad:
        s = jnp.pad(s, ((0, 0),) * 3 + ((0, pad),), constant_values=-jnp.inf)
        kv = jnp.pad(kv, ((0, 0), (0, 0), (0, pad), (0, 0)))
    sb = s.reshape(B, S, -1, nb, SOFTMAX_BLOCK)
    m_blk = jax.lax.cummax(jnp.maximum(jnp.max(sb, axis=-1), -1e30), axis=3)   # running max
    p = jnp.exp(sb - m_blk[..., None])
    m = m_blk[..., -1]
    rescale = jnp.exp(m_blk - m[..., None])                                    # [B,S,H,nb]
    l = jnp.sum(jnp.sum(p, axis=-1) * rescale, axis=-1)
    # one batch dimension (b, s, block): XLA:CPU has no bf16 x bf16 -> f32 dot with several
    pb = p.astype(BF16).transpose(0, 1, 3, 2, 4).reshape(B * S * nb, -1, SOFTMAX_BLOCK)
    pv = jax.lax.dot_general(pb, kv.reshape(B * S * nb, SOFTMAX_BLOCK, K),
                             (((2,), (1,)), ((0,), (0,))), preferred_element_type=F32)
    pv = pv.reshape(B, S, nb, -1, K).transpose(0, 1, 3, 2, 4)               # [B,S,H,nb,K]
    acc = jnp.sum(pv * rescale[..., None], axis=3)
    sink = sink.astype(F32)[None, None, :]
    o = (acc / (l + jnp.exp(sink - m))[..., None]).astype(BF16)
    return o, lse_with_sink(m, l, sink)


def gather_rows(arr: jax.Array, idx: Int[Array, "B S N"]) -> jax.Array:
    """Rows of ``arr [B, T, F]`` at ``idx [B, S, N]`` (-1 reads row 0; mask separately)."""
    B, S, N = idx.shape
    flat = jnp.clip(idx, 0, max(arr.shape[1] - 1, 0)).reshape(B, S * N)
    g = jnp.take_along_axis(arr, flat[..., None], axis=1)
    return g.reshape(B, S, N, arr.shape[-1])


def dequant_window(codes: jax.Array, scale: UInt8[Array, "... G"]) -> Float[Array, "... K"]:
    """FP8 window rows (e4m3 codes + E8M0 per 32) -> bf16 (exact)."""
    k = codes.shape[-1]
    v = codes.astype(F32).reshape(*codes.shape[:-1], k // 32, 32)
    s = exp2_int(scale.astype(jnp.int32) - 127)
    return (v * s[..., None]).reshape(codes.shape).astype(BF16)


def dequant_main(packed: UInt8[Array, "... K2"], scale: Float[Array, "... G"]
                 ) -> Float[Array, "... K"]:
    """Packed FP4 main KV (e2m1 pairs + E4M3 per 16) -> bf16 (exact)."""
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(
        *packed.shape[:-1], packed.shape[-1] * 2)
    v = jnp.asarray(E2M1_LUT)[codes.astype(jnp.int32)]
    k = v.shape[-1]
    v = v.reshape(*v.shape[:-1], k // 16, 16) * scale.astype(F32)[..., None]
    return v.reshape(*codes.shape).astype(BF16)


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_attention_xla(q: Float[Array, "B S H K"], win_kv, win_scale,
                         win_idx: Int[Array, "B S Ww"], main, main_scale,
                         topk: Int[Array, "B S k"] | None, sink: Float[Array, "H"],
                         scale: float) -> tuple[Float[Array, "B S H K"], Float[Array, "B S H"]]:
    """The op in plain XLA: gather the listed rows, dequantise them, blocked sink softmax.

    Memory is O(B*S*(Ww+k)*K) for the gathered bf16 rows: the baseline the kernels replace.
    Argument layout as :func:`pallas_kernels.sparse_attention.sparse_attention`.
    """
    rows = [dequant_window(gather_rows(win_kv, win_idx), gather_rows(win_scale, win_idx))]
    oks = [win_idx >= 0]
    if topk is not None and topk.shape[-1]:
        rows.append(dequant_main(gather_rows(main, topk), gather_rows(main_scale, topk)))
        oks.append(topk >= 0)
    kv = jnp.concatenate(rows, axis=2)
    valid = jnp.concatenate(oks, axis=2)
    kv = jnp.where(valid[..., None], kv, jnp.zeros((), BF16))
    return blocked_sink_softmax(q, kv, valid, sink, scale)
