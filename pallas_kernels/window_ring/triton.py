"""Pallas Triton kernel of :mod:`pallas_kernels.window_ring`: a decode step's window KV row
quantised to FP8 and written into its slot of the rings in place, one program per batch row,
one launch for every row (the XLA form takes three: the quantiser's fusion, and one slice update
each for the codes and the scales, after a select keeping the old row).

Numerics: :func:`pallas_kernels.fp4.reference.fp8_quantize` bit for bit for finite rows: the
amax of each 32 values (at least 1e-4), its power-of-two ceiling ``2**e`` from the exponent bits,
``x * 2**-e`` (exact, as the reference's ``x / 2**e``) clipped to +-448 and rounded to the nearest
e4m3 value (ties to even), and the E8M0 byte ``e + 127``. A NaN in a row is outside the contract
(the kernel's float max drops it).

With ``norm`` and ``rope`` the kernel first makes the row what
:func:`pallas_kernels.window_ring.reference.window_row` makes it, in its formulas' order: the
RMSNorm ``w * (x * rsqrt(sum(x^2) / K + eps))`` rounded to the row's dtype (its sum of squares in
another order than XLA's reduction, so within one bf16 ulp of the reference's), then the
interleaved pairs of the last ``R`` channels rotated in fp32 by the angles ``f32(p) * f_i`` of
the row's position (``cos`` and ``sin`` the CUDA math library's, as XLA's; ``a cos - b sin``,
``a sin + b cos``: a compiler may contract a product and a sum into an FMA in one program and
not the other) and rounded again; the other pairs are kept as they are. So one launch replaces
the norm's two and the rotation's one of a decode step, and no launch makes the angles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.fp4.common import exp2_int
from pallas_kernels.fp4.reference import FP8_MAX, _pow2_ceil_exponent

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32


def _kernel(index_ref, rows_ref, *refs, K, R, column, norm_eps, rope_pairs, parts_at):
    refs = list(refs)
    layer_ref, w_ref = (refs.pop(0), refs.pop(0)) if norm_eps is not None else (None, None)
    pos_ref, freqs_ref = (refs.pop(0), refs.pop(0)) if rope_pairs else (None, None)
    _, _, kv_ref, scale_ref = refs                    # the ring buffers in, aliased out
    b = pl.program_id(0)
    t = index_ref[b, column]

    @pl.when((t >= 0) & (t < R))
    def _write():
        if parts_at is None:
            dt = rows_ref.dtype
            x = rows_ref[b, :]
        elif rows_ref.shape[0] == 1:                  # a GEMV's output without K splits
            dt = rows_ref.dtype
            x = rows_ref[0, b, pl.ds(parts_at, K)]
        else:                                         # its partial sums: XLA's reduction
            dt = BF16
            x = jnp.zeros((K,), F32)
            for s in range(rows_ref.shape[0]):
                x = x + rows_ref[s, b, pl.ds(parts_at, K)]
            x = x.astype(dt)
        if norm_eps is not None:                      # rms_norm's formula and order
            xf = x.astype(F32)
            ms = jnp.sum(xf * xf) * np.float32(1.0 / K)
            rs = jax.lax.rsqrt(ms + np.float32(norm_eps))
            x = (w_ref[layer_ref[0], :].astype(F32) * (xf * rs)).astype(dt)
        if rope_pairs:                                # apply_rope's, on the last pairs only
            a, c = jnp.split(x.astype(F32).reshape(K // 2, 2), 2, axis=-1)
            a, c = a.reshape(K // 2), c.reshape(K // 2)
            j = jnp.arange(K // 2, dtype=I32) - (K // 2 - rope_pairs)
            on = j >= 0
            jc = jnp.maximum(j, 0)
            theta = pos_ref[b].astype(F32) * freqs_ref[jc]    # rope_angles' formula
            cos, sin = jnp.cos(theta), jnp.sin(theta)
            a, c = (jnp.where(on, a * cos - c * sin, a), jnp.where(on, a * sin + c * cos, c))
            x = jnp.stack([a.astype(dt), c.astype(dt)], axis=-1).reshape(K)
        x = x.astype(F32).reshape(K // 32, 32)
        amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), np.float32(1e-4))
        e = _pow2_ceil_exponent(amax * np.float32(1.0 / FP8_MAX))
        q = jnp.clip(x * exp2_int(-e)[:, None], -FP8_MAX, FP8_MAX).astype(kv_ref.dtype)
        kv_ref[b, t, :] = q.reshape(K)
        scale_ref[b, t, :] = (e + 127).astype(scale_ref.dtype)


@functools.partial(jax.jit, static_argnames=("column", "norm_eps", "parts_at", "interpret"))
def quantize_write(ring_kv, ring_scale, rows, index, norm_weight=None, norm_layer=None,
                   positions=None, freqs=None, *, column: int, norm_eps: float | None = None,
                   parts_at: int | None = None, interpret: bool = False):
    """See :func:`pallas_kernels.window_ring.quantize_write` (its arguments checked there):
    ``norm_weight`` ``[K]`` (or a stack ``[L, K]`` with ``norm_layer``) with ``norm_eps``, and
    ``positions`` int32 ``[B]`` with ``freqs`` fp32 ``[R/2]``, where the caller's ``norm``
    and ``rope`` are given; ``parts_at``: ``rows`` are the GEMV's partial sums ``[S, rows,
    C]`` read from that column."""
    B, R, K = ring_kv.shape
    ins = [index.astype(I32), rows]
    if norm_eps is not None:
        if norm_layer is None:
            ins += [jnp.zeros((1,), I32), norm_weight[None]]
        else:
            ins += [jnp.reshape(norm_layer, (1,)).astype(I32), norm_weight]
    rope_pairs = 0 if freqs is None else freqs.shape[-1]
    if rope_pairs:
        ins += [positions.astype(I32), freqs.astype(F32)]
    n = len(ins)
    kernel = functools.partial(_kernel, K=K, R=R, column=column, norm_eps=norm_eps,
                               rope_pairs=rope_pairs, parts_at=parts_at)
    return pl.pallas_call(
        kernel, grid=(B,),
        in_specs=[pl.BlockSpec()] * (n + 2),
        out_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_shape=[jax.ShapeDtypeStruct(ring_kv.shape, ring_kv.dtype),
                   jax.ShapeDtypeStruct(ring_scale.shape, ring_scale.dtype)],
        input_output_aliases={n: 0, n + 1: 1},
        compiler_params=pltr.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="window_ring_write",
    )(*ins, ring_kv, ring_scale)
