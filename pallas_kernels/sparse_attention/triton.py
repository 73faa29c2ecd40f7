"""Pallas Triton kernel of the CSA2 sparse attention (NVIDIA GPUs; docs/architecture.md,
"Joint sink softmax").

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
  make the compiler spill.
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
  against the XLA path on a GPU (the kernel benchmark's ``--check``).
* ``dequant``: ``"jnp"``, or ``"asm"`` (a PTX decode without per-element conversion
  instructions, bitwise equal to the jnp decode). :func:`default_tuning` holds the defaults.
* ``kv="dense"`` hands the call to :mod:`.triton_dense` (rows decoded once, then gathered as
  bf16), the default where each row is listed many times (prefill chunks).

The jnp decodes are integer bit manipulation (fp16 bit placement), so the kernel needs no fp8
instructions and runs unchanged in Pallas interpret mode on CPU. The state never holds the
fp8 NaN codes (the quantisers clip); the kernel would decode them as +-480, where the XLA path
gives NaN. Listed indices are clamped to the array like the XLA path's gather.

Resource use of the GPU build can be read on a CPU machine: ``tools/triton_report.py``
lowers the kernel for an H200 and, with the standalone ``triton`` package installed, compiles
it for sm_90a and prints registers, spills and the instruction mix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention.common import (BF16, F32, I32, MERGE, NEG_START, SOFTMAX,
                                                    SOFTMAX_BLOCK, decode_ptx, e4m3_over_256,
                                                    empty_result, exp_of, list_splits,
                                                    lse_with_sink, merge_splits,
                                                    merge_splits_xla, nonempty_rows, pad_heads,
                                                    pad_list)
from pallas_kernels.sparse_attention.common import _f16_to_f32

PREFETCH = ("none", "index", "late")
DEQUANT = ("jnp", "asm")


def _shl(x, n: int):
    """``x << n`` for n >= 0, ``x >> -n`` otherwise (the bits kept are masked by the caller)."""
    return x << n if n >= 0 else x >> -n


def _e4m3_field(words, k: int):
    """Byte ``k`` of each int32 word, an e4m3 code -> value * 2**-8 (fp32; as e4m3_over_256)."""
    return _f16_to_f32((_shl(words, 8 - 8 * k) & 0x8000) | (_shl(words, 7 - 8 * k) & 0x3F80))


def _e2m1_field(words, n: int):
    """Nibble ``n`` of each int32 word, an e2m1 code -> value * 2**-14 (fp32; as
    e2m1_over_16384)."""
    return _f16_to_f32((_shl(words, 12 - 4 * n) & 0x8000) | (_shl(words, 9 - 4 * n) & 0x0E00))


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

    def scale_bytes(ref, row, start, n):
        """int32 [BN, n]: scale bytes start .. start + n - 1 of each listed row, from the
        rows' scale bytes held as int32 words (``n`` a power of two; below 4 the bytes lie
        in one word)."""
        words = run(ref, row, start // 4, max(1, n // 4))
        return interleave_tiles([(words >> (8 * (start % 4 + k))) & 0xFF
                                 for k in range(min(4, n))])

    # -- loads of one block: per chunk, the words and the scale of each word ------------------
    def load_window(idx):   # 4 e4m3 codes per word, one E8M0 scale per 32 channels (8 words)
        row = jnp.clip(idx, 0, max(n_rows_win - 1, 0))[:, None]   # as XLA's gather; -1 -> 0
        W, G = KC // 4, KC // 32
        return tuple((run(wkv_ref, row, c * W, W),
                      repeat_columns(scale_bytes(wsc_ref, row, c * G, G), 8))
                     for c in range(n_chunks))

    def load_main(idx):     # 8 e2m1 codes per word, one E4M3 scale per 16 channels (2 words)
        row = jnp.clip(idx, 0, max(n_rows_main - 1, 0))[:, None]
        W, G = KC // 8, KC // 16
        return tuple((run(mkv_ref, row, c * W, W),
                      repeat_columns(scale_bytes(msc_ref, row, c * G, G), 2))
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
    """One 64-entry block of the reference's online sink softmax (docs/architecture.md,
    "Joint sink softmax"), in a kernel.

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


def _words(a):
    """[B, N, F] 1-byte array -> int32 words [B, N, ceil(F/4)] (little-endian; a free bitcast
    when F is a multiple of 4, else each row is padded with zero bytes first)."""
    u8 = jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a
    pad = -u8.shape[-1] % 4
    if pad:
        u8 = jnp.pad(u8, ((0, 0),) * (u8.ndim - 1) + ((0, pad),))
    return jax.lax.bitcast_convert_type(u8.reshape(*u8.shape[:-1], -1, 4), I32)


