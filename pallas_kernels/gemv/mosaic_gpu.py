"""The FP8 stacked GEMV of tens of rows as a Pallas Mosaic GPU kernel for Hopper (wgmma): a
decode step of a larger batch; see :mod:`pallas_kernels.gemv` and docs/kernels.md, "FP8
stacked GEMV".

The weight is the wgmma's A operand and the input rows its B operand ("swap AB", as the FP4
grouped matmul, :mod:`pallas_kernels.grouped_matmul.mosaic_gpu`): a CTA computes the
``[128, block_m]`` tile ``W[layer][n-block] @ X[rows]^T``, output features by input rows, so
8 to 64 input rows fill wgmma's N while 128 weight rows fill two of its 64-row M tiles. Per
K step of 64 inputs the kernel

* copies (TMA, pipelined) the input tile ``[block_m, 64]`` bf16 and the weight tile ``[128,
  64]`` FP8, read in place out of the stack of every layer's weights (the layer index is an
  operand), into shared memory;
* loads the weight tile into registers, converts e4m3 -> fp32 (exact) and multiplies each
  value by its 32 x 32 tile's E8M0 scale (read as 8 bytes a step straight from the stored
  ``[L, N/32, K/32]`` scales; exact: an FP8 value times a power of two is a bf16 value), and
* runs ``wgmma(acc, W_tile, X_tile^T)`` with fp32 accumulation.

The finished tile is stored transposed through shared memory, so the output leaves as rows
``Y [M, N]`` (with split K each split's fp32 partial sums, as the high and low 16 bits of
each value: :func:`pallas_kernels.grouped_matmul.mosaic_gpu.store_tile`).

The input is taken as it comes, its rows padded to ``block_m`` by the caller: a quantised
linear's FP8 act-quant is the caller's (:func:`pallas_kernels.gemv.triton.input_rows`), or,
with ``act_quant`` (one group, 64-row tiles), the kernel's own: each step QDQs the input tile
in shared memory before its wgmma (:func:`_act_quant_tile`). ``G >
1`` (the grouped output projection, row ``n`` reading the input's group ``n // (N / G)``):
the input comes as ``[G * M_pad, K]``, group by group. Several weights of one input (a
layer's ``wq_a`` and ``wkv``) run in one launch: the CTAs of the output's 128-row blocks
walk the weights one after the other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, BFloat16, Int, UInt8

from pallas_kernels.fp4.reference import FP8_MAX
from pallas_kernels.grouped_matmul.mosaic_gpu import (from_bit_planes, store_tile,
                                                     weight_times_rows)

BF16, F32 = jnp.bfloat16, jnp.float32
BLOCK_K = 64          # inputs per pipeline step: two 32-input scale blocks
BLOCK_N = 128         # weight rows (output features) per CTA: two wgmma M tiles of 64
BLOCK_MS = (16, 32, 64)           # input row tiles (wgmma N)
#: The most input rows the kernel takes.
MAX_ROWS = BLOCK_MS[-1]


def pick_block_m(rows: int) -> int:
    """The smallest row tile of :data:`BLOCK_MS` holding ``rows`` rows."""
    return next(b for b in BLOCK_MS if b >= rows)


def pick_k_splits(ctas: int, k: int, sms: int = 132) -> int:
    """K splits for ``ctas`` CTAs (128-row blocks) over ``k`` inputs: doubled while the CTAs
    number fewer than the SMs and each split keeps at least two K steps (a divisor of K's
    steps). On an H100 at the ``mid`` decode shapes this was each shape's best or within 10%
    of it, at 4 and at 64 rows (docs/kernels.md, "FP8 stacked GEMV")."""
    steps = k // BLOCK_K
    splits = 1
    while ctas * splits < sms and steps % (2 * splits) == 0 and steps // (2 * splits) >= 2:
        splits *= 2
    return splits


def fits(m: int, g: int, n_rows: tuple[int, ...], k: int) -> bool:
    """Whether the kernel takes ``m`` input rows of ``g`` groups of ``k`` inputs times weights
    of ``n_rows`` rows: at most :data:`MAX_ROWS` rows, ``K`` a multiple of 64, each weight's
    rows (and each group's) a multiple of 128, one group for several weights."""
    if not 1 <= m <= MAX_ROWS or k % BLOCK_K or any(n % BLOCK_N for n in n_rows):
        return False
    if g > 1:
        return len(n_rows) == 1 and n_rows[0] % g == 0 and (n_rows[0] // g) % BLOCK_N == 0
    return True


def _e8m0_to_f32(e):
    """E8M0 scale bytes (as int32, any layout) -> their fp32 powers of two ``2**(e - 127)``
    (exact; 0 gives ``2**-127``, a subnormal)."""
    normal = lax.bitcast_convert_type(e << 23, F32)
    return jnp.where(e == 0, jnp.float32(2.0 ** -127), normal)


def _act_quant_tile(x_smem, block_m):
    """The input tile ``[block_m, 64]`` in shared memory FP8-QDQ'd in place per 32 inputs of a
    row (bit for bit :func:`pallas_kernels.fp4.reference.act_quant_qdq`): loaded in the WGMMA
    layout, each half's amax a masked row reduction, the E8M0 exponent from its bits, the
    hardware's round-to-nearest satfinite e4m3 convert, stored back and fenced for wgmma."""
    layout = plgpu.Layout.WGMMA
    x = plgpu.load(x_smem, (), layout=layout).astype(F32)
    low = plgpu.broadcasted_iota(jnp.int32, (block_m, BLOCK_K), 1, layout=layout) < 32
    a = jnp.abs(x)
    exps = []
    for lo_half in (True, False):
        amax = jnp.maximum(jnp.max(jnp.where(low == lo_half, a, 0.0), axis=1), 1e-4)
        bits = lax.bitcast_convert_type(amax * np.float32(1.0 / FP8_MAX), jnp.int32)
        exps.append(lax.broadcast_in_dim(
            ((bits >> 23) & 0xFF) - 127 + jnp.where((bits & 0x7FFFFF) != 0, 1, 0),
            (block_m, BLOCK_K), [0]))
    e = jnp.where(low, exps[0], exps[1])
    q = (x * _exp2(-e)).astype(jnp.float8_e4m3fn).astype(F32) * _exp2(e)
    x_smem[...] = q.astype(BF16)
    plgpu.commit_smem()


def _exp2(e):
    """``2.0 ** e`` (fp32) for int32 ``e`` in -126 .. 127, from its bits."""
    return lax.bitcast_convert_type((e + 127) << 23, F32)


def _kernel(layer_gmem, x_gmem, *refs, n_weights, K, block_m, groups, rows_per_group,
            k_splits, max_concurrent_steps, out_dtype, act_quant=False):
    w_gmems, s_gmems = refs[:n_weights], refs[n_weights:2 * n_weights]
    o_gmem = refs[2 * n_weights]
    a_smem = refs[2 * n_weights + 1] if len(refs) > 2 * n_weights + 1 else None
    n = lax.axis_index("n")
    ks = lax.axis_index("k")
    layer = layer_gmem[0]
    steps = K // BLOCK_K // k_splits
    k0 = ks * steps
    # the input rows' block of this CTA's group (G > 1: the grouped output projection)
    x_block = (n * BLOCK_N) // rows_per_group if groups > 1 else 0

    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_N, BLOCK_K), 1, layout=plgpu.Layout.WGMMA)
    low_half = col < 32
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    row_block = plgpu.broadcasted_iota(jnp.int32, (BLOCK_N,), 0, layout=row_layout) // 32

    def weight_pipeline(w_gmem, s_gmem, n_local):
        def acc_scope(acc_ref):
            def step(idx, x_smem, w_smem):
                if act_quant:
                    _act_quant_tile(x_smem, block_m)
                kb = 2 * (k0 + idx[0])             # the step's first 32-input scale block
                halves = []
                for h in range(2):
                    s = [s_gmem[layer, 4 * n_local + i, kb + h].astype(jnp.int32)
                         for i in range(4)]
                    e = jnp.where(row_block == 0, s[0],
                                  jnp.where(row_block == 1, s[1],
                                            jnp.where(row_block == 2, s[2], s[3])))
                    halves.append(lax.broadcast_in_dim(_e8m0_to_f32(e), (BLOCK_N, BLOCK_K),
                                                       [0]))
                w = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
                w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(F32)
                w = (w * jnp.where(low_half, halves[0], halves[1])).astype(BF16)
                weight_times_rows(acc_ref, w, x_smem, a_smem)

            plgpu.emit_pipeline(
                step,
                grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((block_m, BLOCK_K), lambda k: (x_block, k0 + k)),
                    plgpu.BlockSpec((BLOCK_N, BLOCK_K), lambda k: (n_local, k0 + k)),
                ],
                max_concurrent_steps=min(max_concurrent_steps, steps),
            )(x_gmem, w_gmem.at[layer])
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_N, block_m), F32))
        store_tile(acc, o_gmem, ks, pl.ds(0, block_m), pl.ds(n * BLOCK_N, BLOCK_N),
                   k_splits=k_splits, rows_out=True, out_dtype=out_dtype)

    start = 0
    for w_gmem, s_gmem in zip(w_gmems, s_gmems):
        blocks = w_gmem.shape[1] // BLOCK_N

        @pl.when((n >= start) & (n < start + blocks))
        def _(w_gmem=w_gmem, s_gmem=s_gmem, first=start):
            weight_pipeline(w_gmem, s_gmem, n - first)

        start += blocks


