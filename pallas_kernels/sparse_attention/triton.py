"""Pallas Triton kernel of the CSA2 sparse attention (NVIDIA GPUs; spec 3.8).

One program per (query row, head block, split): the ``block_h`` heads of a query share its index
list (MQA), so every 64-entry block is one ``[block_h, 64]`` score tile and one
``[block_h, 64] x [64, K]`` PV product on the tensor cores.

* Rows are gathered straight from the state's storage: FP8 window rows (e4m3 + E8M0 per 32) and
  packed FP4 main KV (e2m1 pairs + E4M3 per 16), and dequantised in registers; no bf16 copy of
  the KV is written to HBM.
* Each listed row is one contiguous load of int32 words (4 e4m3 codes or 8 e2m1 nibbles per
  word); the fields are split off with shifts and reshaped to the natural channel order, so
  ``q`` and ``o`` need no permutation.
* ``n_splits > 1`` (flash-decoding) splits the list's blocks over programs; the partial
  ``(acc, m, l)`` are merged in XLA. With ``n_splits = 1`` the blocks run in the reference order
  and the kernel finishes the softmax itself (sink, division, bf16 output).

The e4m3/e2m1 decodes are integer bit manipulation (fp16 bit placement), so the kernel needs no
fp8 instructions and runs unchanged in Pallas interpret mode on CPU. The state never holds the
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


def _fp16_bits_to_f32(bits):
    """int32 holding fp16 bits in its low 16 -> fp32 (exact; fp16 subnormals are f32 normals)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(F32)


def e4m3_over_256(b):
    """e4m3fn byte (int32 0..255; never the NaN code in our data) -> value * 2**-8, exactly.

    The 7 low bits land in an fp16's exponent low 4 bits and mantissa top 3 bits, so the fp16
    reads ``2**(e-15) * (1 + m/8)`` (subnormal ``m/8 * 2**-14`` when e = 0): the e4m3 value
    times 2**-8. No f32 denormals are involved, so CPU flush-to-zero cannot change it.
    """
    return _fp16_bits_to_f32(((b & 0x80) << 8) | ((b & 0x7F) << 7))


def e2m1_over_16384(c):
    """e2m1 nibble (int32 0..15) -> value * 2**-14, exactly (same fp16 bit placement)."""
    return _fp16_bits_to_f32(((c & 8) << 12) | ((c & 7) << 9))


def _bytes(words, n: int):
    """int32 words [..., W] -> their n little-endian fields of 32/n bits, [..., W, n]."""
    bits = 32 // n
    sh = (jnp.arange(n, dtype=I32) * bits).reshape((1,) * words.ndim + (n,))
    return (words[..., None] >> sh) & ((1 << bits) - 1)


