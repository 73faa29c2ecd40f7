"""Pallas Triton kernel of the lightning indexer's scores over the packed FP4 indexer K
(NVIDIA GPUs; docs/architecture.md, "Indexer").

One program per (query row r = b*S + s, block of ``block_t`` indexer-K entries). The entries'
packed MXFP4 rows are read straight from the state (e2m1 nibbles as int32 words, E8M0 scale
bytes), decoded in registers and scored against the query's I heads on the tensor cores; no bf16
copy of the indexer K is written to HBM (the XLA path dequantises the whole K every call).

Channels are handled as 8 classes: int32 word w of a row holds the nibbles of channels
8w .. 8w+7, so nibble c of every word is class c (channels 8w + c), one shift-and-mask per
class; the dot is the sum over classes of ``q_c k_c^T`` (q read with a stride of 8). Channel
8w + c has scale byte w // 4 (32 channels per scale).

Numerics are the XLA path's (:func:`.reference.index_scores`): ``dot`` rounded to
bf16, ``bf16(relu(dot) * w_h)``, the fp32 sum over heads rounded to bf16, ``-inf`` for entries
at or past ``visible``. Only the fp32 summation order of the dot and of the head sum differs,
so a score can differ from XLA's by a bf16 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.indexer.common import BF16, F32, I32
from pallas_kernels.sparse_attention.common import e2m1_over_16384
N_CLS = 8
DEFAULT_BLOCK_T = 128


def supports(heads: int, head_dim: int) -> bool:
    """Shapes the kernel tiles on a GPU: a power-of-two number of heads >= 16 (the tensor-core
    tile's rows) and a head dim that is a multiple of 128 (16 channels per class)."""
    return heads >= 16 and not heads & (heads - 1) and head_dim % 128 == 0


def _kernel(q_ref, w_ref, vis_ref, k_ref, sc_ref, o_ref, *, S, T, J, block_t, interpret):
    r, tb = pl.program_id(0), pl.program_id(1)
    b = r // S
    kc = J // N_CLS
    t = tb * block_t + jax.lax.broadcasted_iota(I32, (block_t, 1), 0)          # [BT, 1]
    row = jnp.minimum(t, T - 1)
    col = jax.lax.broadcasted_iota(I32, (1, kc), 1)                            # word w
    words = k_ref[b, row, col]                                                 # [BT, kc]
    # scale byte w // 4 of the row (32 channels per scale), from the row's scale bytes held
    # as int32 words: byte j is bits 8 (j % 4) .. of word j // 4
    s = (sc_ref[b, row, col // 16] >> (8 * ((col // 4) % 4))) & 0xFF
    # E8M0 byte u -> 2**(u-127) (the fp32 with exponent field u; byte 0, which the quantiser
    # never writes (its floor is byte 1), reads as 0 instead of 2**-127)
    s = jax.lax.bitcast_convert_type(s << 23, F32)
    acc = None
    for c in range(N_CLS):
        # e2m1 value (exact: * 2**14 undoes e2m1_over_16384) times the scale, exact in bf16
        kv = ((e2m1_over_16384((words >> (4 * c)) & 15) * 16384.0) * s).astype(BF16)
        qc = q_ref[:, pl.ds(c, kc, stride=N_CLS)]                              # [I, kc]
        if interpret:  # XLA:CPU has no bf16 x bf16 -> f32 dot; f32 operands are exact
            qc, kv = qc.astype(F32), kv.astype(F32)
        part = jax.lax.dot_general(qc, kv, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        acc = part if acc is None else acc + part                              # [I, BT]
    dot = acc.astype(BF16).astype(F32)
    # relu that keeps NaN like XLA's maximum (Triton lowers a float max to NaN-dropping maxnumf)
    relu = jnp.where(jnp.isnan(dot), dot, jnp.maximum(dot, 0.0))
    prod = (relu * w_ref[...].astype(F32)[:, None]).astype(BF16).astype(F32)
    score = jnp.sum(prod, axis=0).astype(BF16).astype(F32)                      # [BT]
    tt = tb * block_t + jax.lax.broadcasted_iota(I32, (block_t,), 0)
    o_ref[...] = jnp.where(tt < vis_ref[0], score, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("interpret", "block_t", "num_warps"))
def index_scores(q, w, codes, scale, visible, *, interpret: bool = False,
                 block_t: int | None = None, num_warps: int | None = None):
    """Triton implementation of :func:`pallas_kernels.indexer.index_scores` (same arguments
    and result). ``block_t``: entries per program (a power of two >= 16); ``num_warps``.

    Raises ``ValueError`` for shapes the kernel does not tile (:func:`supports`, on a GPU) or
    a bad ``block_t``.
    """
    B, S, I, J = q.shape
    T = codes.shape[1]
    block_t = block_t or DEFAULT_BLOCK_T
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two >= 16")
    if J % (4 * N_CLS) or (not interpret and not supports(I, J)):
        raise ValueError(f"the Triton indexer kernel needs a power-of-two number of heads >= 16"
                         f" and a head dim that is a multiple of 128; got I={I}, J={J}")
    if T == 0:
        return jnp.zeros((B, S, 0), F32)
    R = B * S
    n_tb = pl.cdiv(T, block_t)
    words, scale_words = kernel_operands(codes, scale)
    kernel = functools.partial(_kernel, S=S, T=T, J=J, block_t=block_t, interpret=interpret)
    out = pl.pallas_call(
        kernel,
        grid=(R, n_tb),
        in_specs=[pl.BlockSpec((None, I, J), lambda r, tb: (r, 0, 0)),
                  pl.BlockSpec((None, I), lambda r, tb: (r, 0)),
                  pl.BlockSpec((None, 1), lambda r, tb: (r, 0)),
                  pl.BlockSpec(), pl.BlockSpec()],   # whole arrays: rows are read in-kernel
        out_specs=pl.BlockSpec((None, block_t), lambda r, tb: (r, tb)),
        out_shape=jax.ShapeDtypeStruct((R, n_tb * block_t), F32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        interpret=interpret,
        name="csa2_indexer_scores",
    )(q.reshape(R, I, J), w.reshape(R, I), visible.reshape(R, 1).astype(I32), words,
      scale_words)
    return out[:, :T].reshape(B, S, T)


def kernel_operands(codes, scale):
    """The two whole-array operands the kernel reads rows from, as int32 words (little-endian):
    the codes [B, T, J/8] (a free bitcast) and the E8M0 scale bytes [B, T, ceil(J/128)] (each
    row padded with zero bytes to whole words where J/32 is not a multiple of 4).

    Words, not bytes: Pallas Triton addresses a whole-array operand with 32-bit element
    offsets unless the array is over 2**32 bytes, so a byte array between 2**31 and 2**32
    bytes would wrap (the scales of J = 128 from B x T = 2**29 entries on); as words every
    operand up to 2**32 bytes has fewer than 2**31 elements."""
    B, T, J2 = codes.shape
    words = jax.lax.bitcast_convert_type(codes.reshape(B, T, J2 // 4, 4), I32)     # free
    pad = -scale.shape[-1] % 4
    if pad:
        scale = jnp.pad(scale, ((0, 0), (0, 0), (0, pad)))
    scale_words = jax.lax.bitcast_convert_type(scale.reshape(B, T, -1, 4), I32)
    return words, scale_words
