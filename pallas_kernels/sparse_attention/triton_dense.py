"""Pallas Triton kernel of the CSA2 sparse attention over rows dequantised once
(docs/architecture.md, "Joint sink softmax").

Prefill attends many queries to the same few KV rows: at 4096 queries x 640 listed entries over
4224 window rows and 4096 main-KV entries, each row is listed about 315 times, and the packed
kernel (:mod:`.triton`) decodes it every time. This variant decodes every row once, into one bf16
row array ``[B, Nw + T, K]`` (the window rows, then the main-KV entries: 1 KiB per row, written
once per call, not per query: no gathered copy), and the kernel gathers the listed bf16 rows
directly into the tensor cores' operand tiles. With nothing to decode between the load and the
``dot``, Triton's software pipeliner can stage the rows of the next blocks in shared memory
(``cp.async``) while the current block's products run, which the packed kernel cannot do.

The joint list is the window list followed by the top-k list with the main entries offset by
``Nw`` (-1 stays -1), padded to whole 64-entry blocks: the reference's block order, so the
online softmax sees the same blocks as :func:`.reference.sparse_attention_xla`.

Use it where the rows are listed many times (``rows x list entries`` well above the row count:
prefill chunks); in decode each row is listed about once and decoding all of them would cost
more than the attention. :func:`worth_it` is the rule of :func:`.gpu.sparse_attention`.

Memory: the row array is ``B x (Nw + T) x K x 2`` bytes next to the packed state (at most
``2 K / MIN_REUSE`` bytes per listed entry where the rule picks it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels.sparse_attention import triton as tk
from pallas_kernels.sparse_attention.common import (F32, I32, MERGE, SOFTMAX, SOFTMAX_BLOCK,
                                                    empty_result, exp_of, list_splits)
from pallas_kernels.sparse_attention.reference import dequant_main, dequant_window

# listed entries per row (on average) from which the rule decodes the rows once (the break-even
# of decoding a row once against decoding it per listed entry: docs/benchmarks.md)
MIN_REUSE = 8


def worth_it(rows: int, list_len: int, n_rows: int) -> bool:
    """Whether decoding all ``n_rows`` KV rows once beats decoding each listed row in the
    kernel: ``rows`` query rows x ``list_len`` entries at least :data:`MIN_REUSE` times the
    rows (prefill chunks: hundreds; decode: about one)."""
    return rows * list_len >= MIN_REUSE * max(n_rows, 1)


def default_tuning(rows: int, heads: int, n_blocks: int, head_dim: int = 512) -> dict:
    """Tuning of the Triton rows' kernel for ``rows = B*S`` query rows: all (up to 64) heads
    of a query per program, the list split (:func:`.common.list_splits`) only when there are
    fewer than 128 programs, 8 warps, one tile of all channels per block, the rows staged one
    block ahead (``num_stages = 2``), the ``exp2`` softmax and the Triton merge."""
    block_h = min(heads, 64)
    n_splits = list_splits(rows * (heads // block_h), n_blocks)
    return {"block_h": block_h, "n_splits": n_splits, "num_warps": 8, "num_stages": 2,
            "n_chunks": 1, "softmax": "exp2", "merge": "triton"}


def dense_rows(win_kv: Float[Array, "B Nw K"], win_scale: UInt8[Array, "B Nw G"],
               main: UInt8[Array, "B T K2"] | None, main_scale: Float[Array, "B T G2"] | None
               ) -> Float[Array, "B N K"]:
    """The window rows (float8_e4m3fn codes + E8M0 scale bytes per 32) and the main-KV entries
    (packed e2m1 pairs + float8_e4m3fn scales per 16; None: none) dequantised to bf16, one
    array ``[B, Nw + T, K]`` (exact: the values the packed kernel decodes in registers, for
    every code the state's quantisers write; fp8 NaN codes, never written, decode to NaN
    here and to +-480 there)."""
    rows = [dequant_window(win_kv, win_scale)]
    if main is not None and main.shape[1]:
        rows.append(dequant_main(main, main_scale))
    return jnp.concatenate(rows, axis=1)


def _kernel(q_ref, lst_ref, kv_ref, sink_ref, *out_refs, S, K, n_chunks, block_h, n_blocks,
            n_splits, scale, interpret, softmax):
    """Program (row r = b*S + s, head block, split) over its blocks of the joint list."""
    r, hb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    exp = exp_of(softmax)
    b = r // S
    BN = SOFTMAX_BLOCK
    KC = K // n_chunks
    n_rows = kv_ref.shape[1]
    qs = [q_ref[:, pl.ds(c * KC, KC)] for c in range(n_chunks)]           # [BH, KC] bf16

    dot = functools.partial(tk.tile_dot, interpret=interpret)
    nt, nn = tk.NT, tk.NN

    def load(j):
        idx = lst_ref[pl.ds(j * BN, BN)]
        row = jnp.clip(idx, 0, n_rows - 1)[:, None]      # -1 reads row 0, weight exactly 0
        return idx, [kv_ref[b, row, c * KC + jnp.arange(KC, dtype=I32)[None, :]]
                     for c in range(n_chunks)]           # [BN, KC] bf16 each

    def body(j, carry):
        idx, kv = load(j)
        s = None
        for c in range(n_chunks):
            part = dot(qs[c], kv[c], nt)
            s = part if s is None else s + part
        return tk.softmax_update(s, idx >= 0, *carry, lambda p, c: dot(p, kv[c], nn), scale,
                                 exp)[:3]

    carry = jax.lax.fori_loop(*tk.split_range(sp, n_blocks, n_splits), body,
                              tk.initial_carry(block_h, KC, n_chunks))
    tk.write_outputs(out_refs, sink_ref, hb, *carry, n_splits=n_splits, exp=exp)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "n_splits",
                                             "num_warps", "num_stages", "n_chunks", "softmax",
                                             "merge"))
def sparse_attention_rows(q: Float[Array, "B S H K"], kv: Float[Array, "B N K"],
                          lst: Int[Array, "B S L"], sink: Float[Array, "H"], scale: float, *,
                          interpret: bool = False, block_h: int = 64, n_splits: int = 1,
                          num_warps: int = 8, num_stages: int = 2, n_chunks: int = 1,
                          softmax: str = "exp2", merge: str = "triton"
                          ) -> tuple[Float[Array, "B S H K"], Float[Array, "B S H"]]:
    """The joint sink softmax of each query over its listed bf16 rows.

    ``q`` bf16 [B, S, H, K]; ``kv`` bf16 [B, N, K] rows (:func:`dense_rows`); ``lst`` int32
    [B, S, L] rows per query, -1 = no entry, L a multiple of 64 (:func:`joint_list`); ``sink``
    fp32 [H]. Returns ``(o bf16 [B, S, H, K], lse fp32 [B, S, H])``, as
    :func:`pallas_kernels.sparse_attention.sparse_attention`. Tuning: ``block_h`` heads per
    program, ``n_splits`` list splits (merged by :func:`.common.merge_splits`), Triton
    ``num_warps`` / ``num_stages`` (the default 2 stages the row gathers in shared memory a
    block ahead; 1 loads them at their block), ``n_chunks`` channel chunks per row tile (a
    power of two, K / n_chunks >= 16), ``softmax`` (``"exp2"`` or ``"exp"``, as
    :func:`.common.exp_of`), ``merge`` (``"triton"`` or ``"xla"``).

    Raises ``ValueError`` for a list that is not whole 64-entry blocks, a head dim that is not
    a power of two >= 64 (the Triton tiles), or a tuning outside those limits.
    """
    B, S, H, K = q.shape
    L = lst.shape[-1]
    if L % SOFTMAX_BLOCK:
        raise ValueError(f"lst: {L} entries is not a whole number of {SOFTMAX_BLOCK}-entry "
                         f"blocks (pad with -1: joint_list)")
    if K < 64 or K & (K - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head dim >= 64, got {K}")
    if softmax not in SOFTMAX or merge not in MERGE:
        raise ValueError(f"softmax / merge must be in {SOFTMAX} / {MERGE}, "
                         f"got {softmax!r} / {merge!r}")
    if H % block_h or block_h & (block_h - 1) or (block_h < 16 and not interpret):
        raise ValueError(f"block_h={block_h} must be a power of two dividing the {H} heads "
                         f"(and >= 16 on a GPU: the tensor-core tile)")
    if n_chunks < 1 or n_chunks & (n_chunks - 1) or K % n_chunks or K // n_chunks < 16:
        raise ValueError(f"n_chunks={n_chunks} must be a power of two with K/n_chunks >= 16")
    n_blocks = L // SOFTMAX_BLOCK
    if n_blocks == 0:
        return empty_result(q, sink)
    n_splits = max(1, min(n_splits, n_blocks))
    R = B * S
    args = (q.reshape(R, H, K), lst.reshape(R, L), kv, sink.astype(F32))
    in_specs = [pl.BlockSpec((None, block_h, K), lambda r, h, s: (r, h, 0)),
                pl.BlockSpec((None, L), lambda r, h, s: (r, 0)),
                pl.BlockSpec(),                       # whole array: rows gathered in-kernel
                pl.BlockSpec((H,), lambda r, h, s: (0,))]
    out_shape, out_specs = tk.outputs(R, H, K, block_h, n_splits)
    kernel = functools.partial(_kernel, S=S, K=K, n_chunks=n_chunks, block_h=block_h,
                               n_blocks=n_blocks, n_splits=n_splits, scale=scale,
                               interpret=interpret, softmax=softmax)
    outs = pl.pallas_call(
        kernel, grid=(R, H // block_h, n_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="csa2_sparse_attention_rows",
    )(*args)
    return tk.finish(outs, sink, n_splits=n_splits, merge=merge, softmax=softmax,
                     block_h=block_h, interpret=interpret, shape=(B, S, H, K))