def default_tuning(rows: int, heads: int, n_blocks: int, head_dim: int = 512) -> dict:
    """Tuning of the packed Triton kernel for a call with ``rows = B*S`` query rows, ``heads``
    heads, ``n_blocks`` 64-entry list blocks and ``head_dim``: all heads of a query in one
    program (the block is dequantised once); when that gives fewer than 128 programs (one per
    SM), the list split (flash-decoding, :func:`.common.list_splits`), then the head block
    halved (down to 32) while the programs still fit in one wave of 132 SMs. The PTX decode,
    8 channel chunks (64 channels each at K = 512, fewer for smaller K), no row prefetch,
    8 warps, one pipeline stage, the ``exp2`` softmax and the Triton merge of the splits."""
    block_h = min(heads, 64)
    programs = rows * (heads // block_h)
    n_splits = list_splits(programs, n_blocks)
    if programs < 128:
        while (block_h > 32 and heads % (block_h // 2) == 0
               and 2 * programs * n_splits <= 132):
            block_h //= 2
            programs *= 2
    return {"block_h": block_h, "n_splits": n_splits, "num_warps": 8, "num_stages": 1,
            "n_chunks": max(1, min(8, head_dim // 64)), "dequant": "asm", "prefetch": "none",
            "softmax": "exp2", "merge": "triton"}


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "n_splits",
                                             "num_warps", "num_stages", "n_chunks", "dequant",
                                             "prefetch", "softmax", "merge"))
def sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
                     interpret: bool = False, block_h: int | None = None,
                     n_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, n_chunks: int | None = None,
                     dequant: str | None = None, prefetch: str | None = None,
                     softmax: str | None = None, merge: str | None = None):
    """The packed Triton kernel: :func:`pallas_kernels.sparse_attention.sparse_attention`'s
    arguments and results (o bf16 [B,S,H,K], lse fp32 [B,S,H]), every listed row decoded in
    registers.

    Tuning (unset values come from :func:`default_tuning`): ``block_h`` heads per program (a
    power of two dividing H, >= 16 on a GPU; unset with fewer than 16 heads on a GPU, the heads
    are padded to 16), ``n_splits`` list splits (1 = the reference block order), Triton
    ``num_warps`` / ``num_stages``, ``n_chunks`` contiguous channel chunks (a power of two
    with K / n_chunks >= 32, one FP8 scale block), ``dequant`` (``"jnp"``, or the PTX decode
    ``"asm"``: GPU only; interpret mode always decodes with jnp), ``prefetch`` (one of
    :data:`PREFETCH`, see the module docstring), ``softmax`` (one of :data:`.common.SOFTMAX`,
    :func:`.common.exp_of`), ``merge`` (one of :data:`.common.MERGE`: the splits' merge in
    XLA or in :func:`.common.merge_splits`).

    Raises ``ValueError`` for a tuning outside those limits or a head dim that is not a power
    of two >= 64.
    """
    B, S, H, K = q.shape
    tuning = dict(num_warps=num_warps, num_stages=num_stages, n_chunks=n_chunks,
                  dequant=dequant, prefetch=prefetch, softmax=softmax, merge=merge)
    for key, allowed, value in (("dequant", DEQUANT, dequant), ("prefetch", PREFETCH, prefetch),
                                ("softmax", SOFTMAX, softmax), ("merge", MERGE, merge)):
        if value is not None and value not in allowed:   # checked first: also with no list
            raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    if H < 16 and not interpret and block_h is None:
        # fewer heads than the tensor-core tile (the test configs): zero heads pad the tile
        return pad_heads(q, sink, lambda q16, sink16: sparse_attention(
            q16, win_kv, win_scale, win_idx, main, main_scale, topk, sink16, scale,
            block_h=16, n_splits=n_splits, **tuning))
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
    args = (q.reshape(R, H, K), lst.reshape(R, -1), top.reshape(R, -1), *row_operands(
        win_kv, win_scale, main, main_scale), sink.astype(F32))
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


def row_operands(win_kv, win_scale, main, main_scale):
    """The four whole-array operands the kernel gathers rows from, all int32 words (4 bytes
    each, little-endian): window codes [B, Nw, K/4], window E8M0 scales [B, Nw, ceil(K/128)],
    main-KV codes [B, T, K/8], main-KV E4M3 scales [B, T, ceil(K/64)] (rows padded with zero
    bytes to whole words).

    Words, not bytes: Pallas Triton addresses a whole-array operand with 32-bit element
    offsets unless the array is over 2**32 bytes, so a byte array between 2**31 and 2**32
    bytes would wrap (main-KV scales from B x T = 2**26 + 64 entries on); as words every
    operand up to 2**32 bytes has fewer than 2**31 elements."""
    return _words(win_kv), _words(win_scale), _words(main), _words(main_scale)
