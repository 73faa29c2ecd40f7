"""FP8 / FP4 formats of the reference: quantise-dequantise (QDQ), pack and unpack.

Every function here is bit-exact with the reference kernels (docs/architecture.md,
"Number formats"): power-of-two scales are read from the exponent bits, e4m3 rounds to nearest
even, e2m1 ties go to the even code. All QDQ results are exactly representable in bf16, so a
packed cache that stores ``(codes, scales)`` dequantises to the very bf16 values the reference
keeps.

Formats used by the model (docs/architecture.md, "Number formats"):
  * FP8 activations / window KV: e4m3 codes, one E8M0 (power of two) scale per 32 values.
  * FP4 main KV: e2m1 codes (two per byte), one E4M3 scale per 16 values.
  * FP4 indexer q/k (MXFP4): e2m1 codes, one E8M0 scale per 32 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

# the FP4 quantiser primitives live beside the FP4 codec kernels, their reference
from pallas_kernels.fp4.reference import (_E2M1_BOUNDS, BF16, E2M1_LUT, E2M1_VALUES,  # noqa: F401
                                          E4M3, E8M0_NAN, F32, FP4_MAX, FP8_MAX, _blocks,
                                          _e2m1_code, _pow2_ceil_exponent, e2m1_decode,
                                          e8m0_to_f32, fp4_dequantize, fp4_quantize,
                                          fp4_scale_to_f32, pack_nibbles, unpack_nibbles)
from pallas_kernels.fp4.common import exp2_int
# the FP8 activation quantiser too (the FP8 GEMV kernel applies it in its tiles)
from pallas_kernels.fp4.reference import act_quant_qdq, fp8_dequantize, fp8_quantize  # noqa: F401


# ----------------------------------------------------------------------------- FP4


@functools.partial(jax.jit, static_argnames=("block", "scale_fmt"))
def fp4_qdq(x: Float[Array, "... K"], block: int, scale_fmt: str) -> Float[Array, "... K"]:
    """FP4 QDQ; returns bf16 (the values the reference keeps in its caches).

    See docs/architecture.md, "Number formats".
    """
    codes, s = fp4_quantize(x, block, scale_fmt)
    return fp4_dequantize(codes, s, block, BF16)


# ----------------------------------------------------------------------------- weights


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def dequant_fp8_weight(w: jax.Array, scale: UInt8[Array, "*batch Go Gi"], block: int = 32,
                       dtype=BF16) -> jax.Array:
    """FP8 weight ``[out, in]`` with one E8M0 scale per ``block x block`` tile -> ``dtype``.

    Leading batch dimensions (stacked experts) are allowed. See docs/architecture.md,
    "Number formats".
    """
    out_dim, in_dim = w.shape[-2:]
    s = e8m0_to_f32(scale)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :out_dim, :in_dim]
    return (w.astype(F32) * s).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def dequant_fp4_weight(packed: UInt8[Array, "... O I2"], scale: UInt8[Array, "... O G"],
                       block: int = 32, dtype=BF16) -> jax.Array:
    """Packed e2m1 expert weight ``[out, in/2]`` + E8M0 ``[out, in/32]`` -> ``dtype`` [out, in]."""
    return fp4_dequantize(unpack_nibbles(packed), scale, block, dtype)
