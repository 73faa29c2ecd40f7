"""FP8 stacked GEMV: a few rows times one layer's block-scaled FP8 weight, read in place out of
the stack of every layer's weights (docs/architecture.md, "Quantised linears").

``fp8_gemv(x [M, G, K] bf16, w [L, N, K] float8_e4m3fn, scale [L, ceil(N/32), ceil(K/32)]
uint8, layer int32) -> fp32 [M, N]``: ``y[m, n] = sum_k x[m, g(n), k] * W[layer][n, k] *
2**(scale - 127)`` with ``g(n) = n // (N / G)``. The products are exact in fp32 (the input an
FP8 QDQ activation or bf16, the weight FP8 times a power of two), so implementations differ
only in summation order.

Why: inside a ``lax.scan`` over stacked layers, XLA copies each layer's weight out of the
stack before a GEMM reads it; a decode step (a few rows) reads every weight once, so that copy
doubles or triples its traffic. The kernel reads the stack where it lies.

Implementations (``impl``, :mod:`pallas_kernels.impls`): ``"xla"`` (:mod:`.reference`),
``"gpu"`` (:mod:`.triton`; or, for tens of rows, :mod:`.mosaic_gpu`, ``kernel=``),
``"gpu_interpret"``, ``"auto"`` (``"gpu"`` on an NVIDIA GPU where the shapes fit: at most
:data:`AUTO_MAX_ROWS` rows (the kernel takes up to 64), ``N`` a multiple of 32 and of ``32 *
G``, ``K`` of 64 (:data:`.triton.MIN_BLOCK_K`), the stack under 2**31 bytes; ``"xla"``
otherwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels import impls
from pallas_kernels.gemv import mosaic_gpu, reference, triton

__all__ = ["fp8_gemv", "fp8_gemv_pair", "fp8_gemv_swiglu", "kernel_fits", "pair_fits",
           "auto_fits", "MAX_ROWS", "AUTO_MAX_ROWS"]

#: The most input rows the GPU kernel takes (tiles of 16, 32 or 64 rows).
MAX_ROWS = triton.MAX_TILE_ROWS
#: The most rows for which ``impl="auto"`` (and the model's linears,
#: :func:`dsv41_jax.layers.linear.linear`) run the kernel on a GPU: all it takes. At 64 rows
#: (a ``mid`` decode step of batch 64 on an H100) the 64-row tiles ran the step in 17.2 ms
#: queued against 21.8 ms with XLA's dequantise-and-GEMM above 16 rows (docs/benchmarks.md,
#: "End-to-end").
AUTO_MAX_ROWS = triton.MAX_TILE_ROWS
#: Inputs of at least this many rows (a decode step of a larger batch) run the Mosaic GPU
#: kernel (:mod:`.mosaic_gpu`: the weight as wgmma's first operand, converted and scaled in
#: registers; the input's FP8 act-quant and padding in one Triton launch before it,
#: :func:`triton.input_rows`) instead of the Triton one, where it takes the shapes and no RoPE
#: is asked of the kernel; the same exact products, summed in another order. 65 (the
#: default): never. On an H100 a ``mid`` decode step of batch 64 took 1.7 ms less device time
#: with 17, but 280 more launches (its synced time 0.5 ms more) and 39 distinct kernels to
#: compile, one per layer-group stack depth and shape (docs/benchmarks.md, "Switches timed").
MOSAIC_MIN_ROWS = 65


def auto_fits(x_shape: tuple, w_shape: tuple) -> bool:
    """Whether ``impl="auto"`` picks the GPU kernel for these shapes on a GPU:
    :func:`kernel_fits` and at most :data:`AUTO_MAX_ROWS` rows."""
    return x_shape[0] <= AUTO_MAX_ROWS and kernel_fits(x_shape, w_shape)


def kernel_fits(x_shape: tuple, w_shape: tuple) -> bool:
    """Whether the GPU kernel takes these shapes (see the module docstring)."""
    M, G, K = x_shape
    L, N, Kw = w_shape
    return (M <= MAX_ROWS and K == Kw and N % (32 * G) == 0 and (N // G) % 32 == 0
            and K % triton.MIN_BLOCK_K == 0 and L * N * K < 2 ** 31)


def pair_fits(x_shape: tuple, w0_shape: tuple, w1_shape: tuple) -> bool:
    """Whether the GPU kernel takes two weight stacks on one input (:func:`fp8_gemv_pair`):
    each as :func:`kernel_fits`, one group, the same stack depth, both together under
    2**31 bytes."""
    return (x_shape[1] == 1 and w0_shape[0] == w1_shape[0] and kernel_fits(x_shape, w0_shape)
            and kernel_fits(x_shape, w1_shape)
            and w0_shape[0] * (w0_shape[1] + w1_shape[1]) * w0_shape[2] < 2 ** 31)


#: Whether the Mosaic GPU kernel FP8-QDQs a quantised linear's input tiles itself (one group:
#: the rows padded to 64 by XLA below 64, no launch at 64) instead of taking them from
#: :func:`triton.input_rows` (one launch a call): a batch-64 step's ~160 input launches go.
#: Bitwise the reference's QDQ in interpret mode and built for an H200; not yet run on a GPU.
MOSAIC_ACT_QUANT = False

KERNELS = ("auto", "triton", "mosaic")
#: The Mosaic GPU kernel's tuning keywords (:func:`mosaic_gpu.fp8_gemm_rows`).
MOSAIC_TUNING = ("k_splits", "max_concurrent_steps")


def _mosaic(x, ws: tuple, scales: tuple, layer, act_quant: bool, out_dtype, interpret: bool,
            kernel: str, rope, tuning: dict):
    """The GPU path's ``kernel`` resolved: :func:`mosaic_gpu.fp8_gemm_rows`'s output (its
    input made by :func:`triton.input_rows` in one launch, none for a bf16 input already in
    its layout) for ``"mosaic"``, and for ``"auto"`` where :data:`MOSAIC_MIN_ROWS` sends these
    rows to it, it takes the shapes, no RoPE is asked and no Triton tuning is given; else None
    (the Triton kernel). Raises ``ValueError`` for an unknown ``kernel``, and for
    ``"mosaic"`` with shapes it does not take, a RoPE or tuning keywords not its own."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    M, G, K = x.shape
    fits = mosaic_gpu.fits(M, G, tuple(int(w.shape[1]) for w in ws), K)
    if kernel == "triton" or (kernel == "auto" and (tuning or M < MOSAIC_MIN_ROWS or not fits
                                                    or rope is not None)):
        return None
    if kernel == "mosaic" and (not fits or rope is not None
                               or set(tuning) - set(MOSAIC_TUNING)):
        raise ValueError(
            f"kernel='mosaic' takes no RoPE, tuning keywords {MOSAIC_TUNING} only and at most "
            f"{mosaic_gpu.MAX_ROWS} rows, K a multiple of {mosaic_gpu.BLOCK_K}, rows a multiple "
            f"of {mosaic_gpu.BLOCK_N} per weight and group: got x {tuple(x.shape)}, weights "
            f"{[tuple(w.shape) for w in ws]}, tuning {sorted(tuning)}")
    if act_quant and G == 1 and MOSAIC_ACT_QUANT:     # the kernel QDQs its own tiles
        tile = mosaic_gpu.MAX_ROWS
        xp = x.reshape(M, K).astype(jnp.bfloat16)
        xp = xp if M == tile else jnp.pad(xp, ((0, tile - M), (0, 0)))
        return mosaic_gpu.fp8_gemm_rows(xp, M, ws, scales, layer, out_dtype=out_dtype,
                                        act_quant=True, interpret=interpret, **tuning)
    tile = mosaic_gpu.pick_block_m(M)
    if act_quant or G > 1 or M < tile:
        xp = triton.input_rows(x, tile, act_quant=act_quant, interpret=interpret)
    else:
        xp = x.reshape(M, K)
    return mosaic_gpu.fp8_gemm_rows(xp, M, ws, scales, layer, groups=G, out_dtype=out_dtype,
                                    interpret=interpret, **tuning)


