"""Pure-jnp FP4 quantiser primitives: the reference of the FP4 codec kernels.

Bit-exact with the reference model's kernels: power-of-two scales are read from the exponent
bits, e2m1 rounds to nearest with ties to the even code. Formats:

* main KV: e2m1 codes (two per byte), one E4M3 scale per 16 values;
* indexer q/k (MXFP4): e2m1 codes, one E8M0 (power of two) scale per 32 values.

A NaN in a block makes that block's scale NaN in both formats (E4M3's NaN code; the E8M0 NaN
byte 255), so the whole block dequantises to NaN: a NaN is propagated, never turned into
finite values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, UInt8

from pallas_kernels.fp4.common import E2M1_BOUNDS, F32, exp2_int

BF16 = jnp.bfloat16
E4M3 = jnp.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0_NAN = 255   # the E8M0 byte that encodes NaN
# Magnitudes of the eight e2m1 codes (bit 3 is the sign).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_LUT = np.concatenate([E2M1_VALUES, -E2M1_VALUES])  # code -> value (code 8 is -0)


def e8m0_to_f32(u: UInt8[Array, "..."]) -> Float[Array, "..."]:
    """E8M0 scale byte ``u`` -> ``2**(u - 127)`` in fp32 (byte 255: +inf)."""
    return exp2_int(u.astype(jnp.int32) - 127)


def _pow2_ceil_exponent(t: Float[Array, "..."]) -> jax.Array:
    """Exponent e (int32) of the smallest power of two >= t, for normal positive fp32 t.

    Reads the exponent bits and adds one if any mantissa bit is set, exactly like the
    reference's ``fast_log2_ceil`` (an exact power of two is not bumped).
    """
    bits = jax.lax.bitcast_convert_type(t.astype(F32), jnp.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    return exp + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


_E2M1_BOUNDS = E2M1_BOUNDS  # (boundary, a tie rounds up to the even code)


def _e2m1_code(x: Float[Array, "..."], s: Float[Array, "..."]) -> jax.Array:
    """e2m1 code of ``clamp(x / s, -6, 6)`` rounded to nearest, ties to the even code.

    Decided without dividing: ``|x| <op> b * s`` is exact (``b`` has <= 3 significant bits and
    ``s`` <= 4), and because ``x`` is bf16 the quotient ``x / s`` is either exactly a boundary
    or far from it, so this equals the reference's ``fl(x / s) <op> b``. (XLA may rewrite a
    division by a broadcast scale into a reciprocal multiply, which moves exact ties.)
    """
    a = jnp.abs(x)
    idx = jnp.zeros(x.shape, jnp.uint8)
    for b, up in _E2M1_BOUNDS:
        bs = s * np.float32(b)
        idx = idx + ((a >= bs) if up else (a > bs)).astype(jnp.uint8)
    sign = jnp.signbit(x).astype(jnp.uint8)
    return idx | (sign << 3)


def e2m1_decode(code: jax.Array) -> Float[Array, "..."]:
    """e2m1 nibble code (uint8 0..15) -> fp32 value."""
    return jnp.asarray(E2M1_LUT)[code.astype(jnp.int32)]


@functools.partial(jax.jit, static_argnames=("block", "scale_fmt"))
def fp4_quantize(x: Float[ArrayLike, "... K"], block: int, scale_fmt: str
                 ) -> tuple[jax.Array, jax.Array]:
    """``fp4_act_quant``: e2m1 codes (uint8, one per value) and per-block scales.

    ``scale_fmt="e8m0"`` (block 32, indexer q/k): power-of-two scale, returned as uint8 bytes.
    ``scale_fmt="e4m3"`` (block 16, main KV): ``e4m3(amax / 6)``, returned as float8_e4m3fn.

    A block holding a NaN gets the NaN scale (E4M3's NaN code; the E8M0 byte
    :data:`E8M0_NAN`) and codes 0 (with each value's sign), so that every value of the block
    dequantises to NaN (:func:`fp4_dequantize`: ``0 * NaN``, or ``0 * 2**128`` for the E8M0
    byte). An infinite amax gives E8M0 byte 255 too (``2**128``), the E4M3 scale 448.

    Raises ``ValueError`` for an unknown ``scale_fmt`` or a last dim not a multiple of
    ``block``.
    """
    xb = _blocks(jnp.asarray(x, F32), block)
    nan = jnp.any(jnp.isnan(xb), axis=-1, keepdims=True)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    if scale_fmt == "e8m0":
        amax = jnp.maximum(amax, np.float32(6.0 * 2.0 ** -126))
        e = _pow2_ceil_exponent(amax * np.float32(1.0 / FP4_MAX))
        s = jnp.where(nan, np.float32(np.nan), exp2_int(e))
        s_store = jnp.where(nan[..., 0], E8M0_NAN, e[..., 0] + 127).astype(jnp.uint8)
    elif scale_fmt == "e4m3":
        amax = jnp.maximum(amax, np.float32(6.0 * 2.0 ** -9))
        amax = jnp.where(nan, np.float32(np.nan), amax)
        s_store = jnp.minimum(amax / np.float32(FP4_MAX), FP8_MAX).astype(E4M3)
        s = s_store.astype(F32)
        s_store = s_store[..., 0]
    else:
        raise ValueError(f"scale_fmt must be 'e8m0' or 'e4m3', got {scale_fmt!r}")
    code = _e2m1_code(xb, s)
    return code.reshape(x.shape), s_store


def fp4_scale_to_f32(scale: jax.Array) -> jax.Array:
    """Scale array of either FP4 format (uint8 E8M0 bytes or float8_e4m3fn) -> fp32."""
    if scale.dtype == jnp.uint8:
        return e8m0_to_f32(scale)
    return scale.astype(F32)


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def fp4_dequantize(codes: jax.Array, scale: jax.Array, block: int, dtype=BF16) -> jax.Array:
    """Unpacked e2m1 codes (uint8 [..., K]) and per-block scales -> values (exact)."""
    vb = _blocks(e2m1_decode(codes), block)
    return (vb * fp4_scale_to_f32(scale)[..., None]).reshape(codes.shape).astype(dtype)


@jax.jit
def pack_nibbles(codes: UInt8[Array, "... K"]) -> UInt8[Array, "... K2"]:
    """Two e2m1 codes per byte: element 2j in the low nibble, 2j+1 in the high
    (docs/architecture.md, "Number formats")."""
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


@jax.jit
def unpack_nibbles(packed: UInt8[Array, "... K2"]) -> UInt8[Array, "... K"]:
    """Inverse of :func:`pack_nibbles`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------- FP8 activations


@functools.partial(jax.jit, static_argnames=("block",))
def fp8_quantize(x: Float[ArrayLike, "... K"], block: int = 32) -> tuple[jax.Array, jax.Array]:
    """``act_quant``: e4m3 codes and E8M0 scale bytes, one scale per ``block`` values.

    Returns ``(codes float8_e4m3fn [..., K], scale uint8 [..., K // block])``. See
    docs/architecture.md, "Number formats" (FP8 activations).
    """
    xb = _blocks(jnp.asarray(x, F32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4)
    e = _pow2_ceil_exponent(amax * np.float32(1.0 / FP8_MAX))
    s = exp2_int(e)
    q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(E4M3)
    return q.reshape(x.shape), (e[..., 0] + 127).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def fp8_dequantize(codes: jax.Array, scale: UInt8[Array, "... G"], block: int = 32,
                   dtype=BF16) -> jax.Array:
    """Inverse of :func:`fp8_quantize` (exact): ``e4m3(codes) * 2**(scale - 127)``."""
    qb = _blocks(codes.astype(F32), block)
    return (qb * e8m0_to_f32(scale)[..., None]).reshape(codes.shape).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def act_quant_qdq(x: Float[Array, "... K"], block: int = 32) -> Float[Array, "... K"]:
    """FP8 QDQ of an activation (per-``block`` power-of-two scales); returns bf16.

    See docs/architecture.md, "Number formats" (FP8 activations).
    """
    q, s = fp8_quantize(x, block)
    return fp8_dequantize(q, s, block, BF16)
