"""mHC: four residual streams mixed by Sinkhorn-normalised coefficients
(docs/architecture.md, "mHC: hyper-connections").

Single-pass wiring: each sublayer collapses the streams with the ``pre`` coefficients predicted
one sublayer earlier; its own head predicts ``post``/``comb`` for itself and ``pre`` for the next.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float
from dsv41_jax.dtypes import BF16, F32, HIGHEST
from dsv41_jax.layers.linear import rms_norm
from pallas_kernels import sinkhorn


def sinkhorn_split(mixes: Float[Array, "... M"], scale: Float[Array, "3"], base: Float[Array, "M"],
                   hc: int, iters: int, eps: float, *, impl: str = "auto",
                   loop: bool | None = None):
    """``hc_split_sinkhorn``: mixes ``[..., (2+hc)*hc]`` -> pre ``[...,hc]``, post ``[...,hc]``,
    comb ``[..., hc, hc]`` (row i = source stream, column j = output stream). fp32. See
    docs/architecture.md, "mHC: hyper-connections".

    Row softmax (+eps), a column normalisation, then ``iters - 1`` (row, column) pairs
    (:func:`pallas_kernels.sinkhorn.sinkhorn_pairs`: ``impl="auto"`` is the GPU kernel on an
    NVIDIA GPU, the jnp reference elsewhere; ``impl="xla"`` where gradients are needed).
    ``loop``: the reference's pairs as a ``fori_loop`` (default: on a CPU, where unrolled they
    are most of a layer body's compile time; elsewhere unrolled, one fused kernel on a TPU).
    """
    m = mixes.astype(F32)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = m[..., 2 * hc:] * scale[2] + base[2 * hc:]
    c = c.reshape(*c.shape[:-1], hc, hc)
    c = jax.nn.softmax(c, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    if loop is None:
        loop = jax.default_backend() == "cpu"
    c = sinkhorn.sinkhorn_pairs(c, iters - 1, eps, impl=impl, loop=loop)
    return pre, post, c


def hc_mixes(x: Float[Array, "B S C D"], fn: Float[Array, "M CD"], scale, base, *, hc: int,
             iters: int, hc_eps: float, norm_eps: float, impl: str = "auto",
             loop: bool | None = None):
    """Coefficient head of one sublayer: ``(pre, post, comb)`` from the stream state
    (``impl``, ``loop``: the Sinkhorn's, :func:`sinkhorn_split`).

    See docs/architecture.md, "mHC: hyper-connections".
    """
    xf = x.astype(F32).reshape(*x.shape[:-2], -1)
    mixes = jnp.einsum("...k,mk->...m", xf, fn, precision=HIGHEST, preferred_element_type=F32)
    mixes = mixes * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
    return sinkhorn_split(mixes, scale, base, hc, iters, hc_eps, impl=impl, loop=loop)


def hc_pre(x: Float[Array, "*batch C D"], pre: Float[Array, "*batch C"]
           ) -> Float[Array, "*batch D"]:
    """Collapse the streams: ``bf16(sum_j pre[j] * x[j])``.

    See docs/architecture.md, "mHC: hyper-connections".
    """
    return jnp.sum(pre[..., None] * x.astype(F32), axis=-2).astype(BF16)


def hc_post(y: Float[Array, "B S D"], res: Float[Array, "B S C D"], post: Float[Array, "B S C"],
            comb: Float[Array, "B S C C"]) -> Float[Array, "B S C D"]:
    """New streams: ``bf16(post[j] * y + sum_i comb[i, j] * res[i])``.

    See docs/architecture.md, "mHC: hyper-connections".
    """
    mixed = jnp.sum(comb[..., None] * res.astype(F32)[..., :, None, :], axis=-3)
    return (post[..., None] * y.astype(F32)[..., None, :] + mixed).astype(BF16)


def identity_pre_mix(batch_shape: tuple, hc: int) -> Float[Array, "... C"]:
    """One-hot on stream 0 (the first block's ``pre_mix``)."""
    return jnp.zeros((*batch_shape, hc), F32).at[..., 0].set(1.0)


def block_wiring(p: dict, X: Float[Array, "B S C D"], pre_mix: Float[Array, "B S C"], attn_fn,
                 ffn_fn, *, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """One block's single-pass mHC wiring around its two sublayers (docs/architecture.md,
    "mHC: hyper-connections"), shared by the backbone blocks and the DSpark stages.

    ``attn_fn(x bf16 [B, S, D]) -> (y bf16 [B, S, D], aux)`` gets ``attn_norm(hc_pre(X,
    pre_mix))``; ``ffn_fn(x) -> (y, aux)`` gets ``ffn_norm(hc_pre(X, a_pre))`` with the
    attention head's ``pre``. Returns ``(X, f_pre, (y_attn, aux_attn), (y_ffn, aux_ffn))``;
    ``f_pre`` (the FFN head's ``pre``) collapses the next block's attention input.
    """
    kw = dict(hc=hc, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    a_pre, a_post, a_comb = hc_mixes(X, p["hc_attn_fn"], p["hc_attn_scale"], p["hc_attn_base"],
                                     **kw)
    y, a_aux = attn_fn(rms_norm(hc_pre(X, pre_mix), p["attn_norm"]["weight"], norm_eps))
    X = hc_post(y, X, a_post, a_comb)
    f_pre, f_post, f_comb = hc_mixes(X, p["hc_ffn_fn"], p["hc_ffn_scale"], p["hc_ffn_base"], **kw)
    y2, f_aux = ffn_fn(rms_norm(hc_pre(X, a_pre), p["ffn_norm"]["weight"], norm_eps))
    X = hc_post(y2, X, f_post, f_comb)
    return X, f_pre, (y, a_aux), (y2, f_aux)
