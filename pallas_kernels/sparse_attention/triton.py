"""Pallas Triton kernel of the CSA2 sparse attention (NVIDIA GPUs; spec 3.8).

One program per (query row, head block, list split): the ``block_h`` heads of a query share its
index list (MQA), so every 64-entry block is one ``[block_h, 64]`` score tile on the tensor
cores, and its rows are dequantised once for all those heads.

* Rows are gathered straight from the state's storage: FP8 window rows (e4m3 + E8M0 per 32) and
  packed FP4 main KV (e2m1 pairs + E4M3 per 16), loaded as int32 words and dequantised in
  registers; no bf16 copy of the KV is written to HBM.
* The K channels are handled in ``n_chunks`` contiguous chunks. A chunk's words and scale bytes
  are contiguous runs of each listed row (coalesced, vectorised loads); every code field of the
  words decodes to a tile of every 4th / 8th channel, and register joins (``jnp.stack`` +
  reshape) interleave those tiles back into channel order, so the tile the tensor cores read
  is stored to shared memory with wide stores, q is read and o written contiguously, and
  ``s = sum_c q_c k_c^T``, ``o_c = P v_c``.
* ``prefetch``: ``"none"`` (the default: the rows of block j are loaded at its start),
  ``"index"`` (the list entries of block j+1 are loaded during block j) or ``"late"`` (the rows
  of block j+1 are loaded once block j's scores are computed). With 64 heads the [64, 512]
  fp32 accumulator takes half the registers of 8 warps, and rows held across the score phase
  made the compiler spill: loading them late or not ahead at all measured faster.
* The window list and the top-k list are read in place when each is a whole number of
  64-entry blocks (the release's 128 + 512); otherwise they are concatenated (and padded) in
  XLA first, one more kernel per call.
* ``n_splits > 1`` (flash-decoding) splits the list's blocks over programs; the partial
  ``(acc, m, l)`` are merged by :func:`merge_splits` (``merge="triton"``, one small Pallas
  kernel) or in XLA (``merge="xla"``, :func:`merge_splits_xla`, its reference). With
  ``n_splits = 1`` the blocks run in the reference order and the kernel finishes the softmax
  itself (sink, division, bf16 output).
* ``softmax="exp2"`` (the default) computes the exponentials as ``exp2(x * log2 e)`` (one
  ``MUFU.EX2``, :func:`exp_of`; compiled on CPU by standalone Triton 3.6, the main-KV loop
  drops from 1912 to 1676 SASS instructions, and to 1612 with the PTX decode's shifts cut,
  :func:`decode_ptx`). On CPU, XLA folds ``exp2(x * log2 e)`` back
  into ``exp(x)``, so interpret mode cannot tell the two apart: the GPU's ``ex2`` is checked
  against the XLA path on the H200 (``bench_kernels.py --check``).
* ``dequant``: ``"jnp"``, or ``"asm"`` (a PTX decode without per-element conversion
  instructions, bitwise equal to the jnp decode). :func:`default_tuning` holds the measured
  choices (docs/benchmarks.md).
* ``kv="dense"`` hands the call to :mod:`.triton_dense` (rows decoded once, then gathered as
  bf16), the default where each row is listed many times (prefill chunks).

The jnp decodes are integer bit manipulation (fp16 bit placement), so the kernel needs no fp8
instructions and runs unchanged in Pallas interpret mode on CPU. The state never holds the
fp8 NaN codes (the quantisers clip); the kernel would decode them as +-480, where the XLA path
gives NaN. Listed indices are clamped to the array like the XLA path's gather.

Resource use of the GPU build can be read on a CPU machine: ``scripts/triton_report.py``
lowers the kernel for an H200 and, with the standalone ``triton`` package installed, compiles
it for sm_90a and prints registers, spills and the instruction mix.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.sparse_attention.reference import SOFTMAX_BLOCK, lse_with_sink, pad_list

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32
NEG_START = -1e30  # the reference kernel's initial running max
PREFETCH = ("none", "index", "late")
DEQUANT = ("jnp", "asm")
SOFTMAX = ("exp", "exp2")
MERGE = ("xla", "triton")
KV = ("packed", "dense")
LOG2E = 1.4426950408889634


def exp_of(softmax: str):
    """The softmax's exponential: ``"exp"``, libdevice ``expf`` (about 10 instructions);
    ``"exp2"``, ``exp2(x * log2(e))`` (a multiply and one ``MUFU.EX2``). The argument ``x`` is
    formed as in the reference (``s * scale - m``), so the base change only rounds ``x *
    log2(e)``: an error relative to ``x``, small where ``P`` is large (folding log2(e) into the
    score scale instead would round ``s * scale * log2(e)``, and moved twice as many bf16(P)
    roundings on the H200: docs/benchmarks.md).

    Raises ``ValueError`` for a name not in :data:`SOFTMAX`."""
    if softmax not in SOFTMAX:
        raise ValueError(f"softmax must be one of {SOFTMAX}, got {softmax!r}")
    if softmax == "exp2":
        return lambda x: jnp.exp2(x * LOG2E)
    return jnp.exp


def _shl(x, n: int):
    """``x << n`` for n >= 0, ``x >> -n`` otherwise (the bits kept are masked by the caller)."""
    return x << n if n >= 0 else x >> -n


def _f16_to_f32(bits):
    """int32 holding fp16 bits in its low 16 -> fp32 (exact; fp16 subnormals are f32 normals)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(F32)


