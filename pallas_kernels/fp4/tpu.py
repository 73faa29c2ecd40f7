"""Pallas Mosaic TPU kernels of the FP4 codec (docs/architecture.md, "Number formats"); see
:mod:`pallas_kernels.fp4`.

The TPU keeps vectors in (8 sublane x 128 lane) tiles of 32-bit elements and has no cheap
strided lane access, so the layout avoids both lane-strided loads and lane-changing reshapes:

* The wrapper bitcasts each row of K bf16 values to K/2 int32 words (word j = x[2j] in the low
  half, x[2j+1] in the high half) and views the row-major stream of words as lines of
  W = lcm(K/2, 128) words (K = 512: one row per line, W = 256; K = 128: two rows per line,
  W = 128). A scale block is S = block/2 consecutive words, and W is a multiple of S, so a block
  never straddles a line and the lines are independent. Only when the row count is not a
  multiple of W/(K/2) does the wrapper pad (a copy).
* quantize: the even/odd fp32 bits come from two bit operations per word, so the packed byte of
  word j is computed in lane j (``code_even | code_odd << 4``) and stored as the uint8 [R, W]
  block. The block amax is an XOR butterfly over the S lanes of each block (log2 S steps of
  ``pltpu.roll`` by +-d, the partner chosen by comparing a rolled lane iota, so the rotate's
  direction convention does not matter), an integer max on the |x| bits, which leaves every lane
  holding its block's amax. The scale is then computed in every lane and one byte per block is
  compacted with a 0/1 selection matmul on the MXU (bytes <= 255 are exact in bf16, one nonzero
  product per output, fp32 accumulation: exact).
* unpack: the scale bytes [R, W/S] are expanded to one byte per lane with the transposed 0/1
  matmul, both nibbles and the scale are decoded with bit arithmetic, and each lane writes one
  int32 word of two bf16 values (or the even and odd fp32 values for other dtypes).

Grid: one program per ``block_rows`` lines (default: 32768 words per block, a multiple of 32 rows
for the uint8 tiles), "parallel"; the last block may be partial (Mosaic masks its stores, and the
lines are independent). Only interpret mode has run here; the Mosaic compile (int32 -> uint8
truncation, the small matmuls with 8..32 wide operands, lane rotates) is unverified on hardware.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.fp4 import common as codec

TUNING = ("block_rows",)
_WORDS_PER_BLOCK = 32768
_LANES = 128


def _layout(rows: int, width0: int, block_rows):
    width = math.lcm(width0, _LANES)
    per_line = width // width0
    lines = -(-rows // per_line)
    if block_rows is None:
        block_rows = max(32, _WORDS_PER_BLOCK // width)
    if block_rows < 1:
        raise ValueError(f"block_rows must be positive, got {block_rows}")
    if block_rows >= lines:
        block_rows = lines  # one block of the full extent
    elif block_rows % 32:
        raise ValueError(f"block_rows must be a multiple of 32 (uint8 tiles), got {block_rows}")
    return width, per_line, lines, block_rows


def _to_lines(a: jax.Array, per_line: int, lines: int) -> jax.Array:
    rows, cols = a.shape
    if lines * per_line != rows:
        a = jnp.pad(a, ((0, lines * per_line - rows), (0, 0)))
    return a.reshape(lines, per_line * cols)


def _from_lines(a: jax.Array, rows: int, cols: int) -> jax.Array:
    return a.reshape(-1, cols)[:rows]


def _params(interpret: bool):
    if interpret:
        return dict(interpret=True)
    return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))


def _quantize_kernel(w_ref, q_ref, s_ref, *, fmt, group_words):
    w = w_ref[...]
    rows, width = w.shape
    groups = width // group_words
    even, odd = codec.split_words(w)
    amax = jnp.maximum(codec.abs_bits(even), codec.abs_bits(odd))
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    d = 1
    while d < group_words:  # XOR butterfly inside each aligned group of S lanes
        fwd = pltpu.roll(amax, d, 1)
        bwd = pltpu.roll(amax, width - d, 1)
        fwd_is_partner = pltpu.roll(lane, d, 1) == (lane ^ d)
        amax = jnp.maximum(amax, jnp.where(fwd_is_partner, fwd, bwd))
        d *= 2
    byte, s = codec.scale_from_amax(amax, fmt)
    ce = codec.e2m1_code(even, s)
    co = codec.e2m1_code(odd, s)
    q_ref[...] = (ce | (co << 4)).astype(jnp.uint8)
    # One byte per group: lane g*S of every row, via an exact 0/1 selection matmul.
    gp = -(-groups // _LANES) * _LANES
    src = jax.lax.broadcasted_iota(jnp.int32, (width, gp), 0)
    dst = jax.lax.broadcasted_iota(jnp.int32, (width, gp), 1)
    sel = (src == dst * group_words).astype(jnp.bfloat16)
    compact = jnp.dot(byte.astype(jnp.float32).astype(jnp.bfloat16), sel,
                      preferred_element_type=jnp.float32)
    s_ref[...] = compact[:, :groups].astype(jnp.int32).astype(jnp.uint8)


def quantize_words(words: jax.Array, fmt: str, *, interpret: bool = False, block_rows=None
                   ) -> tuple[jax.Array, jax.Array]:
    """int32 [N, K/2] bf16-pair words -> (packed uint8 [N, K/2], scale bytes uint8 [N, K/block])."""
    rows, width0 = words.shape
    group_words = codec.FMT_BLOCK[fmt][0] // 2
    width, per_line, lines, block_rows = _layout(rows, width0, block_rows)
    groups = width // group_words
    kernel = functools.partial(_quantize_kernel, fmt=fmt, group_words=group_words)
    packed, scale = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(lines, block_rows),),
        in_specs=[pl.BlockSpec((block_rows, width), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((block_rows, width), lambda i: (i, 0)),
                   pl.BlockSpec((block_rows, groups), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((lines, width), jnp.uint8),
                   jax.ShapeDtypeStruct((lines, groups), jnp.uint8)],
        name=f"fp4_quantize_pack_{fmt}",
        **_params(interpret),
    )(_to_lines(words, per_line, lines))
    return (_from_lines(packed, rows, width0),
            _from_lines(scale, rows, width0 // group_words))


def _dequantize_kernel(p_ref, s_ref, *o_refs, fmt, group_words, words_out):
    p = p_ref[...].astype(jnp.int32)
    rows, width = p.shape
    groups = s_ref.shape[-1]
    sb = s_ref[...].astype(jnp.int32)
    # Scale byte of lane j = byte j // S: an exact 0/1 expansion matmul.
    src = jax.lax.broadcasted_iota(jnp.int32, (groups, width), 0)
    dst = jax.lax.broadcasted_iota(jnp.int32, (groups, width), 1)
    expand = ((dst >> (group_words.bit_length() - 1)) == src).astype(jnp.bfloat16)
    lane_bytes = jnp.dot(sb.astype(jnp.float32).astype(jnp.bfloat16), expand,
                         preferred_element_type=jnp.float32).astype(jnp.int32)
    s = codec.decode_scale(lane_bytes, fmt)
    even = codec.e2m1_value(p & 15) * s
    odd = codec.e2m1_value(p >> 4) * s
    if words_out:
        o_refs[0][...] = codec.join_words(even, odd)
    else:
        o_refs[0][...] = even
        o_refs[1][...] = odd


def dequantize_words(packed: jax.Array, scale_bytes: jax.Array, fmt: str, *, words_out: bool,
                     interpret: bool = False, block_rows=None):
    """packed uint8 [N, K/2] + scale bytes uint8 [N, K/block] -> values.

    ``words_out``: one int32 [N, K/2] array of bf16 pairs; else ``(even, odd)`` fp32 [N, K/2].
    """
    rows, width0 = packed.shape
    group_words = codec.FMT_BLOCK[fmt][0] // 2
    width, per_line, lines, block_rows = _layout(rows, width0, block_rows)
    groups = width // group_words
    kernel = functools.partial(_dequantize_kernel, fmt=fmt, group_words=group_words,
                               words_out=words_out)
    spec = pl.BlockSpec((block_rows, width), lambda i: (i, 0))
    dtypes = [jnp.int32] if words_out else [jnp.float32, jnp.float32]
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(lines, block_rows),),
        in_specs=[spec, pl.BlockSpec((block_rows, groups), lambda i: (i, 0))],
        out_specs=[spec] * len(dtypes),
        out_shape=[jax.ShapeDtypeStruct((lines, width), dt) for dt in dtypes],
        name=f"fp4_unpack_dequantize_{fmt}",
        **_params(interpret),
    )(_to_lines(packed, per_line, lines), _to_lines(scale_bytes, per_line, lines))
    out = [_from_lines(o, rows, width0) for o in out]
    return out[0] if words_out else tuple(out)
