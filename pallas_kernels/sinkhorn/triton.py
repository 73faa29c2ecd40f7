"""Pallas Triton (NVIDIA GPU) kernel of :func:`pallas_kernels.sinkhorn.sinkhorn_pairs`.

The matrices stay in their row-major layout ``[T, hc * hc]`` (no transpose around the call);
each program loads a block of ``BLOCK`` matrices column by column (``hc * hc`` strided loads
of ``[BLOCK]``), so each thread holds whole matrices of its lanes: a row or column sum is
``hc - 1`` register adds in increasing index, with no cross-lane reduction. The pairs run as a
``fori_loop`` over the ``hc * hc`` lane vectors. Divisions are ``div.rn.f32`` (Triton's own
f32 division is the approximate ``div.full``); in interpret mode plain IEEE division. ``T``
is padded to a multiple of the block (``BLOCK`` rounded down to the smallest power of two
>= ``T`` for a small call: a decode step of batch 1 pads to 16 rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

F32 = jnp.float32
BLOCK = 128        # matrices per program


def _div(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
    """IEEE ``a / b`` (fp32, round to nearest) on the GPU as in interpret mode."""
    if interpret:
        return a / b
    [out] = pltr.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, F32)])
    return out


def _kernel(c_ref, o_ref, *, hc: int, pairs: int, eps: float, interpret: bool):
    planes = tuple(c_ref[:, k] for k in range(hc * hc))

    def pair(_, p):
        p = list(p)
        for i in range(hc):                                   # rows
            s = p[i * hc]
            for j in range(1, hc):
                s = s + p[i * hc + j]
            s = s + eps
            for j in range(hc):
                p[i * hc + j] = _div(p[i * hc + j], s, interpret)
        for j in range(hc):                                   # columns
            s = p[j]
            for i in range(1, hc):
                s = s + p[i * hc + j]
            s = s + eps
            for i in range(hc):
                p[i * hc + j] = _div(p[i * hc + j], s, interpret)
        return tuple(p)

    out = jax.lax.fori_loop(0, pairs, pair, planes)
    for k in range(hc * hc):
        o_ref[:, k] = out[k]


@functools.partial(jax.jit, static_argnames=("pairs", "eps", "interpret"))
def sinkhorn_pairs(c: jax.Array, pairs: int, eps: float, *, interpret: bool = False
                   ) -> jax.Array:
    """See :func:`pallas_kernels.sinkhorn.sinkhorn_pairs` (shapes checked there)."""
    *batch, hc, _ = c.shape
    flat = c.reshape(-1, hc * hc)
    T = flat.shape[0]
    block = block_rows(T)
    Tp = -(-T // block) * block
    if Tp != T:
        flat = jnp.pad(flat, ((0, Tp - T), (0, 0)), constant_values=1.0)
    out = pl.pallas_call(
        functools.partial(_kernel, hc=hc, pairs=pairs, eps=float(eps), interpret=interpret),
        grid=(Tp // block,),
        in_specs=[pl.BlockSpec((block, hc * hc), lambda t: (t, 0))],
        out_specs=pl.BlockSpec((block, hc * hc), lambda t: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((Tp, hc * hc), F32),
        compiler_params=pltr.CompilerParams(num_warps=max(1, min(4, block // 32)),
                                            num_stages=1),
        interpret=interpret,
        name="sinkhorn_pairs",
    )(flat)
    return (out if Tp == T else out[:T]).reshape(*batch, hc, hc)


def block_rows(T: int) -> int:
    """Matrices per program: :data:`BLOCK`, or for fewer the smallest power of two >= ``T``
    (at least 16)."""
    b = 16
    while b < min(T, BLOCK):
        b *= 2
    return b