def e4m3_over_256(b):
    """e4m3fn byte (int32 0..255; never the NaN code in our data) -> value * 2**-8, exactly.

    The 7 low bits land in an fp16's exponent low 4 bits and mantissa top 3 bits, so the fp16
    reads ``2**(e-15) * (1 + m/8)`` (subnormal ``m/8 * 2**-14`` when e = 0): the e4m3 value
    times 2**-8. No f32 denormals are involved, so CPU flush-to-zero cannot change it.
    """
    return _f16_to_f32(((b & 0x80) << 8) | ((b & 0x7F) << 7))


def e2m1_over_16384(c):
    """e2m1 nibble (int32 0..15) -> value * 2**-14, exactly (same fp16 bit placement)."""
    return _f16_to_f32(((c & 8) << 12) | ((c & 7) << 9))


def _e4m3_field(words, k: int):
    """Byte ``k`` of each int32 word, an e4m3 code -> value * 2**-8 (fp32; as e4m3_over_256)."""
    return _f16_to_f32((_shl(words, 8 - 8 * k) & 0x8000) | (_shl(words, 7 - 8 * k) & 0x3F80))


def _e2m1_field(words, n: int):
    """Nibble ``n`` of each int32 word, an e2m1 code -> value * 2**-14 (fp32; as
    e2m1_over_16384)."""
    return _f16_to_f32((_shl(words, 12 - 4 * n) & 0x8000) | (_shl(words, 9 - 4 * n) & 0x0E00))


# PTX for the GPU build (``dequant="asm"``): one code field of two adjacent words -> bf16x2,
# exactly, with no conversion instructions. ``prmt`` puts the byte holding the code of each
# word into both bytes of a 16-bit half; the code's bits are placed where a bf16's low exponent
# and high mantissa bits are (the magnitude from the low copy, the sign from the high copy),
# which reads as the value times 2**-126 (e2m1) or 2**-120 (e4m3), subnormals included; two
# exact bf16x2 multiplies (that power of two, then the scale: the products have <= 8
# significant bits) give the dequantised pair.
# $0: the bf16 pair; $1, $2: the two int32 words; $3, $4: their scales' bf16 bits.
_DECODE_PTX = """{{
.reg .b32 x, a, b, c, s;
prmt.b32 x, $1, $2, {sel};
shl.b32 a, x, {mag_shl};
and.b32 a, a, {mag_mask};
{sign}
or.b32 a, a, b;
mov.b32 c, {pow2};
mul.rn.bf16x2 a, a, c;
prmt.b32 s, $3, $4, 0x5410;
mul.rn.bf16x2 $0, a, s;
}}"""
# per format: the magnitude's bit 0 goes to bit 6 (e2m1: 3 bits) or 4 (e4m3: 7 bits), and the
# bf16x2 power of two that undoes the placement (2**126, 2**120)
_DECODE_FIELDS = {"e2m1": (6, "0x01C001C0", "0x7E807E80"), "e4m3": (4, "0x07F007F0", "0x7B807B80")}


def decode_ptx(fmt: str, byte: int, shift: int) -> str:
    """The PTX decoding format ``fmt`` ("e2m1" | "e4m3") from byte ``byte`` of each word, the
    code at bit ``shift`` of that byte (4: the high nibble).

    After the ``prmt``, each half holds the byte twice, so the code's magnitude (bits
    ``shift..``) moves left by ``target - shift`` and its sign bit ``shift + width - 1`` sits at
    bit ``8 + shift + width - 1`` of the half: already at bit 15 for the high nibble and e4m3
    (one shift fewer each than with a right shift first), 4 below it for the low nibble."""
    target, mag_mask, pow2 = _DECODE_FIELDS[fmt]
    sign_bit = 8 + shift + (3 if fmt == "e2m1" else 7)
    sign = ("and.b32 b, x, 0x80008000;" if sign_bit == 15 else
            f"shl.b32 b, x, {15 - sign_bit};\nand.b32 b, b, 0x80008000;")
    return _DECODE_PTX.format(sel=hex(byte | byte << 4 | (4 + byte) << 8 | (4 + byte) << 12),
                              mag_shl=target - shift, mag_mask=mag_mask, sign=sign, pow2=pow2)


def _field_asm(fmt: str, byte: int, shift: int, words, scale_bits):
    """bf16 tile of one code per int32 word (byte ``byte``, shifted right by ``shift``) times
    the scales (``scale_bits``: int32 tile of bf16 bits), via :func:`decode_ptx`."""
    [out] = plgpu.elementwise_inline_asm(
        decode_ptx(fmt, byte, shift), args=[words, scale_bits], constraints="=r,r,r,r,r",
        pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, BF16)])
    return out


def _bf16_bits(x_bf16):
    """bf16 tile -> int32 tile of its bits."""
    return jax.lax.bitcast_convert_type(x_bf16, jnp.int16).astype(I32) & 0xFFFF



def interleave_tiles(tiles):
    """2**m tiles [R, W] (tile i holds channel 2**m * w + i at column w) -> [R, W * 2**m] in
    channel order, built with register joins (``stack`` on a new last axis, then a reshape:
    Triton keeps the new axis in each thread's registers, so no data moves between threads)."""
    if len(tiles) == 1:
        return tiles[0]
    even, odd = interleave_tiles(tiles[0::2]), interleave_tiles(tiles[1::2])
    return jnp.stack([even, odd], axis=-1).reshape(even.shape[0], -1)


def repeat_columns(x, n: int):
    """[R, C] -> [R, C * n], each column repeated n times (n a power of two), in registers."""
    while n > 1:
        x = jnp.stack([x, x], axis=-1).reshape(x.shape[0], -1)
        n //= 2
    return x


NT = (((1,), (1,)), ((), ()))   # a @ b.T
NN = (((1,), (0,)), ((), ()))   # a @ b


