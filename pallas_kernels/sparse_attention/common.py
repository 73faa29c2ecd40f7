"""Primitives shared by the CSA2 sparse attention's reference and kernels.

dtype constants, the softmax block and start value, the exact FP8 / FP4 bit decoders (integer
bit placement into fp16, usable in Pallas Triton, Mosaic GPU and interpret mode), the PTX
decode of the GPU kernels, the sink log-sum-exp, list padding and splitting, the joint row
list of the dequantised rows' kernels, and the merge of list splits' partial softmax states
(in XLA and as one Pallas Triton kernel).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

F32 = jnp.float32
BF16 = jnp.bfloat16
I32 = jnp.int32
E4M3 = jnp.float8_e4m3fn
SOFTMAX_BLOCK = 64  # list entries per online-softmax block (the reference kernel's)
NEG_START = -1e30   # the reference kernel's initial running max
E2M1_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SOFTMAX = ("exp", "exp2")
MERGE = ("xla", "triton")
LOG2E = 1.4426950408889634


def exp_of(softmax: str):
    """The softmax's exponential: ``"exp"``, libdevice ``expf`` (about 10 instructions);
    ``"exp2"``, ``exp2(x * log2(e))`` (a multiply and one ``MUFU.EX2``). The argument ``x`` is
    formed as in the reference (``s * scale - m``), so the base change only rounds ``x *
    log2(e)``: an error relative to ``x``, small where ``P`` is large (folding log2(e) into the
    score scale instead would round ``s * scale * log2(e)``, a larger error).

    Raises ``ValueError`` for a name not in :data:`SOFTMAX`."""
    if softmax not in SOFTMAX:
        raise ValueError(f"softmax must be one of {SOFTMAX}, got {softmax!r}")
    if softmax == "exp2":
        return lambda x: jnp.exp2(x * LOG2E)
    return jnp.exp


def _f16_to_f32(bits):
    """int32 holding fp16 bits in its low 16 -> fp32 (exact; fp16 subnormals are f32 normals)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(F32)


def e4m3_over_256(b):
    """e4m3fn byte (int32 0..255; never the NaN code in our data) -> value * 2**-8, exactly.

    The 7 low bits land in an fp16's exponent low 4 bits and mantissa top 3 bits, so the fp16
    reads ``2**(e-15) * (1 + m/8)`` (subnormal ``m/8 * 2**-14`` when e = 0): the e4m3 value
    times 2**-8. No f32 denormals are involved, so CPU flush-to-zero cannot change it.
    """
    return _f16_to_f32(((b & 0x80) << 8) | ((b & 0x7F) << 7))


def e2m1_over_16384(c):
    """e2m1 nibble (int32 0..15) -> value * 2**-14, exactly (same fp16 bit placement)."""
    return _f16_to_f32(((c & 8) << 12) | ((c & 7) << 9))


# PTX for the GPU build (``dequant="asm"``): one code field of two adjacent words -> bf16x2,
# exactly, with no conversion instructions. ``prmt`` puts the byte holding the code of each
# word into both bytes of a 16-bit half; the code's bits are placed where a bf16's low exponent
# and high mantissa bits are (the magnitude from the low copy, the sign from the high copy),
# which reads as the value times 2**-126 (e2m1) or 2**-120 (e4m3), subnormals included; two
# exact bf16x2 multiplies (that power of two, then the scale: the products have <= 8
# significant bits) give the dequantised pair.
# $0: the bf16 pair; $1, $2: the two int32 words; $3, $4: their scales' bf16 bits.
_DECODE_PTX = """{{
.reg .b32 x, a, b, c, s;
prmt.b32 x, $1, $2, {sel};
shl.b32 a, x, {mag_shl};
and.b32 a, a, {mag_mask};
{sign}
or.b32 a, a, b;
mov.b32 c, {pow2};
mul.rn.bf16x2 a, a, c;
prmt.b32 s, $3, $4, 0x5410;
mul.rn.bf16x2 $0, a, s;
}}"""


# per format: the magnitude's bit 0 goes to bit 6 (e2m1: 3 bits) or 4 (e4m3: 7 bits), and the
# bf16x2 power of two that undoes the placement (2**126, 2**120)
_DECODE_FIELDS = {"e2m1": (6, "0x01C001C0", "0x7E807E80"), "e4m3": (4, "0x07F007F0", "0x7B807B80")}