def _check_out_dtype(out_dtype):
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype!r}")


def _check_rope(rope, name: str, M: int, channels: int):
    """``(positions, freqs, head, inverse)`` checked against ``M`` rows of ``channels``."""
    try:
        positions, freqs, head, inverse = rope
    except (TypeError, ValueError):
        raise ValueError(f"{name}: (positions, freqs, head, inverse) expected") from None
    if jnp.shape(positions) != (M,):
        raise ValueError(f"{name}: positions of shape ({M},) expected (one per row), got "
                         f"{jnp.shape(positions)}")
    pairs = jnp.shape(freqs)[0] if jnp.ndim(freqs) == 1 else -1
    if (not isinstance(head, int) or head <= 0 or channels % head or pairs <= 0
            or 2 * pairs > head or head % 2):
        raise ValueError(f"{name}: head={head} must be an even divisor of the {channels} "
                         f"channels holding the 2 x {pairs} rotated ones (freqs [R/2])")
    return positions, freqs, head, bool(inverse)


def fp8_gemv(x: Float[Array, "M G K"], w: jax.Array, scale: UInt8[Array, "L Go Gi"],
             layer: Int[Array, ""], *, act_quant: bool = False, out_dtype=jnp.float32,
             impl: str = "auto", rope_in=None, rope_out=None, kernel: str = "auto",
             **tuning) -> Float[Array, "M N"]:
    """See the module docstring. ``act_quant``: FP8 QDQ of ``x`` per 32 inputs first (a
    quantised linear's activation quantisation; the kernel applies it to its tiles, so no
    separate kernels compute it). ``out_dtype``: the result's dtype, the fp32 sums rounded
    to it once (float32 or bfloat16; the GPU kernel stores it directly where K is not
    split, so no conversion kernel follows it). ``tuning``: ``block_k``, ``k_splits``, ``block_n``,
    ``num_warps``, ``num_stages`` of the Triton kernel, or :data:`MOSAIC_TUNING` of the
    Mosaic GPU one. ``kernel`` (on the GPU): ``"triton"``, ``"mosaic"`` (:mod:`.mosaic_gpu`:
    tens of rows on wgmma; no RoPE), or ``"auto"`` (the Mosaic GPU kernel from
    :data:`MOSAIC_MIN_ROWS` rows where it applies and no tuning is given).

    ``rope_in`` / ``rope_out``: ``(positions int32 [M], freqs fp32 [R/2], head, inverse)``, the
    rotary embedding (:func:`pallas_kernels.rope.apply_rope`, ``inverse`` its conjugate) of
    every head of ``head`` channels, row ``m`` at ``positions[m]``: of the input (each group's
    ``K`` channels, before the act-quant; an attention output before ``wo_a``) or of the output
    after its rounding to ``out_dtype`` (a query after ``wq_b``). The GPU kernel rotates its
    tiles in registers (the output in its store where K is not split, else after the
    reduction), so no launch of its own does; :func:`reference.rope_heads` otherwise. Raises
    ``ValueError`` for an unknown ``impl`` or, with ``impl="gpu"``, shapes the kernel does not
    take, for an ``out_dtype`` other than float32 / bfloat16, and for both ropes or a
    malformed one."""
    impl = impls.check_family(impl)
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() and auto_fits(x.shape, w.shape) else "xla"
    _check_out_dtype(out_dtype)
    if rope_in is not None and rope_out is not None:
        raise ValueError("fp8_gemv: rope_in or rope_out, not both")
    M, _, K = x.shape
    if rope_in is not None:
        rope_in = _check_rope(rope_in, "rope_in", M, K)
    if rope_out is not None:
        rope_out = _check_rope(rope_out, "rope_out", M, w.shape[1])
    if impl in ("xla", "tpu", "tpu_interpret"):
        if rope_in is not None:
            x = reference.rope_heads(x, *rope_in)
        y = reference.fp8_gemv(x, w, scale, layer, act_quant).astype(out_dtype)
        return y if rope_out is None else reference.rope_heads(y, *rope_out)
    if not kernel_fits(x.shape, w.shape):
        raise ValueError(f"fp8_gemv: the GPU kernel does not take x {x.shape} with w {w.shape}")
    rope = rope_in or rope_out
    y = _mosaic(x, (w,), (scale,), layer, act_quant, out_dtype, impls.interpret(impl), kernel,
                rope, tuning)
    if y is not None:
        return y
    return triton.fp8_gemv(
        x, w, scale, layer, *(rope[:2] if rope else ()), act_quant=act_quant,
        out_dtype=jnp.dtype(out_dtype).name, interpret=impls.interpret(impl),
        rope=None if rope is None else ("input" if rope_in else "output", *rope[2:]), **tuning)


