"""Pallas Triton kernel of the CSA2 sparse attention (NVIDIA GPUs; spec 3.8).

One program per (query row, head block, list split): the ``block_h`` heads of a query share its
index list (MQA), so every 64-entry block is one ``[block_h, 64]`` score tile on the tensor
cores, and its rows are dequantised once for all those heads.

* Rows are gathered straight from the state's storage: FP8 window rows (e4m3 + E8M0 per 32) and
  packed FP4 main KV (e2m1 pairs + E4M3 per 16), loaded as int32 words and dequantised in
  registers; no bf16 copy of the KV is written to HBM.
* The K channels are handled as ``n_cls`` classes (class c = channels c, c + n_cls, ...): one
  shift-and-mask of the loaded words gives a whole class, so the decode needs no register
  shuffles; ``s = sum_c q_c k_c^T`` and ``o_c = P v_c`` (q read and o written with a stride).
* The rows of block j+1 are loaded while block j computes.
* ``n_splits > 1`` (flash-decoding) splits the list's blocks over programs; the partial
  ``(acc, m, l)`` are merged in XLA. With ``n_splits = 1`` the blocks run in the reference order
  and the kernel finishes the softmax itself (sink, division, bf16 output).
* Tuning knobs beside the block sizes: ``n_dsplit`` (programs sharing a head block, each doing
  the PV product of part of the channels), ``reuse_kv`` (keep the dequantised block for the PV
  product instead of decoding it again), ``dequant`` (``"jnp"``, or ``"asm"``: a PTX decode
  without per-element conversion instructions, equal to the jnp decode on the H200 and the
  default for one program per query of 64 heads, where it measured 8-9% faster).
  :func:`default_tuning` holds the measured choices.

The jnp decodes are integer bit manipulation (fp16 bit placement), so the kernel needs no fp8
instructions and runs unchanged in Pallas interpret mode on CPU. The state never holds the
fp8 NaN codes (the quantisers clip); the kernel would decode them as +-480, where the XLA path
gives NaN. Listed indices are clamped to the array like the XLA path's gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_attention.reference import SOFTMAX_BLOCK, lse_with_sink, pad_list

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32
NEG_START = -1e30  # the reference kernel's initial running max


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


def _e2m1_field(words, n):
    """Nibble ``n`` (an int, or an int32 array of nibble numbers) of each word, an e2m1 code ->
    value * 2**-14 (fp32; as e2m1_over_16384)."""
    if isinstance(n, int):
        return _f16_to_f32((_shl(words, 12 - 4 * n) & 0x8000) | (_shl(words, 9 - 4 * n) & 0x0E00))
    return e2m1_over_16384((words >> (4 * n)) & 15)


# PTX for the GPU build (``dequant="asm"``): one class of two adjacent words -> bf16x2,
# exactly, with no conversion instructions. ``prmt`` brings the byte holding the code of each
# word into the two halves; the code's bits are placed where a bf16's low exponent and high
# mantissa bits are, which reads as the value times 2**-126 (e2m1) or 2**-120 (e4m3),
# subnormals included; two exact bf16x2 multiplies (that power of two, then the scale: the
# products have <= 8 significant bits) give the dequantised pair.
# $0: the bf16 pair; $1, $2: the two int32 words; $3, $4: their scales' bf16 bits.
_DECODE_PTX = """{
.reg .b32 x, a, b, c, s;
prmt.b32 x, $1, $2, SEL;
shr.u32 x, x, SHIFT;
shl.b32 a, x, MAG_SHL;
and.b32 a, a, MAG_MASK;
shl.b32 b, x, SIGN_SHL;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mov.b32 c, POW2;
mul.rn.bf16x2 a, a, c;
prmt.b32 s, $3, $4, 0x5410;
mul.rn.bf16x2 $0, a, s;
}"""
# per format: where the code's magnitude and sign bits go, and the bf16x2 power of two that
# undoes the placement (e2m1 magnitude bits 0-2 -> 6-8, sign 3 -> 15, x 2**126; e4m3 bits
# 0-6 -> 4-10, sign 7 -> 15, x 2**120)
_DECODE_FIELDS = {"e2m1": {"MAG_SHL": "6", "MAG_MASK": "0x01C001C0", "SIGN_SHL": "12",
                           "POW2": "0x7E807E80"},
                  "e4m3": {"MAG_SHL": "4", "MAG_MASK": "0x07F007F0", "SIGN_SHL": "8",
                           "POW2": "0x7B807B80"}}


def decode_ptx(fmt: str, byte: int, shift: int) -> str:
    """The PTX decoding format ``fmt`` ("e2m1" | "e4m3") from byte ``byte`` of each word, that
    byte shifted right by ``shift`` (4: the high nibble)."""
    asm = _DECODE_PTX.replace("SEL", hex(byte | byte << 4 | (4 + byte) << 8 | (4 + byte) << 12))
    for key, val in dict(_DECODE_FIELDS[fmt], SHIFT=str(shift)).items():
        asm = asm.replace(key, val)
    return asm


def _class_asm(fmt: str, byte: int, shift: int, words, scale_bits):
    """bf16 tile of one code per int32 word (byte ``byte``, shifted right by ``shift``) times
    the scales (``scale_bits``: int32 tile of bf16 bits), via :func:`decode_ptx`."""
    [out] = plgpu.elementwise_inline_asm(
        decode_ptx(fmt, byte, shift), args=[words, scale_bits], constraints="=r,r,r,r,r",
        pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, BF16)])
    return out


def _bf16_bits(x_bf16):
    """bf16 tile -> int32 tile of its bits."""
    return jax.lax.bitcast_convert_type(x_bf16, jnp.int16).astype(I32) & 0xFFFF


def _kernel(*refs, n_dsplit, **static):
    """Program (row r = b*S + s, head block, split) over the joint list ``idx_ref``: the first
    ``n_win`` entries are window rows, the rest main-KV entries (-1 = none).

    The K channels are split into ``n_cls`` classes (class c = channels c, c + n_cls, ...): a
    class of a row is exactly what one shift-and-mask of the row's int32 words yields, so the
    FP8/FP4 decode needs no register shuffles, and every product is a sum/concatenation over
    classes: ``s = sum_c q_c k_c^T`` and ``o_c = P v_c`` (q and o are read and written with a
    stride of ``n_cls``). Codes arrive as int32 words (window rows [B, Nw, K/4], 4 e4m3 codes
    per word; main KV [B, T, K/8], 8 e2m1 nibbles per word), the scales as bytes.

    The rows of block j+1 are loaded while block j computes (and the list entries of block j+2),
    so one program per SM still keeps the memory system busy.

    ``n_dsplit`` programs share a (row, head block): each computes the whole score block but
    the PV product of only ``n_cls / n_dsplit`` classes, so its fp32 accumulator is that much
    smaller (measured on the H200: not faster, so off by default).

    Refs, in order: q, the joint list, window words, window scales, main words, main scales,
    sink, then the outputs; ``static``: the keyword arguments of :func:`_program`.
    """
    r, hd, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    for d in range(n_dsplit):   # one static copy of the program per part of the channels
        pl.when(hd % n_dsplit == d)(functools.partial(
            _program, d, r, hd // n_dsplit, sp, *refs, n_dsplit=n_dsplit, **static))


def _program(d, r, hb, sp, q_ref, idx_ref, wkv_ref, wsc_ref, mkv_ref, msc_ref, sink_ref,
             *out_refs, S, K, n_cls, n_dsplit, block_h, n_win, n_blocks, n_splits, scale,
             interpret, reuse_kv, dequant):
    """The body of :func:`_kernel` for channel part ``d`` (classes ``mine``)."""
    use_asm = dequant == "asm" and n_cls == 8 and not interpret
    per = n_cls // n_dsplit
    mine = range(d * per, (d + 1) * per)
    b = r // S
    BN = SOFTMAX_BLOCK
    KC = K // n_cls
    n_rows_win, n_rows_main = wkv_ref.shape[1], mkv_ref.shape[1]
    t = jnp.arange(KC, dtype=I32)[None, :]
    qs = [q_ref[:, pl.ds(c, KC, stride=n_cls)] for c in range(n_cls)]      # [BH, KC] bf16

    def dot(a, b, dims):
        if interpret:  # XLA:CPU has no bf16 x bf16 -> f32 dot thunk; f32 operands are exact
            a, b = a.astype(F32), b.astype(F32)
        return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)

    nt, nn = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))

    def list_block(j):
        return idx_ref[pl.ds(jnp.clip(j, 0, n_blocks - 1) * BN, BN)]

    # -- loads of one block: the raw words and scale bytes of its 64 listed rows ------------
    def load_window(idx):
        row = jnp.clip(idx, 0, max(n_rows_win - 1, 0))[:, None]   # as XLA's gather; -1 -> 0
        cols = [2 * t, 2 * t + 1] if n_cls == 8 else [t]   # class c: word (n_cls t + c) // 4
        words = tuple(wkv_ref[b, row, col] for col in cols)
        return words, wsc_ref[b, row, (n_cls * t) // 32].astype(I32)

    def load_main(idx):
        row = jnp.clip(idx, 0, max(n_rows_main - 1, 0))[:, None]
        col = t if n_cls == 8 else (n_cls * t) // 8      # class c: word (n_cls t + c) // 8
        return (mkv_ref[b, row, col],), msc_ref[b, row, (n_cls * t) // 16].astype(I32)

    # -- dequantisation of one class of a loaded block -> bf16 [BN, KC] -----------------------
    def window_scale(sc):             # E8M0 bytes (1..254) -> 2**(u-127)
        return jax.lax.bitcast_convert_type(sc << 23, F32)

    def main_scale(sc):               # e4m3 bytes -> scale * 2**14
        return e4m3_over_256(sc) * (2.0 ** 22)

    def window_class(raw, sc, c):
        words = raw[c // 4] if n_cls == 8 else raw[0]
        return ((_e4m3_field(words, c % 4) * 256.0) * sc).astype(BF16)

    def main_class(raw, sc, c):
        nib = c if n_cls == 8 else (n_cls * t + c) % 8
        return (_e2m1_field(raw[0], nib) * sc).astype(BF16)

    def class_groups(kind, j, loaded):
        """[(classes, fn)]: fn() gives the bf16 [BN, KC] tiles of those classes."""
        if kind == "window":
            (raw, sc), = loaded
            if use_asm:   # class c: byte c % 4 of the even (c < 4) / odd words
                sc = sc << 7                                       # 2**(u-127) as bf16 bits
                return [((c,), lambda c=c: (_class_asm("e4m3", c % 4, 0, raw[c // 4], sc),))
                        for c in range(n_cls)]
            sc = window_scale(sc)
            kv_of = lambda c: window_class(raw, sc, c)  # noqa: E731
        elif kind == "main":
            (raw, sc), = loaded
            if use_asm:   # class c: nibble c of the words
                sc = _bf16_bits((e4m3_over_256(sc) * 256.0).astype(BF16))
                return [((c,), lambda c=c: (_class_asm("e2m1", c // 2, 4 * (c % 2), raw[0],
                                                       sc),)) for c in range(n_cls)]
            sc = main_scale(sc)
            kv_of = lambda c: main_class(raw, sc, c)  # noqa: E731
        else:  # the block where the window list ends and the global list starts
            (rw, sw), (rm, sm) = loaded
            sw, sm = window_scale(sw), main_scale(sm)
            is_win = (j * BN + jnp.arange(BN, dtype=I32) < n_win)[:, None]
            kv_of = lambda c: jnp.where(is_win, window_class(rw, sw, c),  # noqa: E731
                                        main_class(rm, sm, c))
        return [((c,), lambda c=c: (kv_of(c),)) for c in range(n_cls)]

    def step(kind, j, idx, loaded, m, l, accs):
        """Online-softmax update with block j (its list entries idx, its loaded rows)."""
        groups = class_groups(kind, j, loaded)
        # an unlisted entry reads row 0 (finite: the state only ever holds valid codes)
        # and gets P = 0, so it adds exactly nothing
        kvs = {}
        s = None
        for classes, fn in groups:
            for c, kv in zip(classes, fn()):
                if reuse_kv and c in mine:
                    kvs[c] = kv
                part = dot(qs[c], kv, nt)
                s = part if s is None else s + part
        s = jnp.where((idx >= 0)[None, :], s * scale, -jnp.inf)          # [BH, BN]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        p = p.astype(BF16)
        new = {}
        for classes, fn in groups:
            if not any(c in mine for c in classes):
                continue
            tiles = [kvs[c] for c in classes if c in mine] if reuse_kv else fn()
            for c, kv in zip([c for c in classes if c in mine] if reuse_kv else classes, tiles):
                if c in mine:
                    new[c] = dot(p, kv, nn)
        accs = tuple(acc * alpha[:, None] + new[c] for c, acc in zip(mine, accs))
        return m_new, l, accs

    def phase(kind, lo, hi, carry):
        """Blocks [lo, hi) of one kind, rows of block j+1 prefetched during block j."""
        load = load_window if kind == "window" else load_main
        if kind == "mixed":
            def body(j, carry):
                idx = list_block(j)
                return step(kind, j, idx, (load_window(idx), load_main(idx)), *carry)
            return jax.lax.fori_loop(lo, hi, body, carry)

        def body(j, c):
            m, l, accs, idx, nxt_idx, loaded = c
            nxt2_idx = list_block(jnp.minimum(j + 2, hi - 1))
            nxt = load(nxt_idx)                                # rows of block j+1 (or j again)
            m, l, accs = step(kind, j, idx, (loaded,), m, l, accs)
            return m, l, accs, nxt_idx, nxt2_idx, nxt

        idx0 = list_block(lo)
        idx1 = list_block(jnp.minimum(lo + 1, hi - 1))
        out = jax.lax.fori_loop(lo, hi, body, (*carry, idx0, idx1, load(idx0)))
        return out[:3]

    carry = (jnp.full((block_h,), NEG_START, F32), jnp.zeros((block_h,), F32),
             tuple(jnp.zeros((block_h, KC), F32) for _ in mine))
    full_win = n_win // BN                       # blocks of window rows only
    first_main = -(-n_win // BN)                 # first block of main-KV rows only
    if n_splits == 1:
        lo, hi = 0, n_blocks
        rng = lambda a, c: (max(a, lo), min(c, hi))  # noqa: E731
    else:
        per = -(-n_blocks // n_splits)
        lo = sp * per
        hi = jnp.minimum(lo + per, n_blocks)
        rng = lambda a, c: (jnp.maximum(a, lo), jnp.minimum(c, hi))  # noqa: E731
    for kind, (a, c) in (("window", (0, full_win)), ("mixed", (full_win, first_main)),
                         ("main", (first_main, n_blocks))):
        if c > a:
            carry = phase(kind, *rng(a, c), carry)
    m, l, accs = carry
    cols = [pl.ds(c, KC, stride=n_cls) for c in mine]
    if n_splits == 1:
        o_ref, lse_ref = out_refs
        sink = sink_ref[pl.ds(hb * block_h, block_h)]
        den = (l + jnp.exp(sink - m))[:, None]
        for col, acc in zip(cols, accs):
            o_ref[:, col] = (acc / den).astype(BF16)
        if d == 0:
            lse_ref[...] = lse_with_sink(m, l, sink)
    else:
        acc_ref, m_ref, l_ref = out_refs
        for col, acc in zip(cols, accs):
            acc_ref[:, col] = acc
        if d == 0:
            m_ref[...] = m
            l_ref[...] = l


def _words(a):
    """[B, N, F] 1-byte array -> int32 words [B, N, F/4] (a free bitcast, little-endian)."""
    u8 = jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a
    return jax.lax.bitcast_convert_type(u8.reshape(*a.shape[:-1], -1, 4), I32)


def default_tuning(rows: int, heads: int, n_blocks: int) -> dict:
    """Block sizes for a call with ``rows = B*S`` query rows (measured on the H200, see
    docs/benchmarks.md): all heads of a query in one program (the block is dequantised once);
    when that gives fewer than 128 programs (one per SM), split the list (flash-decoding),
    then halve the head block. Decode B=8: 32 heads x 8 splits; B=64: 2 splits; B>=128 and
    prefill: one program per query, with the PTX decode (``dequant="asm"``)."""
    block_h = min(heads, 64)
    programs = rows * (heads // block_h)
    n_splits = 1
    while programs * n_splits < 128 and n_splits * 2 <= n_blocks:
        n_splits *= 2
    if programs * n_splits < 128 and block_h == 64 and heads % 32 == 0:
        block_h = 32
    # the PTX decode measured 8-9% faster with one program per query of 64 heads (B=256:
    # 395 vs 431-439 us, prefill 4096: 4.60 vs 4.99-5.04 ms) and 4-14% slower with list splits
    dequant = "asm" if n_splits == 1 and block_h == 64 else "jnp"
    return {"block_h": block_h, "n_splits": n_splits, "num_warps": 8, "num_stages": 1,
            "reuse_kv": False, "n_dsplit": 1, "dequant": dequant}


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "n_splits",
                                             "num_warps", "num_stages", "n_cls", "reuse_kv",
                                             "n_dsplit", "dequant"))
def sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
                     interpret: bool = False, block_h: int | None = None,
                     n_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, n_cls: int | None = None,
                     reuse_kv: bool | None = None, n_dsplit: int | None = None,
                     dequant: str | None = None):
    """Triton implementation of :func:`pallas_kernels.sparse_attention.sparse_attention`.

    Same arguments and results (o bf16 [B,S,H,K], lse fp32 [B,S,H]). Tuning (unset values
    come from :func:`default_tuning`): ``block_h`` heads per program (a power of two dividing
    H, >= 16 on a GPU), ``n_splits`` list splits (1 = the reference block order), Triton
    ``num_warps`` / ``num_stages``, ``n_cls`` channel classes (4 or 8; default 8 when
    ``K / 8 >= 16``, the tensor-core minimum), ``reuse_kv`` (keep the dequantised block for the
    PV product instead of decoding it again), ``n_dsplit`` (1, 2 or 4 programs per head block,
    each doing the PV product of part of the channel classes), ``dequant`` (``"jnp"``, or the
    experimental PTX decode ``"asm"``: GPU only and 8 classes; interpret mode always decodes
    with jnp, since PTX cannot run on CPU).

    Raises ``ValueError`` for a tuning outside those limits or a head dim that is not a power
    of two >= 64.
    """
    B, S, H, K = q.shape
    if H < 16 and not interpret and block_h is None:
        # fewer heads than the tensor-core tile (the test configs): zero heads pad the tile
        o, lse = sparse_attention(
            jnp.pad(q, ((0, 0), (0, 0), (0, 16 - H), (0, 0))), win_kv, win_scale, win_idx, main,
            main_scale, topk, jnp.pad(sink, (0, 16 - H)), scale, block_h=16, n_splits=n_splits,
            num_warps=num_warps, num_stages=num_stages, n_cls=n_cls, reuse_kv=reuse_kv,
            n_dsplit=n_dsplit, dequant=dequant)
        return o[:, :, :H], lse[:, :, :H]
    n_win = win_idx.shape[-1]
    if topk is None:  # SWA-only layer: a dummy main KV that the kernel never reads
        lst = win_idx
        main = jnp.zeros((B, 1, K // 2), jnp.uint8)
        main_scale = jnp.zeros((B, 1, K // 16), jnp.float8_e4m3fn)
    else:
        lst = jnp.concatenate([win_idx, topk], axis=-1)
    lst = pad_list(lst)
    n_blocks = lst.shape[-1] // SOFTMAX_BLOCK
    if win_kv.shape[1] == 0:   # nothing to gather from: one zero row keeps the reads in bounds
        win_kv = jnp.zeros((B, 1, K), win_kv.dtype)
        win_scale = jnp.zeros((B, 1, K // 32), win_scale.dtype)
    if main.shape[1] == 0:
        main = jnp.zeros((B, 1, K // 2), main.dtype)
        main_scale = jnp.zeros((B, 1, K // 16), main_scale.dtype)
    if n_blocks == 0:   # nothing listed at all: o = 0, lse = sink
        return (jnp.zeros((B, S, H, K), BF16),
                jnp.broadcast_to(sink.astype(F32), (B, S, H)))
    tune = default_tuning(B * S, H, n_blocks)
    block_h = block_h or tune["block_h"]
    n_splits = min(n_splits or tune["n_splits"], n_blocks)
    if H % block_h or block_h & (block_h - 1) or (block_h < 16 and not interpret):
        raise ValueError(f"block_h={block_h} must be a power of two dividing the {H} heads "
                         f"(and >= 16 on a GPU: the tensor-core tile)")
    if K % 64 or K & (K - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head dim >= 64, got {K}")
    n_cls = n_cls or (8 if K // 8 >= 16 else 4)
    if n_cls not in (4, 8) or (K // n_cls < 16 and not interpret):
        raise ValueError(f"n_cls={n_cls} must be 4 or 8 with K/n_cls >= 16 on a GPU (K={K})")
    reuse_kv = tune["reuse_kv"] if reuse_kv is None else reuse_kv
    n_dsplit = n_dsplit or tune["n_dsplit"]
    dequant = dequant or (tune["dequant"] if n_cls == 8 else "jnp")
    if dequant not in ("asm", "jnp"):
        raise ValueError(f"dequant must be 'asm' or 'jnp', got {dequant!r}")
    if dequant == "asm" and n_cls != 8:
        raise ValueError(f"dequant='asm' decodes 8 channel classes; n_cls={n_cls} (K={K})")
    if n_dsplit not in (1, 2, 4) or n_dsplit > n_cls:
        raise ValueError(f"n_dsplit={n_dsplit} must be 1, 2 or 4 (and <= n_cls={n_cls})")
    R = B * S
    u8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    args = (q.reshape(R, H, K), lst.reshape(R, -1), _words(win_kv), win_scale,
            _words(main), u8(main_scale), sink.astype(F32))
    in_specs = [
        pl.BlockSpec((None, block_h, K), lambda r, h, s: (r, h // n_dsplit, 0)),
        pl.BlockSpec((None, lst.shape[-1]), lambda r, h, s: (r, 0)),
        *[pl.BlockSpec() for _ in args[2:6]],     # whole arrays: rows are gathered in-kernel
        pl.BlockSpec((H,), lambda r, h, s: (0,)),
    ]
    if n_splits == 1:
        out_shape = (jax.ShapeDtypeStruct((R, H, K), BF16), jax.ShapeDtypeStruct((R, H), F32))
        out_specs = (pl.BlockSpec((None, block_h, K), lambda r, h, s: (r, h // n_dsplit, 0)),
                     pl.BlockSpec((None, block_h), lambda r, h, s: (r, h // n_dsplit)))
    else:
        out_shape = (jax.ShapeDtypeStruct((R, n_splits, H, K), F32),
                     jax.ShapeDtypeStruct((R, n_splits, H), F32),
                     jax.ShapeDtypeStruct((R, n_splits, H), F32))
        out_specs = (
            pl.BlockSpec((None, None, block_h, K), lambda r, h, s: (r, s, h // n_dsplit, 0)),
            pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h // n_dsplit)),
            pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h // n_dsplit)))
    kernel = functools.partial(_kernel, S=S, K=K, n_cls=n_cls, n_dsplit=n_dsplit,
                               block_h=block_h, n_win=n_win,
                               n_blocks=n_blocks, n_splits=n_splits, scale=scale,
                               interpret=interpret, reuse_kv=reuse_kv, dequant=dequant)
    outs = pl.pallas_call(
        kernel, grid=(R, H // block_h * n_dsplit, n_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or tune["num_warps"],
                                             num_stages=num_stages or tune["num_stages"]),
        name="csa2_sparse_attention",
    )(*args)
    if n_splits == 1:
        o, lse = outs
    else:
        acc, m, l = outs
        top = jnp.max(m, axis=1, keepdims=True)
        w = jnp.exp(m - top)
        l_tot = jnp.sum(l * w, axis=1)
        acc = jnp.sum(acc * w[..., None], axis=1)
        top = top[:, 0]
        sink_b = sink.astype(F32)[None, :]
        o = (acc / (l_tot + jnp.exp(sink_b - top))[..., None]).astype(BF16)
        lse = lse_with_sink(top, l_tot, sink_b)
    return o.reshape(B, S, H, K), lse.reshape(B, S, H)
