"""Pallas Triton (NVIDIA GPU) kernel of the FP8 stacked GEMV; see :mod:`pallas_kernels.gemv`.

One program handles ``block_n`` output rows (32: one row of E8M0 scale tiles; a larger
``block_n``, 64 for wide outputs by default, runs its 32-row blocks on one input tile) over one of ``k_splits`` equal
parts of the input dimension, in steps of ``block_k`` columns:

* load the layer's FP8 tile ``[32, block_k]`` straight from the stacked weight (the layer index
  is an operand: nothing is sliced out of the stack beforehand) and convert it to bf16 with
  the hardware's converts (exact);
* scale the input instead of the weight: the ``block_k / 32`` scales of this row block
  multiply the input's columns (powers of two: exact in bf16, the input being FP8 QDQ values
  or bf16), so the large tile is touched once;
* accumulate ``x [tile, block_k] @ W^T`` in fp32 on the tensor cores (``tile`` = 16, 32 or
  64 input rows, :func:`tile_rows`; rows past the input's
  masked to zero in the load: nothing is padded before the call); an input of at most
  :data:`FMA_MAX_ROWS` rows (1 by default) instead adds each row's products into a
  ``[32, block_k]`` fp32 accumulator on the CUDA cores, summed over its columns after the last
  block.

With ``act_quant`` the input tile is FP8-quantised and dequantised in registers first, per 32
inputs as :func:`pallas_kernels.fp4.reference.act_quant_qdq` does (the amax's power-of-two
E8M0 scale from its exponent bits, a product by its exact inverse, the hardware's
round-to-nearest satfinite e4m3 convert, :data:`QDQ_PTX`, and back): a quantised linear's
activation quantisation then launches no kernels of its own. Each program quantises the
tiles it reads; the input is a few rows, so that work is small beside the weight's bytes.

Partial sums ``[k_splits, M, N]`` (fp32; up to 16 rows only the input's ``M`` rows of the
16-row tile are written, so a batch-1 call writes 1/16 of what the tile holds; 32- and 64-row
tiles are written whole and cut to ``M`` rows) are added by the wrapper. The
input's group of a row block (``G > 1``, the grouped output projection) is
``row // (N / G)``.
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
from pallas_kernels.gemv import reference
from pallas_kernels.sparse_attention.triton import repeat_columns

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
ROWS = 16          # the smallest tile of input rows (tensor-core tile height)
#: The most input rows one call takes: tiles of 16, 32 or 64 rows (:func:`tile_rows`).
MAX_TILE_ROWS = 64
BLOCK_N = 32       # output rows per program: one row of 32 x 32 scale tiles
TARGET_PROGRAMS = 1024
#: Row blocks from which K is not split: the partial sums then need no reduction kernel (on
#: an H200, ``[8192, 4096]``: 19.3 us in 256 unsplit programs, 19.4 us in 4 x 256 programs
#: plus the reduction).
UNSPLIT_ROW_BLOCKS = 256
#: Inputs of up to this many rows multiply on the CUDA cores instead of the tensor cores (0:
#: never): each weight tile, converted and scaled in registers, is multiplied by each input
#: row's columns and added into a ``[32, block_k]`` fp32 accumulator per row and 32-row block,
#: summed over its columns once at the end. No operand goes through shared memory for a matrix
#: instruction, and no rows of a 16-row tile are wasted. With 1 (a decode step of batch 1) the
#: `mid` batch-1 step on an H100 went from 7.64 to 7.28 ms of device time (docs/benchmarks.md,
#: "Decode step by op group"); with 4 the batch-4 step is 1.6x slower than on the tensor cores
#: (docs/kernels.md, "FP8 stacked GEMV").
FMA_MAX_ROWS = 1
#: Inputs of at least this many rows (and programs of 64 or more output rows) multiply with
#: the weight as the matrix instruction's first operand ("swap AB"): each program converts its
#: ``[block_n, block_k]`` weight tile to bf16 and scales it in registers (one product per
#: weight value, by its tile's power of two) and accumulates ``W @ x^T`` ``[block_n, tile]``,
#: so the input tile goes to the instruction as it is loaded, once per program instead of once
#: per 32-row block, and one instruction spans 64 weight rows. 65 (the default): never. In a
#: `mid` decode step of batch 64 on an H100 it made the GEMVs without an input prologue 11%
#: faster and those with one (a RoPE or SwiGLU, since kept to one row) 1.7x slower
#: (docs/benchmarks.md, "Switches timed"; ``tools/decode_ab.py --batch 64 --variants
#: base,gemv_swapped``); off until timed again.
SWAP_MIN_ROWS = 65
#: The CUDA-core path's accumulator elements per program (``rows x block_n x block_k``, 64
#: fp32 registers a thread at 4 warps): it caps the default ``block_k``.
FMA_ACC_ELEMENTS = 8192
#: Smallest ``block_k``: with 32 (a tile of one scale column) the kernel's build segfaults on
#: an H200 (jax 0.11.2; seen compiling the demo model's decode step, dim 32); 64 and 128 run.
MIN_BLOCK_K = 64

#: ``$0`` = the e4m3 value nearest the fp32 ``$1`` (ties to even, saturating at +-448), as fp32.
QDQ_PTX = """{
.reg .b32 h;
.reg .b16 c, lo;
cvt.rn.satfinite.e4m3x2.f32 c, $1, $1;
cvt.rn.f16x2.e4m3x2 h, c;
cvt.u16.u32 lo, h;
cvt.f32.f16 $0, lo;
}"""


def _act_qdq(x: jax.Array, interpret: bool) -> jax.Array:
    """FP8 QDQ per 32 columns of an fp32 tile ``[R, C]`` (``C`` a multiple of 32), fp32 out,
    bit for bit :func:`pallas_kernels.fp4.reference.act_quant_qdq`."""
    R, C = x.shape
    xb = x.reshape(R, C // 32, 32)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), 1e-4)
    e = _pow2_ceil_exponent(amax * np.float32(1.0 / FP8_MAX))
    q = e4m3_nearest(xb * exp2_int(-e)[..., None], interpret)     # of x / 2**e (exact)
    return (q * exp2_int(e)[..., None]).reshape(R, C)


def e4m3_nearest(y: jax.Array, interpret: bool) -> jax.Array:
    """The e4m3 value nearest each fp32 value of a tile (ties to even, saturating at
    +-448), as fp32: the hardware's convert (:data:`QDQ_PTX`) in a kernel, ``ml_dtypes``'
    in interpret mode."""
    if interpret:
        return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(F32)
    [q] = pltr.elementwise_inline_asm(
        QDQ_PTX, args=[y], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, F32)])
    return q


def tile_rows(M: int) -> int:
    """The input-row tile of a call of ``M`` rows: 16, 32 or 64, the smallest that holds
    them."""
    t = ROWS
    while t < M:
        t *= 2
    return t


def _kernel(layer_ref, x_ref, *refs, block_k, block_n, n_k, group_rows, rows, tile, act_quant,
            interpret, first_blocks=(0,), rope=None, prologue=None):
    """One program: ``block_n`` output rows over one K split. With several weights (``refs``:
    a weight and its scales per weight, then the output), ``first_blocks`` holds each one's
    first row block in the output: the program runs on the weight its row block falls in.
    ``rope`` (:class:`Rope`'s static part ``(at, head, inverse)``): ``refs`` start with the
    rows' positions and the frequencies; the input's tiles (``at="input"``) or the output
    block (``"output"``) are rotated (:func:`_rotate`)."""
    refs = list(refs)
    turn = None
    if rope is not None:
        _, head, inverse = rope
        pos_ref, freqs_ref = refs.pop(0), refs.pop(0)

        def positions(m=None):
            """Row ``m``'s position ``[1]``, or the tile's rows' ``[tile]`` (0 past ``rows``)."""
            if m is not None:
                return jnp.broadcast_to(pos_ref[m], (1,))
            return pltr.load(pos_ref, mask=jnp.arange(tile) < rows, other=0)

        turn = functools.partial(_rotate, positions=positions, freqs_ref=freqs_ref,
                                 head=head, inverse=inverse)
    *weights, o_ref = refs
    turn_in = turn if rope is not None and rope[0] == "input" else None
    nb, ks = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    g = (nb * block_n) // group_rows
    subs = block_n // BLOCK_N           # 32-row blocks, each with its own row of scales
    if len(weights) == 2:             # one weight and its scales
        accs = _accumulate(layer, x_ref, *weights, nb, ks, g, block_k=block_k, n_k=n_k,
                           subs=subs, rows=rows, tile=tile, act_quant=act_quant,
                           interpret=interpret, turn=turn_in, prologue=prologue)
    else:   # two weights (first_blocks[1]: the second's first row block); uniform per program
        w0, s0, w1, s1 = weights
        accs = jax.lax.cond(
            nb < first_blocks[1],
            lambda: _accumulate(layer, x_ref, w0, s0, nb, ks, g, block_k=block_k, n_k=n_k,
                                subs=subs, rows=rows, tile=tile, act_quant=act_quant,
                                interpret=interpret),
            lambda: _accumulate(layer, x_ref, w1, s1, nb - first_blocks[1], ks, g,
                                block_k=block_k, n_k=n_k, subs=subs, rows=rows, tile=tile,
                                act_quant=act_quant, interpret=interpret))
    width = accs[0].shape[1]        # BLOCK_N, or block_n from the swapped operands
    if rope is not None and rope[0] == "output":    # each block's channels rotated
        accs = tuple(turn(a.astype(o_ref.dtype).astype(F32), nb * block_n + j * width,
                          dtype=o_ref.dtype) for j, a in enumerate(accs))
    _store(o_ref, accs, o_ref.shape[0], tile)


def _rotate(x, ch0, *, positions, freqs_ref, head, inverse, dtype, row=None):
    """:func:`pallas_kernels.rope.apply_rope` of a tile in registers: ``x`` fp32 ``[T, C]``
    (its values ``dtype``'s) whose column ``c`` is channel ``(ch0 + c) % head`` of a head of
    ``head`` channels and whose row ``t`` is at position ``positions()[t]`` (one row, input
    row ``row``: ``positions(row)``): in each head, the last
    ``R / 2`` interleaved pairs (``R / 2`` the frequencies' count) rotated by the angles
    ``f32(pos) * freqs`` (``cos`` and ``sin`` the CUDA math library's, as XLA's), fp32 math
    in ``apply_rope``'s formulas, rounded to ``dtype``; the other columns as they are.
    Returns fp32 ``[T, C]``."""
    T, C = x.shape
    pos = positions(row)
    pairs = freqs_ref.shape[0]
    a, b = jnp.split(x.reshape(T, C // 2, 2), 2, axis=-1)
    a, b = a.reshape(T, C // 2), b.reshape(T, C // 2)
    ch = ch0 + 2 * jnp.arange(C // 2, dtype=I32)
    j = (ch % head) // 2 - (head // 2 - pairs)      # the pair's index among the rotated
    on = (j >= 0)[None, :]
    theta = pos.astype(F32)[:, None] * freqs_ref[jnp.maximum(j, 0)][None, :]
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    if inverse:
        sin = -sin
    a, b = jnp.where(on, a * cos - b * sin, a), jnp.where(on, a * sin + b * cos, b)
    return jnp.stack([a.astype(dtype), b.astype(dtype)], axis=-1).reshape(T, C).astype(F32)


def _accumulate(layer, x_ref, w_ref, s_ref, nb, ks, g, *, block_k, n_k, subs, rows, tile,
                act_quant, interpret, turn=None, prologue=None):
    """The fp32 accumulators ``subs x [tile, BLOCK_N]`` of row block ``nb`` of one weight
    (``rows`` of the ``tile`` rows hold input). ``turn``: :func:`_rotate` with the rows'
    positions, applied to each input tile (before its act-quant). ``prologue``: the input
    made from another GEMV's partial sums (:func:`_swiglu_input`)."""
    load = functools.partial(_load_input, x_ref, g=g, block_k=block_k, rows=rows, tile=tile,
                             prologue=prologue)
    if rows <= FMA_MAX_ROWS:
        return _accumulate_fma(layer, x_ref, w_ref, s_ref, nb, ks, load, block_k=block_k,
                               n_k=n_k, subs=subs, rows=rows, tile=tile, act_quant=act_quant,
                               interpret=interpret, turn=turn)
    if rows >= SWAP_MIN_ROWS and subs > 1:
        return _accumulate_swapped(layer, x_ref, w_ref, s_ref, nb, ks, load, block_k=block_k,
                                   n_k=n_k, subs=subs, tile=tile, act_quant=act_quant,
                                   interpret=interpret, turn=turn)

    prepare = functools.partial(_input_tile, load, turn=turn, act_quant=act_quant,
                                interpret=interpret, dtype=x_ref.dtype)

    def step(i, accs):
        k0 = (ks * n_k + i) * block_k
        x = prepare(k0)
        out = []
        for j in range(subs):
            w, sf = _weight_tile(layer, w_ref, s_ref, nb, j, k0, subs=subs, block_k=block_k)
            xs = (x * sf).astype(BF16)
            wb = w.astype(F32 if interpret else BF16)
            xs = xs.astype(F32) if interpret else xs
            out.append(accs[j] + jax.lax.dot_general(xs, wb, (((1,), (1,)), ((), ())),
                                                     preferred_element_type=F32))
        return tuple(out)

    return jax.lax.fori_loop(0, n_k, step, (jnp.zeros((tile, BLOCK_N), F32),) * subs)


def _accumulate_swapped(layer, x_ref, w_ref, s_ref, nb, ks, load, *, block_k, n_k, subs, tile,
                        act_quant, interpret, turn=None):
    """:func:`_accumulate` with the weight as the first operand (:data:`SWAP_MIN_ROWS`): per
    step the ``[subs x 32, block_k]`` weight tile converted to bf16 and multiplied by each
    32 x 32 tile's power of two in registers (exact), ``W @ x^T`` added into one fp32
    ``[subs x 32, tile]`` accumulator; returned transposed as one ``[tile, subs x 32]`` tile."""
    block_n = subs * BLOCK_N
    sub = jnp.arange(block_n, dtype=I32)[:, None] // BLOCK_N
    prepare = functools.partial(_input_tile, load, turn=turn, act_quant=act_quant,
                                interpret=interpret, dtype=x_ref.dtype)

    def step(i, acc):
        k0 = (ks * n_k + i) * block_k
        x = prepare(k0)
        w = w_ref[layer, pl.ds(nb * block_n, block_n), pl.ds(k0, block_k)].astype(F32)
        sf = None
        for j in range(subs):      # each row's 32 x 32 tiles' scales, [block_n, block_k]
            s = s_ref[layer, pl.ds(nb * subs + j, 1), pl.ds(k0 // 32, block_k // 32)]
            s = repeat_columns(jax.lax.bitcast_convert_type(s.astype(I32) << 23, F32), 32)
            sf = s if sf is None else jnp.where(sub == j, s, sf)
        wb = (w * sf).astype(BF16)
        xb = x.astype(BF16)
        if interpret:
            wb, xb = wb.astype(F32), xb.astype(F32)
        return acc + jax.lax.dot_general(wb, xb, (((1,), (1,)), ((), ())),
                                         preferred_element_type=F32)

    acc = jax.lax.fori_loop(0, n_k, step, jnp.zeros((block_n, tile), F32))
    return (acc.T,)


def _input_tile(load, k0, m=None, *, turn, act_quant, interpret, dtype):
    """The input's columns ``k0..`` as the products take them, fp32: the tile's rows (or row
    ``m``, ``[1, block_k]``) loaded, rotated (``turn``: :func:`_rotate` with the rows'
    positions; row ``m``'s own) and FP8-QDQ'd (``act_quant``; exact in bf16)."""
    x = load(k0) if m is None else load(k0, m)
    if turn is not None:
        x = turn(x, k0, dtype=dtype) if m is None else turn(x, k0, dtype=dtype, row=m)
    return _act_qdq(x, interpret) if act_quant else x


def _weight_tile(layer, w_ref, s_ref, nb, j, k0, *, subs, block_k):
    """The FP8 tile ``[32, block_k]`` of 32-row block ``j`` of row block ``nb`` at column
    ``k0``, and its E8M0 scales as fp32 powers of two ``2**(u - 127)``, each repeated over its
    32 columns (``[1, block_k]``)."""
    w = w_ref[layer, pl.ds((nb * subs + j) * BLOCK_N, BLOCK_N), pl.ds(k0, block_k)]
    s = s_ref[layer, pl.ds(nb * subs + j, 1), pl.ds(k0 // 32, block_k // 32)].astype(I32)
    return w, repeat_columns(jax.lax.bitcast_convert_type(s << 23, F32), 32)


def _load_input(x_ref, k0, m=None, *, g, block_k, rows, tile, prologue):
    """The input's columns ``k0..`` (group ``g``), fp32: row ``m`` ``[1, block_k]``, or the
    tile's rows ``[tile, block_k]`` (those past ``rows`` read as zero); with ``prologue``, made
    from the partial sums ``x_ref`` holds (:func:`_swiglu_input`)."""
    if prologue is not None:
        return _swiglu_input(x_ref, k0, m, block_k=block_k, rows=rows, tile=tile,
                             prologue=prologue)
    if m is not None:
        return x_ref[m, g, pl.ds(k0, block_k)][None, :].astype(F32)
    if rows < tile:     # the block's rows past the input's are masked (read as zero)
        mask = jnp.broadcast_to((jnp.arange(tile) < rows)[:, None], (tile, block_k))
        return pltr.load(x_ref.at[:, g, pl.ds(k0, block_k)], mask=mask,
                         other=0.0).astype(F32)
    return x_ref[:, g, pl.ds(k0, block_k)].astype(F32)


def _swiglu_input(parts_ref, k0, m, *, block_k, rows, tile, prologue):
    """A SwiGLU's output as the input's columns ``k0..``, from the partial sums ``[S, P,
    2I]`` of the GEMV pair that made its gate (columns ``0..I``) and up (``I..2I``)
    projections (``prologue`` = ``("swiglu", I, limit)``): each sum ``0 + parts[0] + ... +
    parts[S-1]`` (XLA's reduction's order) rounded to bf16 (the linears' outputs), the clamps
    (``limit > 0``: up to ``[-limit, limit]``, the gate from above), ``silu(g) * u`` in fp32
    rounded to bf16, as :func:`dsv41_jax.layers.moe.expert` computes it. fp32 ``[1 or tile,
    block_k]``."""
    _, I, limit = prologue
    S = parts_ref.shape[0]

    def total(col):
        acc = 0.0 if S > 1 else None
        for s in range(S):
            if m is not None:
                v = parts_ref[s, m, pl.ds(col, block_k)][None, :]
            elif rows < tile:
                mask = jnp.broadcast_to((jnp.arange(tile) < rows)[:, None], (tile, block_k))
                v = pltr.load(parts_ref.at[jnp.int32(s), :, pl.ds(col, block_k)], mask=mask,
                              other=0.0)
            else:
                v = parts_ref[s, :, pl.ds(col, block_k)]
            v = v.astype(F32)
            acc = v if acc is None else acc + v
        return acc.astype(BF16).astype(F32)          # a no-op where S = 1 (stored bf16)

    gate, up = total(k0), total(I + k0)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return (gate * jax.nn.sigmoid(gate) * up).astype(BF16).astype(F32)


def _accumulate_fma(layer, x_ref, w_ref, s_ref, nb, ks, load, *, block_k, n_k, subs, rows,
                    tile, act_quant, interpret, turn=None):
    """:func:`_accumulate` on the CUDA cores (:data:`FMA_MAX_ROWS`): per input row and 32-row
    block an fp32 ``[32, block_k]`` accumulator of products, summed over its columns at the
    end; returned as ``[tile, BLOCK_N]`` tiles holding row ``m``'s sums in row ``m``."""

    def step(i, accs):
        k0 = (ks * n_k + i) * block_k
        xs = [_input_tile(load, k0, m, turn=turn, act_quant=act_quant, interpret=interpret,
                          dtype=x_ref.dtype) for m in range(rows)]
        out = []
        for j in range(subs):
            w, sf = _weight_tile(layer, w_ref, s_ref, nb, j, k0, subs=subs, block_k=block_k)
            wf = w.astype(F32)
            out.append(tuple(accs[j][m] + wf * (x * sf).astype(BF16).astype(F32)   # exact
                             for m, x in enumerate(xs)))
        return tuple(out)

    zero = jnp.zeros((BLOCK_N, block_k), F32)
    accs = jax.lax.fori_loop(0, n_k, step, ((zero,) * rows,) * subs)
    if rows == 1:
        return tuple(jnp.broadcast_to(jnp.sum(a[0], axis=1)[None, :], (tile, BLOCK_N))
                     for a in accs)
    pick = jnp.arange(tile)[:, None]
    tiles = []
    for a in accs:
        t = jnp.zeros((tile, BLOCK_N), F32)
        for m in range(rows):
            t = jnp.where(pick == m, jnp.sum(a[m], axis=1)[None, :], t)
        tiles.append(t)
    return tuple(tiles)


def _store(o_ref, accs, rows, tile):
    """The accumulators (``tile`` rows, side by side) into the output block of ``rows``
    rows."""
    subs, width = len(accs), accs[0].shape[1]
    if rows == tile:
        for j in range(subs):
            o_ref[:, pl.ds(j * width, width)] = accs[j].astype(o_ref.dtype)
        return
    # only the input's rows are written (a decode step of batch 1 writes 1 of the 16): each
    # picked out of the tile by a sum whose other terms are zeros (exact)
    pick = jnp.arange(tile)[:, None]
    for j in range(subs):
        for m in range(rows):
            o_ref[m, pl.ds(j * width, width)] = jnp.sum(
                jnp.where(pick == m, accs[j], 0.0), axis=0).astype(o_ref.dtype)


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def config(N: int, K: int, block_k: int | None = None, k_splits: int | None = None,
           block_n: int = BLOCK_N, max_block_k: int = 512):
    """``(block_k, k_splits)``: no split of K from :data:`UNSPLIT_ROW_BLOCKS` blocks of
    ``block_n`` output rows, else enough splits for about :data:`TARGET_PROGRAMS` programs (a
    power of two dividing K / block_k), in blocks of 512 columns where that leaves each
    program one block, else of the largest power of two <= 256 dividing K (at least
    :data:`MIN_BLOCK_K`). On an H200 (docs/benchmarks.md, "FP8 GEMV tunings"),
    ``[8192, 4096]`` ran in 19.4 us with 256 x 4 splits against 26.4 us with 512 x 4 (two
    blocks per program), while ``[2048, 8192]`` ran fastest with 512 x 16 (one each).
    ``max_block_k`` caps the default ``block_k`` (the 32- and 64-row tiles keep the input
    tile's registers to those of a 16-row tile of 512 columns). Raises
    ``ValueError`` for a ``block_k`` or ``k_splits`` that does not fit ``K``, or a ``block_n``
    that is not a power of two multiple of 32 dividing ``N``."""
    if block_n < BLOCK_N or block_n & (block_n - 1) or N % block_n:
        raise ValueError(f"block_n={block_n} must be a power of two >= {BLOCK_N} dividing "
                         f"N={N}")
    row_blocks = N // block_n
    target = 1 if row_blocks >= UNSPLIT_ROW_BLOCKS else max(1, TARGET_PROGRAMS // row_blocks)
    if block_k is None:
        block_k = _pow2_divisor(K, min(512, max_block_k))
        if block_k == 512 and _pow2_divisor(K // 512, target) != K // 512:
            block_k = _pow2_divisor(K, 256)
    if block_k < MIN_BLOCK_K or K % block_k or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two >= {MIN_BLOCK_K} dividing "
                         f"K={K}")
    n_kb = K // block_k
    if k_splits is None:
        k_splits = _pow2_divisor(n_kb, target)
    if n_kb % k_splits:
        raise ValueError(f"k_splits={k_splits} must divide K / block_k = {n_kb}")
    return block_k, k_splits


def default_block_n(N: int, group_rows: int, rows: int = 1) -> int:
    """Output rows per program: 64 where that still leaves at least half of
    :data:`TARGET_PROGRAMS` programs without splitting K and divides a group's rows, else
    :data:`BLOCK_N` (on an H200, ``[32768, 1280]`` ran in 24.3 us with 64 against 26.3 us
    with 32; ``[8192, 4096]`` was slower with 64). An input of :data:`SWAP_MIN_ROWS` rows or
    more takes 64 wherever it divides a group's rows (the swapped operands' instruction
    height; K splits make up the programs)."""
    wide = 2 * BLOCK_N
    if rows >= SWAP_MIN_ROWS and group_rows % wide == 0:
        return wide
    return wide if N // wide >= TARGET_PROGRAMS // 2 and group_rows % wide == 0 else BLOCK_N


@functools.partial(jax.jit, static_argnames=("act_quant", "block_k", "k_splits", "block_n",
                                             "num_warps", "num_stages", "interpret",
                                             "out_dtype", "rope"))
def fp8_gemv(x, w, scale, layer, rope_positions=None, rope_freqs=None, *, act_quant=False,
             block_k=None, k_splits=None, block_n=None, num_warps=4, num_stages=3,
             interpret=False, out_dtype="float32", rope=None):
    """See :func:`pallas_kernels.gemv.fp8_gemv`; ``x`` [M <= 64, G, K] (bf16, or with
    ``act_quant`` any float dtype, quantised from its own values). ``block_n``: output rows per
    program (32-row blocks sharing the input tile and its act-quant; default
    :func:`default_block_n`); it must divide ``N / G`` when ``G > 1``. ``rope``: ``(at, head,
    inverse)`` with ``rope_positions`` int32 ``[M]`` and ``rope_freqs`` fp32 ``[R/2]``
    (:func:`pallas_kernels.gemv.fp8_gemv`'s ``rope_in`` / ``rope_out``)."""
    M, G, K = x.shape
    N = w.shape[1]
    block_n = default_block_n(N, N // G, M) if block_n is None else block_n
    if (N // G) % block_n:
        raise ValueError(f"block_n={block_n} must divide the rows of a group, N / G = {N // G}")
    [y] = _call(x, ((w, scale),), layer, act_quant=act_quant, block_k=block_k,
                k_splits=k_splits, block_n=block_n, num_warps=num_warps,
                num_stages=num_stages, interpret=interpret, out_dtype=out_dtype,
                rope=rope, rope_args=(rope_positions, rope_freqs))
    return y


@functools.partial(jax.jit, static_argnames=("act_quant", "block_k", "k_splits", "block_n",
                                             "num_warps", "num_stages", "interpret",
                                             "out_dtype", "partials"))
def fp8_gemv_pair(x, w0, scale0, w1, scale1, layer, *, act_quant=False, block_k=None,
                  k_splits=None, block_n=None, num_warps=4, num_stages=3, interpret=False,
                  out_dtype="float32", partials=False):
    """See :func:`pallas_kernels.gemv.fp8_gemv_pair`: two weight stacks ``[L, N0, K]``,
    ``[L, N1, K]`` on one input ``x [M, 1, K]`` in one launch (the programs of each row block
    run on its weight). ``block_n`` (default :func:`default_block_n` of ``N0 + N1``, 32 where
    it does not divide both) must divide ``N0`` and ``N1``. Returns ``([M, N0], [M, N1])`` of
    ``out_dtype``; ``partials``: also the kernel's output before the reduction (:func:`_call`)."""
    N0, N1 = w0.shape[1], w1.shape[1]
    if block_n is None:
        block_n = default_block_n(N0 + N1, N0 + N1, x.shape[0])
        block_n = block_n if N0 % block_n == 0 and N1 % block_n == 0 else BLOCK_N
    if N0 % block_n or N1 % block_n:
        raise ValueError(f"block_n={block_n} must divide both weights' rows, {N0} and {N1}")
    return _call(x, ((w0, scale0), (w1, scale1)), layer, act_quant=act_quant,
                 block_k=block_k, k_splits=k_splits, block_n=block_n, num_warps=num_warps,
                 num_stages=num_stages, interpret=interpret, out_dtype=out_dtype,
                 partials=partials)


@functools.partial(jax.jit, static_argnames=("rows", "limit", "act_quant", "block_k",
                                             "k_splits", "block_n", "num_warps", "num_stages",
                                             "interpret", "out_dtype"))
def fp8_gemv_swiglu(parts, w, scale, layer, *, rows, limit, act_quant=False, block_k=None,
                    k_splits=None, block_n=None, num_warps=4, num_stages=3, interpret=False,
                    out_dtype="float32"):
    """See :func:`pallas_kernels.gemv.fp8_gemv_swiglu`: the GEMV of ``w`` (``[L, N, I]``) on
    the SwiGLU of a GEMV pair's partial sums ``parts`` ``[S, P >= rows, 2I]``, made in the
    kernel (:func:`_swiglu_input`)."""
    N, I = w.shape[1], w.shape[2]
    if parts.shape[-1] != 2 * I or parts.shape[1] < rows:
        raise ValueError(f"parts {parts.shape}: [S, P >= {rows}, 2 x {I}] expected (the gate "
                         f"and up projections' partial sums side by side)")
    block_n = default_block_n(N, N, rows) if block_n is None else block_n
    [y] = _call(parts, ((w, scale),), layer, act_quant=act_quant, block_k=block_k,
                k_splits=k_splits, block_n=block_n, num_warps=num_warps,
                num_stages=num_stages, interpret=interpret, out_dtype=out_dtype,
                prologue=("swiglu", I, float(limit)), rows=rows)
    return y


def _call(x, weights, layer, *, act_quant, block_k, k_splits, block_n, num_warps, num_stages,
          interpret, out_dtype="float32", partials=False, rope=None, rope_args=(None, None),
          prologue=None, rows=None):
    """The kernel over ``weights`` (``((w, scale), ...)``, their rows one after another in
    the output); the outputs per weight, ``[M, N_i]`` of ``out_dtype`` (the fp32 sums
    rounded once: in the kernel's store without a K split, after the partial sums' reduction
    with one). Up to 16 rows the kernel writes only the input's rows of its 16-row tile;
    above, whole tiles of 32 or 64 rows (:func:`tile_rows`), the rows past ``M`` cut off
    after the call. ``partials``: the outputs and, last, the kernel's own ``[S, rows, N]``
    (``S`` K splits, ``rows >= M``; fp32 sums with ``S > 1``, else ``out_dtype``), whose
    output row ``m`` is ``out_dtype(0 + sum_s parts[s, m])``, so a consumer kernel can read
    it without XLA's reduction and slices before it. ``rope``: ``(at, head, inverse)``, the
    rotation of the input's tiles (``at="input"``) or of the output (``"output"``: in the
    kernel's store without a K split, else after the reduction, by
    :func:`pallas_kernels.gemv.reference.rope_heads`), ``rope_args`` the positions ``[M]``
    and the frequencies. ``prologue``: ``x`` is a GEMV pair's partial sums ``[S, P, 2K]``
    and the input its SwiGLU of ``rows`` rows (:func:`_swiglu_input`)."""
    M, G, K = x.shape if prologue is None else (rows, 1, prologue[1])
    if M > MAX_TILE_ROWS:
        raise ValueError(f"the GEMV takes at most {MAX_TILE_ROWS} rows, got {M}")
    tile = tile_rows(M)
    out_rows = M if tile == ROWS else tile
    sizes = [w.shape[1] for w, _ in weights]
    N = sum(sizes)
    fma = M <= FMA_MAX_ROWS
    block_k, k_splits = config(N, K, block_k, k_splits, block_n,
                               max_block_k=max(FMA_ACC_ELEMENTS // (M * block_n), MIN_BLOCK_K)
                               if fma else 512 * ROWS // tile)
    n_k = K // block_k // k_splits
    x = x if act_quant or prologue is not None else x.astype(BF16)
    first_blocks = tuple(int(b) for b in np.cumsum([0] + sizes[:-1]) // block_n)
    after = rope is not None and rope[0] == "output" and k_splits > 1   # rotated after the sum
    in_kernel = rope is not None and not after
    kernel = functools.partial(_kernel, block_k=block_k, block_n=block_n, n_k=n_k,
                               group_rows=N // G, rows=M, tile=tile, act_quant=act_quant,
                               interpret=interpret, first_blocks=first_blocks,
                               rope=rope if in_kernel else None, prologue=prologue)
    x_spec = (pl.BlockSpec((tile, G, K), lambda nb, ks: (0, 0, 0)) if prologue is None
              else pl.BlockSpec((x.shape[0], tile, x.shape[2]), lambda nb, ks: (0, 0, 0)))
    rope_ins = [rope_args[0].astype(I32), rope_args[1].astype(F32)] if in_kernel else []
    part = pl.pallas_call(
        kernel, grid=(N // block_n, k_splits),
        in_specs=[pl.BlockSpec(), x_spec]
        + ([pl.BlockSpec((tile,), lambda nb, ks: (0,)), pl.BlockSpec()] if in_kernel else [])
        + [pl.BlockSpec()] * (2 * len(weights)),
        out_specs=pl.BlockSpec((None, out_rows, block_n), lambda nb, ks: (ks, 0, nb)),
        out_shape=jax.ShapeDtypeStruct((k_splits, out_rows, N),
                                       F32 if k_splits > 1 else out_dtype),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="fp8_stacked_gemv",
    )(jnp.reshape(layer, (1,)).astype(I32), x, *rope_ins,
      *[a for pair in weights for a in pair])
    y = part[0] if k_splits == 1 else jnp.sum(part, axis=0).astype(out_dtype)
    y = y[:M]
    if after:
        y = reference.rope_heads(y, *rope_args, rope[1], rope[2])
    ys = [y] if len(weights) == 1 else [y[:, a:a + n]
                                        for a, n in zip(np.cumsum([0] + sizes[:-1]), sizes)]
    return ys + [part] if partials else ys


def _rows_kernel(x_ref, o_ref, *, rows, tile, block_k, act_quant, interpret):
    g, kb = pl.program_id(0), pl.program_id(1)
    k0 = kb * block_k
    x = _load_input(x_ref, k0, g=g, block_k=block_k, rows=rows, tile=tile, prologue=None)
    o_ref[...] = (_act_qdq(x, interpret) if act_quant else x).astype(BF16)


def input_rows(x: jax.Array, tile: int, *, act_quant: bool, interpret: bool = False
               ) -> jax.Array:
    """The input of the Mosaic GPU kernel (:mod:`pallas_kernels.gemv.mosaic_gpu`) in one
    launch: ``x [M, G, K]`` -> bf16 ``[G * tile, K]``, group by group, each group's ``M`` rows
    padded with zeros to ``tile`` (16, 32 or 64, at least ``M``) and, with ``act_quant``,
    FP8-QDQ'd per 32 inputs (bit for bit :func:`pallas_kernels.fp4.reference.act_quant_qdq`;
    the padding stays zero). ``K``: a multiple of 64."""
    M, G, K = x.shape
    if tile not in (16, 32, 64) or M > tile or K % MIN_BLOCK_K:
        raise ValueError(f"input_rows: {M} rows in a tile of {tile} (16, 32 or 64) and K={K} "
                         f"(a multiple of {MIN_BLOCK_K}) expected")
    block_k = next(b for b in (256, 128, 64) if K % b == 0)
    kernel = functools.partial(_rows_kernel, rows=M, tile=tile, block_k=block_k,
                               act_quant=act_quant, interpret=interpret)
    return pl.pallas_call(
        kernel, grid=(G, K // block_k),
        in_specs=[pl.BlockSpec((tile, G, K), lambda g, kb: (0, 0, 0))],
        out_specs=pl.BlockSpec((tile, block_k), lambda g, kb: (g, kb)),
        out_shape=jax.ShapeDtypeStruct((G * tile, K), BF16),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="fp8_gemm_input_rows",
    )(x)