def fp8_gemv_swiglu(parts: Float[Array, "S P C"], w: jax.Array, scale: UInt8[Array, "L Go Gi"],
                    layer: Int[Array, ""], *, rows: int, limit: float,
                    act_quant: bool = False, out_dtype=jnp.float32, impl: str = "auto",
                    **tuning) -> Float[Array, "M N"]:
    """:func:`fp8_gemv` of the SwiGLU of a GEMV pair's output, from that pair's partial sums
    (:func:`fp8_gemv_pair` with ``partials=True``: ``parts [S, P >= rows, 2I]``, the gate
    projection then the up projection): ``x = bf16(silu(g) * u)`` of the bf16 outputs ``g``,
    ``u`` with the clamps (``limit > 0``: ``u`` to ``[-limit, limit]``, ``g`` from above;
    :func:`reference.swiglu_input`), ``w`` ``[L, N, I]``. The GPU kernel makes each input
    tile from the partial sums in registers, so neither the pair's reduction nor the SwiGLU
    launches a kernel of its own (an FP8 shared expert's ``w2`` in a decode step). Returns
    ``[rows, N]`` of ``out_dtype``. Raises ``ValueError`` as :func:`fp8_gemv`, and for
    ``parts`` that do not hold ``rows`` rows of ``2 I`` columns."""
    impl = impls.check_family(impl)
    I = w.shape[-1]
    if parts.ndim != 3 or parts.shape[-1] != 2 * I or parts.shape[1] < rows or rows < 1:
        raise ValueError(f"fp8_gemv_swiglu: parts {parts.shape} must be [S, P >= rows={rows}, "
                         f"2 x {I}] (the gate and up projections' partial sums)")
    if impl == "auto":
        impl = "gpu" if impls.on_gpu() and auto_fits((rows, 1, I), w.shape) else "xla"
    _check_out_dtype(out_dtype)
    if impl in ("xla", "tpu", "tpu_interpret"):
        x = reference.swiglu_input(parts, rows, limit)
        return reference.fp8_gemv(x, w, scale, layer, act_quant).astype(out_dtype)
    if not kernel_fits((rows, 1, I), w.shape):
        raise ValueError(f"fp8_gemv_swiglu: the GPU kernel does not take {rows} rows with w "
                         f"{w.shape}")
    return triton.fp8_gemv_swiglu(parts, w, scale, layer, rows=rows, limit=float(limit),
                                  act_quant=act_quant, out_dtype=jnp.dtype(out_dtype).name,
                                  interpret=impls.interpret(impl), **tuning)


