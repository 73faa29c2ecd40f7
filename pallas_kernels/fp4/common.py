"""Elementwise FP4 codec arithmetic shared by the Triton and Mosaic TPU kernels
(docs/architecture.md, "Number formats").

Everything here is plain ``jax.numpy`` on int32 / fp32 arrays, built only from operations that
both Pallas lowerings support and that are exact on any IEEE-754 hardware: bitcasts between int32
and fp32, shifts, bitwise and/or, integer min/max, comparisons, selects, fp32 products that are
exact by construction, and one fp32 product ``t * fp32(1/6)`` that is correctly rounded on every
backend. There is no division (Triton lowers an fp32 division to the approximate
``div.full.f32``; XLA may turn ``x / s`` into ``x * (1 / s)``), no float min/max (Triton lowers
them to the NaN-dropping ``minnumf``/``maxnumf`` while XLA propagates NaN) and no fp8 convert.

Bit layout of the kernels' inputs: two consecutive bf16 values ``x[2j], x[2j+1]`` are one int32
word (the wrapper's ``bitcast_convert_type`` of ``[..., K/2, 2]`` bf16), element ``2j`` in the
low half. A bf16 value's fp32 bits are its 16 bits shifted up by 16, so ``word << 16`` and
``word & 0xFFFF0000`` are the fp32 bit patterns of the even and the odd element.

No state, no caches: every function is pure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

I32 = jnp.int32
F32 = jnp.float32

FMTS = ("main", "index")
# fmt -> (values per scale block, scale format of reference.fp4_quantize)
FMT_BLOCK = {"main": (16, "e4m3"), "index": (32, "e8m0")}

_ABS_MASK = 0x7FFFFFFF
_HI_MASK = -65536  # 0xFFFF0000 as int32
_INF_BITS = 0x7F800000
_E4M3_FLOOR_BITS = int(np.float32(6.0 * 2.0 ** -9).view(np.int32))  # amax floor, e4m3 path
_E8M0_FLOOR_BITS = int(np.float32(6.0 * 2.0 ** -126).view(np.int32))  # amax floor, e8m0 path
# amax / 6 >= 448 saturates; capping amax at 6 * 1024 keeps every intermediate finite.
_E4M3_CAP_BITS = int(np.float32(6.0 * 1024.0).view(np.int32))
_SIXTH = np.float32(1.0 / 6.0)
_E4M3_MAX_CODE = 126  # 448
_E4M3_NAN_CODE = 0x7F
# (boundary, a tie rounds up to the even code): the decision boundaries of quant._e2m1_code.
E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))


def _f32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, F32)


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, I32)


def _srl(x: jax.Array, n: int) -> jax.Array:
    return jax.lax.shift_right_logical(x, jnp.full(x.shape, n, I32))


def split_words(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 words of bf16 pairs -> (fp32 bits of the even element, fp32 bits of the odd one)."""
    return w << 16, w & _HI_MASK


def join_words(even: jax.Array, odd: jax.Array) -> jax.Array:
    """fp32 values that are exact in bf16 -> int32 words of bf16 pairs (even in the low half).

    Truncating the low 16 bits is the bf16 rounding only because every dequantised value has at
    most 6 significant bits (an e2m1 value times an e4m3 or power-of-two scale), infinities and
    zeros included.
    """
    return (_bits(odd) & _HI_MASK) | _srl(_bits(even), 16)


def abs_bits(bits: jax.Array) -> jax.Array:
    """|x| as int32 bits: non-negative ints ordered like the floats, NaN above +inf."""
    return bits & _ABS_MASK


# ----------------------------------------------------------------------------- scales


def _e4m3_value(k: jax.Array) -> jax.Array:
    """Positive e4m3 code k (int32, may run past 126 while rounding) -> fp32 value (exact)."""
    e = k >> 3
    m = k & 7
    normal = _f32(((e + 120) << 23) | (m << 20))
    sub = m.astype(F32) * np.float32(2.0 ** -9)
    return jnp.where(e == 0, sub, normal)


