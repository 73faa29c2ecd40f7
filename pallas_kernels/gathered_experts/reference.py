"""Pure-jnp reference of the gathered FP4 experts (:mod:`pallas_kernels.gathered_experts`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.fp4.reference import BF16, F32, act_quant_qdq
from pallas_kernels.grouped_matmul import kernel_form_values

HIGHEST = jax.lax.Precision.HIGHEST


def expert_values(w: dict, experts: Int[Array, "P"]) -> Float[Array, "P N K"]:
    """The fp32 weights ``[P, N, K]`` of the listed experts of a kernel-form stack (``"at"``:
    the layer's index in a stack of layers, whose experts are numbered across it), exact."""
    E = w["i4"].shape[-3]
    e = experts + (w["at"] * E if "at" in w else 0)
    i4 = w["i4"].reshape(-1, *w["i4"].shape[-2:])[e]
    st = w["scale_t"].reshape(-1, *w["scale_t"].shape[-2:])[e]
    v, s = kernel_form_values({"i4": i4, "scale_t": st})
    return v * jnp.repeat(s, 32, axis=-1)


def up(x: Float[Array, "T D"], w1: dict, w3: dict, ids: Int[Array, "T k"],
       route_w: Float[Array, "T k"], limit: float) -> Float[Array, "P I"]:
    """Each (token, expert) pair's SwiGLU activation ``a`` (bf16 values, as fp32) in the pairs'
    order (row ``t * k + j``): ``g, u`` = the input's FP8 QDQ times ``w1`` / ``w3`` rounded to
    bf16, ``u`` clamped to ``[-limit, limit]`` and ``g`` from above (``limit > 0``),
    ``bf16(silu(g) * u * route_w)``."""
    T, k = ids.shape
    xq = act_quant_qdq(x, 32).astype(F32)
    xp = jnp.repeat(xq, k, axis=0)
    e = ids.reshape(-1)
    g = jnp.einsum("pk,pnk->pn", xp, expert_values(w1, e), precision=HIGHEST).astype(BF16)
    u = jnp.einsum("pk,pnk->pn", xp, expert_values(w3, e), precision=HIGHEST).astype(BF16)
    g, u = g.astype(F32), u.astype(F32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    a = jax.nn.silu(g) * u * route_w.reshape(-1)[:, None]
    return a.astype(BF16).astype(F32)


def down(a: Float[Array, "P I"], w2: dict, ids: Int[Array, "T k"]) -> Float[Array, "T D"]:
    """The routed sum: each pair's ``bf16(QDQ(a) @ w2^T)`` added into an fp32 sum in the
    pairs' order within each token (``ids`` ascending: increasing expert id)."""
    T, k = ids.shape
    aq = act_quant_qdq(a.astype(BF16), 32).astype(F32)
    y = jnp.einsum("pk,pnk->pn", aq, expert_values(w2, ids.reshape(-1)),
                   precision=HIGHEST).astype(BF16).astype(F32).reshape(T, k, -1)
    acc = jnp.zeros(y[:, 0].shape, F32)
    for j in range(k):
        acc = acc + y[:, j]
    return acc


def gathered_experts(x: Float[Array, "T D"], w1: dict, w3: dict, w2: dict,
                     ids: Int[Array, "T k"], route_w: Float[Array, "T k"], limit: float
                     ) -> Float[Array, "T D"]:
    """See :func:`pallas_kernels.gathered_experts.gathered_experts`."""
    return down(up(x, w1, w3, ids, route_w, limit), w2, ids)


def route(scores: Float[Array, "T E"], keys: Float[Array, "T E"], k: int, route_scale: float,
          normalize: bool) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """The router's choice: the ``k`` experts of largest key (``lax.top_k``; the keys are the
    scores plus the selection bias), their scores over their sum ``+ 1e-20`` (where
    ``normalize`` and ``k > 1``) times ``route_scale``, in increasing expert id (ids int32,
    weights fp32): the MoE's gate (``dsv41_jax.layers.moe.gate``) followed by the ascending
    order the kernels add the experts in."""
    _, idx = jax.lax.top_k(keys, k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if normalize and k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * route_scale
    order = jnp.argsort(idx, axis=-1)
    return (jnp.take_along_axis(idx, order, axis=-1).astype(jnp.int32),
            jnp.take_along_axis(w, order, axis=-1))


def routed_experts(x: Float[Array, "T D"], scores: Float[Array, "T E"], keys: Float[Array, "T E"],
                   w1: dict, w3: dict, w2: dict, k: int, route_scale: float, normalize: bool,
                   limit: float) -> Float[Array, "T D"]:
    """See :func:`pallas_kernels.gathered_experts.routed_experts`."""
    ids, route_w = route(scores, keys, k, route_scale, normalize)
    return gathered_experts(x, w1, w3, w2, ids, route_w, limit)