def tile_dot(a, b, dims, *, interpret: bool):
    """fp32-accumulated product of two bf16 tiles (``dims``: :data:`NT` or :data:`NN`). In
    interpret mode the operands go as fp32 (exact): XLA:CPU has no bf16 x bf16 -> f32 dot."""
    if interpret:
        a, b = a.astype(F32), b.astype(F32)
    return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)


def _kernel(q_ref, idx_ref, top_ref, wkv_ref, wsc_ref, mkv_ref, msc_ref, sink_ref, *out_refs,
            S, K, n_chunks, block_h, n_win, n_blocks, n_splits, scale, interpret, dequant,
            prefetch, split_lists, softmax):
    """Program (row r = b*S + s, head block hb, split sp) over the joint list: the first
    ``n_win`` entries are window rows, the rest main-KV entries (-1 = none). With
    ``split_lists`` (both lists a whole number of blocks) ``idx_ref`` is the window list and
    ``top_ref`` the top-k list, read in place; otherwise ``idx_ref`` is their concatenation
    (``top_ref`` unused).

    Codes arrive as int32 words (window rows [B, Nw, K/4], 4 e4m3 codes per word; main KV
    [B, T, K/8], 8 e2m1 nibbles per word), the scales as bytes. Chunk c holds channels
    [c KC, (c+1) KC): its words and scale bytes are contiguous runs of each listed row, each
    code field of the words decodes to a tile of every 4th (FP8) or 8th (FP4) channel, and the
    tiles are interleaved back into channel order in registers (:func:`interleave_tiles`). So q
    is read and o written contiguously, and every product is a sum/concatenation over chunks:
    ``s = sum_c q_c k_c^T``, ``o_c = P v_c``. Each chunk's decode is written for both products;
    Triton's CSE merges the two, so one shared-memory tile per chunk feeds both.

    Refs, in order: q, the window (or joint) list, the top-k list, window words, window
    scales, main words, main scales, sink, then the outputs (o, lse with one split; acc, m, l
    with several).
    """
    r, hb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    exp = exp_of(softmax)
    use_asm = dequant == "asm" and not interpret
    b = r // S
    BN = SOFTMAX_BLOCK
    KC = K // n_chunks
    n_rows_win, n_rows_main = wkv_ref.shape[1], mkv_ref.shape[1]
    qs = [q_ref[:, pl.ds(c * KC, KC)] for c in range(n_chunks)]           # [BH, KC] bf16

    dot = functools.partial(tile_dot, interpret=interpret)
    nt, nn = NT, NN

    n_win_blocks = n_win // BN

    def list_block(j, kind):
        if not split_lists:
            return idx_ref[pl.ds(jnp.clip(j, 0, n_blocks - 1) * BN, BN)]
        if kind == "window":
            return idx_ref[pl.ds(jnp.clip(j, 0, n_win_blocks - 1) * BN, BN)]
        return top_ref[pl.ds(jnp.clip(j - n_win_blocks, 0, n_blocks - n_win_blocks - 1) * BN,
                             BN)]

    def run(ref, row, start, n):
        return ref[b, row, start + jnp.arange(n, dtype=I32)[None, :]]

    # -- loads of one block: per chunk, the words and the scale of each word ------------------
    def load_window(idx):   # 4 e4m3 codes per word, one E8M0 scale per 32 channels (8 words)
        row = jnp.clip(idx, 0, max(n_rows_win - 1, 0))[:, None]   # as XLA's gather; -1 -> 0
        W, G = KC // 4, KC // 32
        return tuple((run(wkv_ref, row, c * W, W),
                      repeat_columns(run(wsc_ref, row, c * G, G).astype(I32), 8))
                     for c in range(n_chunks))

    def load_main(idx):     # 8 e2m1 codes per word, one E4M3 scale per 16 channels (2 words)
        row = jnp.clip(idx, 0, max(n_rows_main - 1, 0))[:, None]
        W, G = KC // 8, KC // 16
        return tuple((run(mkv_ref, row, c * W, W),
                      repeat_columns(run(msc_ref, row, c * G, G).astype(I32), 2))
                     for c in range(n_chunks))

    # -- dequantisation of one chunk -> bf16 [BN, KC] in channel order ------------------------
    def window_chunk(words, sc):
        if use_asm:
            sc = sc << 7                                           # 2**(u-127) as bf16 bits
            return interleave_tiles([_field_asm("e4m3", k, 0, words, sc) for k in range(4)])
        sc = jax.lax.bitcast_convert_type(sc << 23, F32)           # E8M0 -> 2**(u-127)
        return interleave_tiles([((_e4m3_field(words, k) * 256.0) * sc).astype(BF16)
                                 for k in range(4)])

    def main_chunk(words, sc):
        if use_asm:
            sc = _bf16_bits((e4m3_over_256(sc) * 256.0).astype(BF16))
            return interleave_tiles([_field_asm("e2m1", n // 2, 4 * (n % 2), words, sc)
                                     for n in range(8)])
        sc = e4m3_over_256(sc) * (2.0 ** 22)                       # scale * 2**14
        return interleave_tiles([(_e2m1_field(words, n) * sc).astype(BF16) for n in range(8)])

    def chunks(kind, j, loaded):
        """fn(c) -> the bf16 [BN, KC] tile of chunk c of block j."""
        if kind == "window":
            return lambda c: window_chunk(*loaded[0][c])
        if kind == "main":
            return lambda c: main_chunk(*loaded[0][c])
        is_win = (j * BN + jnp.arange(BN, dtype=I32) < n_win)[:, None]   # the mixed block
        return lambda c: jnp.where(is_win, window_chunk(*loaded[0][c]),
                                   main_chunk(*loaded[1][c]))

    def step(kind, j, idx, loaded, m, l, accs, after_scores=None):
        """Online-softmax update with block j; ``after_scores()`` (if given) runs once the
        score block is computed (loads issued there overlap the softmax and PV product)."""
        kv = chunks(kind, j, loaded)
        s = None
        for c in range(n_chunks):
            part = dot(qs[c], kv(c), nt)
            s = part if s is None else s + part
        return softmax_update(s, idx >= 0, m, l, accs, lambda p, c: dot(p, kv(c), nn), scale,
                              exp, after_scores)

    def phase(kind, lo, hi, carry):
        """Blocks [lo, hi) of one kind (``prefetch``: when the rows of block j+1 are loaded)."""
        load = load_window if kind == "window" else load_main
        blk = functools.partial(list_block, kind=kind)
        if kind == "mixed" or prefetch == "none":
            def body(j, carry):
                idx = blk(j)
                rows = (load_window(idx), load_main(idx)) if kind == "mixed" else (load(idx),)
                return step(kind, j, idx, rows, *carry)[:3]
            return jax.lax.fori_loop(lo, hi, body, carry)
        if prefetch == "index":   # only the list entries of block j+1 are loaded ahead
            def body(j, c):
                m, l, accs, idx = c
                nxt_idx = blk(jnp.minimum(j + 1, hi - 1))
                m, l, accs, _ = step(kind, j, idx, (load(idx),), m, l, accs)
                return m, l, accs, nxt_idx
            return jax.lax.fori_loop(lo, hi, body, (*carry, blk(lo)))[:3]

        def body(j, c):   # "late": block j+1's rows are loaded once block j's scores are
            m, l, accs, idx, nxt_idx, loaded = c
            nxt2_idx = blk(jnp.minimum(j + 2, hi - 1))
            m, l, accs, nxt = step(kind, j, idx, (loaded,), m, l, accs,
                                   after_scores=lambda: load(nxt_idx))  # (or block j again)
            return m, l, accs, nxt_idx, nxt2_idx, nxt

        idx0 = blk(lo)
        idx1 = blk(jnp.minimum(lo + 1, hi - 1))
        return jax.lax.fori_loop(lo, hi, body, (*carry, idx0, idx1, load(idx0)))[:3]

    carry = initial_carry(block_h, KC, n_chunks)
    full_win = n_win // BN                       # blocks of window rows only
    first_main = -(-n_win // BN)                 # first block of main-KV rows only
    lo, hi = split_range(sp, n_blocks, n_splits)
    if n_splits == 1:
        rng = lambda a, c: (max(a, lo), min(c, hi))  # noqa: E731
    else:
        rng = lambda a, c: (jnp.maximum(a, lo), jnp.minimum(c, hi))  # noqa: E731
    for kind, (a, c) in (("window", (0, full_win)), ("mixed", (full_win, first_main)),
                         ("main", (first_main, n_blocks))):
        if c > a:
            carry = phase(kind, *rng(a, c), carry)
    write_outputs(out_refs, sink_ref, hb, *carry, n_splits=n_splits, exp=exp)


def softmax_update(s, valid, m, l, accs, pv, scale: float, exp, after_scores=None):
    """One 64-entry block of the reference's online sink softmax (spec 3.8), in a kernel.

    ``s`` fp32 [BH, BN] unscaled scores, ``valid`` bool [BN] (an unlisted entry reads a
    finite row and gets P = 0, so it adds exactly nothing), running max ``m`` / denominator
    ``l`` fp32 [BH], accumulator chunks ``accs``; ``pv(p, c)`` is chunk c's product of the bf16
    probabilities with the block's rows; ``after_scores()`` (if given) runs once the scores are
    masked (loads issued there overlap the softmax and the PV product). Returns ``(m, l, accs,
    after_scores() or None)``."""
    s = jnp.where(valid[None, :], s * scale, -jnp.inf)                   # [BH, BN]
    extra = after_scores() if after_scores is not None else None
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = exp(m - m_new)
    p = exp(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    p = p.astype(BF16)
    accs = tuple(acc * alpha[:, None] + pv(p, c) for c, acc in enumerate(accs))
    return m_new, l, accs, extra


def split_range(sp, n_blocks: int, n_splits: int):
    """Blocks ``[lo, hi)`` of list split ``sp`` (traced): ``ceil(n_blocks / n_splits)`` each,
    the last split shorter; with one split the static ``(0, n_blocks)``."""
    if n_splits == 1:
        return 0, n_blocks
    per = -(-n_blocks // n_splits)
    lo = sp * per
    return lo, jnp.minimum(lo + per, n_blocks)


def initial_carry(block_h: int, chunk: int, n_chunks: int):
    """``(m, l, accs)`` before the first block: the reference's -1e30 running max, zeros."""
    return (jnp.full((block_h,), NEG_START, F32), jnp.zeros((block_h,), F32),
            tuple(jnp.zeros((block_h, chunk), F32) for _ in range(n_chunks)))


def write_outputs(out_refs, sink_ref, hb, m, l, accs, *, n_splits: int, exp) -> None:
    """A program's results: with one split ``o = bf16(acc / (l + e^(sink - m)))`` and the lse
    (refs o [BH, K], lse [BH]); with several the split's ``(acc, m, l)`` for the merge."""
    block_h, chunk = accs[0].shape
    cols = [pl.ds(c * chunk, chunk) for c in range(len(accs))]
    if n_splits == 1:
        o_ref, lse_ref = out_refs
        sink = sink_ref[pl.ds(hb * block_h, block_h)]
        den = (l + exp(sink - m))[:, None]
        for col, acc in zip(cols, accs):
            o_ref[:, col] = (acc / den).astype(BF16)
        lse_ref[...] = lse_with_sink(m, l, sink)
    else:
        acc_ref, m_ref, l_ref = out_refs
        for col, acc in zip(cols, accs):
            acc_ref[:, col] = acc
        m_ref[...] = m
        l_ref[...] = l


def outputs(R: int, H: int, K: int, block_h: int, n_splits: int):
    """``(out_shape, out_specs)`` of a grid (rows, head blocks, splits): o bf16 [R, H, K] and
    lse fp32 [R, H], or with several splits each split's acc fp32 [R, P, H, K], m and l."""
    if n_splits == 1:
        return ((jax.ShapeDtypeStruct((R, H, K), BF16), jax.ShapeDtypeStruct((R, H), F32)),
                (pl.BlockSpec((None, block_h, K), lambda r, h, s: (r, h, 0)),
                 pl.BlockSpec((None, block_h), lambda r, h, s: (r, h))))
    return ((jax.ShapeDtypeStruct((R, n_splits, H, K), F32),
             jax.ShapeDtypeStruct((R, n_splits, H), F32),
             jax.ShapeDtypeStruct((R, n_splits, H), F32)),
            (pl.BlockSpec((None, None, block_h, K), lambda r, h, s: (r, s, h, 0)),
             pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h)),
             pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h))))


