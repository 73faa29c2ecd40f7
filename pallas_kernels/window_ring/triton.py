"""Pallas Triton kernel of :mod:`pallas_kernels.window_ring`: a decode step's window KV row
quantised to FP8 and written into its slot of the rings in place, one program per batch row,
one launch for every row (the XLA form takes three: the quantiser's fusion, and one slice update
each for the codes and the scales, after a select keeping the old row).

Numerics: :func:`pallas_kernels.fp4.reference.fp8_quantize` bit for bit for finite rows: the
amax of each 32 values (at least 1e-4), its power-of-two ceiling ``2**e`` from the exponent bits,
``x * 2**-e`` (exact, as the reference's ``x / 2**e``) clipped to +-448 and rounded to the nearest
e4m3 value (ties to even), and the E8M0 byte ``e + 127``. A NaN in a row is outside the contract
(the kernel's float max drops it).
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
I32 = jnp.int32


def _kernel(index_ref, rows_ref, kv_in_ref, scale_in_ref, kv_ref, scale_ref, *, K, R, column):
    del kv_in_ref, scale_in_ref                       # the same buffers as kv_ref, scale_ref
    b = pl.program_id(0)
    t = index_ref[b, column]

    @pl.when((t >= 0) & (t < R))
    def _write():
        x = rows_ref[b, :].astype(F32).reshape(K // 32, 32)
        amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), np.float32(1e-4))
        e = _pow2_ceil_exponent(amax * np.float32(1.0 / FP8_MAX))
        q = jnp.clip(x * exp2_int(-e)[:, None], -FP8_MAX, FP8_MAX).astype(kv_ref.dtype)
        kv_ref[b, t, :] = q.reshape(K)
        scale_ref[b, t, :] = (e + 127).astype(scale_ref.dtype)


@functools.partial(jax.jit, static_argnames=("column", "interpret"))
def quantize_write(ring_kv, ring_scale, rows, index, *, column: int, interpret: bool = False):
    """See :func:`pallas_kernels.window_ring.quantize_write` (its arguments checked there)."""
    B, R, K = ring_kv.shape
    kernel = functools.partial(_kernel, K=K, R=R, column=column)
    return pl.pallas_call(
        kernel, grid=(B,),
        in_specs=[pl.BlockSpec()] * 4,
        out_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_shape=[jax.ShapeDtypeStruct(ring_kv.shape, ring_kv.dtype),
                   jax.ShapeDtypeStruct(ring_scale.shape, ring_scale.dtype)],
        input_output_aliases={2: 0, 3: 1},
        compiler_params=pltr.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="window_ring_write",
    )(index.astype(I32), rows, ring_kv, ring_scale)
