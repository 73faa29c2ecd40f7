"""Pure-jnp reference of the FP8 stacked GEMV (:mod:`pallas_kernels.gemv`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels.fp4.common import exp2_int
from pallas_kernels.fp4.reference import act_quant_qdq
from pallas_kernels.rope import apply_rope, rope_angles

F32 = jnp.float32


def dequant_layer(w: jax.Array, scale: UInt8[Array, "L Go Gi"], layer) -> Float[Array, "N K"]:
    """Layer ``layer`` of a stack of FP8 weights ``[L, N, K]`` with one E8M0 scale per 32 x 32
    tile -> fp32 (exact)."""
    wl = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False).astype(F32)
    sl = exp2_int(jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)
                  .astype(jnp.int32) - 127)
    N, K = wl.shape
    sl = jnp.repeat(jnp.repeat(sl, 32, axis=0), 32, axis=1)[:N, :K]
    return wl * sl


def fp8_gemv(x: Float[Array, "M G K"], w: jax.Array, scale: UInt8[Array, "L Go Gi"],
             layer: Int[Array, ""], act_quant: bool = False) -> Float[Array, "M N"]:
    """``y[m, n] = sum_k x[m, g(n), k] * W[layer][n, k]`` in fp32, where row ``n`` belongs to
    group ``g(n) = n // (N / G)`` (``G = 1``: a plain linear; ``G > 1``: the block-diagonal
    grouped projection). ``act_quant``: ``x`` is first FP8-quantised and dequantised per 32
    inputs (:func:`pallas_kernels.fp4.reference.act_quant_qdq`, bf16), as a quantised linear's
    input is."""
    if act_quant:
        x = act_quant_qdq(x, 32)
    wl = dequant_layer(w, scale, layer)
    M, G, K = x.shape
    wg = wl.reshape(G, -1, K)
    y = jnp.einsum("mgk,gnk->mgn", x.astype(F32), wg, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=F32)
    return y.reshape(M, -1)


def rope_heads(y: jax.Array, positions: Int[Array, "M"], freqs: Float[Array, "R2"], head: int,
               inverse: bool = False) -> jax.Array:
    """:func:`pallas_kernels.rope.apply_rope` of every head of ``head`` channels along the last
    axis of ``y`` (``[M, ..., C]``, ``C`` a multiple of ``head``), row ``m`` at position
    ``positions[m]``: the GEMV's ``rope_in`` / ``rope_out`` (a query's or an attention
    output's heads). Same shape and dtype."""
    cos, sin = rope_angles(positions, freqs)                        # [M, R/2]
    yh = y.reshape(*y.shape[:-1], y.shape[-1] // head, head)
    lead = (1,) * (yh.ndim - 2)
    cos = cos.reshape(cos.shape[0], *lead, cos.shape[-1])
    sin = sin.reshape(sin.shape[0], *lead, sin.shape[-1])
    return apply_rope(yh, cos, sin, inverse=inverse).reshape(y.shape)


def swiglu_input(parts: Float[Array, "S P C"], rows: int, limit: float) -> Float[Array, "M 1 I"]:
    """The SwiGLU of a GEMV pair's output from its partial sums ``parts`` ``[S, P >= rows,
    2I]`` (the gate projection in columns ``0..I``, the up projection in ``I..2I``; fp32 sums,
    or the bf16 outputs themselves where ``S = 1``): each output ``bf16(sum_s parts[s])``, the
    clamps (``limit > 0``: up to ``[-limit, limit]``, the gate from above), ``silu(g) * u``
    in fp32 rounded to bf16, as :func:`dsv41_jax.layers.moe.expert` computes it. bf16
    ``[rows, 1, I]``: the input of :func:`pallas_kernels.gemv.fp8_gemv_swiglu`'s GEMV."""
    I = parts.shape[-1] // 2
    total = parts[0] if parts.shape[0] == 1 else jnp.sum(parts.astype(F32), axis=0)
    total = total[:rows].astype(jnp.bfloat16).astype(F32)
    g, u = total[:, :I], total[:, I:]
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return (jax.nn.silu(g) * u).astype(jnp.bfloat16)[:, None, :]
