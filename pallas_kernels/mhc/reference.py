"""Pure-jnp reference of :func:`pallas_kernels.mhc.sublayer_glue`, and the one copy of mHC's
jnp pieces (:func:`sinkhorn_split`, :func:`hc_mixes`, :func:`hc_pre`, :func:`hc_post`) and of
the LLM RMSNorm (:func:`rms_norm`), which :mod:`dsv41_jax.layers.mhc` and
:mod:`dsv41_jax.layers.linear` re-export (this package imports nothing from the model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels import sinkhorn

F32 = jnp.float32
BF16 = jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST


def rms_norm(x: Float[Array, "... D"], w: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    """LLM RMSNorm: ``bf16(w * (x * rsqrt(mean(x^2) + eps)))`` in fp32 (docs/architecture.md,
    "Norms, embedding and head")."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(F32) * y).astype(x.dtype)


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


def head_products(x: Float[Array, "*batch C D"], fn: Float[Array, "M CD"]
                  ) -> Float[Array, "*batch M"]:
    """The coefficient head's dot products, not yet normalised: ``f32(X) @ fn^T`` over the
    flattened streams (fp32, HIGHEST). Also the GPU glue's product between its two kernels.

    See docs/architecture.md, "mHC: hyper-connections".
    """
    xf = x.astype(F32).reshape(*x.shape[:-2], -1)
    return jnp.einsum("...k,mk->...m", xf, fn, precision=HIGHEST, preferred_element_type=F32)


def hc_mixes(x: Float[Array, "B S C D"], fn: Float[Array, "M CD"], scale, base, *, hc: int,
             iters: int, hc_eps: float, norm_eps: float, impl: str = "auto",
             loop: bool | None = None):
    """Coefficient head of one sublayer: ``(pre, post, comb)`` from the stream state
    (``impl``, ``loop``: the Sinkhorn's, :func:`sinkhorn_split`).

    See docs/architecture.md, "mHC: hyper-connections".
    """
    xf = x.astype(F32).reshape(*x.shape[:-2], -1)
    mixes = head_products(x, fn)
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


def sublayer_glue(streams, pre_prev, fn, scale, base, norm_weight, *, hc: int, iters: int,
                  hc_eps: float, norm_eps: float, sinkhorn_impl: str = "auto"):
    """:func:`pallas_kernels.mhc.sublayer_glue` in jnp: ``X = hc_post(*streams)`` for a tuple
    ``(y, res, post, comb)`` (else ``X = streams``), then ``hc_mixes(X)`` and
    ``rms_norm(hc_pre(X, pre_prev), norm_weight)``. ``sinkhorn_impl``: the Sinkhorn pairs'
    ``impl`` (:func:`sinkhorn_split`). Returns ``(X, input, pre, post, comb)``."""
    X = hc_post(*streams) if isinstance(streams, tuple) else streams
    pre, post, comb = hc_mixes(X, fn, scale, base, hc=hc, iters=iters, hc_eps=hc_eps,
                               norm_eps=norm_eps, impl=sinkhorn_impl)
    x_in = rms_norm(hc_pre(X, pre_prev), norm_weight, norm_eps)
    return X, x_in, pre, post, comb
