"""The FP4 grouped matmul as a Pallas Mosaic GPU kernel for Hopper (wgmma), the FP4 experts
dequantised in registers (docs/architecture.md, "Mixture of experts"; docs/kernels.md,
"FP4 grouped matmul").

The expert weight is the wgmma's A operand and the tokens its B operand ("swap AB"): a CTA
computes the ``[block_n, block_m]`` tile ``W[e][n-block] @ X[tile]^T`` of one expert ``e``,
features by tokens, so the token tile can be as small as 8 rows (a decode step routes a
handful of tokens to each expert) while the weight tile fills wgmma's 64-row M. Per K step of
64 inputs the kernel

* copies (TMA, pipelined) the token tile ``[block_m, 64]`` bf16, the weight tile
  ``[block_n, 64]`` int4 and its two scale rows ``[2, block_n]`` bf16 into shared memory;
* loads the weight tile into registers, converts int4 -> bf16, maps the codes to their e2m1
  values and multiplies by the scale of each 32-input half (exact: e2m1 values times powers
  of two are bf16 values), and
* runs ``wgmma(acc, W_tile, X_tile^T)`` with fp32 accumulation.

The finished ``[block_n, block_m]`` tile goes out through shared memory either as it is (the
``Y^T [N, R]`` of the swap, ``rows_out=False``) or stored transposed into a ``[block_m,
block_n]`` buffer and copied out as rows of ``Y [R, N]`` (``rows_out=True``; with split K
the fp32 partial sums' rows, as their high and low 16 bits: Mosaic GPU transposes 16-bit
tiles only): the caller then reads each token's outputs as rows (coalesced)
instead of gathering columns of ``Y^T``.

The rows are laid out by :func:`pad_groups`: grouped by expert, each expert's rows padded to a
multiple of ``block_m``, so every token tile belongs to one expert (a table gives it) and
tiles past the last used one do nothing. Grid ``(tiles, N / 128, k_splits)``: when few experts
have tokens (a decode step) K is split (:func:`pick_k_splits`) so that enough CTAs stream
weights at once, each split writing fp32 partial sums that the caller adds.

Kernel form of the weights (:func:`prepare_experts`, once at load time): the e2m1 codes as
int4 ``[E, N, K]`` holding ``+-i`` for a code of sign ``s`` and magnitude index ``i`` (so the
kernel's value is ``f(v) = 2 v - clip(v, -4, 4) / 2 - clip(v, -6, 6)``, which maps
0..7 to 0, 0.5, 1, 1.5, 2, 3, 4, 6 and is odd), and the scales as bf16 ``[E, K / 32, N]``
(the power of two itself, rows by input block). The only value that changes is ``-0``
(code 8), which becomes ``+0``: a sum it enters is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, BFloat16, Float32, Int, UInt8

from pallas_kernels.fp4.reference import BF16, F32, e8m0_to_f32, unpack_nibbles

BLOCK_K = 64          # inputs per pipeline step: two 32-input scale blocks
BLOCK_N = 128         # weight rows (output features) per CTA: two wgmma M tiles of 64
BLOCK_MS = (8, 16, 32, 64, 128)   # token tiles (wgmma N)
I4 = jnp.int4


@jax.jit
def prepare_experts(codes: UInt8[Array, "E N K2"], scale: UInt8[Array, "E N G"]) -> dict:
    """Stored FP4 experts -> the kernel form ``{"i4": int4 [E, N, K], "scale_t": bf16
    [E, K / 32, N]}`` (see the module docstring), one compiled program: nothing but the
    result is allocated (run op by op, the codes would pass through an int32 copy, 16.9 GiB
    for one release projection of 384 experts). Raises ``ValueError`` unless ``K`` is a
    multiple of 64 and ``N`` of 128."""
    E, N, K2 = codes.shape
    K = 2 * K2
    if K % BLOCK_K or N % BLOCK_N:
        raise ValueError(f"prepare_experts: K={K} must be a multiple of {BLOCK_K} and "
                         f"N={N} of {BLOCK_N}")
    if scale.shape != (E, N, K // 32):
        raise ValueError(f"prepare_experts: scale shape {scale.shape} != {(E, N, K // 32)}")
    c = unpack_nibbles(codes).astype(jnp.int32)
    v = jnp.where(c >= 8, 8 - c, c).astype(I4)                     # sign-magnitude -> +-i
    s = jnp.swapaxes(e8m0_to_f32(scale), 1, 2).astype(BF16)        # exact powers of two
    return {"i4": v, "scale_t": s}


def e2m1_from_i4(v):
    """The e2m1 value of a kernel-form code ``v`` in -7..7 (any float dtype; exact)."""
    return 2 * v - 0.5 * jnp.clip(v, -4, 4) - jnp.clip(v, -6, 6)


def pick_block_m(rows: int, experts: int) -> int:
    """The token tile for ``rows`` routed rows over ``experts`` experts: the smallest of
    :data:`BLOCK_MS` that holds the mean rows per expert (wasted rows per expert stay below
    one tile)."""
    mean = -(-rows // max(experts, 1))
    return next((b for b in BLOCK_MS if b >= mean), BLOCK_MS[-1])


def pad_groups(group_sizes: Int[Array, "E"], rows: int, block_m: int):
    """Where each row goes in the padded layout, and the expert of each token tile.

    Rows ``0 .. rows - 1`` are grouped by expert (``group_sizes``, increasing id; rows past
    the total are unused). Returns ``(dest int32 [rows], tile_expert int32 [T])`` with
    ``T = rows // block_m + E`` (a static bound on the tiles): row ``p`` goes to padded row
    ``dest[p]`` (``T * block_m`` for an unused row: out of range, dropped by a scatter), and
    tile ``t`` belongs to expert ``tile_expert[t]`` (``-1``: unused)."""
    E = group_sizes.shape[0]
    T = rows // block_m + E
    sizes = group_sizes.astype(jnp.int32)
    tile_start, tile_expert = group_tiles(sizes, rows, block_m)
    row_start = jnp.cumsum(sizes) - sizes
    p = jnp.arange(rows, dtype=jnp.int32)
    # compare_all: one fused comparison (the default's binary search is a loop of kernels)
    e = jnp.searchsorted(jnp.cumsum(sizes), p, side="right",
                         method="compare_all").astype(jnp.int32)
    used = e < E
    e = jnp.minimum(e, E - 1)
    dest = jnp.where(used, tile_start[e] * block_m + p - row_start[e], T * block_m)
    return dest, tile_expert


def group_tiles(sizes: Int[Array, "E"], rows: int, block_m: int):
    """The token tiles of groups of ``sizes`` rows (int32, at most ``rows`` in all), each
    group's rows in whole tiles of ``block_m``: ``(tile_start int32 [E], tile_expert int32
    [T])``, the first tile of each group and the group of each of the ``T = rows // block_m +
    E`` tiles (``-1``: unused)."""
    E = sizes.shape[0]
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(rows // block_m + E, dtype=jnp.int32)
    # compare_all: one fused comparison (the default's binary search is a loop of kernels)
    te = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    return tile_end - tiles, jnp.where(te < E, te, -1)


def pick_k_splits(rows: int, experts: int, n: int, k: int, sms: int = 132) -> int:
    """K splits for a call of ``rows`` rows over ``experts`` experts (``n`` outputs, ``k``
    inputs): enough CTAs to keep every SM streaming when few experts have tokens (a decode
    step), 1 when the token tiles alone fill the GPU. A power of two, each split at least two
    K steps."""
    tiles = max(min(rows, experts), -(-rows // pick_block_m(rows, experts)))
    ctas = tiles * (n // BLOCK_N)
    splits = 1
    while ctas * splits < 2 * sms and k // (2 * splits) >= 2 * BLOCK_K and k % (2 * splits * BLOCK_K) == 0:
        splits *= 2
    return splits


def _kernel(tile_expert_gmem, x_gmem, w_gmem, s_gmem, o_gmem, *scratch, K, block_m,
            k_splits, max_concurrent_steps, rows_out):
    a_smem = scratch[0] if scratch else None
    t = lax.axis_index("t")
    n = lax.axis_index("n")
    ks = lax.axis_index("k")
    e = tile_expert_gmem[t]
    steps = K // BLOCK_K // k_splits
    out_dtype = BF16 if k_splits == 1 or rows_out else F32

    @pl.when(e >= 0)
    def _():
        col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_N, BLOCK_K), 1, layout=plgpu.Layout.WGMMA)
        low_half = col < 32
        row = plgpu.Layout.WGMMA.reduce(1)

        def acc_scope(acc_ref):
            def step(_, x_smem, w_smem, s_smem):
                w = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA_UPCAST_4X)
                w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(BF16)
                s0 = lax.broadcast_in_dim(plgpu.load(s_smem.at[0], layout=row), w.shape, [0])
                s1 = lax.broadcast_in_dim(plgpu.load(s_smem.at[1], layout=row), w.shape, [0])
                weight_times_rows(acc_ref, e2m1_from_i4(w) * jnp.where(low_half, s0, s1),
                                  x_smem, a_smem)

            k0 = ks * steps
            plgpu.emit_pipeline(
                step,
                grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((block_m, BLOCK_K), lambda k: (t, k0 + k)),
                    plgpu.BlockSpec((BLOCK_N, BLOCK_K), lambda k: (n, k0 + k)),
                    plgpu.BlockSpec((BLOCK_K // 32, BLOCK_N), lambda k: (k0 + k, n)),
                ],
                max_concurrent_steps=min(max_concurrent_steps, steps),
            )(x_gmem, w_gmem.at[e], s_gmem.at[e])
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_N, block_m), F32))

        store_tile(acc, o_gmem, ks, pl.ds(t * block_m, block_m), pl.ds(n * BLOCK_N, BLOCK_N),
                   k_splits=k_splits, rows_out=rows_out, out_dtype=out_dtype)


def weight_times_rows(acc_ref, w, x_smem, a_smem=None):
    """``acc += w @ x^T``: the bf16 weight tile ``w`` (registers, WGMMA layout) as wgmma's A
    operand, the rows' tile in shared memory as its B; waits for it. ``a_smem``: interpret
    mode's staging buffer (its wgmma reads A from shared memory only)."""
    if a_smem is not None:
        a_smem[...] = w
        w = a_smem
    plgpu.wgmma(acc_ref, w, x_smem.T)
    plgpu.wgmma_wait(0)