def e4m3_scale(amax_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``e4m3_RNE(min(max(amax, 6*2^-9) / 6, 448))`` from the int32 bits of ``amax >= 0``.

    Returns ``(code int32 0..126 or 0x7F for NaN, value fp32)``, bit for bit what
    ``quant.fp4_quantize(x, 16, "e4m3")`` gives (its fp32 ``amax / 6`` followed by XLA's RNE
    convert). Decided without dividing: ``r = t * fp32(1/6)`` is within 2^-23 relative of
    ``t/6``, its e4m3 floor code is at most one step off and is fixed by the exact comparisons
    ``6 * value(k) <= t`` (``value(k)`` has <= 4 significant bits); then ``t`` is compared with
    ``6 * midpoint`` (<= 7 bits, exact), a tie going to the even code. For a bf16 ``amax`` the
    fp32 rounding of ``amax / 6`` cannot cross or land on an e4m3 midpoint (``amax`` has 8
    significant bits, a midpoint times 6 has 7), so this equals the two-step reference rounding
    (checked exhaustively over every bf16 value in the tests).
    """
    nan = amax_bits > _INF_BITS
    tb = jnp.minimum(jnp.maximum(amax_bits, _E4M3_FLOOR_BITS), _E4M3_CAP_BITS)
    t = _f32(tb)
    r = t * _SIXTH
    rb = _bits(r)
    er = _srl(rb, 23) - 127
    k_normal = ((er + 7) << 3) | (_srl(rb, 20) & 7)
    k_sub = (r * np.float32(512.0)).astype(I32)
    k = jnp.where(er >= -6, k_normal, k_sub)
    six = np.float32(6.0)
    k = jnp.where(six * _e4m3_value(k) > t, k - 1, k)
    k = jnp.where(six * _e4m3_value(k + 1) <= t, k + 1, k)
    mid6 = (_e4m3_value(k) + _e4m3_value(k + 1)) * np.float32(3.0)
    up = (t > mid6) | ((t == mid6) & ((k & 1) == 1))
    k = jnp.minimum(k + up.astype(I32), _E4M3_MAX_CODE)
    code = jnp.where(nan, _E4M3_NAN_CODE, k)
    s = jnp.where(nan, np.float32(np.nan), _e4m3_value(k))
    return code, s


def e8m0_scale(amax_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6)))`` from the int32 bits of ``amax >= 0``.

    Returns ``(E8M0 byte int32 0..255, value fp32)``. The ceil-log2 reads the exponent bits and
    adds one if any mantissa bit is set, like :func:`.reference._pow2_ceil_exponent`; an
    infinite amax gives byte 255 and the value +inf (as ``jnp.ldexp``), a NaN amax (a NaN in
    the block) byte 255 (E8M0's NaN) and the value NaN, as :func:`.reference.fp4_quantize`.
    """
    nan = amax_bits > _INF_BITS
    tb = jnp.maximum(amax_bits, _E8M0_FLOOR_BITS)
    p = _bits(_f32(tb) * _SIXTH)
    e = (_srl(p, 23) & 0xFF) - 127 + ((p & 0x7FFFFF) != 0).astype(I32)
    byte = jnp.where(nan, 255, jnp.minimum(e + 127, 255))
    s = jnp.where(nan, np.float32(np.nan), _f32(byte << 23))
    return byte, s


def exp2_int(e: jax.Array) -> jax.Array:
    """``2.0 ** e`` in fp32 for int32 ``e``, bit for bit ``jnp.ldexp(1.0, e)`` under XLA
    (+inf above 127; zero below -126, XLA flushing subnormals), built from bits alone: four
    operations where ``ldexp`` traces to dozens, which matters to compile time at every
    quantiser."""
    e = e.astype(I32)
    return _f32(jnp.where(e < -126, 0, (jnp.minimum(e, 128) + 127) << 23))


def scale_from_amax(amax_bits: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """``(scale byte int32, scale fp32)`` of a block from its amax bits (see the two above)."""
    return e4m3_scale(amax_bits) if fmt == "main" else e8m0_scale(amax_bits)


def decode_scale(byte: jax.Array, fmt: str) -> jax.Array:
    """Scale byte (int32 0..255: e4m3 bits for "main", E8M0 for "index") -> fp32 (exact)."""
    if fmt == "main":
        e = (byte >> 3) & 15
        m = byte & 7
        mag = jnp.where(e == 0, m.astype(F32) * np.float32(2.0 ** -9),
                        _f32(((e + 120) << 23) | (m << 20)))
        mag = jnp.where((byte & 0x7F) == 0x7F, np.float32(np.nan), mag)
        return _f32(_bits(mag) | ((byte & 0x80) << 24))
    # E8M0: 2^(byte - 127); byte 0 is the fp32 subnormal 2^-127, byte 255 is +inf (jnp.ldexp).
    return _f32(jnp.where(byte == 0, 0x00400000, byte << 23))


# ----------------------------------------------------------------------------- e2m1


def e2m1_code(bits: jax.Array, s: jax.Array) -> jax.Array:
    """e2m1 code (int32 0..15) of the value with fp32 bits ``bits`` under the scale ``s``.

    Exactly ``quant._e2m1_code``: ``|x| <op> b * s`` for the seven boundaries (``b * s`` is
    exact), the sign bit of ``x`` (negative zero included) in bit 3.
    """
    a = _f32(abs_bits(bits))
    idx = jnp.zeros(bits.shape, I32)
    for b, up in E2M1_BOUNDS:
        bs = s * np.float32(b)
        idx = idx + ((a >= bs) if up else (a > bs)).astype(I32)
    return idx | ((bits < 0).astype(I32) << 3)


def e2m1_value(code: jax.Array) -> jax.Array:
    """e2m1 nibble (int32 0..15) -> fp32 value, ``quant.E2M1_LUT`` without a gather."""
    c = code & 7
    e = c >> 1
    m = c & 1
    mag = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return _f32(mag | ((code & 8) << 28))
