"""Pallas Mosaic TPU kernel of the FP4 grouped matmul (docs/architecture.md, "Mixture of
experts": the routed experts' projections over the (token, expert) pairs sorted by expert id).

Computes :func:`.reference.fp4_grouped_matmul`: ``y[p] = x[p] @ W[e(p)]^T`` with fp32
accumulation and a bf16 output, the rows of ``x`` grouped by expert in increasing id
(``group_sizes[e]`` consecutive rows each), rows past ``sum(group_sizes)`` zero. The weights are
the stacked FP4 experts, packed e2m1 codes ``[E, N, K/2]`` and one E8M0 scale byte per 32 inputs
``[E, N, K/32]``; they are dequantised inside the kernel, tile by tile in VMEM, and never exist
as bf16 in HBM.

Design
------
Megablox-style (``jax.experimental.pallas.ops.tpu.megablox.gmm``): the wrapper builds a table of
*visits* in jnp from ``group_sizes``, one per (row tile, group) pair whose rows intersect, in
increasing group order (hence non-decreasing tile order: a tile straddling a group boundary is
visited once per group, consecutively), followed by one visit per row tile wholly past
``sum(group_sizes)``, which writes zeros. The table is scalar-prefetched to SMEM
(``pltpu.PrefetchScalarGridSpec``) and drives the index maps. Grid ``(N / bn, visits, K / bk)``
("parallel", "arbitrary", "arbitrary"); the number of visits is a traced scalar (a dynamic grid
axis), at most ``cdiv(P, bm) + E - 1``.

* Each step adds one ``[bm, bk] x [bn, bk]^T`` product into an fp32 ``[bm, bn]`` VMEM
  accumulator (zeroed at k = 0). At the last k step the rows of the visit's group are written
  into the output block, the other rows keep what earlier visits of the tile wrote (or get 0 on
  the tile's first visit). The output block index only changes between visits of different
  tiles, so a straddling tile stays resident in VMEM until its last group is done.
* A zero-tile visit computes nothing; its x and weight index maps repeat the blocks of the last
  computing visit (and the last k block), so it starts no DMA.
* x arrives as int32 words of bf16 pairs (the wrapper's bitcast of ``[P, K/2, 2]``; word j =
  x[2j] in the low half): ``word << 16`` and ``word & 0xFFFF0000`` are the fp32 bits of the even
  and the odd inputs, exact in bf16. The packed weight byte j holds the even (low nibble) and
  the odd (high nibble) input's weight, so the product is two matmuls with no lane shuffle:
  ``x_even @ W_even^T + x_odd @ W_odd^T``, each ``[bm, bk/2] x [bn, bk/2]^T``.
* e2m1 nibbles are decoded with bit arithmetic (``fp4.common.e2m1_value``). The scale bytes come
  as one full ``[bn, K/32]`` block per (visit, n tile) (a ``bk/32``-wide block would break the
  128-lane tiling); the bytes of the current k tile, one per weight lane (byte j uses scale
  ``k * bk/32 + j // 16``), are picked and spread with an exact 0/1 matmul on the MXU (bytes
  <= 255 are exact in bf16, one nonzero product per output), then ``2**(b - 127)`` is built from
  the exponent bits. That matmul costs ``(K/32) / (2 bm)`` of the tile product's MXU work
  (1/2 at K = 4096, bm = 128). Each weight is the reference's fp32 product ``e2m1 * scale``
  rounded to bf16 (exact for every finite in-range scale), so results differ from the
  reference only in the fp32 summation order.

Tiling limits: ``bm = min(block_m, P)``, ``bn = min(block_n, N)``, ``bk = min(block_k, K)``
with block_m a multiple of 16, block_n of 128, block_k of 256, and N, K multiples of bn, bk
(K also of 32); nothing is padded. P need not be a multiple of bm (the last row tile is
partial). Only interpret mode has run here; the Mosaic compile (the dynamic grid axis, the
uint8 tiles, the spreading matmul with a ``K/32``-wide operand) is unverified on hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, BFloat16, Float, Integer, UInt8

from pallas_kernels.fp4.common import e2m1_value

BF16 = jnp.bfloat16
F32 = jnp.float32
I32 = jnp.int32
SCALE_BLOCK = 32        # inputs per E8M0 scale byte
_LANES_PER_SCALE = SCALE_BLOCK // 2   # packed bytes (weight lanes) per scale byte
_LANES_PER_SCALE_LOG2 = 4
_HI_MASK = -65536       # 0xFFFF0000 as int32
_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a [m, k] x [n, k]^T product


# ----------------------------------------------------------------------------- group metadata


def visit_table(group_sizes: Integer[Array, "E"], rows: int, block_m: int
                ) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """The visits of the grid's middle axis, from the group sizes (plain jnp, traced).

    A visit is a (row tile, group) pair whose rows intersect, in increasing group order, then
    one visit per row tile wholly past ``sum(group_sizes)`` (group -1, nothing computed, zeros
    written). Group ends are ``cumsum(max(group_sizes, 0))`` clipped to ``rows``.

    Returns ``((tile, lo, hi, first, fetch_tile, fetch_group), n_visits)``: int32 arrays of the
    static length ``cdiv(rows, block_m) + E - 1`` (the most visits there can be; entries from
    ``n_visits`` on are unused): the visit's row tile; the row range ``[lo, hi)`` it writes
    from the accumulator (empty for a zero tile); 1 on the first visit of its tile (rows
    outside ``[lo, hi)`` are then written 0); and the row tile and group whose blocks it reads
    (a zero tile repeats the last computing visit's, so it starts no DMA). ``n_visits`` is an
    int32 scalar.
    """
    n_groups = group_sizes.shape[0]
    tiles_m = -(-rows // block_m)
    length = tiles_m + n_groups - 1
    sizes = jnp.maximum(group_sizes.astype(I32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows).astype(I32)
    starts = jnp.concatenate([jnp.zeros(1, I32), ends[:-1]])
    total = ends[-1]
    first_tile = starts // block_m
    count = jnp.where(ends > starts, (ends - 1) // block_m - first_tile + 1, 0)
    # pseudo-group n_groups: the tiles wholly past the end, one visit each
    zero_start = (total + block_m - 1) // block_m
    first_tile = jnp.append(first_tile, zero_start)
    count = jnp.append(count, tiles_m - zero_start)
    lo_g = jnp.append(starts, 0)
    hi_g = jnp.append(ends, 0)
    cum = jnp.cumsum(count)
    n_visits = cum[-1]
    v = jnp.arange(length, dtype=I32)
    g = jnp.searchsorted(cum, v, side="right").astype(I32)
    g = jnp.minimum(g, n_groups)
    tile = first_tile[g] + v - (cum - count)[g]
    used = v < n_visits
    tile = jnp.where(used, tile, tiles_m - 1)
    lo = jnp.where(used, lo_g[g], 0)
    hi = jnp.where(used, hi_g[g], 0)
    first = (used & (tile != jnp.append(-1, tile[:-1]))).astype(I32)
    # blocks read: the last computing visit's (0, 0 when none computes)
    computes = hi > lo
    last = jax.lax.cummax(jnp.where(computes, v, -1), axis=0)
    fetch_tile = jnp.where(last >= 0, tile[jnp.maximum(last, 0)], 0)
    fetch_group = jnp.where(last >= 0, g[jnp.maximum(last, 0)], 0)
    return (tile, lo, hi, first, fetch_tile, fetch_group), n_visits


# ----------------------------------------------------------------------------- kernel


def _e8m0_value(byte: jax.Array) -> jax.Array:
    """E8M0 byte (int32 0..255) -> ``2**(byte - 127)`` in fp32 from the exponent bits, as
    ``fp4.reference.e8m0_to_f32`` (byte 0 gives 0: no subnormal; byte 255 gives +inf)."""
    return jax.lax.bitcast_convert_type(byte << 23, F32)


def _tile_product(xw: jax.Array, codes: jax.Array, scale_bytes: jax.Array, k: jax.Array
                  ) -> jax.Array:
    """``x_tile @ W_tile^T`` in fp32 for one k tile.

    xw: int32 [bm, bk/2] words of bf16 pairs; codes: uint8 [bn, bk/2] packed e2m1;
    scale_bytes: uint8 [bn, K/32] (the whole row, the k tile's 16 bytes picked here); k: the
    k tile index. Returns fp32 [bm, bn].
    """
    half = codes.shape[-1]
    groups = scale_bytes.shape[-1]
    xe = jax.lax.bitcast_convert_type(xw << 16, F32).astype(BF16)
    xo = jax.lax.bitcast_convert_type(xw & _HI_MASK, F32).astype(BF16)
    # scale byte of weight lane j: byte k * bk/32 + j // 16 (an exact 0/1 matmul)
    src = jax.lax.broadcasted_iota(I32, (groups, half), 0)
    lane = jax.lax.broadcasted_iota(I32, (groups, half), 1)
    pick = (src == k * (half // _LANES_PER_SCALE) + (lane >> _LANES_PER_SCALE_LOG2)
            ).astype(BF16)
    sb = scale_bytes.astype(I32).astype(F32).astype(BF16)
    s = _e8m0_value(jnp.dot(sb, pick, preferred_element_type=F32).astype(I32))
    c = codes.astype(I32)
    we = (e2m1_value(c & 15) * s).astype(BF16)
    wo = (e2m1_value((c >> 4) & 15) * s).astype(BF16)
    return (jax.lax.dot_general(xe, we, _NT, preferred_element_type=F32)
            + jax.lax.dot_general(xo, wo, _NT, preferred_element_type=F32))


def _kernel(tile_ref, lo_ref, hi_ref, first_ref, fetch_tile_ref, fetch_group_ref,
            x_ref, codes_ref, scale_ref, o_ref, acc_ref, *, tiles_k: int):
    """One (n tile, visit, k tile) step. Refs: the six visit tables (SMEM int32 [T]);
    x_ref int32 [bm, bk/2]; codes_ref uint8 [bn, bk/2]; scale_ref uint8 [bn, K/32];
    o_ref [bm, bn] (bf16 or fp32); acc_ref fp32 [bm, bn] scratch."""
    del fetch_tile_ref, fetch_group_ref
    v = pl.program_id(1)
    k = pl.program_id(2)
    lo = lo_ref[v]
    hi = hi_ref[v]

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    @pl.when(hi > lo)
    def _():
        acc_ref[...] += _tile_product(x_ref[...], codes_ref[...], scale_ref[...], k)

    @pl.when(k == tiles_k - 1)
    def _():
        bm, bn = o_ref.shape

        @pl.when(first_ref[v] == 1)
        def _():
            o_ref[...] = jnp.zeros((bm, bn), o_ref.dtype)

        rows = tile_ref[v] * bm + jax.lax.broadcasted_iota(I32, (bm, bn), 0)
        mine = (rows >= lo) & (rows < hi)
        o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), o_ref[...])


# ----------------------------------------------------------------------------- wrapper


def _interpret_mode(interpret):
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def _check(x, codes, scale, group_sizes, block_m: int, block_n: int, block_k: int
           ) -> tuple[int, int, int]:
    """Shape / dtype checks; returns the tile sizes ``(bm, bn, bk)``."""
    if x.ndim != 2 or x.dtype != BF16:
        raise ValueError(f"x must be bf16 [P, K], got {x.dtype} {x.shape}")
    if codes.ndim != 3 or codes.dtype != jnp.uint8:
        raise ValueError(f"codes must be uint8 [E, N, K/2], got {codes.dtype} {codes.shape}")
    if scale.ndim != 3 or scale.dtype != jnp.uint8:
        raise ValueError(f"scale must be uint8 [E, N, K/32], got {scale.dtype} {scale.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer vector [E], got {group_sizes.dtype} "
                         f"{group_sizes.shape}")
    P, K = x.shape
    E, N, half = codes.shape
    if E < 1:
        raise ValueError("codes must hold at least one expert (E >= 1)")
    if K % SCALE_BLOCK:
        raise ValueError(f"K (x.shape[1]) must be a multiple of {SCALE_BLOCK}, got K={K}")
    if half * 2 != K:
        raise ValueError(f"codes must be [E, N, K/2] = [.., .., {K // 2}] for K={K}, "
                         f"got {codes.shape}")
    if scale.shape != (E, N, K // SCALE_BLOCK):
        raise ValueError(f"scale must be [E, N, K/32] = {(E, N, K // SCALE_BLOCK)}, "
                         f"got {scale.shape}")
    if group_sizes.shape[0] != E:
        raise ValueError(f"group_sizes must have E={E} entries, got {group_sizes.shape[0]}")
    if block_m < 16 or block_m % 16:
        raise ValueError(f"block_m must be a positive multiple of 16, got {block_m}")
    if block_n < 128 or block_n % 128:
        raise ValueError(f"block_n must be a positive multiple of 128, got {block_n}")
    if block_k < 256 or block_k % 256:
        raise ValueError(f"block_k must be a positive multiple of 256, got {block_k}")
    bn = min(block_n, N)
    if N % bn:
        raise ValueError(f"N (codes.shape[1]) must be a multiple of block_n={bn}, got N={N}")
    bk = min(block_k, K)
    if K % bk:
        raise ValueError(f"K (x.shape[1]) must be a multiple of block_k={bk}, got K={K}")
    return min(block_m, P), bn, bk


def fp4_grouped_matmul_tpu(x: BFloat16[Array, "P K"], codes: UInt8[Array, "E N K2"],
                           scale: UInt8[Array, "E N G"], group_sizes: Integer[Array, "E"], *,
                           interpret=False, block_m: int = 128, block_n: int = 128,
                           block_k: int = 512) -> BFloat16[Array, "P N"]:
    """The FP4 grouped matmul (:func:`.reference.fp4_grouped_matmul`) as a Pallas Mosaic TPU
    kernel (docs/architecture.md, "Mixture of experts").

    Args:
      x: bf16 [P, K], the rows grouped by expert in increasing id.
      codes: uint8 [E, N, K/2], packed e2m1 (element 2j in the low nibble).
      scale: uint8 [E, N, K/32], E8M0 bytes (``2**(s - 127)`` per 32 inputs along K).
      group_sizes: integer [E], rows per expert (negative counts as 0; the group ends are
        clipped to P).
      interpret: False (compile for TPU), True (TPU interpret mode, ``pltpu.InterpretParams()``)
        or an ``InterpretParams`` instance.
      block_m, block_n, block_k: tile sizes along P, N, K (clamped to the dimension when it is
        smaller): multiples of 16, 128 and 256.

    Returns:
      bf16 [P, N]: ``y[p] = x[p] @ W[e(p)]^T`` (fp32 accumulation); rows past
      ``sum(group_sizes)`` are 0.

    Raises:
      ValueError: a wrong rank or dtype of an argument; codes / scale / group_sizes shapes that
        disagree with x; K not a multiple of 32 or of ``min(block_k, K)``; N not a multiple of
        ``min(block_n, N)``; a block size that is not a positive multiple of its granule.
    """
    return grouped_matmul_kernel(x, codes, scale, group_sizes, out_dtype=BF16,
                                 interpret=interpret, block_m=block_m, block_n=block_n,
                                 block_k=block_k)


def grouped_matmul_kernel(x: BFloat16[Array, "P K"], codes: UInt8[Array, "E N K2"],
                          scale: UInt8[Array, "E N G"], group_sizes: Integer[Array, "E"], *,
                          out_dtype=BF16, interpret=False, block_m: int = 128,
                          block_n: int = 128, block_k: int = 512) -> Float[Array, "P N"]:
    """:func:`fp4_grouped_matmul_tpu` with the output dtype as a parameter: ``jnp.float32``
    gives the accumulator before the bf16 rounding (for tests). Same arguments and errors."""
    bm, bn, bk = _check(x, codes, scale, group_sizes, block_m, block_n, block_k)
    P, K = x.shape
    E, N, _ = codes.shape
    if P == 0:
        return jnp.zeros((0, N), out_dtype)
    tiles_k = K // bk
    tables, n_visits = visit_table(group_sizes, P, bm)
    xw = jax.lax.bitcast_convert_type(x.reshape(P, K // 2, 2), I32)   # [P, K/2] bf16 pairs

    def computes(v, t):
        return t[2][v] > t[1][v]

    def x_map(n, v, k, *t):
        k = jnp.where(computes(v, t), k, tiles_k - 1)
        return t[4][v], k

    def codes_map(n, v, k, *t):
        k = jnp.where(computes(v, t), k, tiles_k - 1)
        return t[5][v], n, k

    def scale_map(n, v, k, *t):
        return t[5][v], n, 0

    def out_map(n, v, k, *t):
        return t[0][v], n

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tables),
        grid=(N // bn, n_visits, tiles_k),
        in_specs=[pl.BlockSpec((bm, bk // 2), x_map),
                  pl.BlockSpec((None, bn, bk // 2), codes_map),
                  pl.BlockSpec((None, bn, K // SCALE_BLOCK), scale_map)],
        out_specs=pl.BlockSpec((bm, bn), out_map),
        scratch_shapes=[pltpu.VMEM((bm, bn), F32)])
    out_bytes = P * N * np.dtype(out_dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * P * K * N, transcendentals=0,
        bytes_accessed=int(x.size * 2 * (N // bn) + codes.size + scale.size + out_bytes))
    return pl.pallas_call(
        functools.partial(_kernel, tiles_k=tiles_k),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((P, N), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret_mode(interpret),
        cost_estimate=cost,
        name="fp4_grouped_matmul",
    )(*tables, xw, codes, scale)