def fp8_gemv_pair(x: Float[Array, "M 1 K"], w0: jax.Array, scale0: UInt8[Array, "L Go0 Gi"],
                  w1: jax.Array, scale1: UInt8[Array, "L Go1 Gi"], layer: Int[Array, ""], *,
                  act_quant: bool = False, out_dtype=jnp.float32, impl: str = "auto",
                  partials: bool = False, kernel: str = "auto", **tuning):
    """:func:`fp8_gemv` of two weight stacks that read the same input (a layer's ``wq_a`` and
    ``wkv``, a shared expert's ``w1`` and ``w3``): ``(x @ W0[layer].T, x @ W1[layer].T)``. The
    GPU kernel runs both in one launch (its programs' row blocks span the two weights), so a
    decode step launches one kernel, and one partial-sum reduction, where it launched two.
    Returns ``(y0 [M, N0], y1 [M, N1])`` of ``out_dtype``; with ``partials``, ``(y0, y1,
    parts)``: ``parts`` ``[S, rows >= M, N0 + N1]`` (fp32, or ``out_dtype`` where ``S`` is 1),
    the two outputs side by side before the reduction of the kernel's K splits (the outputs'
    row ``m`` is ``out_dtype(0 + sum_s parts[s, m])``; the XLA form gives ``S = 1``), for a
    consumer kernel that reads them in place (:func:`pallas_kernels.window_ring.quantize_write`).
    Raises ``ValueError`` as :func:`fp8_gemv` (``impl="gpu"``: shapes :func:`pair_fits`
    refuses) and an ``out_dtype`` other than float32 / bfloat16."""
    impl = impls.check_family(impl)
    if impl == "auto":
        impl = ("gpu" if impls.on_gpu() and pair_fits(x.shape, w0.shape, w1.shape)
                and x.shape[0] <= AUTO_MAX_ROWS else "xla")
    _check_out_dtype(out_dtype)
    if impl in ("xla", "tpu", "tpu_interpret"):
        y0 = reference.fp8_gemv(x, w0, scale0, layer, act_quant).astype(out_dtype)
        y1 = reference.fp8_gemv(x, w1, scale1, layer, act_quant).astype(out_dtype)
        return (y0, y1, jnp.concatenate([y0, y1], axis=-1)[None]) if partials else (y0, y1)
    if not pair_fits(x.shape, w0.shape, w1.shape):
        raise ValueError(f"fp8_gemv_pair: the GPU kernel does not take x {x.shape} with w "
                         f"{w0.shape} and {w1.shape}")
    y = _mosaic(x, (w0, w1), (scale0, scale1), layer, act_quant, out_dtype,
                impls.interpret(impl), kernel, None, tuning)
    if y is not None:
        y0, y1 = y[:, :w0.shape[1]], y[:, w0.shape[1]:]
        return (y0, y1, y[None]) if partials else (y0, y1)
    return tuple(triton.fp8_gemv_pair(x, w0, scale0, w1, scale1, layer, act_quant=act_quant,
                                      out_dtype=jnp.dtype(out_dtype).name,
                                      interpret=impls.interpret(impl), partials=partials,
                                      **tuning))
