"""Pallas Triton (NVIDIA GPU) kernels of the FP4 codec (docs/architecture.md, "Number formats");
see :mod:`pallas_kernels.fp4`.

Layout: the wrapper flattens the leading dims into N rows and bitcasts each row of K bf16 values
to W = K/2 int32 words (a free bitcast: word j holds x[2j] in its low half, x[2j+1] in its high
half). One program handles ``block_rows`` rows (R) of full width:

* quantize: load the [R, W] words (coalesced, no strided access), reshape to [R, G, S] (G scale
  blocks of S = block/2 words) and reduce the |x| bits of both halves with integer maxima
  (NaN-propagating like XLA; the fp32 ``maxnumf`` Triton uses for a float max drops NaN),
  compute the scale per [R, G], decide the codes against the boundaries ``b * s`` and store the
  uint8 [R, W] packed block and the scale bytes [R, G]. Two encodes (``encode``), the same
  bytes:

  - ``"asm"`` (the default on a GPU): the decisions of both values of a word in one PTX
    template (:data:`_ENCODE_PTX`: seven bf16x2 comparisons, four ``lop3`` for the thermometer
    code, four bit-selects for the nibbles), and for main KV the E4M3 scale and its boundaries
    in PTX too (:data:`_E4M3_SCALE_PTX`: a correctly rounded ``t / 6`` and the hardware's
    RNE-satfinite e4m3 convert). 424 SASS instructions per thread and 16 words, against 1144
    for the jnp encode (``scripts/triton_report.py``-style compile for sm_90a).
  - ``"jnp"``: per-value fp32 comparisons and the integer scale arithmetic of :mod:`.codec`
    (the only one in interpret mode, where PTX cannot run).
* unpack: load the packed bytes [R, W] and scale bytes [R, G], decode both nibbles and the scale
  with bit arithmetic and store, for bf16, one int32 word per byte (the two bf16 values; the
  wrapper bitcasts back), otherwise the even and odd fp32 values.

Defaults: main K = 512 with 16 rows x 8 warps, index K = 128 with 64 rows x 4 warps
(docs/benchmarks.md has the measurements). Both kernels are bit-exact with the XLA reference
on a GPU (tests/test_fp4_kernels.py, which adds ``impl="gpu"`` on a GPU machine). On CPU the PTX templates are emulated bit by bit
(tests/ptx_emu.py): the encode for every bf16 value under every e4m3 and E8M0 scale (+inf and
NaN included), the E4M3 scale for every bf16 amax.

Rows past N in the last program are masked in the loads and stores. Triton block shapes must be
powers of two: W and G are padded (with zero words that form whole extra scale blocks, sliced
off by the wrapper) when K/2 is not one, which costs a copy; K = 128 and 512, the model's, need
none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.fp4 import common as codec

TUNING = ("block_rows", "num_warps", "num_stages", "encode")
ENCODES = ("asm", "jnp")
# Defaults: words per program and warps (main K = 512: 16 rows, 8 warps; index K = 128:
# 64 rows, 4 warps).
_DEFAULTS = {"main": (4096, 8), "index": (4096, 4)}


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_pieces(n: int, widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` in which the kernels process ``n`` rows whose byte arrays (uint8
    [n, w] for each ``w`` of ``widths``: the packed codes, the scales) are addressed safely: all
    rows at once, except where one of those arrays has between 2**31 and 2**32 bytes, which
    Pallas Triton would address with 32-bit element offsets (it widens them above 2**32 bytes
    only): there, pieces of at most 2**31 bytes of the widest. The other operands have 4-byte
    elements (fewer than 2**31 of them up to 2**33 bytes)."""
    if not any(2 ** 31 < n * w <= 2 ** 32 for w in widths):
        return [(0, n)]
    rows = 2 ** 31 // max(widths)
    return [(a, min(a + rows, n)) for a in range(0, n, rows)]


