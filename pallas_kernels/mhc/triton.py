"""Pallas Triton (NVIDIA GPU) kernels of :func:`pallas_kernels.mhc.sublayer_glue`.

Two launches, no XLA op between them or around them (every reshape is a bitcast):

* :func:`_partials_kernel`, grid ``(D / chunk, T / rows)``: per program a ``[rows, chunk]``
  slice of every stream. Optionally ``X = hc_post(y, res, post, comb)`` of the slice (stored
  bf16), then ``h = hc_pre(X, pre_prev)`` (stored bf16), and the slice's partial sums for each
  row: the ``M = (2 + hc) * hc`` mixes dot products with ``fn``'s ``hc`` stream slices
  (:data:`MIX_GROUP` mixes per ``[rows, MIX_GROUP, chunk]`` product and one reduction), the
  sum of ``f32(X)^2`` and the sum of ``f32(h)^2`` -> ``partials`` fp32
  ``[D / chunk, M + 2, T]``.
* :func:`_finish_kernel`, grid ``(T / rows, D / norm_chunk)``: every program sums the
  ``partials`` over the chunks for its rows (one load per power-of-two piece of the chunks,
  summed as a tree, the pieces in increasing order) and writes its ``[rows, norm_chunk]`` slice
  of ``input = bf16(w * (h * rsqrt(sum_h2 / D + eps)))``; the programs of the first column also
  run the whole Sinkhorn split of their rows (each lane one row's matrix, as
  :mod:`pallas_kernels.sinkhorn.triton`, whose IEEE division and pairs they share) and write
  ``pre``, ``post``, ``comb``.

Rows past ``T`` of a ragged last row block are masked in the kernels (loads read 0 or 1, stores
skip them). ``D`` must be a multiple of :data:`MIN_CHUNK`; chunks are powers of two dividing
``D`` (:func:`mix_chunk`: at a decode step's few rows, chunks of 64, so a DeepSeek-V4.1-Flash
``D = 5120`` runs 80 programs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.sinkhorn.triton import divide, run_pairs

F32 = jnp.float32
BF16 = jnp.bfloat16
MIN_CHUNK = 64         # a tile's width along D (narrower tiles crashed another kernel's build)
MIN_BLOCK_ROWS = 1     # rows per program, at least (a power of two)
MAX_BLOCK_ROWS = 16    # rows per program, at most
MIX_GROUP = 8          # mixes per broadcast product and reduction in the partials kernel
PRODUCT_TILE = 8192    # elements of the partials kernel's [rows, MIX_GROUP, chunk] products
TARGET_PROGRAMS = 64   # the partials kernel's grid, at least, where chunks of MIN_CHUNK allow
NORM_TILE = 4096       # elements of the [rows, norm_chunk] tile in the finishing kernel
#: Warps per program of each kernel (read when a call is traced). With one warp every
#: reduction is shuffles within the warp, no barrier; at 4 warps each of the finishing
#: kernel's 26 chunk sums synchronises the warps (on an H100 the finishing kernel took 15 us a
#: call at 8 rows, 24 us at 64).
PARTIALS_WARPS = 4
FINISH_WARPS = 4


def block_rows(T: int) -> int:
    """Rows per program: the smallest power of two >= ``T``, at least
    :data:`MIN_BLOCK_ROWS`, at most :data:`MAX_BLOCK_ROWS`."""
    b = MIN_BLOCK_ROWS
    while b < min(T, MAX_BLOCK_ROWS):
        b *= 2
    return b


def chunk(D: int, rows: int, tile: int) -> int:
    """The largest power of two dividing ``D`` with ``rows * chunk <= tile`` (at least
    :data:`MIN_CHUNK`)."""
    c = MIN_CHUNK
    while D % (2 * c) == 0 and rows * 2 * c <= tile:
        c *= 2
    return c


def mix_chunk(D: int, T: int) -> int:
    """The partials kernel's chunk of ``D`` for ``T`` rows: :func:`chunk` of a
    ``[rows, MIX_GROUP, chunk]`` product within :data:`PRODUCT_TILE`, halved (down to
    :data:`MIN_CHUNK`) while the grid has fewer than :data:`TARGET_PROGRAMS` programs (a
    decode step's few rows: more programs in flight, each reading less of ``fn``)."""
    bt = block_rows(T)
    c = chunk(D, bt, PRODUCT_TILE // MIX_GROUP)
    while c > MIN_CHUNK and (D // c) * pl.cdiv(T, bt) < TARGET_PROGRAMS:
        c //= 2
    return c


def _partials_kernel(layer_ref, *refs, hc: int, M: int, rows: int, bt: int, ch: int,
                     with_post: bool):
    if with_post:
        y_ref, res_ref, post_ref, comb_ref, pre_ref, fn_ref, x_out, h_out, p_out = refs
    else:
        x_ref, pre_ref, fn_ref, h_out, p_out = refs
    layer = layer_ref[0]                               # fn: the whole stack [L, M, hc, D]
    cols = pl.ds(pl.program_id(0) * ch, ch)            # this program's chunk of D
    r = pl.program_id(1) * bt + jnp.arange(bt)
    rmask = r < rows
    mask = jnp.broadcast_to(rmask[:, None], (bt, ch))

    def col(ref, k):                                   # [bt] column k of a [T, K] block
        return pltr.load(ref.at[:, np.int32(k)], mask=rmask, other=0.0)

    def stream(ref, i):                                # [bt, ch] fp32 of stream i
        return pltr.load(ref.at[:, np.int32(i), :], mask=mask, other=0.0).astype(F32)

    if with_post:                                      # hc_post's formula and order
        y = pltr.load(y_ref, mask=mask, other=0.0).astype(F32)
        res = [stream(res_ref, i) for i in range(hc)]
        xs = []
        for j in range(hc):
            mixed = col(comb_ref, j)[:, None] * res[0]
            for i in range(1, hc):
                mixed = mixed + col(comb_ref, i * hc + j)[:, None] * res[i]
            xj = (col(post_ref, j)[:, None] * y + mixed).astype(BF16)
            pltr.store(x_out.at[:, np.int32(j), :], xj, mask=mask)
            xs.append(xj.astype(F32))
    else:
        xs = [stream(x_ref, j) for j in range(hc)]

    h = col(pre_ref, 0)[:, None] * xs[0]               # hc_pre's formula and order
    for j in range(1, hc):
        h = h + col(pre_ref, j)[:, None] * xs[j]
    hb = h.astype(BF16)
    pltr.store(h_out, hb, mask=mask)
    hf = hb.astype(F32)

    if M >= MIX_GROUP:
        # the mixes MIX_GROUP at a time: the streams' products with fn's rows summed into one
        # [rows, MIX_GROUP, chunk] tile, then one reduction over the chunk (one barrier per
        # group, not one per mix and stream); a last group that would pass M starts at
        # M - MIX_GROUP instead (its first mixes stored twice, the same values)
        starts = list(range(0, M - MIX_GROUP + 1, MIX_GROUP))
        if M % MIX_GROUP:
            starts.append(M - MIX_GROUP)
        pmask = jnp.broadcast_to(rmask[None, :], (MIX_GROUP, bt))
        for s0 in starts:
            acc = None
            for c in range(hc):
                w = fn_ref[layer, pl.ds(s0, MIX_GROUP), np.int32(c), cols]   # [G, ch]
                prod = xs[c][:, None, :] * w[None, :, :]                     # [bt, G, ch]
                acc = prod if acc is None else acc + prod
            pltr.store(p_out.at[pl.ds(s0, MIX_GROUP), :], jnp.sum(acc, axis=2).T, mask=pmask)
    else:
        for m in range(M):
            acc = None
            for c in range(hc):
                w = fn_ref[layer, np.int32(m), np.int32(c), cols]
                part = jnp.sum(xs[c] * w[None, :], axis=1)
                acc = part if acc is None else acc + part
            pltr.store(p_out.at[np.int32(m), :], acc, mask=rmask)
    sq = xs[0] * xs[0]                                 # the streams' squares, then one sum
    for c in range(1, hc):
        sq = sq + xs[c] * xs[c]
    pltr.store(p_out.at[np.int32(M), :], jnp.sum(sq, axis=1), mask=rmask)
    pltr.store(p_out.at[np.int32(M + 1), :], jnp.sum(hf * hf, axis=1), mask=rmask)


def _finish_kernel(layer_ref, p_ref, h_ref, w_ref, scale_ref, base_ref, in_out, pre_out,
                   post_out, comb_out, *, hc: int, M: int, n_chunks: int, rows: int, bt: int,
                   D: int, iters: int, hc_eps: float, norm_eps: float, interpret: bool):
    layer = layer_ref[0]                               # w, scale, base: whole stacks
    r = pl.program_id(0) * bt + jnp.arange(bt)
    rmask = r < rows
    dc = h_ref.shape[1]
    mask = jnp.broadcast_to(rmask[:, None], (bt, dc))

    # the chunks in power-of-two pieces (a Triton tile's size): 40 chunks load as 32 + 8
    pieces, start = [], 0
    for bit in reversed(range(n_chunks.bit_length())):
        if n_chunks >> bit & 1:
            pieces.append((start, 1 << bit))
            start += 1 << bit

    def total(k):                                      # partial column k summed over chunks
        # one [chunks, rows] load per piece and a sum over it: no chain of dependent loads
        out = None
        for s0, n in pieces:
            tile = pltr.load(p_ref.at[pl.ds(s0, n), np.int32(k), :],
                             mask=jnp.broadcast_to(rmask[None, :], (n, bt)), other=0.0)
            part = jnp.sum(tile, axis=0)
            out = part if out is None else out + part
        return out

    def mean(s, n):                                    # s / n, IEEE
        return divide([s], jnp.full_like(s, float(n)), interpret)[0]

    rs = jax.lax.rsqrt(mean(total(M + 1), D) + norm_eps)
    hf = pltr.load(h_ref, mask=mask, other=0.0).astype(F32)
    w = w_ref[layer, pl.ds(pl.program_id(1) * dc, dc)].astype(F32)
    pltr.store(in_out, (w[None, :] * (hf * rs[:, None])).astype(BF16), mask=mask)

    @pl.when(pl.program_id(1) == 0)
    def _split():
        rx = jax.lax.rsqrt(mean(total(M), hc * D) + norm_eps)
        m = [total(k) * rx for k in range(M)]
        s = [scale_ref[layer, np.int32(i)] for i in range(3)]
        b = [base_ref[layer, np.int32(k)] for k in range(M)]
        for j in range(hc):
            pltr.store(pre_out.at[:, np.int32(j)],
                       jax.nn.sigmoid(m[j] * s[0] + b[j]) + hc_eps, mask=rmask)
            pltr.store(post_out.at[:, np.int32(j)],
                       2.0 * jax.nn.sigmoid(m[hc + j] * s[1] + b[hc + j]), mask=rmask)
        c = [m[2 * hc + k] * s[2] + b[2 * hc + k] for k in range(hc * hc)]
        for i in range(hc):                            # row softmax + eps
            row = c[i * hc:(i + 1) * hc]
            mx = row[0]
            for v in row[1:]:
                mx = jnp.maximum(mx, v)
            e = [jnp.exp(v - mx) for v in row]
            tot = e[0]
            for v in e[1:]:
                tot = tot + v
            c[i * hc:(i + 1) * hc] = [q + hc_eps for q in divide(e, tot, interpret)]
        for j in range(hc):                            # column normalisation
            tot = c[j]
            for i in range(1, hc):
                tot = tot + c[i * hc + j]
            c[j::hc] = divide(c[j::hc], tot + hc_eps, interpret)
        c = run_pairs(tuple(c), hc=hc, pairs=iters - 1, eps=hc_eps, interpret=interpret)
        for k in range(hc * hc):
            pltr.store(comb_out.at[:, np.int32(k)], c[k], mask=rmask)


def _stack(a, layer):
    """``(stack, layer [1] int32)``: ``a`` with a stack axis of 1 and layer 0 when ``layer``
    is None (one layer's parameter), else ``a`` (a stack) and its layer index."""
    if layer is None:
        return a[None], jnp.zeros((1,), jnp.int32)
    return a, jnp.reshape(layer, (1,)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("hc", "interpret"))
def partials(streams, pre_prev, fn, *, hc: int, layer=None, interpret: bool = False):
    """The first kernel: ``([X bf16 [T, hc, D] if streams is a tuple,] h bf16 [T, D],
    partials fp32 [D / chunk, M + 2, T])``, a chunk's ``M`` mixes dot products, ``sum f32(X)^2``
    and ``sum f32(h)^2`` (the module docstring). ``fn``: ``[M, hc * D]``, or with ``layer``
    (int32 scalar) a stack ``[L, M, hc * D]`` that the kernel reads at that layer."""
    with_post = isinstance(streams, tuple)
    x = streams[1] if with_post else streams
    *batch, _, D = x.shape
    T = int(np.prod(batch))
    M = (2 + hc) * hc
    bt = block_rows(T)
    ch = mix_chunk(D, T)
    n_chunks = D // ch
    n_rows = pl.cdiv(T, bt)
    row_spec = lambda k: pl.BlockSpec((bt, k), lambda i, t: (t, 0))  # noqa: E731
    stream_spec = pl.BlockSpec((bt, hc, ch), lambda i, t: (t, 0, i))
    if with_post:
        y, res, post, comb = streams
        ins = [y.reshape(T, D), res.reshape(T, hc, D), post.reshape(T, hc),
               comb.reshape(T, hc * hc)]
        in_specs = [pl.BlockSpec((bt, ch), lambda i, t: (t, i)), stream_spec, row_spec(hc),
                    row_spec(hc * hc)]
        out_shape = [jax.ShapeDtypeStruct((T, hc, D), BF16)]
        out_specs = [stream_spec]
    else:
        ins, in_specs, out_shape, out_specs = [x.reshape(T, hc, D)], [stream_spec], [], []
    fn, at = _stack(fn, layer)
    ins += [pre_prev.reshape(T, hc), fn.reshape(fn.shape[0], M, hc, D)]
    in_specs += [row_spec(hc), pl.BlockSpec()]
    out_shape += [jax.ShapeDtypeStruct((T, D), BF16),
                  jax.ShapeDtypeStruct((n_chunks, M + 2, T), F32)]
    out_specs += [pl.BlockSpec((bt, ch), lambda i, t: (t, i)),
                  pl.BlockSpec((None, M + 2, bt), lambda i, t: (i, 0, t))]
    return pl.pallas_call(
        functools.partial(_partials_kernel, hc=hc, M=M, rows=T, bt=bt, ch=ch,
                          with_post=with_post),
        grid=(n_chunks, n_rows), in_specs=[pl.BlockSpec()] + in_specs, out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=PARTIALS_WARPS, num_stages=1),
        interpret=interpret, name="mhc_glue_partials",
    )(at, *ins)


@functools.partial(jax.jit, static_argnames=("hc", "iters", "hc_eps", "norm_eps", "interpret"))
def sublayer_glue(streams, pre_prev, fn, scale, base, norm_weight, *, hc: int, iters: int,
                  hc_eps: float, norm_eps: float, layer=None, interpret: bool = False):
    """See :func:`pallas_kernels.mhc.sublayer_glue` (arguments checked there; with ``layer``,
    ``fn``, ``scale``, ``base`` and ``norm_weight`` are stacks read at that layer)."""
    x = streams[1] if isinstance(streams, tuple) else streams
    *batch, _, D = x.shape
    T = int(np.prod(batch))
    M = (2 + hc) * hc
    bt = block_rows(T)
    n_chunks, n_rows = D // mix_chunk(D, T), pl.cdiv(T, bt)
    outs = partials(streams, pre_prev, fn, hc=hc, layer=layer, interpret=interpret)
    X = outs[0].reshape(x.shape) if isinstance(streams, tuple) else x
    h, parts = outs[-2:]

    dc = chunk(D, bt, NORM_TILE)
    at = _stack(scale, layer)[1]
    x_in, pre, post, comb = pl.pallas_call(
        functools.partial(_finish_kernel, hc=hc, M=M, n_chunks=n_chunks, rows=T, bt=bt, D=D,
                          iters=iters, hc_eps=float(hc_eps), norm_eps=float(norm_eps),
                          interpret=interpret),
        grid=(n_rows, D // dc),
        in_specs=[pl.BlockSpec(),
                  pl.BlockSpec((n_chunks, M + 2, bt), lambda t, d: (0, 0, t)),
                  pl.BlockSpec((bt, dc), lambda t, d: (t, d)),
                  pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec()],
        out_specs=[pl.BlockSpec((bt, dc), lambda t, d: (t, d)),
                   pl.BlockSpec((bt, hc), lambda t, d: (t, 0)),
                   pl.BlockSpec((bt, hc), lambda t, d: (t, 0)),
                   pl.BlockSpec((bt, hc * hc), lambda t, d: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((T, D), BF16), jax.ShapeDtypeStruct((T, hc), F32),
                   jax.ShapeDtypeStruct((T, hc), F32),
                   jax.ShapeDtypeStruct((T, hc * hc), F32)],
        compiler_params=pltr.CompilerParams(num_warps=FINISH_WARPS, num_stages=1),
        interpret=interpret, name="mhc_glue_finish",
    )(at, parts, h, *[_stack(a, layer)[0] for a in (norm_weight, scale, base)])
    return (X, x_in.reshape(*batch, D), pre.reshape(*batch, hc), post.reshape(*batch, hc),
            comb.reshape(*batch, hc, hc))
