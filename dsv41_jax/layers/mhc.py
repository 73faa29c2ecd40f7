"""mHC: four residual streams mixed by Sinkhorn-normalised coefficients
(docs/architecture.md, "mHC: hyper-connections").

Single-pass wiring: each sublayer collapses the streams with the ``pre`` coefficients predicted
one sublayer earlier; its own head predicts ``post``/``comb`` for itself and ``pre`` for the next.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float
from dsv41_jax.dtypes import F32
from pallas_kernels import mhc as mhc_kernels
# The jnp pieces live with the glue kernels' reference (one copy); re-exported here.
from pallas_kernels.mhc.reference import (hc_mixes, hc_post, hc_pre,  # noqa: F401
                                          sinkhorn_split)


def identity_pre_mix(batch_shape: tuple, hc: int) -> Float[Array, "... C"]:
    """One-hot on stream 0 (the first block's ``pre_mix``)."""
    return jnp.zeros((*batch_shape, hc), F32).at[..., 0].set(1.0)


def block_wiring(p: dict, X: Float[Array, "B S C D"], pre_mix: Float[Array, "B S C"], attn_fn,
                 ffn_fn, *, hc: int, iters: int, hc_eps: float, norm_eps: float,
                 impl: str = "auto"):
    """One block's single-pass mHC wiring around its two sublayers (docs/architecture.md,
    "mHC: hyper-connections"), shared by the backbone blocks and the DSpark stages.

    ``attn_fn(x bf16 [B, S, D]) -> (y bf16 [B, S, D], aux)`` gets ``attn_norm(hc_pre(X,
    pre_mix))``; ``ffn_fn(x) -> (y, aux)`` gets ``ffn_norm(hc_pre(X, a_pre))`` with the
    attention head's ``pre``. Returns ``(X, f_pre, (y_attn, aux_attn), (y_ffn, aux_ffn))``;
    ``f_pre`` (the FFN head's ``pre``) collapses the next block's attention input.

    The glue before each sublayer (its head, the collapse and norm of its input, and before the
    FFN the attention's ``hc_post``) is :func:`pallas_kernels.mhc.sublayer_glue` (``impl``:
    two kernels on a GPU for a decode step's rows, the jnp functions of this module otherwise);
    the block's last ``hc_post`` stays jnp. ``p["hc_at"]``, where present (a scanned layer
    group's parameters, :func:`dsv41_jax.model._unpin`): the heads' and norms' parameters are
    whole stacks, read at that layer.
    """
    kw = dict(hc=hc, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, impl=impl,
              layer=p.get("hc_at"))
    X, xa, a_pre, a_post, a_comb = mhc_kernels.sublayer_glue(
        X, pre_mix, p["hc_attn_fn"], p["hc_attn_scale"], p["hc_attn_base"],
        p["attn_norm"]["weight"], **kw)
    y, a_aux = attn_fn(xa)
    X, xf, f_pre, f_post, f_comb = mhc_kernels.sublayer_glue(
        (y, X, a_post, a_comb), a_pre, p["hc_ffn_fn"], p["hc_ffn_scale"], p["hc_ffn_base"],
        p["ffn_norm"]["weight"], **kw)
    y2, f_aux = ffn_fn(xf)
    X = hc_post(y2, X, f_post, f_comb)
    return X, f_pre, (y, a_aux), (y2, f_aux)