def decode_ptx(fmt: str, byte: int, shift: int) -> str:
    """The PTX decoding format ``fmt`` ("e2m1" | "e4m3") from byte ``byte`` of each word, the
    code at bit ``shift`` of that byte (4: the high nibble).

    After the ``prmt``, each half holds the byte twice, so the code's magnitude (bits
    ``shift..``) moves left by ``target - shift`` and its sign bit ``shift + width - 1`` sits at
    bit ``8 + shift + width - 1`` of the half: already at bit 15 for the high nibble and e4m3
    (one shift fewer each than with a right shift first), 4 below it for the low nibble."""
    target, mag_mask, pow2 = _DECODE_FIELDS[fmt]
    sign_bit = 8 + shift + (3 if fmt == "e2m1" else 7)
    sign = ("and.b32 b, x, 0x80008000;" if sign_bit == 15 else
            f"shl.b32 b, x, {15 - sign_bit};\nand.b32 b, b, 0x80008000;")
    return _DECODE_PTX.format(sel=hex(byte | byte << 4 | (4 + byte) << 8 | (4 + byte) << 12),
                              mag_shl=target - shift, mag_mask=mag_mask, sign=sign, pow2=pow2)


def pad_list(idx: Int[Array, "B S N"], multiple: int = SOFTMAX_BLOCK) -> Int[Array, "B S M"]:
    """Pad an index list with -1 (no entry) to a multiple of ``multiple`` entries."""
    pad = -idx.shape[-1] % multiple
    if not pad:
        return idx
    return jnp.pad(idx, ((0, 0), (0, 0), (0, pad)), constant_values=-1)


def lse_with_sink(m: Float[Array, "..."], l: Float[Array, "..."], sink: Float[Array, "..."]
                  ) -> Float[Array, "..."]:
    """``log(l * e^m + e^sink)`` without overflow (``m`` may be the -1e30 start value)."""
    top = jnp.maximum(m, sink)
    return top + jnp.log(l * jnp.exp(m - top) + jnp.exp(sink - top))


def empty_result(q, sink):
    """The op's result when nothing is listed: ``o = 0`` bf16 like ``q`` [B, S, H, K],
    ``lse = sink`` fp32 [B, S, H]."""
    B, S, H, _ = q.shape
    return jnp.zeros(q.shape, BF16), jnp.broadcast_to(sink.astype(F32), (B, S, H))


def pad_heads(q, sink, fn):
    """``fn(q, sink)`` with fewer than 16 heads padded by zero queries (and sinks) to the
    16-row tensor-core tile, the padding heads cut from its ``(o, lse)``."""
    H = q.shape[2]
    o, lse = fn(jnp.pad(q, ((0, 0), (0, 0), (0, 16 - H), (0, 0))), jnp.pad(sink, (0, 16 - H)))
    return o[:, :, :H], lse[:, :, :H]