def _config(fmt: str, n: int, width: int, block_rows, num_warps, num_stages):
    words, warps = _DEFAULTS[fmt]
    if block_rows is None:
        block_rows = min(_pow2_ceil(max(1, words // width)), _pow2_ceil(max(n, 1)))
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    params = pltr.CompilerParams(num_warps=warps if num_warps is None else num_warps,
                                 num_stages=1 if num_stages is None else num_stages)
    return block_rows, params


def _row_mask(n: int, block_rows: int, cols: int) -> jax.Array:
    rows = jax.lax.broadcasted_iota(jnp.int32, (block_rows, cols), 0)
    return pl.program_id(0) * block_rows + rows < n


# PTX of the e2m1 encode of one word (``encode="asm"``): two bf16 values -> their packed byte,
# with the decisions of :func:`codec.e2m1_code` made two at a time. $1: the word; $2..$8: the
# seven boundaries ``b * s`` of the word's scale block as bf16 pairs (exact: b has <= 3 and s
# <= 4 significant bits). ``set.<cmp>.u32.bf16x2`` compares both halves (0xFFFF per true half,
# NaN false, subnormals kept). The boundaries increase, so the true tests are the first c of
# the seven (a thermometer code, c = the code magnitude): bit 0 of c is their parity, bit 1 is
# ``(m2 & ~m4) | m6``, bit 2 is ``m4`` (4 ``lop3``). That holds for every block the codec can
# produce: an infinite |x| makes the block's scale 448 ("main", finite boundaries) or +inf
# ("index", where :func:`_boundary_pairs` gives monotone stand-ins), and a finite |x| never
# passes a boundary that overflowed to inf. Bit-selects place the count bits and the sign
# (bit 15 of each half) into a nibble per half, and the last select puts the odd value's nibble
# above the even's. $0 holds the byte in its low 8 bits (the bits above are not zero).
_XOR3, _SELECT = "0x96", "0xE4"   # lop3 tables: a ^ b ^ c, c ? a : b
_ANDNOT_OR = "0xBA"               # (a & ~b) | c
_ENCODE_PTX = "\n".join([
    "{",
    ".reg .b32 a, m1, m2, m3, m4, m5, m6, m7, x, y, r, t, k;",
    "and.b32 a, $1, 0x7FFF7FFF;",
    *[f"set.{'ge' if up else 'gt'}.u32.bf16x2 m{i + 1}, a, ${i + 2};"
      for i, (_, up) in enumerate(codec.E2M1_BOUNDS)],
    f"lop3.b32 x, m1, m2, m3, {_XOR3};", f"lop3.b32 x, x, m4, m5, {_XOR3};",
    f"lop3.b32 x, x, m6, m7, {_XOR3};", f"lop3.b32 y, m2, m4, m6, {_ANDNOT_OR};",
    "mov.b32 k, 0x00010001;", f"lop3.b32 r, x, y, k, {_SELECT};",
    "mov.b32 k, 0x00030003;", f"lop3.b32 r, r, m4, k, {_SELECT};",
    "shr.u32 t, $1, 12;",
    "mov.b32 k, 0x00070007;", f"lop3.b32 r, r, t, k, {_SELECT};",
    "shr.u32 t, r, 12;",
    "mov.b32 k, 0x0000000F;", f"lop3.b32 $0, r, t, k, {_SELECT};",
    "}"])


# PTX of a main-KV block scale (``encode="asm"``, fmt "main"): the amax bits -> the E4M3 scale
# byte and the seven boundary pairs of :data:`_ENCODE_PTX`, in about 22 instructions instead
# of the integer search of :func:`codec.e4m3_scale` and seven fp32 products.
# ``t = clamp(amax, 6 * 2^-9, 6 * 1024)`` as in the codec; ``q = t * fp32(1/6)`` refined by
# one fma step (``e = t - 6 q`` is exact) is the correctly rounded ``t / 6`` for every bf16
# ``t`` (checked exhaustively in the tests), which the hardware converts with RNE and
# saturation at 448 (``cvt.rn.satfinite.e4m3x2``), as the reference rounds its fp32 quotient.
# A NaN amax gives the NaN code 0x7F. (Pallas lowers an inline asm of one result only, hence
# three templates.) $0: the result; $1: the operand.
_E4M3_SCALE_PTX = "\n".join([   # amax bits -> the scale byte, twice (a b16 in the low half)
    "{",
    ".reg .pred nan;", ".reg .b32 t;", ".reg .f32 tf, q, e;", ".reg .b16 c;",
    "setp.gt.s32 nan, $1, 0x7F800000;",
    f"max.s32 t, $1, {hex(codec._E4M3_FLOOR_BITS)};",
    f"min.s32 t, t, {hex(codec._E4M3_CAP_BITS)};",
    "mov.b32 tf, t;",
    "mul.rn.f32 q, tf, 0f3E2AAAAB;",
    "fma.rn.f32 e, q, 0fC0C00000, tf;",
    "fma.rn.f32 q, e, 0f3E2AAAAB, q;",
    "cvt.rn.satfinite.e4m3x2.f32 c, q, q;",
    "selp.b16 c, 0x7F7F, c, nan;",
    "cvt.u32.u16 $0, c;",
    "}"])
# scale bytes (as above) -> the scale as a bf16 pair, exactly (through f16 and fp32; the NaN
# code gives NaN, hence NaN boundaries and every code 0, as in the codec)
_E4M3_PAIR_PTX = "\n".join([
    "{",
    ".reg .b32 h;", ".reg .b16 c, lo;", ".reg .f32 f;",
    "cvt.u16.u32 c, $1;",
    "cvt.rn.f16x2.e4m3x2 h, c;",
    "cvt.u16.u32 lo, h;",
    "cvt.f32.f16 f, lo;",
    "cvt.rn.bf16x2.f32 $0, f, f;",
    "}"])


# a scale pair -> one boundary pair, b * s in bf16x2 (PAIR: b twice, as a hex immediate)
_BOUND_PTX = "{\n.reg .b32 b;\nmov.b32 b, PAIR;\nmul.rn.bf16x2 $0, $1, b;\n}"


def _bf16_pair(x: float) -> str:
    """A PTX hex immediate of two equal bf16 halves holding ``x`` (exact in bf16)."""
    b = int(np.array(x, np.float32).view(np.uint32)) >> 16
    return hex(b << 16 | b)


def _asm(ptx: str, *xs: jax.Array) -> jax.Array:
    """The int32 result of ``ptx`` ($0) from int32 operands of one shape ($1, $2, ...),
    elementwise."""
    [out] = pltr.elementwise_inline_asm(
        ptx, args=list(xs), constraints=",".join(["=r"] + ["r"] * len(xs)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(xs[0].shape, jnp.int32)])
    return out


def _e4m3_scale_asm(amax_bits: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """int32 amax bits [R, G] -> (E4M3 scale byte int32 (low 8 bits), the seven boundary
    pairs int32 [R, G]: ``b * s`` in bf16x2, exact since ``s >= 2^-9`` puts every product
    at >= 2^-11 with <= 7 significant bits)."""
    codes = _asm(_E4M3_SCALE_PTX, amax_bits)
    pair = _asm(_E4M3_PAIR_PTX, codes)
    bounds = [_asm(_BOUND_PTX.replace("PAIR", _bf16_pair(b)), pair)
              for b, _ in codec.E2M1_BOUNDS]
    return codes & 0xFF, bounds


# the boundary pairs of an infinite scale (an "index" block holding +-inf): +-inf passes the
# three ">= inf" tests (b = 0.75, 1.75, 3.5) and no other, so its code is 3 and a finite value's
# is 0; these stand-ins give the same counts as a thermometer code (max finite bf16, inf, max
# finite, then NaN: never passed)
_INF_SCALE_PAIRS = (0x7F7F7F7F, 0x7F807F80, 0x7F7F7F7F, 0x7FC07FC0, 0x7FC07FC0, 0x7FC07FC0,
                    0x7FC07FC0)


def _boundary_pairs(s: jax.Array) -> list[jax.Array]:
    """fp32 block scales -> the seven ``b * s`` (exact in fp32 and bf16) as int32 words of
    two equal bf16 halves, the ``set`` operands of :data:`_ENCODE_PTX` (for ``s = +inf``:
    :data:`_INF_SCALE_PAIRS`).

    For the smallest E8M0 scales (2^-126, 2^-125) ``0.25 s`` and ``0.75 s`` are fp32
    subnormals: the products must not be flushed (they are not in this kernel on a GPU, as in
    XLA:GPU's reference; the GPU tests' all-zero blocks cover it), or a zero would pass
    ``0.75 s`` but not ``0.25 s``. The jnp encode depends on the same products."""
    out = []
    inf = s == np.float32(np.inf)
    for (b, _), stand_in in zip(codec.E2M1_BOUNDS, _INF_SCALE_PAIRS):
        t = s * np.float32(b)
        out.append(jnp.where(inf, np.int32(np.uint32(stand_in).view(np.int32)),
                             codec.join_words(t, t)))
    return out


def _encode_asm(words: jax.Array, bounds: list[jax.Array]) -> jax.Array:
    """int32 [R, G, S] words + the seven boundary pairs [R, G, 1] -> int32 [R, G, S], the
    packed byte of each word in its low 8 bits (:data:`_ENCODE_PTX`)."""
    return _asm(_ENCODE_PTX, words, *[jnp.broadcast_to(t, words.shape) for t in bounds])


def _quantize_kernel(w_ref, q_ref, s_ref, *, fmt, n, block_rows, group_words, encode):
    width = w_ref.shape[-1]
    groups = width // group_words
    r = block_rows
    w = pltr.load(w_ref, mask=_row_mask(n, r, width), other=0)
    if encode == "asm":
        # |x| of both halves at once; the integer max of the words is the max of the high
        # halves, the max of the words shifted up is that of the low halves (NaN above inf)
        a = (w & 0x7FFF7FFF).reshape(r, groups, group_words)
        amax = jnp.maximum(jnp.max(a, axis=-1) & codec._HI_MASK, jnp.max(a << 16, axis=-1))
        if fmt == "main":
            byte, bounds = _e4m3_scale_asm(amax)
        else:
            byte, s = codec.scale_from_amax(amax, fmt)
            bounds = _boundary_pairs(s)
        packed = _encode_asm(w.reshape(r, groups, group_words), [t[:, :, None] for t in bounds])
        packed = packed.reshape(r, width).astype(jnp.uint8)
    else:
        even, odd = codec.split_words(w)   # the fp32 bits of each value, reused below
        amax = jnp.maximum(codec.abs_bits(even), codec.abs_bits(odd))
        amax = jnp.max(amax.reshape(r, groups, group_words), axis=-1)
        byte, s = codec.scale_from_amax(amax, fmt)
        s = s[:, :, None]
        ce = codec.e2m1_code(even.reshape(r, groups, group_words), s)
        co = codec.e2m1_code(odd.reshape(r, groups, group_words), s)
        packed = (ce | (co << 4)).reshape(r, width).astype(jnp.uint8)
    pltr.store(q_ref, packed, mask=_row_mask(n, r, width))
    pltr.store(s_ref, byte.astype(jnp.uint8), mask=_row_mask(n, r, groups))


def quantize_words(words: jax.Array, fmt: str, *, interpret: bool = False, block_rows=None,
                   num_warps=None, num_stages=None, encode=None) -> tuple[jax.Array, jax.Array]:
    """int32 [N, W] bf16-pair words -> (packed uint8 [N, W], scale bytes uint8 [N, W / S]).

    S = block / 2 words per scale block (W is a multiple of S since K is one of 32).
    ``encode``: ``"asm"`` (the default on a GPU: the PTX encode of :data:`_ENCODE_PTX`, two
    values per instruction) or ``"jnp"`` (per-value fp32 comparisons; always in interpret
    mode, where PTX cannot run). Both give the same bytes. ``ValueError`` for another value.
    """
    if encode is not None and encode not in ENCODES:
        raise ValueError(f"encode must be one of {ENCODES}, got {encode!r}")
    encode = "jnp" if interpret else (encode or "asm")
    n, width0 = words.shape
    group_words = codec.FMT_BLOCK[fmt][0] // 2
    width = _pow2_ceil(width0)
    pieces = row_pieces(n, (width, width // group_words))
    if len(pieces) > 1:   # byte arrays of 2**31 .. 2**32 bytes: in pieces of < 2**31 bytes
        outs = [quantize_words(words[a:b], fmt, interpret=interpret, block_rows=block_rows,
                               num_warps=num_warps, num_stages=num_stages, encode=encode)
                for a, b in pieces]
        return tuple(jnp.concatenate(parts) for parts in zip(*outs))
    if width != width0:  # zero words: whole extra scale blocks, sliced off below
        words = jnp.pad(words, ((0, 0), (0, width - width0)))
    groups = width // group_words
    block_rows, params = _config(fmt, n, width, block_rows, num_warps, num_stages)
    kernel = functools.partial(_quantize_kernel, fmt=fmt, n=n, block_rows=block_rows,
                               group_words=group_words, encode=encode)
    packed, scale = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_rows),),
        in_specs=[pl.BlockSpec((block_rows, width), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((block_rows, width), lambda i: (i, 0)),
                   pl.BlockSpec((block_rows, groups), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, width), jnp.uint8),
                   jax.ShapeDtypeStruct((n, groups), jnp.uint8)],
        compiler_params=params,
        interpret=interpret,
        name=f"fp4_quantize_pack_{fmt}",
    )(words)
    return packed[:, :width0], scale[:, :width0 // group_words]


def _dequantize_kernel(p_ref, s_ref, *o_refs, fmt, n, block_rows, group_words, words_out):
    width = p_ref.shape[-1]
    groups = width // group_words
    r = block_rows
    p = pltr.load(p_ref, mask=_row_mask(n, r, width), other=0).astype(jnp.int32)
    sb = pltr.load(s_ref, mask=_row_mask(n, r, groups), other=0).astype(jnp.int32)
    s = codec.decode_scale(sb, fmt)[:, :, None]
    p = p.reshape(r, groups, group_words)
    even = codec.e2m1_value(p & 15) * s
    odd = codec.e2m1_value(p >> 4) * s
    mask = _row_mask(n, r, width)
    if words_out:
        pltr.store(o_refs[0], codec.join_words(even, odd).reshape(r, width), mask=mask)
    else:
        pltr.store(o_refs[0], even.reshape(r, width), mask=mask)
        pltr.store(o_refs[1], odd.reshape(r, width), mask=mask)


def dequantize_words(packed: jax.Array, scale_bytes: jax.Array, fmt: str, *, words_out: bool,
                     interpret: bool = False, block_rows=None, num_warps=None, num_stages=None):
    """packed uint8 [N, W] + scale bytes uint8 [N, W / S] -> values.

    ``words_out``: one int32 [N, W] array of bf16 pairs; else ``(even, odd)`` fp32 [N, W].
    """
    n, width0 = packed.shape
    group_words = codec.FMT_BLOCK[fmt][0] // 2
    width = _pow2_ceil(width0)
    pieces = row_pieces(n, (width, width // group_words))
    if len(pieces) > 1:   # byte arrays of 2**31 .. 2**32 bytes: in pieces of < 2**31 bytes
        outs = [dequantize_words(packed[a:b], scale_bytes[a:b], fmt, words_out=words_out,
                                 interpret=interpret, block_rows=block_rows,
                                 num_warps=num_warps, num_stages=num_stages)
                for a, b in pieces]
        if words_out:
            return jnp.concatenate(outs)
        return tuple(jnp.concatenate(parts) for parts in zip(*outs))
    if width != width0:
        packed = jnp.pad(packed, ((0, 0), (0, width - width0)))
        scale_bytes = jnp.pad(scale_bytes, ((0, 0), (0, (width - width0) // group_words)))
    groups = width // group_words
    block_rows, params = _config(fmt, n, width, block_rows, num_warps, num_stages)
    kernel = functools.partial(_dequantize_kernel, fmt=fmt, n=n, block_rows=block_rows,
                               group_words=group_words, words_out=words_out)
    spec = pl.BlockSpec((block_rows, width), lambda i: (i, 0))
    if words_out:
        out_specs, out_shape = [spec], [jax.ShapeDtypeStruct((n, width), jnp.int32)]
    else:
        out_specs = [spec, spec]
        out_shape = [jax.ShapeDtypeStruct((n, width), jnp.float32)] * 2
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_rows),),
        in_specs=[spec, pl.BlockSpec((block_rows, groups), lambda i: (i, 0))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name=f"fp4_unpack_dequantize_{fmt}",
    )(packed, scale_bytes)
    out = [o[:, :width0] for o in out]
    return out[0] if words_out else tuple(out)