@functools.partial(jax.jit, static_argnames=("groups", "k_splits", "max_concurrent_steps",
                                             "out_dtype", "interpret", "act_quant"))
def _kernel_call(layer, x, ws, ss, *, groups, k_splits, max_concurrent_steps, out_dtype,
                 interpret, act_quant=False):
    K = x.shape[-1]
    rows = x.shape[0] // groups
    block_m = rows
    N = sum(w.shape[1] for w in ws)
    planes = k_splits > 1
    out_dtype = BF16 if planes else jnp.dtype(out_dtype)
    kernel = functools.partial(
        _kernel, n_weights=len(ws), K=K, block_m=block_m, groups=groups,
        rows_per_group=N // groups, k_splits=k_splits,
        max_concurrent_steps=max_concurrent_steps, out_dtype=out_dtype, act_quant=act_quant)
    out = jax.ShapeDtypeStruct((k_splits, 2, block_m, N) if planes else (1, block_m, N),
                               out_dtype)
    call = plgpu.kernel(
        kernel,
        out_type=out,
        grid=(N // BLOCK_N, k_splits),
        grid_names=("n", "k"),
        kernel_name="fp8_stacked_gemm",
        # interpret mode's wgmma takes A from shared memory only: stage the tile there
        scratch_types=[plgpu.SMEM((BLOCK_N, BLOCK_K), BF16)] if interpret else [],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(layer.reshape(1).astype(jnp.int32), x, *ws, *ss)


def fp8_gemm(x: BFloat16[Array, "M G K"], ws: tuple, scales: tuple, layer: Int[Array, ""], *,
             out_dtype=F32, k_splits: int | None = None, max_concurrent_steps: int = 4,
             interpret: bool = False) -> Array:
    """``x [M, G, K] @ W[layer].T`` for each weight stack of ``ws`` (``float8_e4m3fn [L, N_i,
    K]``, E8M0 ``scales[i]`` uint8 ``[L, N_i / 32, K / 32]``) on the same input, as
    :func:`pallas_kernels.gemv.fp8_gemv` (``G > 1``: one weight, row ``n`` reading group ``n //
    (N / G)``). ``x``: the input as the products take it (bf16; a quantised linear's FP8 QDQ
    already applied). Returns the outputs side by side, ``[M, sum N_i]`` of ``out_dtype``
    (float32 or bfloat16; the fp32 sums rounded once). Tuning: ``k_splits`` (default
    :func:`pick_k_splits`), ``max_concurrent_steps``. Raises ``ValueError`` for shapes the
    kernel does not take (:func:`fits`)."""
    M, G, K = x.shape
    block_m = pick_block_m(M)
    # group by group, each padded to the row tile: [G * block_m, K]
    xg = jnp.pad(jnp.swapaxes(x.astype(BF16), 0, 1), ((0, 0), (0, block_m - M), (0, 0)))
    return fp8_gemm_rows(xg.reshape(G * block_m, K), M, ws, scales, layer, groups=G,
                         out_dtype=out_dtype, k_splits=k_splits,
                         max_concurrent_steps=max_concurrent_steps, interpret=interpret)


def fp8_gemm_rows(xp: BFloat16[Array, "R K"], rows: int, ws: tuple, scales: tuple,
                  layer: Int[Array, ""], *, groups: int = 1, out_dtype=F32,
                  k_splits: int | None = None, max_concurrent_steps: int = 4,
                  act_quant: bool = False, interpret: bool = False) -> Array:
    """:func:`fp8_gemm` of an input already in the kernel's layout: ``xp`` ``[G * T, K]``, the
    ``groups`` groups one after the other, each its ``rows`` rows padded to the row tile ``T =
    pick_block_m(rows)`` (:func:`pallas_kernels.gemv.triton.input_rows` makes it in one
    launch). ``act_quant``: the kernel FP8-QDQs each input tile itself, per 32 inputs
    (:func:`_act_quant_tile`; one group, a row tile of :data:`MAX_ROWS`: ``xp`` ``[64, K]``).
    Returns ``[rows, sum N_i]``; raises ``ValueError`` as :func:`fp8_gemm`, and for
    ``act_quant`` with groups or another row tile."""
    K = xp.shape[-1]
    n_rows = tuple(int(w.shape[1]) for w in ws)
    block_m = (MAX_ROWS if act_quant else pick_block_m(rows)) if 1 <= rows <= MAX_ROWS else 0
    if (not fits(rows, groups, n_rows, K) or xp.shape != (groups * block_m, K)
            or (act_quant and groups > 1)
            or any(w.shape[2] != K or w.shape[0] != ws[0].shape[0] for w in ws)):
        raise ValueError(f"fp8_gemm: the Mosaic GPU kernel does not take {rows} rows of "
                         f"{groups} groups {tuple(xp.shape)} with weights "
                         f"{[tuple(w.shape) for w in ws]} (at most {MAX_ROWS} rows, K a "
                         f"multiple of {BLOCK_K}, rows of each weight and group a multiple "
                         f"of {BLOCK_N}, one stack depth; act_quant: one group of "
                         f"{MAX_ROWS} rows)")
    for w, s in zip(ws, scales):
        L, N, _ = w.shape
        if s.shape != (L, N // 32, K // 32):
            raise ValueError(f"fp8_gemm: scale {s.shape} != {(L, N // 32, K // 32)}")
    N = sum(n_rows)
    splits = k_splits or pick_k_splits(N // BLOCK_N, K)
    if K % (BLOCK_K * splits):
        raise ValueError(f"fp8_gemm: K={K} must be a multiple of {BLOCK_K} x "
                         f"k_splits={splits}")
    y = _kernel_call(layer, xp.astype(BF16), tuple(ws), tuple(scales), groups=groups,
                     k_splits=splits, max_concurrent_steps=max_concurrent_steps,
                     out_dtype=jnp.dtype(out_dtype).name, interpret=interpret,
                     act_quant=act_quant)
    if splits > 1:      # the K splits' fp32 partial sums added, rounded once
        return jnp.sum(from_bit_planes(y), axis=0)[:rows].astype(out_dtype)
    return y[0, :rows].astype(out_dtype)
