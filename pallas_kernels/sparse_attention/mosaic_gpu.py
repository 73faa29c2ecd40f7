"""Pallas Mosaic GPU (Hopper, ``plgpu``) prototype of the CSA2 sparse attention op (spec 3.8).

FlashMLA-like structure: one CTA per query row ``(b, s)`` with all 64 heads (the heads share
the row's index list, MQA), the listed KV rows gathered by per-row TMA copies and dequantised
once into one bf16 ``[64 entries, 512]`` SMEM tile that is the wgmma operand of both products:
``S = Q K^T`` (the tile viewed transposed) and ``O += bf16(P) V``.

Warpgroups (``num_threads=2``, ``thread_name="wg"``): two consumer warpgroups, no separate
memory warpgroup yet. Warpgroup 0 issues the TMA gathers of a block (64 data rows + 64 scale
copies onto one barrier) one block ahead: the copies of block ``j + 1`` are issued as soon as
block ``j``'s staging has been decoded, so they overlap block ``j``'s two matmuls and softmax.
Both warpgroups dequantise half of the block's channels into the shared tile (barrier), then
each computes the full score tile ``[64 heads, 64 entries]`` (one wgmma, duplicated) and the
PV product of its half of the channels (``[64, 256]`` f32 accumulator: 128 registers per
thread), then a second barrier frees the tile for the next block.

Channel permutation (no register shuffles in the decode): byte ``j`` of a main row holds
channels ``2j`` (low nibble) and ``2j + 1`` (high nibble), and a window row read as uint16 words
holds channels ``2j`` (low byte) and ``2j + 1`` (high byte). The tile stores ``[even channels |
odd channels]``: warpgroup 0 decodes the low halves of all words (columns 0..255), warpgroup 1
the high halves (256..511). ``q`` is permuted the same way in the wrapper and ``o`` un-permuted
after the kernel; the scores do not depend on the channel order.

Per-group scales without broadcasts: the scale of tile column ``i`` (either half) is group
``i // 8`` of a main row (one E4M3 per 16 channels) or ``i // 16`` of a window row (one E8M0 per
32). The kernel expands them with the tensor cores: ``SC = A @ E`` (one wgmma, K = 64), where
``E [64, 256]`` is a constant 0/1 kernel input (rows 0..31: ``E[g, i] = (i // 8 == g)``, rows
32..47: ``E[32 + g, i] = (i // 16 == g)``, rows 48..63 zero) and ``A [64 rows, 64]`` (bf16,
exact) holds each row's decoded scales: a main row's in columns 0..31, a window row's in
columns 32..47, zero elsewhere. ``A`` comes from one 128-byte TMA copy per row (copies must
move a multiple of 128 bytes) starting at the row's first scale byte, from the scales viewed as
flat byte rows; the window scales get 32 zero bytes in front (a copy of the small window
array) so that their bytes land in columns 32..47. The bytes of the other rows that come along
are masked off. ``SC`` lands in the WGMMA register layout, the layout the codes are loaded in,
so the dequant is elementwise: ``tile = bf16(code_value * SC)`` (exact). The block that holds
both window and main rows (at most one: the list is the window list followed by the top-k
list; its row kinds are static) selects per row.

Softmax: the reference's online recursion over 64-entry blocks in list order, running max
from -1e30, ``bf16(P)`` in the PV product, fp32 ``P`` in the denominator, the sink added at the
end; -1 entries copy a clamped row and get the score -inf (exactly zero weight).

Budgets. SMEM (bytes): q 64 Ki + tile 64 Ki (bf16 [64, 512], (8, 64) tiles, 128-byte
swizzle; the tile doubles as the output staging) + window staging 32 Ki (uint16 [64, 256]) +
main staging 16 Ki (uint8 [64, 256]) + scale staging 8 Ki ([64, 128]: TMA copies must move a
multiple of 128 bytes, so each row's 16 / 32 scale bytes come with the next rows' bytes, masked
off) + E 32 Ki (bf16 [64, 256]) + the row list 4 N (N = padded list length) + sink / lse 512
+ barriers and alignment, about 220 Ki + 4 N of the 227 Ki; measured by the lowering, N = 1536
fits and N = 1600 is 32 bytes over (allocations are aligned), so lists of up to 1536 entries
(ValueError beyond; the release model lists 128 + 512). Interpret mode adds 16 Ki (wgmma A
operands through SMEM). Registers per consumer thread (estimate, not measured: no ptxas
here): PV accumulator 128 (f32 [64, 256] over 128 threads) + S / P 32 + the scale tile SC and
the codes of one 64-column chunk during the dequant (32 + 32, transient); no
``set_max_registers`` (two warpgroups: up to 255 each).

Lowering: Lane semantics (``CompilerParams(lowering_semantics=Lane)``; with the default
Warpgroup semantics the layout inference search did not finish in 5 minutes). The staging
buffers are plain row-major SMEM (per-row TMA destinations), read with
``plgpu.load(..., layout=WGMMA, optimized=False)``: no bank-conflict-free transfer plan exists
for them, so these loads are the slow path (a tuning target: swizzled staging).

The kernel is named ``csa2_sparse_attention_mgpu`` in profiles (``scripts/ncu_stalls.py
profile --impl mosaic_gpu --kernel csa2``).

Requirements: H == 64 heads, K == 512 channels (Hopper wgmma; GPU only, or Mosaic GPU interpret
mode on CPU). Raises ``ValueError`` for other shapes. The E8M0 window scale byte 0 (2**-127) is
decoded as 0 (the quantisers never write it); fp8 NaN codes are not expected in the state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.sparse_attention.reference import SOFTMAX_BLOCK, lse_with_sink, pad_list
from pallas_kernels.sparse_attention.triton import e2m1_over_16384, e4m3_over_256

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32
NEG_START = -1e30   # the reference kernel's initial running max
H_SUPPORTED = 64
K_SUPPORTED = 512
BN = SOFTMAX_BLOCK  # 64 list entries per block
HALF = K_SUPPORTED // 2
WIN_GROUPS = K_SUPPORTED // 32    # E8M0 scales per window row (16)
MAIN_GROUPS = K_SUPPORTED // 16   # E4M3 scales per main row (32)
DEQ_CH = 64   # tile columns dequantised per step (scale matmul N)
LIST_CHUNK = 256   # list entries per TMA copy (a box holds <= 256 per dimension)
MAX_LIST = 1536   # list entries (padded) whose row list fits the SMEM left
SC_K = 64   # the scale matmul's K (wgmma: a multiple of 64 bf16)
SC_BYTES = 128   # bytes per TMA copy of a row's scales (copies must move a multiple of 128)


def scale_expand_matrix() -> np.ndarray:
    """E [64, 256]: ``E[g, i] = 1`` if tile column ``i`` (of either half) uses main scale group
    ``g`` (rows 0..31: ``i // 8``) or window scale group ``g - 32`` (rows 32..47: ``i // 16``);
    rows 48..63 are zero."""
    i = np.arange(HALF)[None, :]
    g = np.arange(SC_K)[:, None]
    main = (g < MAIN_GROUPS) & (i // 8 == g)
    win = (g >= MAIN_GROUPS) & (g < MAIN_GROUPS + WIN_GROUPS) & (i // 16 == g - MAIN_GROUPS)
    return (main | win).astype(np.float32)


def permute_channels(x):
    """``[..., K]`` -> ``[..., K]`` in the tile's channel order: even channels, then odd ones."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def unpermute_channels(x):
    """Inverse of :func:`permute_channels`."""
    k = x.shape[-1] // 2
    return jnp.stack([x[..., :k], x[..., k:]], axis=-1).reshape(x.shape)


# ---- decodes (int32 code arrays -> fp32 values), elementwise in any register layout ----------

def _e4m3_value(byte):
    """e4m3fn byte (int32 0..255) -> fp32 value, exactly (the NaN code is not expected), by
    fp16 bit placement (:func:`triton.e4m3_over_256`: a handful of integer instructions and
    one conversion; no f32 subnormals, so flush-to-zero cannot change it)."""
    return e4m3_over_256(byte) * 256.0


def _e2m1_value(code):
    """e2m1 code (int32 0..15) -> fp32 value, exactly, by fp16 bit placement
    (:func:`triton.e2m1_over_16384`)."""
    return e2m1_over_16384(code) * 16384.0


def _e8m0_value(byte):
    """E8M0 scale byte (int32 1..254) -> 2**(byte - 127) (byte 0 -> 0)."""
    return lax.bitcast_convert_type(byte << 23, F32)


# ---- the kernel ------------------------------------------------------------------------------

# ---- the parts every per-query-row kernel here shares ---------------------------------------

def copy_list(bar, src, dst, n_list: int) -> int:
    """TMA copies of a row list ``src`` (int32 GMEM ref [n_list]) into ``dst`` (SMEM) onto
    ``bar``, in boxes of at most ``LIST_CHUNK`` entries (a TMA box holds <= 256 per dimension);
    returns the number of copies (``bar``'s arrivals)."""
    for c in range(0, n_list, LIST_CHUNK):
        n = min(LIST_CHUNK, n_list - c)
        plgpu.copy_gmem_to_smem(src.at[pl.ds(c, n)], dst.at[pl.ds(c, n)], bar)
    return -(-n_list // LIST_CHUNK)


def load_row_inputs(bar, rid, q_ref, q_smem, rows_ref, rows_smem, n_list: int, *pairs):
    """TMA copies of query row ``rid``'s inputs onto ``bar`` (one arrival each): q, its row list
    (:func:`copy_list`) and the ``(src, dst)`` ``pairs`` (sink, ...). Call from one warp group;
    ``bar`` expects ``1 + ceil(n_list / LIST_CHUNK) + len(pairs)`` arrivals."""
    plgpu.copy_gmem_to_smem(q_ref.at[rid], q_smem, bar)
    copy_list(bar, rows_ref.at[rid], rows_smem, n_list)
    for src, dst in pairs:
        plgpu.copy_gmem_to_smem(src, dst, bar)


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
    softmax state for :func:`.triton.merge_splits`: acc fp32 [R, 64, 512], m and l fp32
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


def _kernel(q_ref, rows_ref, wkv_ref, wsc_ref, mkv_ref, msc_ref, e_ref,
            sink_ref, o_ref, lse_ref,
            q_smem, tile, wst, mst, sst, rows_smem, e_smem,
            sink_smem, lse_smem, in_bar, kv_bar, ready_bar, done_bar, *a_smem,
            S, n_win, n_blocks, scale, pv_in_place):
    rid = lax.axis_index("row")
    n_list = n_blocks * BN
    b = rid // S
    wg = lax.axis_index("wg")
    n_wfull = n_win // BN                      # blocks of window rows only
    w_rem = n_win % BN                         # window rows in the mixed block
    has_mixed = w_rem != 0 and n_blocks > n_wfull
    main_start = n_wfull + int(has_mixed)      # first block of main rows only

    def kind_of(j: int) -> str:
        return "win" if j < n_wfull else ("mixed" if j < main_start else "main")

    # ---- the per-row inputs: q, the row list (clamped; -1 = no entry), E, sink ----
    pl.when(wg == 0)(lambda: load_row_inputs(in_bar, rid, q_ref, q_smem, rows_ref, rows_smem,
                                             n_list, (e_ref, e_smem), (sink_ref, sink_smem)))
    plgpu.barrier_wait(in_bar)

    def issue(j, kind: str):
        """TMA gathers of block j's 64 rows (data + scales) onto kv_bar (128 arrivals), issued
        in loops over the rows (unrolled, the copies of the three block kinds made the kernel
        17.5K SASS instructions and a quarter of its stall samples instruction fetches)."""
        def copy_rows(lo: int, hi: int, win: bool):
            kv_ref, sc_ref, staging, groups = ((wkv_ref, wsc_ref, wst, WIN_GROUPS) if win else
                                               (mkv_ref, msc_ref, mst, MAIN_GROUPS))

            def body(r, carry):
                row = jnp.maximum(rows_smem[j * BN + r], 0)   # -1: copy row 0, score masked
                plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(row, 1)], staging.at[pl.ds(r, 1)],
                                        kv_bar)
                plgpu.copy_gmem_to_smem(sc_ref.at[b, pl.ds(row * groups, SC_BYTES)],
                                        sst.at[r], kv_bar)
                return carry
            if hi > lo:
                lax.fori_loop(lo, hi, body, 0)

        if kind == "mixed":
            copy_rows(0, w_rem, True)
            copy_rows(w_rem, BN, False)
        else:
            copy_rows(0, BN, kind == "win")

    def issue_dynamic(j):
        """issue(j) for a traced block number j (one branch per block kind)."""
        if n_wfull:
            pl.when(j < n_wfull)(lambda: issue(j, "win"))
        if has_mixed:
            pl.when(j == n_wfull)(lambda: issue(j, "mixed"))
        if main_start < n_blocks:
            pl.when((j >= main_start) & (j < n_blocks))(lambda: issue(j, "main"))

    @pl.when(wg == 0)
    def _():
        issue(0, kind_of(0))

    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)   # per head (row of the S / O tiles)
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # per entry (column of S)

    def dequant(kind: str):
        """This warpgroup's half of the block's channels -> tile[:, wg*256 : wg*256+256], in
        column chunks of DEQ_CH (bounds the live registers: SC and codes of one chunk)."""
        # A [64 rows, 64] (the wgmma K is a multiple of 64) from each row's 128-byte scale
        # copy: a main row's E4M3 scales in columns 0..31, a window row's E8M0 scales in
        # columns 32..47; every other column (other rows' bytes) is zeroed.
        raw = plgpu.load(sst.at[:, :SC_K], layout=wgmma_layout, optimized=False).astype(I32)
        col = plgpu.broadcasted_iota(I32, (BN, SC_K), 1, layout=wgmma_layout)
        win_cols = (col >= MAIN_GROUPS) & (col < MAIN_GROUPS + WIN_GROUPS)
        if kind == "win":
            a = jnp.where(win_cols, _e8m0_value(raw), 0.0)
        elif kind == "main":
            a = jnp.where(col < MAIN_GROUPS, _e4m3_value(raw), 0.0)
        else:
            row = plgpu.broadcasted_iota(I32, (BN, SC_K), 0, layout=wgmma_layout)
            a = jnp.where(win_cols & (row < w_rem), _e8m0_value(raw),
                          jnp.where((col < MAIN_GROUPS) & (row >= w_rem), _e4m3_value(raw),
                                    0.0))
        a = operand_a(a.astype(BF16))

        for c in range(HALF // DEQ_CH):
            cols = pl.ds(c * DEQ_CH, DEQ_CH)

            def scale_chunk(acc_ref):
                plgpu.wgmma(acc_ref, a, e_smem.at[:, cols])
                return acc_ref[...]
            sc = pl.run_scoped(scale_chunk, plgpu.ACC((BN, DEQ_CH), F32))
            if kind in ("win", "mixed"):
                words = plgpu.load(wst.at[:, cols], layout=wgmma_layout,
                                   optimized=False).astype(I32)
                wval = _e4m3_value((words >> (8 * wg)) & 255)
            if kind in ("main", "mixed"):
                codes = plgpu.load(mst.at[:, cols], layout=wgmma_layout,
                                   optimized=False).astype(I32)
                mval = _e2m1_value((codes >> (4 * wg)) & 15)
            if kind == "win":
                val = wval
            elif kind == "main":
                val = mval
            else:
                row_ids = plgpu.broadcasted_iota(I32, (BN, DEQ_CH), 0, layout=wgmma_layout)
                val = jnp.where(row_ids < w_rem, wval, mval)
            tile.at[:, pl.ds(wg * HALF + c * DEQ_CH, DEQ_CH)][...] = (val * sc).astype(BF16)

    def operand_a(x):
        """A bf16 [64, 64] wgmma A operand: from registers on the GPU; through SMEM in interpret
        mode (its wgmma reads A from SMEM only)."""
        if not a_smem:
            return x
        a_smem[0].at[wg][...] = x
        plgpu.commit_smem()
        return a_smem[0].at[wg]

    def sync(bar):
        plgpu.barrier_arrive(bar)
        plgpu.barrier_wait(bar)

    def block(j, carry, kind: str):
        acc, m_i, l_i = carry
        plgpu.barrier_wait(kv_bar)
        dequant(kind)
        plgpu.commit_smem()          # tile writes visible to the wgmma (async proxy)
        sync(ready_bar)              # both halves written; staging free again

        @pl.when(wg == 0)
        def _():
            issue_dynamic(j + 1)     # the next block's gathers overlap this block's math

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, tile.transpose((1, 0)))
            return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((H_SUPPORTED, BN), F32))
        listed = plgpu.load(rows_smem.at[pl.ds(j * BN, BN)], layout=col_layout)
        s = jnp.where(lax.broadcast_in_dim(listed, s.shape, [1]) >= 0, s * scale, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        v = tile.at[:, pl.ds(wg * HALF, HALF)]
        if pv_in_place:              # the wgmma accumulates into the rescaled registers
            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(BF16), v)
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        else:                        # interpret mode cannot run pl.run_state / ACC.init
            def pv(acc_ref):
                plgpu.wgmma(acc_ref, operand_a(p.astype(BF16)), v)
                return acc_ref[...]
            acc = acc + pl.run_scoped(pv, plgpu.ACC((H_SUPPORTED, HALF), F32))
        sync(done_bar)               # both PV products done: the tile may be overwritten
        return acc, m_new, l_i

    acc = plgpu.layout_cast(jnp.zeros((H_SUPPORTED, HALF), F32), wgmma_layout)
    m_i = plgpu.layout_cast(jnp.full((H_SUPPORTED,), NEG_START, F32), row_layout)
    l_i = plgpu.layout_cast(jnp.zeros((H_SUPPORTED,), F32), row_layout)
    carry = (acc, m_i, l_i)
    if n_wfull:
        carry = lax.fori_loop(0, n_wfull, functools.partial(block, kind="win"), carry)
    if has_mixed:
        carry = block(n_wfull, carry, "mixed")
    if main_start < n_blocks:
        carry = lax.fori_loop(main_start, n_blocks, functools.partial(block, kind="main"), carry)
    acc, m_i, l_i = carry

    # ---- epilogue: sink in the denominator, lse, bf16 output through the (free) tile ----
    sink = plgpu.load(sink_smem, layout=row_layout)
    den = l_i + jnp.exp(sink - m_i)
    o = acc / lax.broadcast_in_dim(den, acc.shape, [0])
    store_row_outputs(tile, o_ref, lse_smem, lse_ref, rid, wg, pl.ds(wg * HALF, HALF),
                      o.astype(BF16), lse_with_sink(m_i, l_i, sink))


