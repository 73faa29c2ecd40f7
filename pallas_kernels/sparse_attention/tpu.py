"""Pallas Mosaic TPU kernel of the CSA2 sparse attention op (docs/architecture.md,
"Joint sink softmax").

Semantics of :func:`.reference.sparse_attention_xla` (see its module docstring), except for the
block boundaries when the window list is not a multiple of 64 long: per query row ``(b, s)``
the list is ``win_idx[b, s]`` padded with -1 to a multiple of 64, then ``topk[b, s]`` (padded
as well). With the release layout (window 128, top-k 512) that is exactly the reference's
list; for other widths the blocks after the window start elsewhere, which moves single
``bf16(P)`` roundings (about one bf16 ulp of the output). Online softmax over 64-entry blocks in list order from ``m = -1e30``, ``bf16(P)`` in the
PV product, the sink in the denominator only, ``o = bf16(acc / (l + e^{sink - m}))``.

Design
------
Grid ``(rows, H // block_h)``, one query row ``(b, s)`` (and one head block) per step; both grid
axes are independent ("parallel"). The flattened, padded index lists are scalar-prefetch
operands (SMEM); the KV arrays stay in HBM (``memory_space=pl.ANY``) and every listed entry is
fetched with one row DMA for its codes and one for its scales into a double-buffered 64-row
VMEM block (block ``c + 1`` is in flight while block ``c`` is computed). A -1 entry reads
nothing from HBM: its buffer rows are DMA'd from a zero row in VMEM (exactly the reference's
"row treated as zero", whatever HBM row 0 holds) and its score is masked to -inf. Every block
thus moves the same number of bytes and is awaited with one semaphore wait per buffer.
Indices past the end read the last row, like the reference's clipped gather.

All KV words are 32-bit (``int32`` views made outside the kernel), so DMAs, VMEM buffers and the
bit-level decoding use the native 32-bit (8, 128) layout only. The channels are processed in
"plane" order: plane ``n`` (0..7) holds the elements ``8v + n`` at lane ``v`` (``W = K / 8``
lanes).

* main (FP4): word ``v`` of a packed row holds the eight e2m1 nibbles of elements
  ``8v .. 8v + 7``, so plane ``n`` is nibble ``n`` of every word: no shuffling at all.
* window (FP8): the rows are re-laid out outside the kernel into two half-rows of ``W`` words,
  byte ``b`` of word ``v`` of half ``h`` = element ``8v + 4h + b`` (a channel reorder of the
  small window array only); plane ``n`` is byte ``n % 4`` of half ``n // 4``.
* scales: one value per 32 (window) or 16 (main) elements, i.e. per 4 or 2 lanes, the same for
  all planes; they are spread over the lanes with a tiny one-hot matmul (exact: every scale is a
  bf16 value and each output has one non-zero term).
* q is split into the same planes and the output is put back into natural channel order, both
  with exact one-hot matmuls on the MXU (lane interleaving has no cheap vector form on TPU).

Scores are ``sum_n q_n . k_n`` (eight ``[Hb, W] x [64, W]^T`` matmuls), the PV product
``acc_n += bf16(P) @ k_n`` per plane (fp32 accumulators in VMEM scratch).

The index lists live in SMEM, so long inputs are processed in chunks of query rows
(``lax.map`` over chunks of at most ``SMEM_LIST_WORDS`` list entries).

Requires ``K % 128 == 0`` (whole 32-bit words of scale bytes per row). The release model has
K = 512 (W = 64 lanes per plane).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels.sparse_attention.common import BF16, F32, I32, SOFTMAX_BLOCK, pad_list
NEG_INIT = -1e30        # running-max start value (docs/architecture.md, "Joint sink softmax")
PLANES = 8              # e2m1 nibbles per 32-bit word
SMEM_LIST_WORDS = 1 << 15  # index-list entries prefetched to SMEM per pallas_call (128 KiB)


# ----------------------------------------------------------------------------- decoding
# Pure functions on int32 arrays holding code bytes / nibbles (0..255 / 0..15); used inside the
# kernel and tested on their own.


def e4m3_to_f32(x: Int[Array, "..."]) -> Float[Array, "..."]:
    """float8_e4m3fn code byte (int32, 0..255) -> fp32 value, bit-exact (NaN for 0x7F/0xFF)."""
    sign = (x >> 7) & 1
    exp = (x >> 3) & 0xF
    man = x & 7
    normal = jax.lax.bitcast_convert_type((sign << 31) | ((exp + 120) << 23) | (man << 20), F32)
    sub = man.astype(F32) * np.float32(2.0 ** -9)
    sub = jnp.where(sign == 1, -sub, sub)
    v = jnp.where(exp == 0, sub, normal)
    return jnp.where((exp == 15) & (man == 7), np.float32(np.nan), v)


def e2m1_to_f32(x: Int[Array, "..."]) -> Float[Array, "..."]:
    """e2m1 nibble code (int32, 0..15; bit 3 = sign) -> fp32 value (code 8 is -0.0)."""
    exp = (x >> 1) & 3
    man = x & 1
    mag = jnp.where(exp == 0, man * (126 << 23), ((exp + 126) << 23) | (man << 22))
    return jax.lax.bitcast_convert_type(mag | (((x >> 3) & 1) << 31), F32)


def e8m0_to_f32(x: Int[Array, "..."]) -> Float[Array, "..."]:
    """E8M0 scale byte (int32, 0..255) -> ``2**(x - 127)`` (byte 0 is the subnormal 2**-127)."""
    return jax.lax.bitcast_convert_type(jnp.where(x == 0, 1 << 22, x << 23), F32)


def _byte(w: Int[Array, "..."], b: int) -> Int[Array, "..."]:
    return (w >> (8 * b)) & 0xFF


def _spread_scales(words: Int[Array, "E U"], decode, group_lanes: int, width: int
                   ) -> Float[Array, "E W"]:
    """Per-group scales (4 code bytes per int32 word) -> one scale per plane lane.

    Group ``g = 4u + b`` is byte ``b`` of word ``u``; lane ``v`` of every plane belongs to group
    ``v // group_lanes``. Done as a one-hot matmul (exact: bf16-exact scales, one term each).
    """
    n_words = words.shape[-1]
    lane = jax.lax.broadcasted_iota(I32, (n_words, width), 1) // group_lanes
    word = jax.lax.broadcasted_iota(I32, (n_words, width), 0)
    out = None
    for b in range(4):
        onehot = (lane == 4 * word + b).astype(BF16)
        part = jnp.dot(decode(_byte(words, b)).astype(BF16), onehot, preferred_element_type=F32)
        out = part if out is None else out + part
    return out


def _plane_onehot(n: int, width: int) -> Float[Array, "W K"]:
    """``E[v, c] = (c == 8v + n)``, bf16 [W, 8W]: plane ``n`` lane ``v`` <-> channel ``8v + n``."""
    v = jax.lax.broadcasted_iota(I32, (width, PLANES * width), 0)
    c = jax.lax.broadcasted_iota(I32, (width, PLANES * width), 1)
    return (c == PLANES * v + n).astype(BF16)


# ----------------------------------------------------------------------------- kernel


def _kernel(lists_ref, rowb_ref, q_ref, idx_ref, sink_ref, win_ref, wsc_ref, *rest,
            n_entries: int, n_win_blocks: int, n_blocks: int, has_main: bool, scale: float):
    """One query row (and head block). Shapes (Hb heads, W = K/8 lanes, E = 64 entries):

    lists_ref: SMEM int32 [rows * n_entries] (padded lists); rowb_ref: SMEM int32 [rows] batch.
    q_ref: bf16 [Hb, K]; idx_ref: int32 [n_blocks, 1, E] (the lists again, for the score mask);
    sink_ref: fp32 [Hb, 1]; win_ref: HBM int32 [B, 2, Nw, W]; wsc_ref: HBM int32 [B, Nw, K/128];
    main_ref: HBM int32 [B, T, W]; msc_ref: HBM int32 [B, T, K/64] (when has_main).
    Outputs: o_ref bf16 [Hb, K]; lse_ref fp32 [Hb, 1]. Scratch: see ``_scratch_shapes``;
    ``sem`` holds one DMA semaphore per buffer slot.
    """
    if has_main:
        (main_ref, msc_ref, o_ref, lse_ref, qp, acc, wbuf, wsbuf, wzero, wszero,
         mbuf, msbuf, mzero, mszero, sem) = rest
    else:
        o_ref, lse_ref, qp, acc, wbuf, wsbuf, wzero, wszero, sem = rest
    E = SOFTMAX_BLOCK
    W = acc.shape[-1]
    row = pl.program_id(0)
    b = rowb_ref[row]
    base = row * n_entries

    # ---- row DMAs: block c -> slot c % 2 (a -1 entry copies the VMEM zero rows)
    def bufs(kind, slot):
        """(codes, scales) VMEM buffers of a slot, their HBM sources and the zero rows."""
        if kind == "win":
            return (wbuf.at[slot], wsbuf.at[slot]), (win_ref.at[b], wsc_ref.at[b]), (wzero, wszero)
        return (mbuf.at[slot], msbuf.at[slot]), (main_ref.at[b], msc_ref.at[b]), (mzero, mszero)

    def start_kind(c, kind):
        slot = c % 2
        dst, hbm, zero = bufs(kind, slot)

        def body(i, carry):
            e = lists_ref[base + c * E + i]
            rows = [d.at[..., pl.ds(i, 1), :] for d in dst]

            @pl.when(e >= 0)
            def _():
                for src, d in zip(hbm, rows):
                    r = jnp.minimum(e, src.shape[-2] - 1)
                    pltpu.make_async_copy(src.at[..., pl.ds(r, 1), :], d, sem.at[slot]).start()

            @pl.when(e < 0)
            def _():
                for src, d in zip(zero, rows):
                    pltpu.make_async_copy(src, d, sem.at[slot]).start()
            return carry
        jax.lax.fori_loop(0, E, body, 0)

    def wait_kind(c, kind):
        slot = c % 2
        for d in bufs(kind, slot)[0]:   # one wait for the bytes of all E row copies into d
            pltpu.make_async_copy(d, d, sem.at[slot]).wait()

    def start_block(c):
        if n_win_blocks:
            pl.when(c < n_win_blocks)(lambda: start_kind(c, "win"))
        if has_main:
            pl.when(c >= n_win_blocks)(lambda: start_kind(c, "main"))

    # ---- q in plane order (exact one-hot matmuls), accumulators
    q = q_ref[...]
    for n in range(PLANES):
        qp[n] = jax.lax.dot_general(q, _plane_onehot(n, W), (((1,), (1,)), ((), ())),
                                    preferred_element_type=F32).astype(BF16)
    acc[...] = jnp.zeros(acc.shape, F32)
    zeros = (wzero, wszero, mzero, mszero) if has_main else (wzero, wszero)
    for z in zeros:
        z[...] = jnp.zeros(z.shape, I32)

    # ---- one 64-entry block of the online softmax
    def softmax_block(c, planes, m, l):
        s = None
        for n in range(PLANES):
            part = jax.lax.dot_general(qp[n], planes[n], (((1,), (1,)), ((), ())),
                                       preferred_element_type=F32)
            s = part if s is None else s + part
        valid = idx_ref[c] >= 0                                  # [1, E]
        s = jnp.where(valid, s * np.float32(scale), -jnp.inf)    # [Hb, E]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
        pb = p.astype(BF16)
        for n in range(PLANES):
            acc[n] = acc[n] * alpha + jnp.dot(pb, planes[n], preferred_element_type=F32)
        return m_new, l

    def win_block(c, carry):
        slot = c % 2
        wait_kind(c, "win")
        pl.when(c + 1 < n_blocks)(lambda: start_block(c + 1))
        sc = _spread_scales(wsbuf[slot], e8m0_to_f32, 4, W)          # [E, W] fp32
        halves = (wbuf[slot, 0], wbuf[slot, 1])                      # [E, W] int32 each
        planes = [(e4m3_to_f32(_byte(halves[n // 4], n % 4)) * sc).astype(BF16)
                  for n in range(PLANES)]
        return softmax_block(c, planes, *carry)

    def main_block(c, carry):
        slot = c % 2
        wait_kind(c, "main")
        pl.when(c + 1 < n_blocks)(lambda: start_block(c + 1))
        sc = _spread_scales(msbuf[slot], e4m3_to_f32, 2, W)
        words = mbuf[slot]
        planes = [(e2m1_to_f32((words >> (4 * n)) & 0xF) * sc).astype(BF16)
                  for n in range(PLANES)]
        return softmax_block(c, planes, *carry)

    hb = q.shape[0]
    carry = (jnp.full((hb, 1), NEG_INIT, F32), jnp.zeros((hb, 1), F32))
    if n_blocks:
        start_block(0)
    carry = jax.lax.fori_loop(0, n_win_blocks, win_block, carry)
    if has_main:
        carry = jax.lax.fori_loop(n_win_blocks, n_blocks, main_block, carry)
    m, l = carry

    # ---- finish: o = bf16(acc / (l + e^{sink - m})), back to natural channel order
    sink = sink_ref[...]
    denom = l + jnp.exp(sink - m)
    o = None
    for n in range(PLANES):
        part = jnp.dot((acc[n] / denom).astype(BF16), _plane_onehot(n, W),
                       preferred_element_type=F32)
        o = part if o is None else o + part
    o_ref[...] = o.astype(o_ref.dtype)
    top = jnp.maximum(m, sink)
    lse_ref[...] = top + jnp.log(l * jnp.exp(m - top) + jnp.exp(sink - top))


def _scratch_shapes(hb: int, K: int, has_main: bool):
    W = K // PLANES
    E = SOFTMAX_BLOCK
    shapes = [pltpu.VMEM((PLANES, hb, W), BF16),        # q planes
              pltpu.VMEM((PLANES, hb, W), F32),         # acc planes
              pltpu.VMEM((2, 2, E, W), I32),            # window codes [slot, half, entry, word]
              pltpu.VMEM((2, E, K // 128), I32),        # window E8M0 scales
              pltpu.VMEM((2, 1, W), I32),               # zero rows for -1 entries
              pltpu.VMEM((1, K // 128), I32)]
    if has_main:
        shapes += [pltpu.VMEM((2, E, W), I32),          # main nibbles [slot, entry, word]
                   pltpu.VMEM((2, E, K // 64), I32),    # main E4M3 scales
                   pltpu.VMEM((1, W), I32),
                   pltpu.VMEM((1, K // 64), I32)]
    shapes.append(pltpu.SemaphoreType.DMA((2,)))
    return shapes


def _call_rows(lists, rowb, q, sink, kv_args, *, n_win_blocks: int, hb: int, scale: float,
               interpret):
    """One pallas_call over ``R`` query rows.

    lists int32 [R, N] (padded lists), rowb int32 [R] (batch of each row), q bf16 [R, H, K],
    sink fp32 [H, 1], kv_args: the int32 HBM views (window codes and scales, then main codes
    and scales when present). Returns o bf16 [R, H, K], lse fp32 [R, H, 1].
    """
    R, N = lists.shape
    _, H, K = q.shape
    n_blocks = N // SOFTMAX_BLOCK
    has_main = len(kv_args) == 4
    kernel = functools.partial(_kernel, n_entries=N, n_win_blocks=n_win_blocks,
                               n_blocks=n_blocks, has_main=has_main, scale=scale)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(R, H // hb),
        in_specs=[pl.BlockSpec((None, hb, K), lambda r, h, *_: (r, h, 0)),
                  pl.BlockSpec((None, n_blocks, 1, SOFTMAX_BLOCK),
                               lambda r, h, *_: (r, 0, 0, 0)),
                  pl.BlockSpec((hb, 1), lambda r, h, *_: (h, 0))]
        + [any_spec] * len(kv_args),
        out_specs=[pl.BlockSpec((None, hb, K), lambda r, h, *_: (r, h, 0)),
                   pl.BlockSpec((None, hb, 1), lambda r, h, *_: (r, h, 0))],
        scratch_shapes=_scratch_shapes(hb, K, has_main))
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((R, H, K), BF16),
                   jax.ShapeDtypeStruct((R, H, 1), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(lists.reshape(-1), rowb, q, lists.reshape(R, n_blocks, 1, SOFTMAX_BLOCK), sink, *kv_args)


def _words(x: jax.Array) -> jax.Array:
    """Byte array [..., F] (uint8 or float8) -> int32 words [..., F/4] (little-endian)."""
    u8 = jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype != jnp.uint8 else x
    return jax.lax.bitcast_convert_type(u8.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), I32)


def _window_words(win_kv: jax.Array) -> jax.Array:
    """FP8 window rows [B, Nw, K] -> int32 [B, 2, Nw, K/8]: byte b of word v of half h holds
    element 8v + 4h + b (the plane layout, see the module docstring)."""
    B, Nw, K = win_kv.shape
    u8 = jax.lax.bitcast_convert_type(win_kv, jnp.uint8).reshape(B, Nw, K // 8, 2, 4)
    return _words(u8.transpose(0, 3, 1, 2, 4).reshape(B, 2, Nw, K // 2))


def _interpret_mode(interpret):
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def sparse_attention(q: Float[Array, "B S H K"], win_kv, win_scale, win_idx: Int[Array, "B S Ww"],
                     main, main_scale, topk: Int[Array, "B S k"] | None,
                     sink: Float[Array, "H"], scale: float, *, interpret=False,
                     block_h: int | None = None, **unused
                     ) -> tuple[Float[Array, "B S H K"], Float[Array, "B S H"]]:
    """The CSA2 sparse attention op as a Pallas Mosaic TPU kernel (docs/architecture.md,
    "Joint sink softmax").

    Args (layout and semantics as :func:`pallas_kernels.sparse_attention.sparse_attention`,
    already checked there):
      q: bf16 [B, S, H, K], K a multiple of 128.
      win_kv: float8_e4m3fn [B, Nw, K]; win_scale: uint8 [B, Nw, K/32] (E8M0 bytes).
      win_idx: int32 [B, S, Ww], -1 = no entry.
      main: uint8 [B, T, K/2] packed e2m1; main_scale: float8_e4m3fn [B, T, K/16].
      topk: int32 [B, S, k] or None (SWA-only; ``main``/``main_scale`` are then ignored).
      sink: fp32 [H]; scale: softmax scale.
      interpret: False (compile for TPU), True (TPU interpret mode, ``pltpu.InterpretParams()``)
        or an ``InterpretParams`` instance.
      block_h: heads per grid step (default H; must divide H and be a multiple of 8 or H). Each
        head block gathers the rows again (the heads share the list).
      unused: tuning options of other implementations, ignored.

    Returns:
      ``(o bf16 [B, S, H, K], lse fp32 [B, S, H])``, ``lse = log(sum_j e^{s_j} + e^{sink_h})``.

    Raises:
      ValueError: K not a multiple of 128, a bad ``block_h``.
    """
    return _sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale,
                             interpret=interpret, block_h=block_h,
                             smem_list_words=SMEM_LIST_WORDS)


def _sparse_attention(q, win_kv, win_scale, win_idx, main, main_scale, topk, sink, scale, *,
                      interpret, block_h, smem_list_words: int):
    """:func:`sparse_attention` with the SMEM budget for the prefetched lists as a parameter:
    query rows go to one pallas_call per ``smem_list_words // N`` rows (``N`` = padded list
    length), mapped with ``lax.map`` when there is more than one chunk."""
    B, S, H, K = q.shape
    if K % 128:
        raise ValueError(f"the TPU sparse attention kernel needs K % 128 == 0, got K={K}")
    hb = H if block_h is None else int(block_h)
    if H % hb or (hb != H and hb % 8):
        raise ValueError(f"block_h={hb} must divide H={H} and be a multiple of 8 (or H)")

    lists = [pad_list(win_idx)]
    kv_args = [_window_words(win_kv), _words(win_scale)]
    if topk is not None and topk.shape[-1]:
        lists.append(pad_list(topk))
        kv_args += [_words(main), _words(main_scale)]
    n_win_blocks = lists[0].shape[-1] // SOFTMAX_BLOCK
    lists = jnp.concatenate(lists, axis=-1).astype(I32).reshape(B * S, -1)
    R, N = lists.shape
    if N == 0:                                   # no list at all: o = 0, lse = sink
        return (jnp.zeros((B, S, H, K), BF16),
                jnp.broadcast_to(sink.astype(F32), (B, S, H)))
    rowb = jnp.arange(R, dtype=I32) // S
    qr = q.reshape(R, H, K)
    call = functools.partial(_call_rows, sink=sink.astype(F32).reshape(H, 1), kv_args=kv_args,
                             n_win_blocks=n_win_blocks, hb=hb, scale=float(scale),
                             interpret=_interpret_mode(interpret))

    rows = max(1, smem_list_words // N)
    if R <= rows:
        o, lse = call(lists, rowb, qr)
    else:
        n_chunks = -(-R // rows)
        pad = n_chunks * rows - R
        chunked = (jnp.pad(lists, ((0, pad), (0, 0)), constant_values=-1),
                   jnp.pad(rowb, (0, pad)), jnp.pad(qr, ((0, pad), (0, 0), (0, 0))))
        o, lse = jax.lax.map(lambda a: call(*a),
                             tuple(x.reshape(n_chunks, rows, *x.shape[1:]) for x in chunked))
        o, lse = o.reshape(-1, H, K)[:R], lse.reshape(-1, H, 1)[:R]
    return o.reshape(B, S, H, K), lse.reshape(B, S, H)
