"""Pallas Triton (NVIDIA GPU) kernel of :func:`pallas_kernels.sinkhorn.sinkhorn_pairs`.

The matrices stay in their row-major layout ``[T, hc * hc]`` (no transpose, no pad around the
call): each program loads a block of ``BLOCK`` matrices column by column (``hc * hc`` strided,
masked loads of ``[BLOCK]``; rows past ``T`` read 1.0 and are not stored), so each thread holds
whole matrices of its lanes: a row or column sum is ``hc - 1`` register adds in increasing
index, with no cross-lane reduction. The pairs run as a ``fori_loop`` over the ``hc * hc`` lane
vectors.

Division. PTX ``div.rn.f32`` is IEEE, but ptxas emits it as a fast path plus a branch to a
slow-path subroutine, and the branches keep the 32 divisions of a pair from overlapping (a
decode step's call took 20 us). The kernel instead runs the fast path straight: per sum ``s``
a reciprocal ``y`` (``rcp.approx`` refined by one Newton step, :data:`RECIP_PTX`), then per
entry ``q = a * y``, ``r = fma(-s, q, a)`` (exact), ``q + r * y`` rounded once
(:data:`DIV_PTX`). For a normal ``s`` and a quotient in the normal range this is the correctly
rounded ``a / s`` (Markstein's correction step; the slow path only serves subnormal, huge or
special operands). mHC's matrices are a softmax plus ``eps`` (entries >= ``eps`` / (``hc`` +
``eps``)) so every operand is in that range. In interpret mode: plain IEEE division.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

F32 = jnp.float32
BLOCK = 128        # matrices per program

#: ``$0 = 1 / $1`` to within the rounding of one Newton step from ``rcp.approx``.
RECIP_PTX = """{
.reg .f32 y, e, nb;
rcp.approx.ftz.f32 y, $1;
neg.f32 nb, $1;
fma.rn.f32 e, nb, y, 0f3F800000;
fma.rn.f32 $0, y, e, y;
}"""

#: ``$0 = $1 / $2`` rounded to nearest, given ``$3`` = :data:`RECIP_PTX` of ``$2``.
DIV_PTX = """{
.reg .f32 q, r, nb;
mul.rn.f32 q, $1, $3;
neg.f32 nb, $2;
fma.rn.f32 r, nb, q, $1;
fma.rn.f32 $0, r, $3, q;
}"""


def asm(template: str, *args: jax.Array) -> jax.Array:
    """One fp32 result of the PTX ``template`` applied elementwise to fp32 ``args``."""
    [out] = pltr.elementwise_inline_asm(
        template, args=list(args), constraints="=f" + ",f" * len(args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, F32)])
    return out


def divide(vals: list, s: jax.Array, interpret: bool) -> list:
    """Each of ``vals`` divided by ``s`` (IEEE, round to nearest; see the module docstring)."""
    if interpret:
        return [v / s for v in vals]
    y = asm(RECIP_PTX, s)
    return [asm(DIV_PTX, v, s, y) for v in vals]


def run_pairs(planes: tuple, *, hc: int, pairs: int, eps: float, interpret: bool) -> tuple:
    """``pairs`` (row, column) normalisations of the matrices held as ``hc * hc`` lane vectors
    (``planes[i * hc + j]`` = entry (i, j) of every lane's matrix), as a ``fori_loop``; sums
    in increasing index, IEEE divisions (:func:`divide`). Also used by
    :mod:`pallas_kernels.mhc`'s kernel."""

    def pair(_, p):
        p = list(p)
        for i in range(hc):                                   # rows
            s = p[i * hc]
            for j in range(1, hc):
                s = s + p[i * hc + j]
            p[i * hc:(i + 1) * hc] = divide(p[i * hc:(i + 1) * hc], s + eps, interpret)
        for j in range(hc):                                   # columns
            s = p[j]
            for i in range(1, hc):
                s = s + p[i * hc + j]
            p[j::hc] = divide(p[j::hc], s + eps, interpret)
        return tuple(p)

    return jax.lax.fori_loop(0, pairs, pair, tuple(planes))


def _kernel(c_ref, o_ref, *, hc: int, pairs: int, eps: float, rows: int, block: int,
            interpret: bool):
    r = pl.program_id(0) * block + jnp.arange(block)
    mask = r < rows
    planes = tuple(pltr.load(c_ref.at[:, np.int32(k)], mask=mask, other=1.0)
                   for k in range(hc * hc))

    out = run_pairs(planes, hc=hc, pairs=pairs, eps=eps, interpret=interpret)
    for k in range(hc * hc):
        pltr.store(o_ref.at[:, np.int32(k)], out[k], mask=mask)


@functools.partial(jax.jit, static_argnames=("pairs", "eps", "interpret"))
def sinkhorn_pairs(c: jax.Array, pairs: int, eps: float, *, interpret: bool = False
                   ) -> jax.Array:
    """See :func:`pallas_kernels.sinkhorn.sinkhorn_pairs` (shapes checked there)."""
    *batch, hc, _ = c.shape
    flat = c.reshape(-1, hc * hc)
    T = flat.shape[0]
    block = block_rows(T)
    out = pl.pallas_call(
        functools.partial(_kernel, hc=hc, pairs=pairs, eps=float(eps), rows=T, block=block,
                          interpret=interpret),
        grid=(pl.cdiv(T, block),),
        in_specs=[pl.BlockSpec((block, hc * hc), lambda t: (t, 0))],
        out_specs=pl.BlockSpec((block, hc * hc), lambda t: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((T, hc * hc), F32),
        compiler_params=pltr.CompilerParams(num_warps=max(1, min(4, block // 32)),
                                            num_stages=1),
        interpret=interpret,
        name="sinkhorn_pairs",
    )(flat)
    return out.reshape(*batch, hc, hc)


def block_rows(T: int) -> int:
    """Matrices per program: :data:`BLOCK`, or for fewer the smallest power of two >= ``T``
    (at least 16)."""
    b = 16
    while b < min(T, BLOCK):
        b *= 2
    return b