def _kernel(q_ref, idx_ref, wkv_ref, wsc_ref, mkv_ref, msc_ref, sink_ref, *out_refs,
            S, K, block_h, n_win, n_blocks, n_splits, scale, interpret):
    """Program (row r = b*S + s, head block, split) over the joint list ``idx_ref``: the first
    ``n_win`` entries are window rows, the rest main-KV entries (-1 = none).

    Codes arrive as int32 words so every row is one contiguous, vectorisable load: window rows
    [B, Nw, K/4] (4 e4m3 codes per word), main KV [B, T, K/8] (8 e2m1 nibbles per word); the
    scales as bytes: E8M0 [B, Nw, K/32], e4m3 bits [B, T, K/16].
    """
    r, hb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = r // S
    BN = SOFTMAX_BLOCK
    n_rows_win, n_rows_main = wkv_ref.shape[1], mkv_ref.shape[1]
    q = q_ref[...]                                            # [BH, K] bf16
    w_col = jnp.arange(K // 4, dtype=I32)[None, :]
    ws_col = jnp.arange(K // 32, dtype=I32)[None, :]
    m_col = jnp.arange(K // 8, dtype=I32)[None, :]
    ms_col = jnp.arange(K // 16, dtype=I32)[None, :]

    def dot(a, b, dims):
        if interpret:  # XLA:CPU has no bf16 x bf16 -> f32 dot thunk; f32 operands are exact
            a, b = a.astype(F32), b.astype(F32)
        return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)

    nt, nn = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))

    def window_rows(row):                                     # row [BN, 1] -> f32 [BN, K]
        codes = _bytes(wkv_ref[b, row, w_col], 4)             # [BN, K/4, 4]
        sc = wsc_ref[b, row, ws_col].astype(I32)              # E8M0 bytes [BN, K/32]
        sc = jax.lax.bitcast_convert_type(sc << 23, F32)      # 2**(u-127), bytes 1..254
        v = (e4m3_over_256(codes) * 256.0).reshape(BN, K // 32, 32) * sc[:, :, None]
        return v.reshape(BN, K)

    def main_rows(row):
        nib = _bytes(mkv_ref[b, row, m_col], 8)               # [BN, K/8, 8] element 8w+n
        sc = msc_ref[b, row, ms_col].astype(I32)              # e4m3 bytes [BN, K/16]
        sc = e4m3_over_256(sc) * (2.0 ** 22)                  # scale * 2**14
        v = e2m1_over_16384(nib).reshape(BN, K // 16, 16) * sc[:, :, None]
        return v.reshape(BN, K)

    def block(kind):
        def body(j, carry):
            m, l, acc = carry
            idx = idx_ref[pl.ds(j * BN, BN)]
            ok = idx >= 0
            # clamp to the array read (as the XLA path's gather does); -1 reads row 0
            row_w = jnp.clip(idx, 0, n_rows_win - 1)[:, None]
            row_m = jnp.clip(idx, 0, n_rows_main - 1)[:, None]
            if kind == "window":
                kv = window_rows(row_w)
            elif kind == "main":
                kv = main_rows(row_m)
            else:  # the block where the window list ends and the global list starts
                is_win = (j * BN + jnp.arange(BN, dtype=I32) < n_win)[:, None]
                kv = jnp.where(is_win, window_rows(row_w), main_rows(row_m))
            # an unlisted entry reads row 0 (finite: the state only ever holds valid codes)
            # and gets P = 0, so it adds exactly nothing
            kv = kv.astype(BF16)
            s = dot(q, kv, nt) * scale
            s = jnp.where(ok[None, :], s, -jnp.inf)               # [BH, BN]
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(p.astype(BF16), kv, nn)
            return m_new, l, acc
        return body

    carry = (jnp.full((block_h,), NEG_START, F32), jnp.zeros((block_h,), F32),
             jnp.zeros((block_h, K), F32))
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
            carry = jax.lax.fori_loop(*rng(a, c), block(kind), carry)
    m, l, acc = carry
    if n_splits == 1:
        o_ref, lse_ref = out_refs
        sink = sink_ref[pl.ds(hb * block_h, block_h)]
        o_ref[...] = (acc / (l + jnp.exp(sink - m))[:, None]).astype(BF16)
        lse_ref[...] = lse_with_sink(m, l, sink)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _words(a):
    """[B, N, F] 1-byte array -> int32 words [B, N, F/4] (a free bitcast, little-endian)."""
    u8 = jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a
    return jax.lax.bitcast_convert_type(u8.reshape(*a.shape[:-1], -1, 4), I32)


def default_tuning(rows: int, heads: int, n_blocks: int) -> dict:
    """Block sizes for a call with ``rows = B*S`` query rows (measured on the H200)."""
    block_h = min(heads, 64)
    programs = rows * (heads // block_h)
    # flash-decoding: split the list when too few programs would fill the GPU's 132 SMs
    n_splits = 1
    while programs * n_splits < 264 and n_splits * 2 <= n_blocks:
        n_splits *= 2
    return {"block_h": block_h, "n_splits": n_splits, "num_warps": 8, "num_stages": 2}


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "n_splits",
                                             "num_warps", "num_stages"))
def sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
                     interpret: bool = False, block_h: int | None = None,
                     n_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None):
    """Triton implementation of :func:`pallas_kernels.sparse_attention.sparse_attention`.

    Same arguments and results (o bf16 [B,S,H,K], lse fp32 [B,S,H]); ``block_h`` heads per
    program (a power of two dividing H), ``n_splits`` list splits (1 = the reference block
    order), Triton ``num_warps`` / ``num_stages``. Unset tuning comes from
    :func:`default_tuning`. Raises ``ValueError`` for a ``block_h`` that does not divide H.
    """
    B, S, H, K = q.shape
    n_win = win_idx.shape[-1]
    if topk is None:  # SWA-only layer: a dummy main KV that the kernel never reads
        lst = win_idx
        main = jnp.zeros((B, 1, K // 2), jnp.uint8)
        main_scale = jnp.zeros((B, 1, K // 16), jnp.float8_e4m3fn)
    else:
        lst = jnp.concatenate([win_idx, topk], axis=-1)
    lst = pad_list(lst)
    n_blocks = lst.shape[-1] // SOFTMAX_BLOCK
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
    R = B * S
    u8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    args = (q.reshape(R, H, K), lst.reshape(R, -1), _words(win_kv), win_scale,
            _words(main), u8(main_scale), sink.astype(F32))
    in_specs = [
        pl.BlockSpec((None, block_h, K), lambda r, h, s: (r, h, 0)),
        pl.BlockSpec((None, lst.shape[-1]), lambda r, h, s: (r, 0)),
        *[pl.BlockSpec() for _ in args[2:6]],     # whole arrays: rows are gathered in-kernel
        pl.BlockSpec((H,), lambda r, h, s: (0,)),
    ]
    if n_splits == 1:
        out_shape = (jax.ShapeDtypeStruct((R, H, K), BF16), jax.ShapeDtypeStruct((R, H), F32))
        out_specs = (pl.BlockSpec((None, block_h, K), lambda r, h, s: (r, h, 0)),
                     pl.BlockSpec((None, block_h), lambda r, h, s: (r, h)))
    else:
        out_shape = (jax.ShapeDtypeStruct((R, n_splits, H, K), F32),
                     jax.ShapeDtypeStruct((R, n_splits, H), F32),
                     jax.ShapeDtypeStruct((R, n_splits, H), F32))
        out_specs = (pl.BlockSpec((None, None, block_h, K), lambda r, h, s: (r, s, h, 0)),
                     pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h)),
                     pl.BlockSpec((None, None, block_h), lambda r, h, s: (r, s, h)))
    kernel = functools.partial(_kernel, S=S, K=K, block_h=block_h, n_win=n_win,
                               n_blocks=n_blocks, n_splits=n_splits, scale=scale,
                               interpret=interpret)
    outs = pl.pallas_call(
        kernel, grid=(R, H // block_h, n_splits), in_specs=in_specs, out_specs=out_specs,
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
