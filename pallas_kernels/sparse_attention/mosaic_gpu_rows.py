"""Warp-specialised Pallas Mosaic GPU (Hopper) kernel of the CSA2 sparse attention over bf16
rows (spec 3.8): the dequantised rows' design of :mod:`.triton_dense` with the warp groups the
Triton kernel cannot own.

One CTA per query row ``(b, s)`` with all 64 heads (they share the row's list: MQA) and three
warp groups (``num_threads=3``, ``thread_name="wg"``):

* **warp group 2, the producer** (40 registers per thread): gathers each 64-entry block's
  listed bf16 rows (1 KiB each) with ``cp.async`` (16 bytes per copy, 32 per thread and block,
  each thread one 16-byte column of 32 rows), straight into the swizzled ``[64, 512]`` operand
  tile the tensor cores read: the 64-byte swizzle of Mosaic GPU's (8 rows x 64 bytes) tiling
  (:data:`TILED`, :func:`tile_byte_offset`) is computed per copy, so no relayout pass and no bf16 copy in HBM.
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

On the H200 (docs/benchmarks.md, session 12): the prefill row (4096 queries x 640 entries,
rows dequantised by XLA first) in 1.01 ms, 339-341 TFLOP/s (the Triton rows' kernel: 1.43
ms); the outputs 99.97% bitwise equal to the XLA path, all within the check's tolerance.
Over bf16 rows at decode shapes (one CTA per query, no list splits) the kernel alone takes
80 us at batch 256 (214 TFLOP/s) and 33 us at batch 8; decode keeps the packed kernel, since
decoding every row once costs more than the attention there.

**Packed rows** (:func:`sparse_attention_packed`, the default for packed rows with 128
programs or more): the producer reads the state's FP8 window rows and packed FP4 main KV
itself and decodes them into the tile (:func:`_decode_rows`: 16-byte loads, the Triton
kernel's PTX decode, swizzled 16-byte shared stores; 72 registers, the consumers 216). H200:
142.8 us at B=256 (150.4 TFLOP/s; Triton's packed kernel 158.6), 99.98% bitwise equal to XLA
at B=8; the producer is its bottleneck (7.3 us per block and SM against 4.1 over bf16 rows).

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

from pallas_kernels.sparse_attention import mosaic_gpu as mg
from pallas_kernels.sparse_attention import triton as tk
from pallas_kernels.sparse_attention.mosaic_gpu import (BF16, F32, H_SUPPORTED, I32,
                                                        K_SUPPORTED, LIST_CHUNK, NEG_START)
from pallas_kernels.sparse_attention.reference import SOFTMAX_BLOCK, lse_with_sink

BN = SOFTMAX_BLOCK    # 64 list entries per block
HALF_N = BN // 2      # entries of a block per consumer's score half
HALF_K = K_SUPPORTED // 2   # output channels per consumer
MAX_LIST = 3072       # padded list entries whose row list fits the shared memory (lowering: 3136 is 48 bytes over)
ROW_BYTES = K_SUPPORTED * 2
COPY_BYTES = 16       # one cp.async
COLS_PER_ROW = ROW_BYTES // COPY_BYTES            # 64 copies per row
ROWS_PER_PASS = 128 // COLS_PER_ROW               # rows one pass of the producer covers (2)
PRODUCER_REGS, CONSUMER_REGS = 40, 232
# the packed producer holds PASS_ROWS rows' words and decodes them: more registers, and the
# consumers give them up. The three warp groups share what the launch allocates, 168 per
# thread (65536 / 384, in steps of 8): producer + 2 x consumer must stay <= 504, or a
# consumer's setmaxnreg increase waits forever (64 + 2 x 224 hung the H200)
PACKED_PRODUCER_REGS, PACKED_CONSUMER_REGS = 72, 216
REG_POOL = 3 * 168
assert PRODUCER_REGS + 2 * CONSUMER_REGS <= REG_POOL
assert PACKED_PRODUCER_REGS + 2 * PACKED_CONSUMER_REGS <= REG_POOL
# the operand tiles' layout (q, rows, P: wgmma needs one swizzle for both operands, and P's
# halves are 32 entries = 64 bytes wide): tiles of 8 rows x 64 bytes, 64-byte swizzle
SWIZZLE = 64
TILED = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


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


def _cp_async_rows(rows_smem, kv_gmem, tile_smem, *, n_rows: int):
    """The producer's copies of one block (GPU): the 64 listed rows (``rows_smem``: int32 [64],
    -1 = no entry: row 0) of ``kv_gmem`` (bf16 [N, 512]) into ``tile_smem`` (bf16 [64, 512],
    the swizzled operand tile), by ``cp.async`` of 16 bytes; then one commit group. Thread t of
    the warp group copies 16-byte column ``t % 64`` of rows ``2 i + t // 64``, i = 0..31, so a
    warp reads 512 contiguous bytes of a row per copy instruction."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(TILED)))
    def copies(ctx, rows_ref, kv_ref, tile_ref):
        del ctx
        m = _Mlir()
        a = m.arith
        col = a.andi(m.lane, m.c(COLS_PER_ROW - 1))          # 16-byte column of the row
        half = a.divui(m.lane, m.c(COLS_PER_ROW))            # which of the pass's rows
        kv_base, tile_base = m.gmem(kv_ref), m.mu.memref_ptr(tile_ref)
        col_bytes = a.extsi(m.i64, a.muli(col, m.c(COPY_BYTES)))
        for i in range(BN // ROWS_PER_PASS):
            r = a.addi(half, m.c(ROWS_PER_PASS * i))
            row = a.minsi(a.maxsi(m.load_i32(rows_ref, r), m.c(0)), m.c(n_rows - 1))
            src = m.at(kv_base, a.addi(m.wide(row, ROW_BYTES), col_bytes))
            dst = m.at(tile_base, tile_byte_offset(m.int(r), m.int(col)).value)
            nvvm.cp_async_shared_global(dst, src, COPY_BYTES, nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_commit_group()

    copies(rows_smem, kv_gmem, tile_smem)


# The packed producer's PTX. A global 16-byte load (read-only path) and a 16-byte shared store.
_LD_V4 = "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];"
_LD_U8 = "ld.global.nc.u8 $0, [$1];"
_ST_V4 = "st.shared.v4.b32 [$0], {$1, $2, $3, $4};"
# An E4M3 scale byte -> the bf16 bits of its value (exact: the hardware's e4m3 -> f16, then
# f16 -> f32 -> bf16, both exact for every e4m3 value; the state never holds the NaN code).
_E4M3_TO_BF16 = """{
.reg .b16 h, lo, hi;
.reg .b32 f;
.reg .f32 x;
cvt.u16.u32 h, $1;
cvt.rn.f16x2.e4m3x2 f, h;
mov.b32 {lo, hi}, f;
cvt.f32.f16 x, lo;
cvt.rn.bf16.f32 lo, x;
cvt.u32.u16 $0, lo;
}"""
PASS_ROWS = 4   # rows whose packed words one producer thread holds at a time (loads in flight)


def _decode_rows(rows_smem, wkv, wsc, mkv, msc, tile_smem, *, n_win: int, n_main: int):
    """The packed producer's block (GPU): the 64 listed rows of the joint list ``rows_smem``
    (int32 [64]: window row e < ``n_win``, main-KV entry ``e - n_win`` otherwise, -1 = no
    entry: window row 0) decoded from the state's storage into ``tile_smem`` (bf16 [64, 512],
    the swizzled operand tile): window rows ``wkv`` (uint8 [Nw, 512] e4m3 codes) with ``wsc``
    (uint8 [Nw, 16] E8M0 scales), main KV ``mkv`` (uint8 [T, 256], two e2m1 codes per byte,
    channel 2j in the low nibble) with ``msc`` (uint8 [T, 32] E4M3 scales).

    Thread t decodes the 32 channels ``32 (t % 16) ..`` of rows ``t // 16 + 8 i`` (i = 0..7, in
    two passes of :data:`PASS_ROWS` rows whose loads are issued first, so they are in flight
    together). Every row issues two 16-byte loads and two scale-byte loads, their addresses
    chosen per row by ``select``: a window row's 32 bytes of e4m3 codes and its E8M0 byte
    (twice), a main entry's 16 bytes of e2m1 codes (twice: the second load is not used) and its
    two E4M3 bytes; then one branch per row (``scf.if``) decodes by the row's kind with the
    Triton kernel's PTX (:func:`.triton.decode_ptx`: two codes per template, exact) on each
    word and the word shifted by one code, so each template gives two adjacent channels; four
    16-byte shared stores at the swizzled chunks. (A main row's second load and a window row's
    second scale load are wasted: the producer is the packed kernel's bottleneck, a lead.)
    The E8M0 byte 0 decodes to 0, not 2^-127 (as the Triton kernel; the quantisers never
    write it)."""
    from jax._src.lib.mlir.dialects import scf

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 5 + (plgpu.RefType(TILED),))
    def decode(ctx, rows_ref, wkv_ref, wsc_ref, mkv_ref, msc_ref, tile_ref):
        del ctx
        m = _Mlir()
        a, ptx, i32 = m.arith, m.mu.inline_ptx, m.i32
        unit = a.andi(m.lane, m.c(15))                      # 32-channel unit of the row
        first = a.shrui(m.lane, m.c(4))                     # first row (of 8 rows apart)
        wk, ws, mk, ms = (m.gmem(r) for r in (wkv_ref, wsc_ref, mkv_ref, msc_ref))
        tile_base = m.mu.memref_ptr(tile_ref)
        i64 = lambda x: a.extsi(m.i64, x)                   # noqa: E731

        def pair(fmt, word, nxt, sc):
            return ptx(tk.decode_ptx(fmt, 0, 0), word, nxt, sc, sc, result_types=i32)

        for p in range(BN // 8 // PASS_ROWS):
            held = []
            for i in range(PASS_ROWS):
                r = a.addi(first, m.c(8 * (p * PASS_ROWS + i)))
                e = a.maxsi(m.load_i32(rows_ref, r), m.c(0))
                win = a.cmpi(a.CmpIPredicate.slt, e, m.c(n_win))
                wrow = a.minsi(e, m.c(n_win - 1))
                mrow = a.minsi(a.maxsi(a.subi(e, m.c(n_win)), m.c(0)), m.c(n_main - 1))
                w_codes = m.at(wk, a.addi(m.wide(wrow, 512), i64(a.muli(unit, m.c(32)))))
                m_codes = m.at(mk, a.addi(m.wide(mrow, 256), i64(a.muli(unit, m.c(16)))))
                w_sc = m.at(ws, a.addi(m.wide(wrow, 16), i64(unit)))
                m_sc = m.at(ms, a.addi(m.wide(mrow, 32), i64(a.muli(unit, m.c(2)))))
                lo = a.select(win, w_codes, m_codes)
                hi = a.select(win, m.at(w_codes, m.c(16)), m_codes)
                words = [*ptx(_LD_V4, lo, result_types=[i32] * 4),
                         *ptx(_LD_V4, hi, result_types=[i32] * 4)]
                sc0 = ptx(_LD_U8, a.select(win, w_sc, m_sc), result_types=i32)
                sc1 = ptx(_LD_U8, a.select(win, w_sc, m.at(m_sc, m.c(1))), result_types=i32)
                held.append((r, win, words, sc0, sc1))
            for r, win, words, sc0, sc1 in held:
                branch = scf.IfOp(win, [i32] * 16, has_else=True)
                with m.ir.InsertionPoint(branch.then_block):   # e4m3: 4 codes per word
                    sc = a.shli(sc0, m.c(7))                       # E8M0 -> bf16 bits
                    out = []
                    for w in words:
                        nxt = a.shrui(w, m.c(8))
                        out += [pair("e4m3", w, nxt, sc),
                                pair("e4m3", a.shrui(w, m.c(16)), a.shrui(w, m.c(24)), sc)]
                    scf.YieldOp(out)
                with m.ir.InsertionPoint(branch.else_block):   # e2m1: 8 codes per word
                    scs = [ptx(_E4M3_TO_BF16, x, result_types=i32) for x in (sc0, sc1)]
                    out = []
                    for j, w in enumerate(words[:4]):
                        for k in range(4):
                            byte = a.shrui(w, m.c(8 * k))
                            out.append(pair("e2m1", byte, a.shrui(byte, m.c(4)), scs[j // 2]))
                    scf.YieldOp(out)
                vals = list(branch.results)
                for c in range(4):
                    chunk = a.addi(a.muli(unit, m.c(4)), m.c(c))
                    dst = m.at(tile_base, tile_byte_offset(m.int(r), m.int(chunk)).value)
                    ptx(_ST_V4, dst, *vals[4 * c:4 * c + 4], has_side_effects=True)

    decode(rows_smem, wkv, wsc, mkv, msc, tile_smem)


def _cp_async_wait(n: int):
    """Wait until at most ``n`` of this thread's ``cp.async`` groups are pending (GPU)."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(n)

    wait()


def _kernel(q_ref, rows_ref, *refs, S, n_blocks, n_rows, scale, interpret, softmax, packed):
    """Refs: q, the row list, the rows (bf16 ``kv``; with ``packed`` the window codes and
    scales and the main-KV codes and scales), sink, then o, lse, then the scratch."""
    n_data = 4 if packed else 1
    data, (sink_ref, o_ref, lse_ref) = refs[:n_data], refs[n_data:n_data + 3]
    (q_smem, tiles, p_smem, rows_smem, mx_smem, l_smem, sink_smem, lse_smem,
     in_bar, full, free, xchg, *staging) = refs[n_data + 3:]
    rid = lax.axis_index("row")
    b = rid // S
    wg = lax.axis_index("wg")
    L = n_blocks * BN
    row_layout = plgpu.Layout.WGMMA.reduce(1)   # per head (row of the S / O tiles)
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # per entry (column of S)
    exp = tk.exp_of(softmax)

    # ---- per-row inputs: q (consumers), the row list, the sink ----
    pl.when(wg == 0)(lambda: mg.load_row_inputs(in_bar, rid, q_ref, q_smem, rows_ref, rows_smem,
                                                L, (sink_ref, sink_smem)))
    plgpu.barrier_wait(in_bar)

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
                n_win, n_main = n_rows
                _decode_rows(block_rows, *(d.at[b] for d in data), tiles.at[slot],
                             n_win=n_win, n_main=n_main)
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

        def sync():
            plgpu.barrier_arrive(xchg)
            plgpu.barrier_wait(xchg)

        def block(j, carry):
            acc, m_i, l_i = carry
            slot, par = j % 2, j % 2
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

        # ---- epilogue: both denominators, the sink, bf16 output through q's buffer ----
        l_smem.at[wg][...] = l_i
        sync()          # (both warp groups' last score products are done: q is free)
        l_tot = (plgpu.load(l_smem.at[0], layout=row_layout)
                 + plgpu.load(l_smem.at[1], layout=row_layout))
        sink = plgpu.load(sink_smem, layout=row_layout)
        den = l_tot + exp(sink - m_i)
        o = acc / lax.broadcast_in_dim(den, acc.shape, [0])
        mg.store_row_outputs(q_smem, o_ref, lse_smem, lse_ref, rid, wg,
                             pl.ds(wg * HALF_K, HALF_K), o.astype(BF16),
                             lse_with_sink(m_i, l_tot, sink))


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
                         f"blocks (pad with -1: triton_dense.joint_list)")
    if rows.shape[-1] > MAX_LIST:
        raise ValueError(f"rows: at most {MAX_LIST} entries fit the shared memory, got "
                         f"{rows.shape[-1]}")
    if sink.shape != (H_SUPPORTED,):
        raise ValueError(f"sink: expected shape ({H_SUPPORTED},), got {sink.shape}")


def sparse_attention_rows(q: Float[Array, "B S 64 512"], kv: Float[Array, "B N 512"],
                          rows: Int[Array, "B S L"], sink: Float[Array, "64"], scale: float, *,
                          interpret: bool = False, softmax: str = "exp2"
                          ) -> tuple[Float[Array, "B S 64 512"], Float[Array, "B S 64"]]:
    """The joint sink softmax of each query over its listed bf16 rows (spec 3.8), by the
    warp-specialised kernel.

    Args:
      q: bf16 [B, S, 64, 512] queries.
      kv: bf16 [B, N, 512] rows (:func:`.triton_dense.dense_rows`), N >= 1.
      rows: int32 [B, S, L] rows of ``kv`` per query in the reference's order, -1 = no entry,
        L a multiple of 64 and at most ``MAX_LIST`` (:func:`.triton_dense.joint_list`);
        entries past the end read the last row.
      sink: fp32 [64] sink logits. scale: the softmax scale (static).
      interpret: Mosaic GPU interpret mode (CPU; slow, for tests).
      softmax: the exponential, ``"exp2"`` (``exp2(x log2 e)``, the Triton kernels' default)
        or ``"exp"`` (:func:`.triton.exp_of`).

    Returns:
      ``(o bf16 [B, S, 64, 512], lse fp32 [B, S, 64])``, as
      :func:`pallas_kernels.sparse_attention.sparse_attention`.

    Raises:
      ValueError: shapes or dtypes other than the above, an unknown ``softmax``, a GPU that is
        not Hopper (outside interpret mode).
    """
    _check(q, kv, rows, sink)
    tk.exp_of(softmax)   # ValueError for an unknown name
    if not interpret and not on_hopper_or_unknown():
        raise ValueError("the Mosaic GPU kernels need a Hopper GPU (sm_90: wgmma, setmaxnreg)")
    call = functools.partial(_rows_call, scale=float(scale), interpret=interpret,
                             softmax=softmax)
    if interpret:   # eager: see mosaic_gpu.sparse_attention (interpreter callbacks on 2 cores)
        with jax.disable_jit():
            return call(q, kv, rows, sink)
    return call(q, kv, rows, sink)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "softmax"))
def _rows_call(q, kv, rows, sink, *, scale, interpret, softmax):
    B, S, H, _ = q.shape
    L = rows.shape[-1]
    if L == 0:
        return jnp.zeros(q.shape, BF16), jnp.broadcast_to(sink.astype(F32), (B, S, H))
    N = kv.shape[1]
    rows = jnp.where(rows >= 0, jnp.minimum(rows, N - 1), -1)
    return _call(q, rows, (kv,), sink, n_rows=N, scale=scale, interpret=interpret,
                 softmax=softmax, packed=False)


def sparse_attention_packed(q: Float[Array, "B S 64 512"], win_kv, win_scale,
                            win_idx: Int[Array, "B S Ww"], main, main_scale,
                            topk: Int[Array, "B S k"] | None, sink: Float[Array, "64"],
                            scale: float, *, softmax: str = "exp2"
                            ) -> tuple[Float[Array, "B S 64 512"], Float[Array, "B S 64"]]:
    """:func:`pallas_kernels.sparse_attention.sparse_attention` over the state's packed rows
    (FP8 window rows + E8M0 scales, packed FP4 main KV + E4M3 scales), the producer warp group
    decoding each listed row into the operand tile (:func:`_decode_rows`; GPU only: PTX).

    Args and results as that op (``win_kv`` float8_e4m3fn [B, Nw, 512], ``win_scale`` uint8
    [B, Nw, 16], ``main`` uint8 [B, T, 256], ``main_scale`` float8_e4m3fn [B, T, 32]; ``topk``
    None for a SWA-only layer); 64 heads x 512, at most ``MAX_LIST`` entries in the joint list
    (window + top-k, padded to 64).

    Raises:
      ValueError: other shapes or dtypes, a joint list over ``MAX_LIST``, an unknown
        ``softmax``, a GPU that is not Hopper.
    """
    from pallas_kernels.sparse_attention import triton_dense as td
    tk.exp_of(softmax)
    mg._check_supported(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink)
    if not on_hopper_or_unknown():
        raise ValueError("the Mosaic GPU kernels need a Hopper GPU (sm_90: wgmma, setmaxnreg)")
    B, S, H, K = q.shape
    if topk is None:
        main = main_scale = None
    win_kv, win_scale, main, main_scale = tk.nonempty_rows(win_kv, win_scale, main, main_scale)
    if main is None:   # a dummy main KV that no entry selects
        main = jnp.zeros((B, 1, K // 2), jnp.uint8)
        main_scale = jnp.zeros((B, 1, K // 16), jnp.float8_e4m3fn)
    n_list = win_idx.shape[-1] + (0 if topk is None else topk.shape[-1])
    if -(-n_list // BN) * BN > MAX_LIST:
        raise ValueError(f"win_idx + topk: {n_list} entries (padded to {BN}) exceed the "
                         f"{MAX_LIST} the kernel's shared memory holds")
    n_win, n_main = win_kv.shape[1], main.shape[1]
    rows = td.joint_list(win_idx, topk, n_win, n_main)
    _check(q, jnp.zeros((B, 1, K), BF16), rows, sink)   # (shapes only: traced away)
    u8 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.uint8)
    return _packed_call(q, rows, (u8(win_kv), u8(win_scale), u8(main), u8(main_scale)), sink,
                        n_rows=(n_win, n_main), scale=float(scale), softmax=softmax)


@functools.partial(jax.jit, static_argnames=("n_rows", "scale", "softmax"))
def _packed_call(q, rows, data, sink, *, n_rows, scale, softmax):
    B, S, H, _ = q.shape
    if rows.shape[-1] == 0:
        return jnp.zeros(q.shape, BF16), jnp.broadcast_to(sink.astype(F32), (B, S, H))
    return _call(q, rows, data, sink, n_rows=n_rows, scale=scale, interpret=False,
                 softmax=softmax, packed=True)


def _call(q, rows, data, sink, *, n_rows, scale, interpret, softmax, packed):
    """The kernel over ``rows`` (int32 [B, S, L], clamped, -1 = no entry) of ``data``."""
    B, S, H, K = q.shape
    L = rows.shape[-1]
    R = B * S
    tiled = TILED
    scratch = [
        plgpu.SMEM((H, K), BF16, transforms=tiled),              # q, then the output
        plgpu.SMEM((2, BN, K), BF16, transforms=tiled),          # two row tiles
        plgpu.SMEM((2, 2, H, HALF_N), BF16, transforms=tiled),  # P halves, by block parity
        plgpu.SMEM((L,), I32),                                   # the row list
        plgpu.SMEM((2, 2, H), F32),                              # score maxima halves
        plgpu.SMEM((2, H), F32),                                 # denominators
        plgpu.SMEM((H,), F32),                                   # sink
        plgpu.SMEM((H,), F32),                                   # lse staging
        plgpu.Barrier(num_arrivals=2 + -(-L // LIST_CHUNK)),     # per-row inputs
        plgpu.Barrier(num_arrivals=1, num_barriers=2),           # tile full (producer)
        plgpu.Barrier(num_arrivals=2, num_barriers=2),           # tile free (consumers)
        plgpu.Barrier(num_arrivals=2),                           # consumers' exchange
    ]
    if interpret:
        scratch.append((plgpu.SMEM((BN, K), BF16), plgpu.Barrier(num_arrivals=BN)))
    kernel = functools.partial(_kernel, S=S, n_blocks=L // BN, n_rows=n_rows, scale=scale,
                               interpret=interpret, softmax=softmax, packed=packed)
    name = "csa2_sparse_attention_packed_mgpu" if packed else "csa2_sparse_attention_rows_mgpu"
    o, lse = mg.row_kernel(kernel, scratch, R, num_threads=3, name=name, interpret=interpret)(
        q.reshape(R, H, K), rows.reshape(R, L), *data, sink.astype(F32))
    return o.reshape(B, S, H, K), lse.reshape(B, S, H)
