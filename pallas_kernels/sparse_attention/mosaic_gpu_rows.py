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

Interpret mode (CPU, tests) cannot run the producer's ``cp.async`` (``plgpu.inline_mgpu``):
there the producer copies each listed row by TMA into a plain staging buffer and moves it
into the tile through registers (the same tiles, barriers and consumers).

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

from pallas_kernels.sparse_attention import triton as tk
from pallas_kernels.sparse_attention.reference import SOFTMAX_BLOCK, lse_with_sink

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32
NEG_START = -1e30     # the reference kernel's initial running max
H_SUPPORTED = 64
K_SUPPORTED = 512
BN = SOFTMAX_BLOCK    # 64 list entries per block
HALF_N = BN // 2      # entries of a block per consumer's score half
HALF_K = K_SUPPORTED // 2   # output channels per consumer
LIST_CHUNK = 256      # list entries per TMA copy (a box holds <= 256 per dimension)
MAX_LIST = 3072       # padded list entries whose row list fits the shared memory (lowering: 3136 is 48 bytes over)
ROW_BYTES = K_SUPPORTED * 2
COPY_BYTES = 16       # one cp.async
COLS_PER_ROW = ROW_BYTES // COPY_BYTES            # 64 copies per row
ROWS_PER_PASS = 128 // COLS_PER_ROW               # rows one pass of the producer covers (2)
PRODUCER_REGS, CONSUMER_REGS = 40, 232
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


def _cp_async_rows(rows_smem, kv_gmem, tile_smem, *, n_rows: int):
    """The producer's copies of one block (GPU): the 64 listed rows (``rows_smem``: int32 [64],
    -1 = no entry: row 0) of ``kv_gmem`` (bf16 [N, 512]) into ``tile_smem`` (bf16 [64, 512],
    the swizzled operand tile), by ``cp.async`` of 16 bytes; then one commit group. Thread t of
    the warp group copies 16-byte column ``t % 64`` of rows ``2 i + t // 64``, i = 0..31, so a
    warp reads 512 contiguous bytes of a row per copy instruction."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(TILED)))
    def copies(ctx, rows_ref, kv_ref, tile_ref):
        del ctx
        i32, i64, index = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                           ir.IndexType.get())
        c = lambda v, t=i32: arith.constant(t, v)   # noqa: E731
        tid = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        lane = arith.remui(tid, c(128))
        col = arith.andi(lane, c(COLS_PER_ROW - 1))          # 16-byte column of the row
        half = arith.divui(lane, c(COLS_PER_ROW))            # which of the pass's rows
        kv_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                     mu.memref_ptr(kv_ref))
        tile_base = mu.memref_ptr(tile_ref)
        col_bytes = arith.muli(col, c(COPY_BYTES))
        i8 = ir.IntegerType.get_signless(8)

        class _I:   # i32 MLIR values with the integer operators tile_byte_offset uses
            def __init__(self, v):
                self.value = v

            def _op(self, fn, o):
                return _I(fn(self.value, o.value if isinstance(o, _I) else c(o)))
            __and__ = lambda self, o: self._op(arith.andi, o)   # noqa: E731
            __xor__ = lambda self, o: self._op(arith.xori, o)   # noqa: E731
            __rshift__ = lambda self, o: self._op(arith.shrui, o)   # noqa: E731
            __mul__ = lambda self, o: self._op(arith.muli, o)   # noqa: E731
            __add__ = lambda self, o: self._op(arith.addi, o)   # noqa: E731
            __floordiv__ = lambda self, o: self._op(arith.divui, o)   # noqa: E731
            __mod__ = lambda self, o: self._op(arith.remui, o)   # noqa: E731
            __radd__ = __add__

        for i in range(BN // ROWS_PER_PASS):
            r = arith.addi(half, c(ROWS_PER_PASS * i))
            row = memref.load(rows_ref, [arith.index_cast(index, r)])
            row = arith.minsi(arith.maxsi(row, c(0)), c(n_rows - 1))
            src_off = arith.addi(arith.muli(arith.extsi(i64, row), c(ROW_BYTES, i64)),
                                 arith.extsi(i64, col_bytes))
            dst_off = tile_byte_offset(_I(r), _I(col)).value
            src = llvm.getelementptr(kv_base.type, kv_base, [src_off], [-2**31], i8, 0)
            dst = llvm.getelementptr(tile_base.type, tile_base, [dst_off], [-2**31], i8, 0)
            nvvm.cp_async_shared_global(dst, src, COPY_BYTES, nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_commit_group()

    copies(rows_smem, kv_gmem, tile_smem)


def _cp_async_wait(n: int):
    """Wait until at most ``n`` of this thread's ``cp.async`` groups are pending (GPU)."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(n)

    wait()