def _flat_scales(sc, front: int = 0):
    """uint8 [B, T, G] -> [B, front + T * G] bytes (at least SC_BYTES), ``front`` zero bytes
    first (a free reshape when front = 0 and the array is not tiny)."""
    flat = sc.reshape(sc.shape[0], -1)
    back = max(SC_BYTES - front - flat.shape[1], 0)
    if front or back:
        flat = jnp.pad(flat, ((0, 0), (front, back)))
    return flat


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


def sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
                     interpret: bool = False):
    """Mosaic GPU implementation of :func:`pallas_kernels.sparse_attention.sparse_attention`.

    Args:
      q: bf16 [B, S, 64, 512] queries.
      win_kv: float8_e4m3fn [B, Nw, 512] window rows; win_scale: uint8 [B, Nw, 16] E8M0.
      win_idx: int32 [B, S, Ww] rows of ``win_kv``, -1 = no entry.
      main: uint8 [B, T, 256] packed e2m1 (element 2j in the low nibble); main_scale:
        float8_e4m3fn [B, T, 32].
      topk: int32 [B, S, k] rows of ``main``, -1 = no entry; None for a SWA-only layer.
      sink: fp32 [64] sink logits. scale: softmax scale (static).
      interpret: run in Mosaic GPU interpret mode (CPU; slow, for tests).

    Returns:
      ``(o bf16 [B, S, 64, 512], lse fp32 [B, S, 64])``, as
      :func:`reference.sparse_attention_xla`. Indices past the end read the last row (as the
      XLA gather). Requires H == 64 and K == 512 and a padded list of at most ``MAX_LIST``
      entries (ValueError otherwise).

    Interpret mode runs eagerly (``jax.disable_jit``): under jit, the interpreter's blocking
    barrier callbacks and the outer thread-map callback can occupy every XLA:CPU worker thread
    on a small machine (seen on 2 cores) and deadlock; eager, the outer callback runs in Python.
    """
    args = (q, win_kv, win_scale, win_idx, main, main_scale, topk, sink)
    if interpret:
        with jax.disable_jit():
            return _sparse_attention(*args, scale=float(scale), interpret=True)
    return _sparse_attention(*args, scale=float(scale), interpret=False)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, *, scale,
                      interpret):
    _check_supported(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink)
    B, S, H, K = q.shape
    if topk is not None and topk.shape[-1] == 0:
        topk = None
    n_win = win_idx.shape[-1]
    Tw = win_kv.shape[1]
    if win_kv.shape[1] == 0:   # nothing to gather from: one zero row keeps the copies in bounds
        win_kv = jnp.zeros((B, 1, K), win_kv.dtype)
        win_scale = jnp.zeros((B, 1, K // 32), win_scale.dtype)
    if topk is None:
        main = jnp.zeros((B, 1, K // 2), jnp.uint8)
        main_scale = jnp.zeros((B, 1, K // 16), jnp.float8_e4m3fn)
        lst = win_idx
        rows = jnp.clip(win_idx, 0, win_kv.shape[1] - 1)
    else:
        if main.shape[1] == 0:
            main = jnp.zeros((B, 1, K // 2), main.dtype)
            main_scale = jnp.zeros((B, 1, K // 16), main_scale.dtype)
        lst = jnp.concatenate([win_idx, topk], axis=-1)
        rows = jnp.concatenate([jnp.clip(win_idx, 0, win_kv.shape[1] - 1),
                                jnp.clip(topk, 0, main.shape[1] - 1)], axis=-1)
    del Tw
    lst = pad_list(lst)
    rows = pad_list(rows)
    N = lst.shape[-1]
    n_blocks = N // BN
    if N > MAX_LIST:
        raise ValueError(f"the Mosaic GPU kernel keeps the row list in SMEM: at most {MAX_LIST} "
                         f"entries (window + top-k, padded to {BN}), got {N}")
    sink = sink.astype(F32)
    if n_blocks == 0:
        return (jnp.zeros((B, S, H, K), BF16), jnp.broadcast_to(sink, (B, S, H)))
    R = B * S
    rows = jnp.where(lst >= 0, rows, -1).reshape(R, N)   # clamped rows, -1 = no entry
    qp = permute_channels(q).reshape(R, H, K)
    u8 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.uint8)
    wkv16 = lax.bitcast_convert_type(u8(win_kv).reshape(B, -1, K // 2, 2), jnp.uint16)
    # scales as flat byte rows: a row's scales are copied as the SC_BYTES bytes from its start
    # (TMA zero-fills past the end; tiny arrays are padded to one copy)
    # (window scales: 32 zero bytes in front, so that a row's copy puts them in bytes 32..47;
    # a copy of the small window array only, the main KV scales are not copied)
    wsc_flat = _flat_scales(win_scale, MAIN_GROUPS)
    msc_flat = _flat_scales(u8(main_scale))
    e = jnp.asarray(scale_expand_matrix(), BF16)

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((H, K), BF16, transforms=tiled),          # q (permuted channels)
        plgpu.SMEM((BN, K), BF16, transforms=tiled),         # dequantised tile / o staging
        plgpu.SMEM((BN, K // 2), jnp.uint16),                # window rows (uint16 words)
        plgpu.SMEM((BN, K // 2), jnp.uint8),                 # main rows (packed FP4)
        plgpu.SMEM((BN, SC_BYTES), jnp.uint8),               # scale bytes (+ other rows')
        plgpu.SMEM((N,), I32),                               # clamped rows, -1 = no entry
        plgpu.SMEM((SC_K, HALF), BF16, transforms=tiled),    # E (scale expansion)
        plgpu.SMEM((H,), F32),                               # sink
        plgpu.SMEM((H,), F32),                               # lse staging
        plgpu.Barrier(num_arrivals=3 + -(-N // LIST_CHUNK)),  # per-row inputs
        plgpu.Barrier(num_arrivals=2 * BN),                  # a block's gathers
        plgpu.Barrier(num_arrivals=2),                       # tile written
        plgpu.Barrier(num_arrivals=2),                       # tile consumed
    ]
    if interpret:   # A operands through SMEM (one [64, 64] slot per warpgroup)
        scratch.append(plgpu.SMEM((2, BN, BN), BF16, transforms=tiled))
    kernel = functools.partial(_kernel, S=S, n_win=n_win, n_blocks=n_blocks, scale=float(scale),
                               pv_in_place=not interpret)
    o, lse = row_kernel(kernel, scratch, R, num_threads=2, name="csa2_sparse_attention_mgpu",
                        interpret=interpret)(qp, rows, wkv16, wsc_flat, main, msc_flat, e, sink)
    o = unpermute_channels(o).reshape(B, S, H, K)
    return o, lse.reshape(B, S, H)