def nonempty_rows(win_kv, win_scale, main, main_scale):
    """The row arrays with one zero row in place of an empty one (``main`` may be None), so
    that every read stays in bounds: a listed entry of an empty part reads zeros, as XLA's
    gather from an empty array does."""
    B, _, K = win_kv.shape
    if win_kv.shape[1] == 0:
        win_kv = jnp.zeros((B, 1, K), win_kv.dtype)
        win_scale = jnp.zeros((B, 1, K // 32), win_scale.dtype)
    if main is not None and main.shape[1] == 0:
        main = jnp.zeros((B, 1, K // 2), main.dtype)
        main_scale = jnp.zeros((B, 1, K // 16), main_scale.dtype)
    return win_kv, win_scale, main, main_scale


def list_splits(programs: int, n_blocks: int) -> int:
    """List splits (flash-decoding) for ``programs`` (query row, head block) programs over
    ``n_blocks`` list blocks: none from 128 programs (about one per SM) on; otherwise up to one
    block per split until 128, balanced (the fewest splits with the same blocks per split)."""
    if programs >= 128 or n_blocks < 1:
        return 1
    n_splits = min(n_blocks, -(-128 // programs))
    return -(-n_blocks // -(-n_blocks // n_splits))


def merge_splits_xla(acc: Float[Array, "R P H K"], m: Float[Array, "R P H"],
                     l: Float[Array, "R P H"], sink: Float[Array, "H"], softmax: str = "exp"
                     ) -> tuple[Float[Array, "R H K"], Float[Array, "R H"]]:
    """The list splits' partial softmax states -> ``(o bf16 [R, H, K], lse fp32 [R, H])``.

    ``acc`` fp32 [R, P, H, K] (unnormalised ``sum P V`` of each of the P splits), ``m`` the
    splits' running maxima, ``l`` their denominators (without the sink); ``sink`` fp32 [H]
    logits; ``softmax`` the exponential (:func:`exp_of`). The reference of
    :func:`merge_splits`.
    """
    exp = exp_of(softmax)
    top = jnp.max(m, axis=1, keepdims=True)
    w = exp(m - top)
    l_tot = jnp.sum(l * w, axis=1)
    acc = jnp.sum(acc * w[..., None], axis=1)
    top = top[:, 0]
    sink = sink[None, :]
    o = (acc / (l_tot + exp(sink - top))[..., None])
    return o.astype(BF16), lse_with_sink(top, l_tot, sink)


def _merge_kernel(acc_ref, m_ref, l_ref, sink_ref, o_ref, lse_ref, *, n_splits, softmax):
    """Program (row, head block, channel block): the splits' maxima, then one pass over their
    accumulators (fp32 sums in split order)."""
    exp = exp_of(softmax)
    ms = [m_ref[p, :] for p in range(n_splits)]
    top = functools.reduce(jnp.maximum, ms)
    ws = [exp(mp - top) for mp in ms]
    l_tot = functools.reduce(operator.add, [l_ref[p, :] * w for p, w in enumerate(ws)])
    acc = functools.reduce(operator.add, [acc_ref[p] * w[:, None] for p, w in enumerate(ws)])
    sink = sink_ref[...]
    den = l_tot + exp(sink - top)
    o_ref[...] = (acc / den[:, None]).astype(BF16)
    lse_ref[...] = lse_with_sink(top, l_tot, sink)


def merge_splits(acc: Float[Array, "R P H K"], m: Float[Array, "R P H"], l: Float[Array, "R P H"],
                 sink: Float[Array, "H"], softmax: str = "exp", *, block_h: int = 8,
                 block_k: int = 128, interpret: bool = False
                 ) -> tuple[Float[Array, "R H K"], Float[Array, "R H"]]:
    """:func:`merge_splits_xla` in one Pallas Triton kernel (XLA runs it as two fusions): one
    program per (row, ``block_h`` heads, ``block_k`` channels); small blocks, so that at decode
    B=8 the 8 rows x 64 heads x 512 channels make 256 programs. Blocks larger than the heads /
    channels are cut to them.

    Raises ``ValueError`` if ``m``, ``l`` or ``sink`` do not match ``acc``'s [R, P, H] / [H],
    or ``block_h`` / ``block_k`` is not a power of two dividing the heads / channels.
    """
    R, P, H, K = acc.shape
    for name, x, shape in (("m", m, (R, P, H)), ("l", l, (R, P, H)), ("sink", sink, (H,))):
        if x.shape != shape:
            raise ValueError(f"{name}: expected shape {shape} (acc is {acc.shape}), got {x.shape}")
    block_h, block_k = min(block_h, H), min(block_k, K)
    for name, b, n in (("block_h", block_h, H), ("block_k", block_k, K)):
        if b < 1 or n % b or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two dividing {n}")
    kernel = functools.partial(_merge_kernel, n_splits=P, softmax=softmax)
    return pl.pallas_call(
        kernel, grid=(R, H // block_h, K // block_k),
        in_specs=[pl.BlockSpec((None, P, block_h, block_k), lambda r, h, c: (r, 0, h, c)),
                  pl.BlockSpec((None, P, block_h), lambda r, h, c: (r, 0, h)),
                  pl.BlockSpec((None, P, block_h), lambda r, h, c: (r, 0, h)),
                  pl.BlockSpec((block_h,), lambda r, h, c: (h,))],
        out_specs=(pl.BlockSpec((None, block_h, block_k), lambda r, h, c: (r, h, c)),
                   pl.BlockSpec((None, block_h), lambda r, h, c: (r, h))),
        out_shape=(jax.ShapeDtypeStruct((R, H, K), BF16), jax.ShapeDtypeStruct((R, H), F32)),
        interpret=interpret, compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        name="csa2_merge_splits",
    )(acc, m, l, sink)


def joint_list(win_idx: Int[Array, "B S Ww"], topk: Int[Array, "B S k"] | None,
               n_win_rows: int, n_main_rows: int = 0) -> Int[Array, "B S N"]:
    """Rows of :func:`dense_rows` per query: the window list, then the top-k list offset by
    ``n_win_rows`` (-1 = no entry stays -1), padded with -1 to whole 64-entry blocks. Entries
    past the end of their rows read the last one, as the XLA path's gathers (and the packed
    kernel) clamp them."""
    win = jnp.where(win_idx >= 0, jnp.minimum(win_idx, max(n_win_rows - 1, 0)), -1)
    if topk is None:
        return pad_list(win)
    top = jnp.where(topk >= 0, jnp.minimum(topk, max(n_main_rows - 1, 0)) + n_win_rows, -1)
    return pad_list(jnp.concatenate([win, top], axis=-1))


def balanced_splits(n_splits: int, n_blocks: int) -> int:
    """The list splits a call runs: at most one per block, then the fewest with the same
    blocks per split (no split is empty; the last may be shorter)."""
    n_splits = max(1, min(n_splits, n_blocks))
    return -(-n_blocks // -(-n_blocks // n_splits))