def store_tile(acc, o_gmem, ks, rows: pl.Slice, cols: pl.Slice, *, k_splits: int,
               rows_out: bool, out_dtype):
    """A finished ``[cols, rows]`` accumulator tile (fp32, WGMMA layout) of K split ``ks`` out
    through shared memory: as it is into ``o_gmem[ks, cols, rows]`` (``rows_out=False``), or
    transposed on its way into shared memory into ``o_gmem[ks, rows, cols]`` (``rows_out``;
    with ``k_splits > 1`` the fp32 values' high and low 16 bits into ``o_gmem[ks, 0 | 1,
    rows, cols]``, bf16-typed: :func:`from_bit_planes`). ``out_dtype``: the stored dtype
    (bf16 planes with split K's rows)."""
    planes = rows_out and k_splits > 1
    tile = (rows.size, cols.size) if rows_out else (cols.size, rows.size)

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(((2,) if planes else ()) + tile,
                                                        out_dtype))
    def _store(o_smem):
        if planes:              # fp32 partial sums as rows: see from_bit_planes
            bits = lax.bitcast_convert_type(acc, jnp.uint32)
            copies = []
            for i, plane in enumerate((bits >> 16, bits & 0xFFFF)):
                o_smem.at[i].T[...] = lax.bitcast_convert_type(plane.astype(jnp.uint16), BF16)
                copies.append((o_smem.at[i], o_gmem.at[ks, i, rows, cols]))
        elif rows_out:          # the tile transposed on its way into shared memory
            o_smem.T[...] = acc.astype(out_dtype)
            copies = [(o_smem, o_gmem.at[ks, rows, cols])]
        else:
            o_smem[...] = acc.astype(out_dtype)
            copies = [(o_smem, o_gmem.at[ks, cols, rows])]
        plgpu.commit_smem()
        for src, dst in copies:
            plgpu.copy_smem_to_gmem(src, dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul_t(x: BFloat16[Array, "R K"], w: dict, tile_expert: Int[Array, "T"], *,
                     block_m: int, k_splits: int = 1, max_concurrent_steps: int = 4,
                     rows_out: bool = False, interpret: bool = False) -> Array:
    """``Y^T`` for the padded layout: ``Y^T[:, r] = W[e(r)] @ x[r]`` (fp32 accumulation) for
    every row ``r`` of a used tile (``e(r) = tile_expert[r // block_m]``); the columns of
    unused tiles are left unwritten (their values are undefined). Returns bf16 ``[N, R]``,
    or with ``k_splits > 1`` the fp32 partial sums ``[k_splits, N, R]`` of each K split.
    ``rows_out``: ``Y`` itself, bf16 ``[R, N]`` (fp32 ``[k_splits, R, N]`` with split K; the
    same values), each tile transposed on its way into shared memory.

    ``x``: bf16 ``[R, K]`` with ``R = T * block_m``; ``w``: the kernel form of
    :func:`prepare_experts`. Raises ``ValueError`` for shapes the kernel does not tile."""
    i4, s = w["i4"], w["scale_t"]
    E, N, K = i4.shape
    T = tile_expert.shape[0]
    R, Kx = x.shape
    if block_m not in BLOCK_MS:
        raise ValueError(f"grouped_matmul_t: block_m={block_m} must be one of {BLOCK_MS}")
    if Kx != K or R != T * block_m:
        raise ValueError(f"grouped_matmul_t: x {x.shape} does not match K={K} and "
                         f"{T} tiles of {block_m} rows")
    if K % (BLOCK_K * k_splits) or N % BLOCK_N:
        raise ValueError(f"grouped_matmul_t: K={K} must be a multiple of {BLOCK_K} x "
                         f"k_splits={k_splits}, N={N} of {BLOCK_N}")
    y = _kernel_call(tile_expert.astype(jnp.int32), x.astype(BF16), i4, s, block_m=block_m,
              k_splits=k_splits, max_concurrent_steps=max_concurrent_steps, rows_out=rows_out,
              interpret=interpret)
    if k_splits == 1:
        return y[0]
    return from_bit_planes(y) if rows_out else y


def from_bit_planes(y: BFloat16[Array, "S 2 R N"]) -> Float32[Array, "S R N"]:
    """The fp32 values whose high and low 16 bits the kernel wrote as two bf16-typed planes
    (exact). Mosaic GPU stores a tile transposed into shared memory for 16-bit types only, so
    split K's fp32 partial sums leave the kernel as rows this way: the same bytes as fp32, and
    XLA puts the halves together inside the fusion that adds the splits."""
    hi, lo = (lax.bitcast_convert_type(y[:, i], jnp.uint16).astype(jnp.uint32) for i in (0, 1))
    return lax.bitcast_convert_type((hi << 16) | lo, F32)


# Jitted so that the call sites of one shape (every MoE layer of a scanned group, the encoder's
# and the bounded replay's) share one lowering: JAX lowers a jitted function once per program
# and XLA inlines the calls, where each bare kernel call would be lowered to Mosaic GPU anew
# (about 0.3 s of a first call's host time each).
@functools.partial(jax.jit, static_argnames=("block_m", "k_splits", "max_concurrent_steps",
                                             "rows_out", "interpret"))
def _kernel_call(tile_expert, x, i4, s, *, block_m, k_splits, max_concurrent_steps, rows_out,
          interpret):
    _, N, K = i4.shape
    T = tile_expert.shape[0]
    R = x.shape[0]
    kernel = functools.partial(_kernel, K=K, block_m=block_m, k_splits=k_splits,
                               max_concurrent_steps=max_concurrent_steps, rows_out=rows_out)
    if rows_out and k_splits > 1:   # fp32 rows as two 16-bit planes (from_bit_planes)
        out = jax.ShapeDtypeStruct((k_splits, 2, R, N), BF16)
    else:
        out = jax.ShapeDtypeStruct((k_splits, R, N) if rows_out else (k_splits, N, R),
                                   BF16 if k_splits == 1 else F32)
    call = plgpu.kernel(
        kernel,
        out_type=out,
        grid=(T, N // BLOCK_N, k_splits),
        grid_names=("t", "n", "k"),
        kernel_name="fp4_grouped_matmul",
        # interpret mode's wgmma takes A from shared memory only: stage the tile there
        scratch_types=[plgpu.SMEM((BLOCK_N, BLOCK_K), BF16)] if interpret else [],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(tile_expert, x, i4, s)