def finish(outs, sink, *, n_splits: int, merge: str, softmax: str, block_h: int,
           interpret: bool, shape: tuple[int, int, int, int]):
    """The kernel's outputs -> ``(o bf16 [B, S, H, K], lse fp32 [B, S, H])``: with several
    splits merged by :func:`merge_splits` (``merge="triton"``) or :func:`merge_splits_xla`."""
    if n_splits == 1:
        o, lse = outs
    else:
        mrg = merge_splits_xla if merge == "xla" else functools.partial(
            merge_splits, block_h=min(8, block_h), interpret=interpret)
        o, lse = mrg(*outs, sink.astype(F32), softmax=softmax)
    B, S, H, K = shape
    return o.reshape(B, S, H, K), lse.reshape(B, S, H)


def empty_result(q, sink):
    """The op's result when nothing is listed: ``o = 0`` bf16 like ``q`` [B, S, H, K],
    ``lse = sink`` fp32 [B, S, H]."""
    B, S, H, _ = q.shape
    return jnp.zeros(q.shape, BF16), jnp.broadcast_to(sink.astype(F32), (B, S, H))


def pad_heads(q, sink, fn):
    """``fn(q, sink)`` with fewer than 16 heads padded by zero queries (and sinks) to the
    16-row tensor-core tile, the padding heads cut from its ``(o, lse)``."""
    H = q.shape[2]
    o, lse = fn(jnp.pad(q, ((0, 0), (0, 0), (0, 16 - H), (0, 0))), jnp.pad(sink, (0, 16 - H)))
    return o[:, :, :H], lse[:, :, :H]


