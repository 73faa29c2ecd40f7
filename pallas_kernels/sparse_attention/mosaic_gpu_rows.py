"""Warp-specialised Pallas Mosaic GPU (Hopper) kernel of the CSA2 sparse attention over bf16
rows (docs/architecture.md, "Joint sink softmax"): the dequantised rows' design of
:mod:`.triton_dense` with the warp groups the Triton kernel cannot own.

One CTA per query row ``(b, s)`` with all 64 heads (they share the row's list: MQA) and three
warp groups (``num_threads=3``, ``thread_name="wg"``):

* **warp group 2, the producer** (40 registers per thread): gathers each 64-entry block's
  listed bf16 rows (1 KiB each) with ``cp.async`` (16 bytes per copy, 32 per thread and block,
  the 8 threads of a quarter warp the same chunk of 8 rows: :func:`_lanes`), straight into
  the swizzled ``[64, 512]`` operand tile the tensor cores read: the 64-byte swizzle of
  Mosaic GPU's (8 rows x 64 bytes) tiling (:data:`TILED`, :func:`tile_byte_offset`) is
  computed per copy, so no relayout pass and no bf16 copy in HBM.
  Two tiles: block ``j + 1``'s copies are in flight while block ``j`` is consumed.
* **warp groups 0 and 1, the consumers** (232 registers): each computes **half of the score
  tile** (``S_w = Q K_w^T``, entries ``32 w .. 32 w + 31`` of the block: wgmma N = 32, K = 512,
  both operands in shared memory; the Triton kernel computes the whole tile in both warp
  groups), the two exchange their row maxima and bf16 probabilities through shared memory,
  and each accumulates the PV product of **its 256 output channels** (``[64, 256]`` fp32
  accumulator, 128 registers) from the whole ``P`` (A operand in shared memory) and the tile.

The softmax is the reference's online recursion over 64-entry blocks in list order (running max
from -1e30, ``m' = max(m, max of the block)`` over both halves, ``bf16(P)`` in the PV product,
fp32 ``P`` in the denominator, the sink added at the end); each warp group sums the denominator
of its half of every block and the two sums are added at the end (an fp32 summation order
different from the reference's row sum, as the Triton kernels' are). -1 entries gather row 0
and get the score -inf (exactly zero weight); a row with no entry gives 0.

Shared memory: q 64 KiB (its buffer stages the output at the end), two row tiles 128 KiB, two
``P`` buffers 16 KiB (by block parity; with the two exchange syncs per block they are a
safety margin, not needed: a later version may free them for longer lists), the row
list ``4 L`` bytes, maxima / sums / sink / lse, barriers and Mosaic GPU's own scratch: the
lowering's budget check passes up to ``L = MAX_LIST = 3072`` entries (3136 is 48 bytes over
the 227 KiB); the release lists 640.

Decode runs over the packed rows (below): decoding every row once costs more than the
attention there.

**Packed rows** (:func:`sparse_attention_packed`, the default for packed rows of 8 query
rows or more): the producer reads the state's FP8 window rows and packed FP4 main KV itself
and decodes them into the tile (:func:`_decode_rows`: one code path per kind of block,
16-byte loads, the Triton kernel's PTX decode, bank-conflict-free swizzled 16-byte shared
stores, the next block's rows prefetched into L2; 72 registers, the consumers 216). With
whole-block lists (the release's 128 + 512) and a split count that divides the blocks, the
kernel copies the window and top-k lists itself, block by block (no joint list is built).

**List splits** (``n_splits``, flash-decoding): one CTA per (query row, split), each split
a contiguous run of blocks; its fp32 partial state (``acc`` staged in the free tiles' shared
memory and stored by TMA, in interpret mode from the registers; the maxima and denominators
through shared memory) is merged by :func:`.common.merge_splits`.

Interpret mode (CPU, tests) cannot run the producer's ``cp.async`` (``plgpu.inline_mgpu``):
there the producer copies each listed row by TMA into a plain staging buffer and moves it
into the tile through registers (the same tiles, barriers and consumers). The packed
producer's PTX has no interpret mode: its decode pairs are CPU-emulated, its build lowered.

Requirements: 64 heads, head dim 512, bf16 (GPU: Hopper). Raises ``ValueError`` otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.sparse_attention.common import (BF16, F32, I32, NEG_START, SOFTMAX_BLOCK,
                                                    balanced_splits, decode_ptx, exp_of,
                                                    joint_list, lse_with_sink, merge_splits,
                                                    nonempty_rows)

H_SUPPORTED = 64      # heads (all of a query row's in one CTA)
K_SUPPORTED = 512     # head dim

BN = SOFTMAX_BLOCK    # 64 list entries per block
HALF_N = BN // 2      # entries of a block per consumer's score half
HALF_K = K_SUPPORTED // 2   # output channels per consumer
MAX_LIST = 3072       # padded list entries whose row list fits the shared memory (lowering: 3136 is 48 bytes over)
LIST_CHUNK = 256      # list entries per TMA copy (a box holds <= 256 per dimension)
ROW_BYTES = K_SUPPORTED * 2
COPY_BYTES = 16       # one cp.async
COLS_PER_ROW = ROW_BYTES // COPY_BYTES            # 64 copies per row
PRODUCER_REGS, CONSUMER_REGS = 40, 232
# the packed producer holds PASS_ROWS rows' words and decodes them: more registers, and the
# consumers give them up. The three warp groups share what the launch allocates, 168 per
# thread (65536 / 384, in steps of 8): producer + 2 x consumer must stay <= 504, or a
# consumer's setmaxnreg increase waits forever
PACKED_PRODUCER_REGS, PACKED_CONSUMER_REGS = 72, 216
REG_POOL = 3 * 168
assert PRODUCER_REGS + 2 * CONSUMER_REGS <= REG_POOL
assert PACKED_PRODUCER_REGS + 2 * PACKED_CONSUMER_REGS <= REG_POOL
# the operand tiles' layout (q, rows, P: wgmma needs one swizzle for both operands, and P's
# halves are 32 entries = 64 bytes wide): tiles of 8 rows x 64 bytes, 64-byte swizzle
SWIZZLE = 64
TILED = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
# the staged fp32 partial accumulators (TMA stores): tiles of 8 rows x 128 bytes, 128-byte swizzle
TILED_F32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def tile_byte_offset(row, chunk):
    """Byte offset of the 16-byte chunk ``chunk`` (0..63) of row ``row`` in a bf16
    ``[rows, 512]`` shared-memory tile with the operands' layout (:data:`TILED`: tiles of 8 rows
    x ``SWIZZLE`` bytes, ``SWIZZLE``-byte swizzle).

    The tiled array is ``[rows / 8, 1024 / SWIZZLE column tiles, 8, SWIZZLE / 2]`` (tiles
    row-major); inside a tile, row ``r`` is ``SWIZZLE`` bytes at ``SWIZZLE r``, and its 16-byte
    chunk ``c`` sits at chunk ``c XOR ((SWIZZLE r >> 7) mod (SWIZZLE / 16))`` (the hardware
    swizzle: address bits 4.. XOR bits 7..). Works on Python ints and integer arrays."""
    per_row = SWIZZLE // 16
    r8 = row & 7
    return (((row >> 3) * (ROW_BYTES // SWIZZLE) + chunk // per_row) * (8 * SWIZZLE)
            + r8 * SWIZZLE + (((chunk % per_row) ^ ((r8 * SWIZZLE >> 7) % per_row)) * 16))


class _Mlir:
    """The few MLIR builders the producers' inline Mosaic GPU code uses (built inside an
    ``inline_mgpu`` function, where an MLIR context and insertion point exist)."""

    def __init__(self):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref
        from jax.experimental.mosaic.gpu import utils as mu
        self.ir, self.arith, self.llvm, self.memref, self.mu = ir, arith, llvm, memref, mu
        self.i8, self.i32, self.i64 = (ir.IntegerType.get_signless(n) for n in (8, 32, 64))
        self.index = ir.IndexType.get()
        tid = arith.index_cast(self.i32, gpu.thread_id(gpu.Dimension.x))
        self.lane = arith.remui(tid, self.c(128))          # thread of the warp group

    def c(self, v: int, t=None):
        return self.arith.constant(t or self.i32, v)

    def gmem(self, ref):
        """Global pointer of a GMEM ref (its offset included)."""
        return self.llvm.addrspacecast(self.llvm.PointerType.get(address_space=1),
                                       self.mu.memref_ptr(ref))

    def at(self, base, offset):
        """``base + offset`` bytes (offset: i32 or i64 value)."""
        return self.llvm.getelementptr(base.type, base, [offset], [-2**31], self.i8, 0)

    def load_i32(self, ref, i):
        """``ref[i]`` of an int32 SMEM ref (``i``: i32 value)."""
        return self.memref.load(ref, [self.arith.index_cast(self.index, i)])

    def wide(self, x, n: int):
        """i64 ``x * n`` (x: i32 value)."""
        return self.arith.muli(self.arith.extsi(self.i64, x), self.c(n, self.i64))

    def int(self, v):
        return _Int(self, v)


class _Int:
    """An i32 MLIR value with the integer operators :func:`tile_byte_offset` uses."""

    def __init__(self, m: _Mlir, v):
        self.m, self.value = m, v

    def _op(self, fn, o):
        return _Int(self.m, fn(self.value, o.value if isinstance(o, _Int) else self.m.c(o)))

    def __and__(self, o): return self._op(self.m.arith.andi, o)   # noqa: E704
    def __xor__(self, o): return self._op(self.m.arith.xori, o)   # noqa: E704
    def __rshift__(self, o): return self._op(self.m.arith.shrui, o)   # noqa: E704
    def __mul__(self, o): return self._op(self.m.arith.muli, o)   # noqa: E704
    def __add__(self, o): return self._op(self.m.arith.addi, o)   # noqa: E704
    def __floordiv__(self, o): return self._op(self.m.arith.divui, o)   # noqa: E704
    def __mod__(self, o): return self._op(self.m.arith.remui, o)   # noqa: E704
    __radd__ = __add__


def _lanes(m):
    """The producers' thread mapping: ``(first, unit)`` of thread ``t`` of the warp group,
    ``first = t % 8`` (the row of each 8-row group: the tile row) and ``unit = 4 (t // 32) +
    (t // 8) % 4`` (0..15). The 8 threads of a quarter warp (one shared-memory wavefront of
    16-byte stores) then hold the 8 rows of one tile at the same 16-byte chunk, which the
    swizzle spreads over the 8 distinct 16-byte bank groups: no bank conflict (the same unit
    of 8 rows apart would put all 8 in one bank group, 8 column tiles = 4 KiB apart)."""
    a = m.arith
    first = a.andi(m.lane, m.c(7))
    unit = a.ori(a.shli(a.shrui(m.lane, m.c(5)), m.c(2)), a.andi(a.shrui(m.lane, m.c(3)), m.c(3)))
    return first, unit


def _cp_async_rows(rows_smem, kv_gmem, tile_smem, *, n_rows: int):
    """The producer's copies of one block (GPU): the 64 listed rows (``rows_smem``: int32 [64],
    -1 = no entry: row 0) of ``kv_gmem`` (bf16 [N, 512]) into ``tile_smem`` (bf16 [64, 512],
    the swizzled operand tile), by ``cp.async`` of 16 bytes; then one commit group. Thread t
    (:func:`_lanes`) copies the 16-byte columns ``unit + 16 c`` (c = 0..3) of rows ``first +
    8 g`` (g = 0..7): a warp reads 64 contiguous bytes of 8 rows per copy instruction, and
    each quarter warp writes 8 distinct bank groups."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(TILED)))
    def copies(ctx, rows_ref, kv_ref, tile_ref):
        del ctx
        m = _Mlir()
        a = m.arith
        first, unit = _lanes(m)
        kv_base, tile_base = m.gmem(kv_ref), m.mu.memref_ptr(tile_ref)
        for g in range(BN // 8):
            r = a.addi(first, m.c(8 * g))
            row = a.minsi(a.maxsi(m.load_i32(rows_ref, r), m.c(0)), m.c(n_rows - 1))
            row_base = m.at(kv_base, m.wide(row, ROW_BYTES))
            for c in range(COLS_PER_ROW // 16):
                col = a.addi(unit, m.c(16 * c))
                src = m.at(row_base, a.extsi(m.i64, a.muli(col, m.c(COPY_BYTES))))
                dst = m.at(tile_base, tile_byte_offset(m.int(r), m.int(col)).value)
                nvvm.cp_async_shared_global(dst, src, COPY_BYTES, nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_commit_group()

    copies(rows_smem, kv_gmem, tile_smem)


# The packed producer's PTX. Global loads (read-only path) and a 16-byte shared store.
_LD_V4 = "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];"
_LD_U8 = "ld.global.nc.u8 $0, [$1];"
_LD_U16 = "ld.global.nc.u16 $0, [$1];"
_ST_V4 = "st.shared.v4.b32 [$0], {$1, $2, $3, $4};"
_PREFETCH = "prefetch.global.L2 [$0];"
# E4M3 scale bytes -> the bf16 bits of their values (exact: the hardware's e4m3 -> f16, then
# f16 -> f32 -> bf16, both exact for every e4m3 value; the state never holds the NaN code):
# the low byte of $2 -> $0, its second byte -> $1 (a main-KV row's two scales of a 32-channel
# unit, read as one 16-bit word)
_E4M3X2_TO_BF16 = """{
.reg .b16 h, lo, hi;
.reg .b32 f;
.reg .f32 x, y;
cvt.u16.u32 h, $2;
cvt.rn.f16x2.e4m3x2 f, h;
mov.b32 {lo, hi}, f;
cvt.f32.f16 x, lo;
cvt.f32.f16 y, hi;
cvt.rn.bf16.f32 lo, x;
cvt.rn.bf16.f32 hi, y;
cvt.u32.u16 $0, lo;
cvt.u32.u16 $1, hi;
}"""
# rows whose packed words one producer thread holds at a time (their loads in flight together):
# a window row is 8 words + a scale, a main-KV row 4 words + a scale word
PASS_ROWS = {"window": 4, "main": 8, "mixed": 4}


def block_kind(j: int, n_wlist: int) -> str:
    """Which rows block ``j`` of the joint list holds (its first ``n_wlist`` entries are the
    window list, the rest the top-k list and -1 padding): ``"window"``, ``"main"`` or
    ``"mixed"`` (the block across the boundary; none when ``n_wlist`` is a multiple of 64,
    as at the release's 128)."""
    if (j + 1) * BN <= n_wlist:
        return "window"
    return "main" if j * BN >= n_wlist else "mixed"


def _decode_rows(rows_smem, wkv, wsc, mkv, msc, tile_smem, *, n_win: int, n_main: int,
                 main_offset: int, kind: str, prefetch: bool = False):
    """The packed producer's block (GPU): the 64 listed rows ``rows_smem`` (int32 [64]; -1 = no
    entry) decoded from the state's storage into ``tile_smem`` (bf16 [64, 512], the swizzled
    operand tile), or with ``prefetch`` only their bytes fetched into L2
    (``prefetch.global.L2``, issued for the next block, so that its loads hit L2). Window rows
    ``wkv`` (uint8 [Nw, 512] e4m3 codes) with ``wsc`` (uint8 [Nw, 16] E8M0 scales); main KV
    ``mkv`` (uint8 [T, 256], two e2m1 codes per byte, channel 2j in the low nibble) with
    ``msc`` (uint8 [T, 32] E4M3 scales): entry e of a main row is main-KV entry ``e -
    main_offset`` (``n_win`` in the joint list, 0 in the top-k list itself); in a mixed block
    a row is a window row if ``e < n_win``.

    ``kind`` (:func:`block_kind`, static per block): a ``"window"`` block loads 32 bytes of
    e4m3 codes and one E8M0 byte per row and thread, a ``"main"`` block 16 bytes of e2m1 codes
    and its two E4M3 scales as one 16-bit word (converted together by ``cvt.e4m3x2``); a
    ``"mixed"`` block loads both kinds' addresses chosen per row (``select``) and branches per
    row (``scf.if``). -1 entries read window row 0 / main entry 0 (their scores are masked).

    Thread t decodes the 32 channels ``32 unit ..`` of rows ``first + 8 i`` (:func:`_lanes`:
    bank-conflict-free stores; i = 0..7), in passes of :data:`PASS_ROWS` rows whose loads are
    issued first, so that they are in flight together; the Triton kernel's PTX decode
    (:func:`.common.decode_ptx`: two codes per template, exact) on each word and the word
    shifted by one code gives two adjacent channels; four 16-byte shared stores at the
    swizzled chunks. The E8M0 byte 0 decodes to 0, not 2^-127 (as the Triton kernel; the
    quantisers never write it)."""
    from jax._src.lib.mlir.dialects import scf

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 5 + (plgpu.RefType(TILED),))
    def decode(ctx, rows_ref, wkv_ref, wsc_ref, mkv_ref, msc_ref, tile_ref):
        del ctx
        m = _Mlir()
        a, ptx, i32 = m.arith, m.mu.inline_ptx, m.i32
        first, unit = _lanes(m)      # rows first + 8 i, channels 32 unit .. 32 unit + 31
        wk, ws, mk, ms = (m.gmem(r) for r in (wkv_ref, wsc_ref, mkv_ref, msc_ref))
        tile_base = m.mu.memref_ptr(tile_ref)
        i64 = lambda x: a.extsi(m.i64, x)                   # noqa: E731

        def pair(fmt, word, nxt, sc):
            return ptx(decode_ptx(fmt, 0, 0), word, nxt, sc, sc, result_types=i32)

        def window_addrs(e):
            wrow = a.minsi(a.maxsi(e, m.c(0)), m.c(n_win - 1))
            return (m.at(wk, a.addi(m.wide(wrow, 512), i64(a.muli(unit, m.c(32))))),
                    m.at(ws, a.addi(m.wide(wrow, 16), i64(unit))))

        def main_addrs(e):
            mrow = a.minsi(a.maxsi(a.subi(e, m.c(main_offset)), m.c(0)), m.c(n_main - 1))
            return (m.at(mk, a.addi(m.wide(mrow, 256), i64(a.muli(unit, m.c(16))))),
                    m.at(ms, a.addi(m.wide(mrow, 32), i64(a.muli(unit, m.c(2))))))

        def load_window(e):
            codes, sc = window_addrs(e)
            return ([*ptx(_LD_V4, codes, result_types=[i32] * 4),
                     *ptx(_LD_V4, m.at(codes, m.c(16)), result_types=[i32] * 4)],
                    ptx(_LD_U8, sc, result_types=i32))

        def load_main(e):
            codes, sc = main_addrs(e)
            return ptx(_LD_V4, codes, result_types=[i32] * 4), ptx(_LD_U16, sc, result_types=i32)

        def decode_window(words, sc):   # e4m3: 4 codes per word
            sc = a.shli(sc, m.c(7))                             # E8M0 -> bf16 bits
            out = []
            for w in words:
                out += [pair("e4m3", w, a.shrui(w, m.c(8)), sc),
                        pair("e4m3", a.shrui(w, m.c(16)), a.shrui(w, m.c(24)), sc)]
            return out

        def decode_main(words, scs):    # e2m1: 8 codes per word, a scale per 2 words
            out = []
            for j, w in enumerate(words[:4]):
                for k in range(4):
                    byte = a.shrui(w, m.c(8 * k))
                    out.append(pair("e2m1", byte, a.shrui(byte, m.c(4)), scs[j // 2]))
            return out

        def load_mixed(e):
            win = a.cmpi(a.CmpIPredicate.slt, e, m.c(n_win))
            w_codes, w_sc = window_addrs(e)
            m_codes, m_sc = main_addrs(e)
            words = [*ptx(_LD_V4, a.select(win, w_codes, m_codes), result_types=[i32] * 4),
                     *ptx(_LD_V4, a.select(win, m.at(w_codes, m.c(16)), m_codes),
                          result_types=[i32] * 4)]
            sc0 = ptx(_LD_U8, a.select(win, w_sc, m_sc), result_types=i32)
            sc1 = ptx(_LD_U8, a.select(win, w_sc, m.at(m_sc, m.c(1))), result_types=i32)
            return win, words, a.ori(sc0, a.shli(sc1, m.c(8)))   # (a window row: sc0 twice)

        def decode_mixed(win, words, sc):
            branch = scf.IfOp(win, [i32] * 16, has_else=True)
            with m.ir.InsertionPoint(branch.then_block):
                scf.YieldOp(decode_window(words, a.andi(sc, m.c(0xFF))))
            with m.ir.InsertionPoint(branch.else_block):
                scf.YieldOp(decode_main(words[:4], ptx(_E4M3X2_TO_BF16, sc,
                                                       result_types=[i32] * 2)))
            return list(branch.results)

        if prefetch:
            for i in range(BN // 8):
                e = m.load_i32(rows_ref, a.addi(first, m.c(8 * i)))
                for addr in (window_addrs if kind == "window" else main_addrs)(e):
                    ptx(_PREFETCH, addr, has_side_effects=True)
            return
        n_pass = PASS_ROWS[kind]
        for p in range(BN // 8 // n_pass):
            held = []
            for i in range(n_pass):
                r = a.addi(first, m.c(8 * (p * n_pass + i)))
                e = m.load_i32(rows_ref, r)
                held.append((r, {"window": load_window, "main": load_main,
                                 "mixed": load_mixed}[kind](e)))
            for r, loaded in held:
                if kind == "window":
                    vals = decode_window(*loaded)
                elif kind == "main":
                    words, sc = loaded
                    vals = decode_main(words, ptx(_E4M3X2_TO_BF16, sc, result_types=[i32] * 2))
                else:
                    vals = decode_mixed(*loaded)
                for c in range(4):
                    chunk = a.addi(a.muli(unit, m.c(4)), m.c(c))
                    dst = m.at(tile_base, tile_byte_offset(m.int(r), m.int(chunk)).value)
                    ptx(_ST_V4, dst, *vals[4 * c:4 * c + 4], has_side_effects=True)

    decode(rows_smem, wkv, wsc, mkv, msc, tile_smem)


def _is_kind(j, kind: str, n_wlist: int):
    """Whether block ``j`` (traced) is of ``kind`` (:func:`block_kind`)."""
    n_wfull = n_wlist // BN          # window blocks; then a mixed one if n_wlist % BN
    if kind == "window":
        return j < n_wfull
    if kind == "mixed":
        return j == n_wfull
    return j >= n_wfull + int(n_wlist % BN != 0)


def _cp_async_wait(n: int):
    """Wait until at most ``n`` of this thread's ``cp.async`` groups are pending (GPU)."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(n)

    wait()


def _kernel(q_ref, *refs, S, n_blocks, n_splits, n_rows, scale, interpret, softmax, packed,
            split_lists):
    """Refs: q, the row lists (the joint list, one per CTA; with ``split_lists`` the window
    list and the top-k list, one per query row), the rows (bf16 ``kv``; with ``packed`` the
    window codes and scales and the main-KV codes and scales), sink, then the outputs (o, lse;
    with list splits acc, m, l), then the scratch. CTA ``rid`` runs query row ``rid`` or, with
    ``n_splits`` list splits, blocks ``n_blocks (rid % n_splits) ..`` of query row ``rid //
    n_splits``."""
    n_lists, n_data = (2 if split_lists else 1), (4 if packed else 1)
    lists, refs = refs[:n_lists], refs[n_lists:]
    # the first block of this CTA's list in the query row's joint list (its kind, packed)
    first_block = (lax.axis_index("row") % n_splits) * n_blocks if n_splits > 1 else 0
    n_out = 2 if n_splits == 1 else 3
    data, sink_ref = refs[:n_data], refs[n_data]
    outs = refs[n_data + 1:n_data + 1 + n_out]
    (q_smem, tiles, p_smem, rows_smem, mx_smem, l_smem, sink_smem, lse_smem,
     list_bar, q_bar, full, free, xchg, *staging) = refs[n_data + 1 + n_out:]
    acc_stage = None
    if n_splits > 1 and not interpret:   # list splits on the GPU: the tiles' memory (a
        tiles, acc_stage = tiles         # RefUnion) stages the fp32 partial accumulators
    rid = lax.axis_index("row")        # the CTA's list (a query row's, or one split of it)
    qid = rid // n_splits              # its query row
    b = qid // S
    wg = lax.axis_index("wg")
    L = n_blocks * BN
    row_layout = plgpu.Layout.WGMMA.reduce(1)   # per head (row of the S / O tiles)
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # per entry (column of S)
    exp = exp_of(softmax)

    # ---- per-row inputs: the row list (everyone), q and the sink (the consumers) ----
    @pl.when(wg == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[qid], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(sink_ref, sink_smem, q_bar)
        if not split_lists:
            copy_list(list_bar, lists[0].at[rid], rows_smem, L)
            return
        win_ref, top_ref = lists
        n_wblocks = n_rows[2] // BN
        for k in range(n_blocks):   # block by block from the window or the top-k list
            jg, dst = first_block + k, rows_smem.at[pl.ds(k * BN, BN)]
            pl.when(jg < n_wblocks)(lambda jg=jg, dst=dst: plgpu.copy_gmem_to_smem(
                win_ref.at[qid, pl.ds(jg * BN, BN)], dst, list_bar))
            pl.when(jg >= n_wblocks)(lambda jg=jg, dst=dst: plgpu.copy_gmem_to_smem(
                top_ref.at[qid, pl.ds((jg - n_wblocks) * BN, BN)], dst, list_bar))
    plgpu.barrier_wait(list_bar)

    # ---- the producer ----
    @pl.when(wg == 2)
    def _producer():
        if not interpret:
            plgpu.set_max_registers(PACKED_PRODUCER_REGS if packed else PRODUCER_REGS,
                                    action="decrease")

        def issue(j):
            slot = j % 2
            block_rows = rows_smem.at[pl.ds(j * BN, BN)]
            if packed:   # decoded in the producer's registers: the tile is written on return
                n_win, n_main, n_wlist, main_offset = n_rows
                kinds = sorted({block_kind(k, n_wlist) for k in range(n_blocks * n_splits)})

                def for_kind(jj, fn):   # one branch per kind of block (uniform in the CTA)
                    for kind in kinds:
                        run = functools.partial(fn, kind)
                        if len(kinds) == 1:
                            run()
                        else:
                            pl.when(_is_kind(first_block + jj, kind, n_wlist))(run)

                def decode(rows, kind, *, prefetch=False):
                    _decode_rows(rows, *(d.at[b] for d in data), tiles.at[slot],
                                 n_win=n_win, n_main=n_main, main_offset=main_offset,
                                 kind=kind, prefetch=prefetch)

                def prefetch(jj, kind):
                    if kind != "mixed":   # (both kinds' addresses: not worth it)
                        decode(rows_smem.at[pl.ds(jj * BN, BN)], kind, prefetch=True)

                # the next block's rows towards L2, so that its loads hit L2
                pl.when(j + 1 < n_blocks)(
                    lambda: for_kind(j + 1, functools.partial(prefetch, j + 1)))
                for_kind(j, functools.partial(decode, block_rows))
            elif interpret:   # TMA per row into a plain staging buffer, then into the tile
                (stage, stage_bar), = staging
                (kv_ref,) = data

                def body(r, carry):
                    row = jnp.clip(rows_smem[j * BN + r], 0, n_rows - 1)
                    plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(row, 1)], stage.at[pl.ds(r, 1)],
                                            stage_bar)
                    return carry
                lax.fori_loop(0, BN, body, 0)
                plgpu.barrier_wait(stage_bar)
                tiles.at[slot][...] = stage[...]
                plgpu.commit_smem()   # the staging is read before the next block's copies
            else:
                _cp_async_rows(block_rows, data[0].at[b], tiles.at[slot], n_rows=n_rows)

        def publish(j, pending: int):
            if not interpret and not packed:
                _cp_async_wait(pending)
            plgpu.commit_smem()          # generic-proxy writes -> visible to wgmma
            plgpu.barrier_arrive(full.at[j % 2])

        if packed:
            # block j + 1 is decoded while block j is consumed, into the tile block j - 1
            # has freed
            issue(0)
            publish(0, 0)

            def step(j, carry):
                @pl.when(j + 1 < n_blocks)
                def _():
                    @pl.when(j >= 1)
                    def _():
                        plgpu.barrier_wait(free.at[(j + 1) % 2])
                    issue(j + 1)
                    publish(j + 1, 0)
                return carry
        else:
            # block j is published as soon as its copies land (it does not wait for block
            # j - 1 to be consumed); block j + 2's copies go out once block j has freed its
            # tile
            issue(0)
            if n_blocks > 1:
                issue(1)
            publish(0, 1 if n_blocks > 1 else 0)

            def step(j, carry):   # block j published, block j + 1 (if any) in flight
                @pl.when(j + 1 < n_blocks)
                def _():
                    publish(j + 1, 0)

                @pl.when(j + 2 < n_blocks)
                def _():
                    plgpu.barrier_wait(free.at[j % 2])
                    issue(j + 2)
                return carry
        lax.fori_loop(0, n_blocks, step, 0)
        for j in range(max(n_blocks - 2, 0), n_blocks):   # observe every phase of the
            plgpu.barrier_wait(free.at[j % 2])              # free barriers (last blocks)

    # ---- the consumers ----
    @pl.when(wg < 2)
    def _consumer():
        if not interpret:
            plgpu.set_max_registers(PACKED_CONSUMER_REGS if packed else CONSUMER_REGS,
                                    action="increase")
        plgpu.barrier_wait(q_bar)

        def sync():
            plgpu.barrier_arrive(xchg)
            plgpu.barrier_wait(xchg)

        def block(j, carry):
            acc, m_i, l_i = carry
            slot = par = j % 2
            plgpu.barrier_wait(full.at[slot])
            tile = tiles.at[slot]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem,
                            tile.at[pl.ds(wg * HALF_N, HALF_N)].transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((H_SUPPORTED, HALF_N), F32))
            listed = plgpu.load(rows_smem.at[pl.ds(j * BN + wg * HALF_N, HALF_N)],
                                layout=col_layout)
            s = jnp.where(lax.broadcast_in_dim(listed, s.shape, [1]) >= 0, s * scale, -jnp.inf)
            mx_smem.at[par, wg][...] = s.max(axis=1)
            sync()                        # both halves' maxima written
            mx = jnp.maximum(plgpu.load(mx_smem.at[par, 0], layout=row_layout),
                             plgpu.load(mx_smem.at[par, 1], layout=row_layout))
            m_new = jnp.maximum(m_i, mx)
            alpha = exp(m_i - m_new)
            p = exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            p_smem.at[par, wg][...] = p.astype(BF16)
            plgpu.commit_smem()
            sync()                        # both P halves written
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            v = tile.at[:, pl.ds(wg * HALF_K, HALF_K)]

            def pv(acc_ref):
                for h in range(2):
                    plgpu.wgmma(acc_ref, p_smem.at[par, h], v.at[pl.ds(h * HALF_N, HALF_N)])
            if interpret:                 # interpret mode cannot run pl.run_state / ACC.init
                def pv_new(acc_ref):
                    pv(acc_ref)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv_new, plgpu.ACC((H_SUPPORTED, HALF_K), F32))
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(free.at[slot])   # this warp group is done with the tile
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((H_SUPPORTED, HALF_K), F32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((H_SUPPORTED,), NEG_START, F32), row_layout)
        l_i = plgpu.layout_cast(jnp.zeros((H_SUPPORTED,), F32), row_layout)
        acc, m_i, l_i = lax.fori_loop(0, n_blocks, block, (acc, m_i, l_i))

        # ---- epilogue: both denominators; the sink and bf16 output through q's buffer, or
        # the split's partial state ----
        l_smem.at[wg][...] = l_i
        sync()          # (both warp groups' last score products are done: q is free)
        l_tot = (plgpu.load(l_smem.at[0], layout=row_layout)
                 + plgpu.load(l_smem.at[1], layout=row_layout))
        cols = pl.ds(wg * HALF_K, HALF_K)
        if n_splits > 1:
            acc_ref, m_ref, l_ref = outs
            if acc_stage is None:   # (interpret mode) registers -> global memory
                acc_ref.at[rid, :, cols][...] = acc
            else:   # through the free tiles' memory (both passed the last PV product), by
                # TMA
                acc_stage.at[wg][...] = acc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(acc_stage.at[wg], acc_ref.at[rid, :, cols])

            @pl.when(wg == 0)
            def _():   # (the maxima buffers are free: both passed the last exchange)
                mx_smem.at[0, 0][...] = m_i
                mx_smem.at[0, 1][...] = l_tot
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(mx_smem.at[0, 0], m_ref.at[rid])
                plgpu.copy_smem_to_gmem(mx_smem.at[0, 1], l_ref.at[rid])
            plgpu.wait_smem_to_gmem(0)
            return
        o_ref, lse_ref = outs
        sink = plgpu.load(sink_smem, layout=row_layout)
        den = l_tot + exp(sink - m_i)
        o = acc / lax.broadcast_in_dim(den, acc.shape, [0])
        store_row_outputs(q_smem, o_ref, lse_smem, lse_ref, rid, wg, cols, o.astype(BF16),
                             lse_with_sink(m_i, l_tot, sink))


def copy_list(bar, src, dst, n_list: int) -> int:
    """TMA copies of a row list ``src`` (int32 GMEM ref [n_list]) into ``dst`` (SMEM) onto
    ``bar``, in boxes of at most ``LIST_CHUNK`` entries (a TMA box holds <= 256 per dimension);
    returns the number of copies (``bar``'s arrivals)."""
    for c in range(0, n_list, LIST_CHUNK):
        n = min(LIST_CHUNK, n_list - c)
        plgpu.copy_gmem_to_smem(src.at[pl.ds(c, n)], dst.at[pl.ds(c, n)], bar)
    return -(-n_list // LIST_CHUNK)


def store_row_outputs(stage, o_ref, lse_smem, lse_ref, rid, wg, cols, o, lse):
    """Query row ``rid``'s results, each warp group ``wg`` its output channels ``cols``: ``o``
    (bf16 [64, |cols|], WGMMA layout) through the free tiled buffer ``stage`` (TMA needs a
    contiguous source: one 8-row tile row per copy), ``lse`` (fp32 [64]) through ``lse_smem``
    by warp group 0; waits for the copies."""
    stage.at[:, cols][...] = o

    @pl.when(wg == 0)
    def _():
        lse_smem[...] = lse
    plgpu.commit_smem()
    for t in range(H_SUPPORTED // 8):
        plgpu.copy_smem_to_gmem(stage.at[pl.ds(8 * t, 8), cols],
                                o_ref.at[rid, pl.ds(8 * t, 8), cols])

    @pl.when(wg == 0)
    def _():
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[rid])
    plgpu.wait_smem_to_gmem(0)


def row_kernel(kernel, scratch, R: int, *, num_threads: int, name: str, interpret: bool,
               partial: bool = False):
    """``plgpu.kernel`` of a kernel with one CTA per row list (``R`` of them, grid axis "row"),
    ``num_threads`` warp groups (axis "wg"), Lane semantics, returning o bf16 [R, 64, 512] and
    lse fp32 [R, 64]; with ``partial`` (list splits: a list per split) each list's partial
    softmax state for :func:`.common.merge_splits`: acc fp32 [R, 64, 512], m and l fp32
    [R, 64]."""
    o_dtype = F32 if partial else BF16
    out_type = (jax.ShapeDtypeStruct((R, H_SUPPORTED, K_SUPPORTED), o_dtype),
                *[jax.ShapeDtypeStruct((R, H_SUPPORTED), F32)] * (2 if partial else 1))
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(R,),
        grid_names=("row",),
        num_threads=num_threads,
        thread_name="wg",
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def _check_supported(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink):
    if q.ndim != 4:
        raise ValueError(f"q: expected [B, S, H, K], got shape {q.shape}")
    B, S, H, K = q.shape
    if H != H_SUPPORTED or K != K_SUPPORTED:
        raise ValueError(f"the Mosaic GPU kernel needs H == {H_SUPPORTED} heads and K == "
                         f"{K_SUPPORTED} channels, got H={H}, K={K}")
    if q.dtype != BF16:
        raise ValueError(f"q: expected bfloat16, got {q.dtype}")

    def check(name, x, shape, dtype):
        if x.shape[:1] + x.shape[2:] != shape[:1] + shape[2:] or x.ndim != len(shape):
            raise ValueError(f"{name}: expected shape {shape}, got {x.shape}")
        if x.dtype != jnp.dtype(dtype):
            raise ValueError(f"{name}: expected dtype {jnp.dtype(dtype).name}, got {x.dtype}")

    check("win_kv", win_kv, (B, None, K), jnp.float8_e4m3fn)
    check("win_scale", win_scale, (B, None, K // 32), jnp.uint8)
    if win_scale.shape[1] != win_kv.shape[1]:
        raise ValueError("win_scale: rows must match win_kv")
    if win_idx.shape[:2] != (B, S) or win_idx.dtype != I32:
        raise ValueError(f"win_idx: expected int32 [B, S, Ww], got {win_idx.dtype} "
                         f"{win_idx.shape}")
    if sink.shape != (H,):
        raise ValueError(f"sink: expected shape ({H},), got {sink.shape}")
    if topk is not None:
        if topk.shape[:2] != (B, S) or topk.dtype != I32:
            raise ValueError(f"topk: expected int32 [B, S, k], got {topk.dtype} {topk.shape}")
        if main is None or main_scale is None:
            raise ValueError("main, main_scale: required when topk is given")
        check("main", main, (B, None, K // 2), jnp.uint8)
        check("main_scale", main_scale, (B, None, K // 16), jnp.float8_e4m3fn)
        if main_scale.shape[1] != main.shape[1]:
            raise ValueError("main_scale: rows must match main")


def on_hopper_or_unknown() -> bool:
    """False on a GPU that is not Hopper (sm_90: the kernel's wgmma and register split), True
    on Hopper and where the default device is no GPU (CPU lowering of a GPU build, tests)."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    return dev.platform != "gpu" or cc is None or str(cc).startswith("9.")


def _check(q, kv, rows, sink):
    if q.ndim != 4 or q.shape[2:] != (H_SUPPORTED, K_SUPPORTED) or q.dtype != BF16:
        raise ValueError(f"q: the Mosaic GPU rows' kernel needs bf16 [B, S, {H_SUPPORTED}, "
                         f"{K_SUPPORTED}], got {q.dtype} {q.shape}")
    B, S = q.shape[:2]
    if kv.ndim != 3 or kv.shape[0] != B or kv.shape[2] != K_SUPPORTED or kv.dtype != BF16:
        raise ValueError(f"kv: expected bf16 [{B}, N, {K_SUPPORTED}], got {kv.dtype} {kv.shape}")
    if kv.shape[1] == 0:
        raise ValueError("kv: needs at least one row (an empty part gets one zero row)")
    if rows.ndim != 3 or rows.shape[:2] != (B, S) or rows.dtype != I32:
        raise ValueError(f"rows: expected int32 [{B}, {S}, L], got {rows.dtype} {rows.shape}")
    if rows.shape[-1] % BN:
        raise ValueError(f"rows: {rows.shape[-1]} entries is not a whole number of {BN}-entry "
                         f"blocks (pad with -1: common.joint_list)")
    if rows.shape[-1] > MAX_LIST:
        raise ValueError(f"rows: at most {MAX_LIST} entries fit the shared memory, got "
                         f"{rows.shape[-1]}")
    if sink.shape != (H_SUPPORTED,):
        raise ValueError(f"sink: expected shape ({H_SUPPORTED},), got {sink.shape}")


def sparse_attention_rows(q: Float[Array, "B S 64 512"], kv: Float[Array, "B N 512"],
                          rows: Int[Array, "B S L"], sink: Float[Array, "64"], scale: float, *,
                          interpret: bool = False, softmax: str = "exp2", n_splits: int = 1
                          ) -> tuple[Float[Array, "B S 64 512"], Float[Array, "B S 64"]]:
    """The joint sink softmax of each query over its listed bf16 rows (docs/architecture.md,
    "Joint sink softmax"), by the warp-specialised kernel.

    Args:
      q: bf16 [B, S, 64, 512] queries.
      kv: bf16 [B, N, 512] rows (:func:`.triton_dense.dense_rows`), N >= 1.
      rows: int32 [B, S, L] rows of ``kv`` per query in the reference's order, -1 = no entry,
        L a multiple of 64 and at most ``MAX_LIST`` (:func:`.common.joint_list`);
        entries past the end read the last row.
      sink: fp32 [64] sink logits. scale: the softmax scale (static).
      interpret: Mosaic GPU interpret mode (CPU; slow, for tests).
      softmax: the exponential, ``"exp2"`` (``exp2(x log2 e)``, the Triton kernels' default)
        or ``"exp"`` (:func:`.common.exp_of`).
      n_splits: list splits (flash-decoding: one CTA per query row and split, each split's
        fp32 partial state merged by :func:`.common.merge_splits`); cut to at most one per
        64-entry block, then balanced (:func:`balanced_splits`). 1 keeps the reference's
        block order.

    Returns:
      ``(o bf16 [B, S, 64, 512], lse fp32 [B, S, 64])``, as
      :func:`pallas_kernels.sparse_attention.sparse_attention`.

    Raises:
      ValueError: shapes or dtypes other than the above, an unknown ``softmax``,
        ``n_splits < 1``, a GPU that is not Hopper (outside interpret mode).
    """
    _check(q, kv, rows, sink)
    exp_of(softmax)   # ValueError for an unknown name
    _check_splits(n_splits)
    if not interpret and not on_hopper_or_unknown():
        raise ValueError("the Mosaic GPU kernels need a Hopper GPU (sm_90: wgmma, setmaxnreg)")
    call = functools.partial(_rows_call, scale=float(scale), interpret=interpret,
                             softmax=softmax, n_splits=int(n_splits))
    # interpret mode runs eagerly: under jit the interpreter's blocking barrier callbacks and
    # the outer thread-map callback can occupy every XLA:CPU worker thread of a small machine
    # and deadlock; eager, the outer callback runs in Python
    if interpret:
        with jax.disable_jit():
            return call(q, kv, rows, sink)
    return call(q, kv, rows, sink)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "softmax", "n_splits"))
def _rows_call(q, kv, rows, sink, *, scale, interpret, softmax, n_splits):
    B, S, H, _ = q.shape
    L = rows.shape[-1]
    if L == 0:
        return jnp.zeros(q.shape, BF16), jnp.broadcast_to(sink.astype(F32), (B, S, H))
    N = kv.shape[1]
    rows = jnp.where(rows >= 0, jnp.minimum(rows, N - 1), -1)
    return _call(q, (rows,), (kv,), sink, n_rows=N, scale=scale, interpret=interpret,
                 softmax=softmax, packed=False, n_splits=n_splits)


def sparse_attention_packed(q: Float[Array, "B S 64 512"], win_kv, win_scale,
                            win_idx: Int[Array, "B S Ww"], main, main_scale,
                            topk: Int[Array, "B S k"] | None, sink: Float[Array, "64"],
                            scale: float, *, softmax: str = "exp2", n_splits: int = 1
                            ) -> tuple[Float[Array, "B S 64 512"], Float[Array, "B S 64"]]:
    """:func:`pallas_kernels.sparse_attention.sparse_attention` over the state's packed rows
    (FP8 window rows + E8M0 scales, packed FP4 main KV + E4M3 scales), the producer warp group
    decoding each listed row into the operand tile (:func:`_decode_rows`; GPU only: PTX).

    Args and results as that op (``win_kv`` float8_e4m3fn [B, Nw, 512], ``win_scale`` uint8
    [B, Nw, 16], ``main`` uint8 [B, T, 256], ``main_scale`` float8_e4m3fn [B, T, 32]; ``topk``
    None for a SWA-only layer); 64 heads x 512, at most ``MAX_LIST`` entries in the joint list
    (window + top-k, padded to 64); ``n_splits`` list splits as
    :func:`sparse_attention_rows`.

    Raises:
      ValueError: other shapes or dtypes, a joint list over ``MAX_LIST``, an unknown
        ``softmax``, ``n_splits < 1``, a GPU that is not Hopper.
    """
    exp_of(softmax)
    _check_splits(n_splits)
    _check_supported(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink)
    if not on_hopper_or_unknown():
        raise ValueError("the Mosaic GPU kernels need a Hopper GPU (sm_90: wgmma, setmaxnreg)")
    B, S, H, K = q.shape
    if topk is None:
        main = main_scale = None
    win_kv, win_scale, main, main_scale = nonempty_rows(win_kv, win_scale, main, main_scale)
    if main is None:   # a dummy main KV that no entry selects
        main = jnp.zeros((B, 1, K // 2), jnp.uint8)
        main_scale = jnp.zeros((B, 1, K // 16), jnp.float8_e4m3fn)
    n_list = win_idx.shape[-1] + (0 if topk is None else topk.shape[-1])
    if -(-n_list // BN) * BN > MAX_LIST:
        raise ValueError(f"win_idx + topk: {n_list} entries (padded to {BN}) exceed the "
                         f"{MAX_LIST} the kernel's shared memory holds")
    n_win, n_main, n_wlist = win_kv.shape[1], main.shape[1], win_idx.shape[-1]
    n_top = 0 if topk is None else topk.shape[-1]
    n_blocks = -(-n_list // BN)
    splits = balanced_splits(n_splits, max(n_blocks, 1))
    u8 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.uint8)
    data = (u8(win_kv), u8(win_scale), u8(main), u8(main_scale))
    if (n_wlist % BN == 0 and n_top % BN == 0 and n_wlist > 0 and n_top > 0
            and n_blocks % splits == 0):
        # whole blocks of each list (the release: 128 + 512): the kernel copies both lists
        # block by block and reads top-k entries as they are (no joint list to build)
        lists = (win_idx.astype(I32), topk.astype(I32))
        n_rows = (n_win, n_main, n_wlist, 0)
    else:
        lists = (joint_list(win_idx, topk, n_win, n_main),)
        n_rows = (n_win, n_main, n_wlist, n_win)
    _check(q, jax.ShapeDtypeStruct((B, 1, K), BF16),
           jax.ShapeDtypeStruct((B, S, n_blocks * BN), I32), sink)   # (shapes and dtypes)
    return _packed_call(q, lists, data, sink, n_rows=n_rows, scale=float(scale),
                        softmax=softmax, n_splits=splits)


@functools.partial(jax.jit, static_argnames=("n_rows", "scale", "softmax", "n_splits"))
def _packed_call(q, lists, data, sink, *, n_rows, scale, softmax, n_splits):
    B, S, H, _ = q.shape
    if sum(x.shape[-1] for x in lists) == 0:
        return jnp.zeros(q.shape, BF16), jnp.broadcast_to(sink.astype(F32), (B, S, H))
    return _call(q, lists, data, sink, n_rows=n_rows, scale=scale, interpret=False,
                 softmax=softmax, packed=True, n_splits=n_splits)


def _check_splits(n_splits):
    if int(n_splits) != n_splits or n_splits < 1:
        raise ValueError(f"n_splits must be an integer >= 1, got {n_splits!r}")


def _call(q, lists, data, sink, *, n_rows, scale, interpret, softmax, packed, n_splits):
    """The kernel over ``lists`` of ``data``: the joint list (int32 [B, S, L], clamped, -1 = no
    entry), or (packed, whole blocks) the window and top-k lists; with list splits, their
    partial states merged by :func:`.common.merge_splits`."""
    B, S, H, K = q.shape
    R = B * S
    split_lists = len(lists) == 2
    n_total = sum(x.shape[-1] for x in lists) // BN if split_lists else None
    if not split_lists:
        (rows,) = lists
        n_total = rows.shape[-1] // BN
        n_splits = balanced_splits(n_splits, n_total)
        if n_splits > 1:   # one list per split (the last padded with -1 entries: zero weight)
            per = -(-n_total // n_splits) * BN
            rows = jnp.pad(rows, ((0, 0), (0, 0), (0, per * n_splits - rows.shape[-1])),
                           constant_values=-1).reshape(B, S * n_splits, per)
        lists = (rows.reshape(R * n_splits, -1),)
    else:   # copied block by block by the kernel: the splits divide the blocks
        lists = tuple(x.reshape(R, -1) for x in lists)
    L = n_total // n_splits * BN if split_lists else lists[0].shape[-1]
    tiled = TILED
    tile_smem = plgpu.SMEM((2, BN, K), BF16, transforms=tiled)
    acc_smem = plgpu.SMEM((2, H, K // 2), F32, transforms=TILED_F32)
    scratch = [
        plgpu.SMEM((H, K), BF16, transforms=tiled),              # q, then the output
        # two row tiles; with list splits on the GPU, the same memory then stages the two
        # consumers' fp32 partial accumulators for their TMA stores
        tile_smem if n_splits == 1 or interpret else plgpu.RefUnion(tile_smem, acc_smem),
        plgpu.SMEM((2, 2, H, HALF_N), BF16, transforms=tiled),  # P halves, by block parity
        plgpu.SMEM((L,), I32),                                   # the row list
        plgpu.SMEM((2, 2, H), F32),                              # score maxima halves
        plgpu.SMEM((2, H), F32),                                 # denominators
        plgpu.SMEM((H,), F32),                                   # sink
        plgpu.SMEM((H,), F32),                                   # lse staging
        # the list: one copy per block (split lists) or per LIST_CHUNK entries
        plgpu.Barrier(num_arrivals=L // BN if split_lists else -(-L // LIST_CHUNK)),
        plgpu.Barrier(num_arrivals=2),                           # q and the sink
        plgpu.Barrier(num_arrivals=1, num_barriers=2),           # tile full (producer)
        plgpu.Barrier(num_arrivals=2, num_barriers=2),           # tile free (consumers)
        plgpu.Barrier(num_arrivals=2),                           # consumers' exchange
    ]
    if interpret:
        scratch.append((plgpu.SMEM((BN, K), BF16), plgpu.Barrier(num_arrivals=BN)))
    kernel = functools.partial(_kernel, S=S, n_blocks=L // BN, n_splits=n_splits,
                               n_rows=n_rows, scale=scale, interpret=interpret,
                               softmax=softmax, packed=packed, split_lists=split_lists)
    name = "csa2_sparse_attention_packed_mgpu" if packed else "csa2_sparse_attention_rows_mgpu"
    outs = row_kernel(kernel, scratch, R * n_splits, num_threads=3, name=name,
                         interpret=interpret, partial=n_splits > 1)(
        q.reshape(R, H, K), *lists, *data, sink.astype(F32))
    if n_splits == 1:
        o, lse = outs
    else:
        acc, m, l = (x.reshape(R, n_splits, *x.shape[1:]) for x in outs)
        o, lse = merge_splits(acc, m, l, sink.astype(F32), softmax=softmax,
                                 interpret=interpret)
    return o.reshape(B, S, H, K), lse.reshape(B, S, H)