def _kernel(q_ref, rows_ref, kv_ref, sink_ref, o_ref, lse_ref,
            q_smem, tiles, p_smem, rows_smem, mx_smem, l_smem, sink_smem, lse_smem,
            in_bar, full, free, xchg, *staging,
            S, n_blocks, n_rows, scale, interpret, softmax):
    rid = lax.axis_index("row")
    b = rid // S
    wg = lax.axis_index("wg")
    L = n_blocks * BN
    row_layout = plgpu.Layout.WGMMA.reduce(1)   # per head (row of the S / O tiles)
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # per entry (column of S)
    exp = tk.exp_of(softmax)

    # ---- per-row inputs: q (consumers), the row list, the sink ----
    @pl.when(wg == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[rid], q_smem, in_bar)
        for c0 in range(0, L, LIST_CHUNK):
            n = min(LIST_CHUNK, L - c0)
            plgpu.copy_gmem_to_smem(rows_ref.at[rid, pl.ds(c0, n)], rows_smem.at[pl.ds(c0, n)],
                                    in_bar)
        plgpu.copy_gmem_to_smem(sink_ref, sink_smem, in_bar)
    plgpu.barrier_wait(in_bar)

    # ---- the producer ----
    @pl.when(wg == 2)
    def _producer():
        if not interpret:
            plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

        def issue(j):
            slot = j % 2
            if interpret:   # TMA per row into a plain staging buffer, then into the tile
                (stage, stage_bar), = staging

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
                _cp_async_rows(rows_smem.at[pl.ds(j * BN, BN)], kv_ref.at[b], tiles.at[slot],
                               n_rows=n_rows)

        def publish(j, pending: int):
            if not interpret:
                _cp_async_wait(pending)
            plgpu.commit_smem()          # generic-proxy writes -> visible to wgmma
            plgpu.barrier_arrive(full.at[j % 2])

        # block j is published as soon as its copies land (it does not wait for block j - 1
        # to be consumed); block j + 2's copies go out once block j has freed its tile
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
            plgpu.set_max_registers(CONSUMER_REGS, action="increase")

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
        q_smem.at[:, pl.ds(wg * HALF_K, HALF_K)][...] = o.astype(BF16)
        lse = lse_with_sink(m_i, l_tot, sink)

        @pl.when(wg == 0)
        def _():
            lse_smem[...] = lse
        plgpu.commit_smem()
        for t in range(H_SUPPORTED // 8):   # contiguous TMA sources: one 8-row tile row each
            plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(8 * t, 8), pl.ds(wg * HALF_K, HALF_K)],
                                    o_ref.at[rid, pl.ds(8 * t, 8), pl.ds(wg * HALF_K, HALF_K)])

        @pl.when(wg == 0)
        def _():
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[rid])
        plgpu.wait_smem_to_gmem(0)


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
      ValueError: shapes or dtypes other than the above, an unknown ``softmax``.
    """
    _check(q, kv, rows, sink)
    tk.exp_of(softmax)   # ValueError for an unknown name
    call = functools.partial(_rows_call, scale=float(scale), interpret=interpret,
                             softmax=softmax)
    if interpret:   # eager: see mosaic_gpu.sparse_attention (interpreter callbacks on 2 cores)
        with jax.disable_jit():
            return call(q, kv, rows, sink)
    return call(q, kv, rows, sink)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "softmax"))
def _rows_call(q, kv, rows, sink, *, scale, interpret, softmax):
    B, S, H, K = q.shape
    L = rows.shape[-1]
    sink = sink.astype(F32)
    if L == 0:
        return jnp.zeros(q.shape, BF16), jnp.broadcast_to(sink, (B, S, H))
    R, N = B * S, kv.shape[1]
    rows = jnp.where(rows >= 0, jnp.minimum(rows, N - 1), -1).reshape(R, L)
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
    kernel = functools.partial(_kernel, S=S, n_blocks=L // BN, n_rows=N, scale=scale,
                               interpret=interpret, softmax=softmax)
    o, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((R, H, K), BF16), jax.ShapeDtypeStruct((R, H), F32)),
        scratch_types=scratch,
        grid=(R,),
        grid_names=("row",),
        num_threads=3,
        thread_name="wg",
        kernel_name="csa2_sparse_attention_rows_mgpu",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q.reshape(R, H, K), rows, kv, sink)
    return o.reshape(B, S, H, K), lse.reshape(B, S, H)