def nonempty_rows(win_kv, win_scale, main, main_scale):
    """The row arrays with one zero row in place of an empty one (``main`` may be None), so
    that every read stays in bounds: a listed entry of an empty part reads zeros, as XLA's
    gather from an empty array does."""
    B, _, K = win_kv.shape
    if win_kv.shape[1] == 0:
        win_kv = jnp.zeros((B, 1, K), win_kv.dtype)
        win_scale = jnp.zeros((B, 1, K // 32), win_scale.dtype)
    if main is not None and main.shape[1] == 0:
        main = jnp.zeros((B, 1, K // 2), main.dtype)
        main_scale = jnp.zeros((B, 1, K // 16), main_scale.dtype)
    return win_kv, win_scale, main, main_scale


def list_splits(programs: int, n_blocks: int) -> int:
    """List splits (flash-decoding) for ``programs`` (query row, head block) programs over
    ``n_blocks`` list blocks: none from 128 programs (about one per SM) on; otherwise up to one
    block per split until 128, balanced (the fewest splits with the same blocks per split)."""
    if programs >= 128 or n_blocks < 1:
        return 1
    n_splits = min(n_blocks, -(-128 // programs))
    return -(-n_blocks // -(-n_blocks // n_splits))


def _words(a):
    """[B, N, F] 1-byte array -> int32 words [B, N, F/4] (a free bitcast, little-endian)."""
    u8 = jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a
    return jax.lax.bitcast_convert_type(u8.reshape(*a.shape[:-1], -1, 4), I32)


def merge_splits_xla(acc: Float[Array, "R P H K"], m: Float[Array, "R P H"],
                     l: Float[Array, "R P H"], sink: Float[Array, "H"], softmax: str = "exp"
                     ) -> tuple[Float[Array, "R H K"], Float[Array, "R H"]]:
    """The list splits' partial softmax states -> ``(o bf16 [R, H, K], lse fp32 [R, H])``.

    ``acc`` fp32 [R, P, H, K] (unnormalised ``sum P V`` of each of the P splits), ``m`` the
    splits' running maxima, ``l`` their denominators (without the sink); ``sink`` fp32 [H]
    logits; ``softmax`` the exponential (:func:`exp_of`). The reference of
    :func:`merge_splits`.
    """
    exp = exp_of(softmax)
    top = jnp.max(m, axis=1, keepdims=True)
    w = exp(m - top)
    l_tot = jnp.sum(l * w, axis=1)
    acc = jnp.sum(acc * w[..., None], axis=1)
    top = top[:, 0]
    sink = sink[None, :]
    o = (acc / (l_tot + exp(sink - top))[..., None])
    return o.astype(BF16), lse_with_sink(top, l_tot, sink)


def _merge_kernel(acc_ref, m_ref, l_ref, sink_ref, o_ref, lse_ref, *, n_splits, softmax):
    """Program (row, head block, channel block): the splits' maxima, then one pass over their
    accumulators (fp32 sums in split order)."""
    exp = exp_of(softmax)
    ms = [m_ref[p, :] for p in range(n_splits)]
    top = functools.reduce(jnp.maximum, ms)
    ws = [exp(mp - top) for mp in ms]
    l_tot = functools.reduce(operator.add, [l_ref[p, :] * w for p, w in enumerate(ws)])
    acc = functools.reduce(operator.add, [acc_ref[p] * w[:, None] for p, w in enumerate(ws)])
    sink = sink_ref[...]
    den = l_tot + exp(sink - top)
    o_ref[...] = (acc / den[:, None]).astype(BF16)
    lse_ref[...] = lse_with_sink(top, l_tot, sink)


def merge_splits(acc: Float[Array, "R P H K"], m: Float[Array, "R P H"], l: Float[Array, "R P H"],
                 sink: Float[Array, "H"], softmax: str = "exp", *, block_h: int = 8,
                 block_k: int = 128, interpret: bool = False
                 ) -> tuple[Float[Array, "R H K"], Float[Array, "R H"]]:
    """:func:`merge_splits_xla` in one Pallas Triton kernel (XLA runs it as two fusions): one
    program per (row, ``block_h`` heads, ``block_k`` channels); small blocks, so that at decode
    B=8 the 8 rows x 64 heads x 512 channels make 256 programs. Blocks larger than the heads /
    channels are cut to them.

    Raises ``ValueError`` if ``m``, ``l`` or ``sink`` do not match ``acc``'s [R, P, H] / [H],
    or ``block_h`` / ``block_k`` is not a power of two dividing the heads / channels.
    """
    R, P, H, K = acc.shape
    for name, x, shape in (("m", m, (R, P, H)), ("l", l, (R, P, H)), ("sink", sink, (H,))):
        if x.shape != shape:
            raise ValueError(f"{name}: expected shape {shape} (acc is {acc.shape}), got {x.shape}")
    block_h, block_k = min(block_h, H), min(block_k, K)
    for name, b, n in (("block_h", block_h, H), ("block_k", block_k, K)):
        if b < 1 or n % b or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two dividing {n}")
    kernel = functools.partial(_merge_kernel, n_splits=P, softmax=softmax)
    return pl.pallas_call(
        kernel, grid=(R, H // block_h, K // block_k),
        in_specs=[pl.BlockSpec((None, P, block_h, block_k), lambda r, h, c: (r, 0, h, c)),
                  pl.BlockSpec((None, P, block_h), lambda r, h, c: (r, 0, h)),
                  pl.BlockSpec((None, P, block_h), lambda r, h, c: (r, 0, h)),
                  pl.BlockSpec((block_h,), lambda r, h, c: (h,))],
        out_specs=(pl.BlockSpec((None, block_h, block_k), lambda r, h, c: (r, h, c)),
                   pl.BlockSpec((None, block_h), lambda r, h, c: (r, h))),
        out_shape=(jax.ShapeDtypeStruct((R, H, K), BF16), jax.ShapeDtypeStruct((R, H), F32)),
        interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="csa2_merge_splits",
    )(acc, m, l, sink)


# query rows from which the packed rows go to the Mosaic GPU kernel by default (measured from
# B=8 on; B=1 keeps Triton's 32-head programs)
MGPU_MIN_ROWS = 8


def default_tuning(rows: int, heads: int, n_blocks: int, head_dim: int = 512) -> dict:
    """Block sizes for a call with ``rows = B*S`` query rows (measured on the H200, device
    times, docs/benchmarks.md): all heads of a query in one program (the block is
    dequantised once); when that gives fewer than 128 programs (one per SM), split the list
    (flash-decoding) into up to one block per split, balanced (the fewest splits with the same
    blocks per split), then halve the head block (down to 32) while the programs still fit
    in one wave of 132 SMs. Decode B=1: 32 heads x 10 splits (9.9 us of kernel, 16.3 with
    the old 32 x 8); B=8: 64 heads x 10 splits (16.1 us, 18.9); B=64: 64 heads x 2 splits;
    B>=128 and prefill: one program per query. The PTX decode everywhere (session 8: with the
    split rows too, 2.6-5.6% faster at B=1-64 than the jnp decode). 8 channel chunks (64
    channels each at the release's K = 512; chunks of 64 for smaller K: 1, 2 and 4 chunks
    measured 15-75% slower in session 8), no row prefetch, 8 warps, no software pipelining;
    the softmax's exponentials as ``exp2(x log2 e)`` and the splits merged by
    :func:`merge_splits` (session 7, together: 6% faster at B=256 and prefill, 0.5-4 us
    faster at B=1-64). ``kernel``: ``"mosaic_gpu"`` (the warp-specialised kernel with the
    decoding producer, :func:`.mosaic_gpu_rows.sparse_attention_packed`, with the same list
    splits below 128 query rows: session 13, H200, B=8 14.3 against 17.3 us, B=64 33.6
    against 51.9, B=256 84.3 against 157.6) for 64 heads x 512 and at least
    :data:`MGPU_MIN_ROWS` query rows, lists of at most ``MAX_LIST`` entries, on Hopper (or
    without a GPU); ``"triton"`` otherwise."""
    from pallas_kernels.sparse_attention import mosaic_gpu_rows as mr
    block_h = min(heads, 64)
    programs = rows * (heads // block_h)
    n_splits = list_splits(programs, n_blocks)
    mgpu = ((heads, head_dim) == (mr.H_SUPPORTED, mr.K_SUPPORTED)
            and programs >= MGPU_MIN_ROWS and n_blocks * SOFTMAX_BLOCK <= mr.MAX_LIST
            and mr.on_hopper_or_unknown())
    if programs < 128:   # (Triton's head blocks; the Mosaic GPU kernel takes all 64 heads)
        while (block_h > 32 and heads % (block_h // 2) == 0
               and 2 * programs * n_splits <= 132):
            block_h //= 2
            programs *= 2
    return {"block_h": block_h, "n_splits": n_splits, "num_warps": 8, "num_stages": 1,
            "n_chunks": max(1, min(8, head_dim // 64)), "dequant": "asm", "prefetch": "none",
            "softmax": "exp2", "merge": "triton", "kernel": "mosaic_gpu" if mgpu else "triton"}


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "n_splits",
                                             "num_warps", "num_stages", "n_chunks", "dequant",
                                             "prefetch", "softmax", "merge", "kv", "kernel"))
def sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
                     interpret: bool = False, block_h: int | None = None,
                     n_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, n_chunks: int | None = None,
                     dequant: str | None = None, prefetch: str | None = None,
                     softmax: str | None = None, merge: str | None = None,
                     kv: str | None = None, kernel: str | None = None):
    """Triton implementation of :func:`pallas_kernels.sparse_attention.sparse_attention`.

    Same arguments and results (o bf16 [B,S,H,K], lse fp32 [B,S,H]). Tuning (unset values
    come from :func:`default_tuning`): ``block_h`` heads per program (a power of two dividing
    H, >= 16 on a GPU), ``n_splits`` list splits (1 = the reference block order), Triton
    ``num_warps`` / ``num_stages``, ``n_chunks`` contiguous channel chunks (a power of two with
    K / n_chunks >= 32, one FP8 scale block; >= 16 with ``kv="dense"``), ``dequant``
    (``"jnp"``, or the PTX decode ``"asm"``: GPU only; interpret mode always decodes with jnp,
    since PTX cannot run on CPU), ``prefetch`` (one of :data:`PREFETCH`, see the module
    docstring), ``softmax`` (one of :data:`SOFTMAX`: the exponential, :func:`exp_of`),
    ``merge`` (one of :data:`MERGE`: the splits' merge in XLA or in :func:`merge_splits`),
    ``kv`` (one of :data:`KV`): ``"packed"``,
    this kernel, which decodes every listed row in registers, or ``"dense"``, every window
    row and main-KV entry decoded once to bf16 and the listed rows gathered by
    :func:`.triton_dense.sparse_attention_rows` (its own defaults,
    :func:`.triton_dense.default_tuning`; ``dequant`` / ``prefetch`` do not apply). Unset,
    ``"dense"`` where the rows are listed at least :data:`.triton_dense.MIN_REUSE` times on
    average (:func:`.triton_dense.worth_it`: prefill chunks; on the H200 the prefill row of
    4096 queries takes 1.43 instead of 2.23 ms), ``"packed"`` otherwise (decode). ``kernel``
    (``kv="dense"`` only): the rows' kernel, ``"triton"`` or ``"mosaic_gpu"`` (the
    warp-specialised :mod:`.mosaic_gpu_rows`; its own rule in
    :func:`.triton_dense.default_tuning`: prefill at the release's 64 heads x 512); with
    ``kv="packed"``, ``kernel="mosaic_gpu"`` runs that kernel with a producer that decodes the
    packed rows (:func:`.mosaic_gpu_rows.sparse_attention_packed`; GPU only, ``softmax`` and
    ``n_splits`` its only tunings; unset, the default for 64 heads x 512 from
    :data:`MGPU_MIN_ROWS` query rows on, with :func:`default_tuning`'s list splits).

    Raises ``ValueError`` for a tuning outside those limits (``dequant`` / ``prefetch`` with
    ``kv="dense"``, and Triton tunings other than ``n_splits``, ``n_splits < 1`` or interpret
    mode with ``kv="packed", kernel="mosaic_gpu"`` included) or, for the packed kernel, a head
    dim that is not a power of two >= 64.
    """
    B, S, H, K = q.shape
    tuning = dict(num_warps=num_warps, num_stages=num_stages, n_chunks=n_chunks,
                  dequant=dequant, prefetch=prefetch, softmax=softmax, merge=merge)
    for key, allowed, value in (("dequant", DEQUANT, dequant), ("prefetch", PREFETCH, prefetch),
                                ("softmax", SOFTMAX, softmax), ("merge", MERGE, merge),
                                ("kv", KV, kv)):   # checked first: also when nothing is listed
        if value is not None and value not in allowed:
            raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    from pallas_kernels.sparse_attention import triton_dense   # it imports this module

    n_list = win_idx.shape[-1] + (0 if topk is None else topk.shape[-1])
    n_kv_rows = win_kv.shape[1] + (0 if topk is None else main.shape[1])
    if kv is None:
        kv = "dense" if triton_dense.worth_it(B * S, n_list, B * n_kv_rows) else "packed"
    defaults = default_tuning(B * S, H, max(1, -(-n_list // SOFTMAX_BLOCK)), K)
    if kv == "packed" and kernel not in (None, "triton"):
        if kernel != "mosaic_gpu":
            raise ValueError(f"kernel must be 'triton' or 'mosaic_gpu', got {kernel!r}")
        given = [k for k, v in dict(tuning, block_h=block_h).items()
                 if v is not None and k != "softmax"]
        if interpret:
            raise ValueError("kv='packed', kernel='mosaic_gpu' (the warp-specialised kernel "
                             "decoding in its producer: PTX) runs on the GPU only, not in "
                             "interpret mode")
        if given:
            raise ValueError(f"kv='packed', kernel='mosaic_gpu' takes softmax and n_splits "
                             f"only, got {sorted(given)}")
        from pallas_kernels.sparse_attention import mosaic_gpu_rows
        return mosaic_gpu_rows.sparse_attention_packed(
            q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale,
            softmax=softmax or "exp2",
            n_splits=defaults["n_splits"] if n_splits is None else n_splits)
    triton_tuned = any(v is not None for v in (block_h, n_splits, num_warps, num_stages,
                                               n_chunks, dequant, prefetch, merge))
    if kv == "packed" and kernel is None and not interpret and not triton_tuned and (
            defaults["kernel"] == "mosaic_gpu"):
        from pallas_kernels.sparse_attention import mosaic_gpu_rows
        return mosaic_gpu_rows.sparse_attention_packed(
            q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale,
            softmax=softmax or "exp2", n_splits=defaults["n_splits"])
    if kv == "dense":
        if dequant is not None or prefetch is not None:
            raise ValueError("dequant / prefetch tune the packed rows' decode: not with "
                             "kv='dense'")
        given = dict(tuning, block_h=block_h, n_splits=n_splits, kernel=kernel)
        return triton_dense.sparse_attention(
            q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale,
            interpret=interpret, **{k: v for k, v in given.items() if v is not None})
    if H < 16 and not interpret and block_h is None:
        # fewer heads than the tensor-core tile (the test configs): zero heads pad the tile
        return pad_heads(q, sink, lambda q16, sink16: sparse_attention(
            q16, win_kv, win_scale, win_idx, main, main_scale, topk, sink16, scale,
            block_h=16, n_splits=n_splits, kv="packed", **tuning))
    n_win = win_idx.shape[-1]
    if topk is None:  # SWA-only layer: a dummy main KV that the kernel never reads
        main = jnp.zeros((B, 1, K // 2), jnp.uint8)
        main_scale = jnp.zeros((B, 1, K // 16), jnp.float8_e4m3fn)
    n_top = 0 if topk is None else topk.shape[-1]
    # both lists whole blocks (decode and prefill at the release sizes: 128 + 512): the
    # kernel reads them in place; otherwise one concatenated list, padded to whole blocks
    split_lists = n_win > 0 and n_win % SOFTMAX_BLOCK == 0 and n_top % SOFTMAX_BLOCK == 0
    if split_lists:
        lst = win_idx
        top = win_idx if topk is None else topk
        n_blocks = (n_win + n_top) // SOFTMAX_BLOCK
    else:
        lst = pad_list(win_idx if topk is None else jnp.concatenate([win_idx, topk], axis=-1))
        top = lst
        n_blocks = lst.shape[-1] // SOFTMAX_BLOCK
    win_kv, win_scale, main, main_scale = nonempty_rows(win_kv, win_scale, main, main_scale)
    if n_blocks == 0:   # nothing listed at all
        return empty_result(q, sink)
    if K % 64 or K & (K - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head dim >= 64, got {K}")
    tune = default_tuning(B * S, H, n_blocks, K)
    tune.update({k: v for k, v in tuning.items() if v is not None})
    block_h = block_h or tune["block_h"]
    n_splits = min(n_splits or tune["n_splits"], n_blocks)
    if H % block_h or block_h & (block_h - 1) or (block_h < 16 and not interpret):
        raise ValueError(f"block_h={block_h} must be a power of two dividing the {H} heads "
                         f"(and >= 16 on a GPU: the tensor-core tile)")
    n_chunks = tune["n_chunks"]
    if n_chunks < 1 or n_chunks & (n_chunks - 1) or K // n_chunks < 32:
        raise ValueError(f"n_chunks={n_chunks} must be a power of two with K/n_chunks >= 32 "
                         f"(K={K})")
    R = B * S
    u8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    args = (q.reshape(R, H, K), lst.reshape(R, -1), top.reshape(R, -1), _words(win_kv),
            win_scale, _words(main), u8(main_scale), sink.astype(F32))
    in_specs = [
        pl.BlockSpec((None, block_h, K), lambda r, h, s: (r, h, 0)),
        pl.BlockSpec((None, lst.shape[-1]), lambda r, h, s: (r, 0)),
        pl.BlockSpec((None, top.shape[-1]), lambda r, h, s: (r, 0)),
        *[pl.BlockSpec() for _ in args[3:7]],     # whole arrays: rows are gathered in-kernel
        pl.BlockSpec((H,), lambda r, h, s: (0,)),
    ]
    out_shape, out_specs = outputs(R, H, K, block_h, n_splits)
    kernel = functools.partial(_kernel, S=S, K=K, n_chunks=n_chunks, block_h=block_h,
                               n_win=n_win, n_blocks=n_blocks, n_splits=n_splits, scale=scale,
                               interpret=interpret, dequant=tune["dequant"],
                               prefetch=tune["prefetch"], split_lists=split_lists,
                               softmax=tune["softmax"])
    outs = pl.pallas_call(
        kernel, grid=(R, H // block_h, n_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tune["num_warps"],
                                             num_stages=tune["num_stages"]),
        name="csa2_sparse_attention",
    )(*args)
    return finish(outs, sink, n_splits=n_splits, merge=tune["merge"], softmax=tune["softmax"],
                  block_h=block_h, interpret=interpret, shape=(B, S, H, K))
