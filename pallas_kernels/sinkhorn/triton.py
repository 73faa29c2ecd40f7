"""Pallas Triton (NVIDIA GPU) kernel of :func:`pallas_kernels.sinkhorn.sinkhorn_pairs`.

The ``hc x hc`` matrices are laid out as ``hc * hc`` planes ``[hc * hc, T]`` (one matrix per
column), so each thread holds whole matrices of its lanes: a row or column sum is ``hc - 1``
register adds in increasing index, with no cross-lane reduction and no layout change. One
program handles ``BLOCK`` matrices through every pair (a ``fori_loop`` over the pairs, the
planes as its carry). Divisions are ``div.rn.f32`` (Triton's own f32 division is the
approximate ``div.full``); in interpret mode plain IEEE division.
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
    planes = tuple(c_ref[k, :] for k in range(hc * hc))

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
        o_ref[k, :] = out[k]


@functools.partial(jax.jit, static_argnames=("pairs", "eps", "interpret"))
def sinkhorn_pairs(c: jax.Array, pairs: int, eps: float, *, interpret: bool = False
                   ) -> jax.Array:
    """See :func:`pallas_kernels.sinkhorn.sinkhorn_pairs` (shapes checked there)."""
    *batch, hc, _ = c.shape
    flat = c.reshape(-1, hc * hc)
    T = flat.shape[0]
    Tp = -(-T // BLOCK) * BLOCK
    planes = jnp.pad(flat, ((0, Tp - T), (0, 0)), constant_values=1.0).T   # [hc*hc, Tp]
    out = pl.pallas_call(
        functools.partial(_kernel, hc=hc, pairs=pairs, eps=float(eps), interpret=interpret),
        grid=(Tp // BLOCK,),
        in_specs=[pl.BlockSpec((hc * hc, BLOCK), lambda t: (0, t))],
        out_specs=pl.BlockSpec((hc * hc, BLOCK), lambda t: (0, t)),
        out_shape=jax.ShapeDtypeStruct((hc * hc, Tp), F32),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="sinkhorn_pairs",
    )(planes)
    return out.T[:T].reshape(*batch, hc, hc)
