"""Pallas Triton (NVIDIA GPU) kernels of the FP4 codec (spec 2.6); see :mod:`pallas_kernels.fp4`.

Layout: the wrapper flattens the leading dims into N rows and bitcasts each row of K bf16 values
to W = K/2 int32 words (a free bitcast: word j holds x[2j] in its low half, x[2j+1] in its high
half). One program handles ``block_rows`` rows (R) of full width:

* quantize: load the [R, W] words (coalesced, no strided access), split each word into the fp32
  bits of its even and odd value with two bit operations, reshape to [R, G, S] (G scale blocks of
  S = block/2 words) and reduce the |x| bits with an integer max (NaN-propagating like XLA; the
  fp32 ``maxnumf`` Triton uses for a float max drops NaN), compute the scale per [R, G] with the
  integer bit arithmetic of :mod:`.codec`, decide both codes against ``b * s`` and store
  ``code_even | code_odd << 4`` as the uint8 [R, W] packed block and the scale bytes [R, G].
* unpack: load the packed bytes [R, W] and scale bytes [R, G], decode both nibbles and the scale
  with bit arithmetic and store, for bf16, one int32 word per byte (the two bf16 values; the
  wrapper bitcasts back), otherwise the even and odd fp32 values.

Defaults (measured on one H200, jit, 100 calls): main K = 512 with 16 rows x 8 warps, index
K = 128 with 32 rows x 4 warps. With 256 MiB of bf16 input: quantize 157 us (main) / 136 us
(index), about 2.2-2.5 TB/s of traffic, against XLA's 234 us; unpack 106 / 100 us, 3.2-3.4
TB/s, the speed of a plain elementwise copy there, against XLA's 485-495 us. Blocks of 16K words
or more ran 2-10x slower. Both kernels were bit-exact with the XLA reference on that GPU (the
tests of tests/test_fp4_kernels.py with ``impl="triton"``).

Rows past N in the last program are masked in the loads and stores. Triton block shapes must be
powers of two: W and G are padded (with zero words that form whole extra scale blocks, sliced
off by the wrapper) when K/2 is not one, which costs a copy; K = 128 and 512, the model's, need
none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.fp4 import codec

TUNING = ("block_rows", "num_warps", "num_stages")
# Defaults measured on an H200 (64 MiB of bf16 input; see the package docstring): words per
# program and warps. main K = 512: 16 rows, 8 warps; index K = 128: 32 rows, 4 warps. Larger
# blocks (>= 16K words) spill and run 2-10x slower.
_DEFAULTS = {"main": (4096, 8), "index": (2048, 4)}


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


def _quantize_kernel(w_ref, q_ref, s_ref, *, fmt, n, block_rows, group_words):
    width = w_ref.shape[-1]
    groups = width // group_words
    r = block_rows
    w = pltr.load(w_ref, mask=_row_mask(n, r, width), other=0)
    even, odd = codec.split_words(w)
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
                   num_warps=None, num_stages=None) -> tuple[jax.Array, jax.Array]:
    """int32 [N, W] bf16-pair words -> (packed uint8 [N, W], scale bytes uint8 [N, W / S]).

    S = block / 2 words per scale block (W is a multiple of S since K is one of 32).
    """
    n, width0 = words.shape
    group_words = codec.FMT_BLOCK[fmt][0] // 2
    width = _pow2_ceil(width0)
    if width != width0:  # zero words: whole extra scale blocks, sliced off below
        words = jnp.pad(words, ((0, 0), (0, width - width0)))
    groups = width // group_words
    block_rows, params = _config(fmt, n, width, block_rows, num_warps, num_stages)
    kernel = functools.partial(_quantize_kernel, fmt=fmt, n=n, block_rows=block_rows,
                               group_words=group_words)
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
