"""Pallas Triton (NVIDIA GPU) kernels of :func:`pallas_kernels.mhc.sublayer_glue`: a decode
step's glue in two kernel launches with XLA's product of the head's mixes between them.

* :func:`rows` (``mhc_glue_rows``), grid ``(T,)``, one program per row, ``D`` in chunks of a
  power of two (:func:`row_chunk`: the whole of ``D = 2048``, 5 chunks of 1024 at ``D = 5120``):
  optionally ``X = hc_post(y, res, post, comb)`` (stored bf16), ``h = hc_pre(X, pre_prev)``
  rounded to bf16, the row's ``sum f32(X)^2`` (stored fp32) and ``sum h^2``; then ``input =
  bf16(w * (h * rsqrt(sum_h2 / D + eps)))``, ``h`` kept in registers for one chunk and
  recomputed from the inputs for several (a program never reads what it wrote).
* the mixes ``X @ fn^T`` (``[T, M]`` fp32): the reference's ``einsum``, which XLA runs as one
  reduction kernel over ``fn`` at a decode step's rows (no kernel reads ``fn`` per row block).
* :func:`split` (``mhc_glue_split``), grid ``(ceil(T / rows),)``: the mixes scaled by
  ``rsqrt(sumsq / (hc * D) + eps)`` and the whole Sinkhorn split of the rows, one row's
  matrix per lane (as :mod:`pallas_kernels.sinkhorn.triton`, whose IEEE division and pairs it
  shares): sigmoids, the row softmax plus ``eps``, the column normalisation and the
  ``iters - 1`` pairs -> ``pre``, ``post``, ``comb``.

Every parameter a scanned layer group stacks (``fn``, ``scale``, ``base``, ``norm_weight``)
can be passed whole with the layer's index (``layer=``) and is read there. ``D`` must be a
multiple of :data:`MIN_CHUNK`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.mhc import reference
from pallas_kernels.sinkhorn.triton import block_rows as sinkhorn_block_rows
from pallas_kernels.sinkhorn.triton import divide, run_pairs

F32 = jnp.float32
BF16 = jnp.bfloat16
MIN_CHUNK = 64         # a tile's width along D (narrower tiles crashed another kernel's build)
ROW_TILE = 8192        # values of a [hc, chunk] tile of the row kernel (a power of two)
#: Warps per program (read when a call is traced): the row kernel's (4 ran the same on an H100:
#: 6.96 against 6.92 ms of a ``mid`` batch-1 step's device time), the split kernel's (its
#: block's rows are lanes; at a decode step's rows one warp holds them all).
ROW_WARPS = 8
SPLIT_WARPS = 1


def row_chunk(D: int, hc: int) -> int:
    """The row kernel's chunk of ``D``: the largest power of two dividing ``D`` with
    ``hc * chunk <= ROW_TILE`` (at least :data:`MIN_CHUNK`)."""
    c = MIN_CHUNK
    while D % (2 * c) == 0 and hc * 2 * c <= ROW_TILE:
        c *= 2
    return c


def _store_split(m, layer, scale_ref, base_ref, pre_out, post_out, comb_out, rmask, *, hc: int,
                 iters: int, hc_eps: float, interpret: bool):
    """``hc_split_sinkhorn`` of the normalised mixes ``m`` (``M`` lane vectors, one row of
    the block per lane) with the layer's ``scale`` and ``base``: stores ``pre``, ``post``
    (``[rows, hc]``) and ``comb`` (``[rows, hc * hc]``) at the rows ``rmask`` keeps
    (the formula of :func:`pallas_kernels.mhc.reference.sinkhorn_split`; IEEE divisions)."""
    M = len(m)
    s = [scale_ref[layer, np.int32(i)] for i in range(3)]
    b = [base_ref[layer, np.int32(k)] for k in range(M)]
    for j in range(hc):
        pltr.store(pre_out.at[:, np.int32(j)],
                   jax.nn.sigmoid(m[j] * s[0] + b[j]) + hc_eps, mask=rmask)
        pltr.store(post_out.at[:, np.int32(j)],
                   2.0 * jax.nn.sigmoid(m[hc + j] * s[1] + b[hc + j]), mask=rmask)
    c = [m[2 * hc + k] * s[2] + b[2 * hc + k] for k in range(hc * hc)]
    for i in range(hc):                                # row softmax + eps
        row = c[i * hc:(i + 1) * hc]
        mx = row[0]
        for v in row[1:]:
            mx = jnp.maximum(mx, v)
        e = [jnp.exp(v - mx) for v in row]
        tot = e[0]
        for v in e[1:]:
            tot = tot + v
        c[i * hc:(i + 1) * hc] = [q + hc_eps for q in divide(e, tot, interpret)]
    for j in range(hc):                                # column normalisation
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


def _rows_kernel(layer_ref, *refs, hc: int, D: int, dc: int, with_post: bool,
                 norm_eps: float, interpret: bool):
    if with_post:
        y_ref, res_ref, post_ref, comb_ref, pre_ref, w_ref, x_out, in_out, sq_out = refs
    else:
        x_ref, pre_ref, w_ref, in_out, sq_out = refs
    layer = layer_ref[0]                               # w: the whole stack [L, D]
    t = pl.program_id(0)                               # this program's row
    n = D // dc

    def values(c):                                     # (X bf16 streams, f32 streams, f32 h)
        cols = pl.ds(c * dc, dc)
        if with_post:                                  # hc_post's formula and order
            y = y_ref[t, cols].astype(F32)
            res = [res_ref[t, np.int32(i), cols].astype(F32) for i in range(hc)]
            xs = []
            for j in range(hc):
                mixed = comb_ref[t, np.int32(j)] * res[0]
                for i in range(1, hc):
                    mixed = mixed + comb_ref[t, np.int32(i * hc + j)] * res[i]
                xs.append((post_ref[t, np.int32(j)] * y + mixed).astype(BF16))
        else:
            xs = [x_ref[t, np.int32(j), cols] for j in range(hc)]
        xf = [x.astype(F32) for x in xs]
        h = pre_ref[t, np.int32(0)] * xf[0]            # hc_pre's formula and order
        for j in range(1, hc):
            h = h + pre_ref[t, np.int32(j)] * xf[j]
        return xs, xf, h.astype(BF16).astype(F32)

    kept, sq, h2 = {}, None, None
    for c in range(n):
        xs, xf, hf = values(c)
        if with_post:
            for j in range(hc):
                pltr.store(x_out.at[t, np.int32(j), pl.ds(c * dc, dc)], xs[j])
        s = xf[0] * xf[0]                              # the streams' squares, then one sum
        for j in range(1, hc):
            s = s + xf[j] * xf[j]
        sq = s if sq is None else sq + s
        h2 = hf * hf if h2 is None else h2 + hf * hf
        if n == 1:
            kept[c] = hf
    pltr.store(sq_out.at[pl.ds(t, 1)], jnp.sum(sq.reshape(1, dc), axis=1))
    h2 = jnp.sum(h2.reshape(1, dc), axis=1)
    rs = jax.lax.rsqrt(divide([h2], jnp.full_like(h2, float(D)), interpret)[0] + norm_eps)
    for c in range(n):                                 # rms_norm's formula and order
        hf = kept[c] if c in kept else values(c)[2]
        w = w_ref[layer, pl.ds(c * dc, dc)].astype(F32)
        pltr.store(in_out.at[t, pl.ds(c * dc, dc)], (w * (hf * rs)).astype(BF16))


def _split_kernel(layer_ref, mix_ref, sq_ref, scale_ref, base_ref, pre_out, post_out, comb_out,
                  *, hc: int, M: int, rows: int, bt: int, n: int, iters: int, hc_eps: float,
                  norm_eps: float, interpret: bool):
    layer = layer_ref[0]                               # scale, base: whole stacks
    r = pl.program_id(0) * bt + jnp.arange(bt)
    rmask = r < rows
    sq = pltr.load(sq_ref, mask=rmask, other=1.0)
    rx = jax.lax.rsqrt(divide([sq], jnp.full_like(sq, float(n)), interpret)[0] + norm_eps)
    m = [pltr.load(mix_ref.at[:, np.int32(k)], mask=rmask, other=0.0) * rx for k in range(M)]
    _store_split(m, layer, scale_ref, base_ref, pre_out, post_out, comb_out, rmask, hc=hc,
                 iters=iters, hc_eps=hc_eps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("hc", "norm_eps", "interpret"))
def rows(streams, pre_prev, norm_weight, *, hc: int, norm_eps: float, layer=None,
         interpret: bool = False):
    """The row kernel, one program per row of ``*batch``: ``(X bf16 [*batch, hc, D], input
    bf16 [*batch, D], sumsq fp32 [*batch])`` with ``X = hc_post(*streams)`` for a tuple (else
    ``streams``), ``input = rms_norm(hc_pre(X, pre_prev), norm_weight)`` and ``sumsq = sum
    f32(X)^2`` over the row's ``hc * D`` values. ``norm_weight``: ``[D]``, or with ``layer`` a stack ``[L, D]``."""
    with_post = isinstance(streams, tuple)
    x = streams[1] if with_post else streams
    *batch, _, D = x.shape
    T = int(np.prod(batch))
    dc = row_chunk(D, hc)
    if with_post:
        y, res, post, comb = streams
        ins = [y.reshape(T, D), res.reshape(T, hc, D), post.reshape(T, hc),
               comb.reshape(T, hc * hc)]
        out_shape = [jax.ShapeDtypeStruct((T, hc, D), BF16)]
    else:
        ins, out_shape = [x.reshape(T, hc, D)], []
    w, at = _stack(norm_weight, layer)
    ins += [pre_prev.reshape(T, hc), w]
    out_shape += [jax.ShapeDtypeStruct((T, D), BF16), jax.ShapeDtypeStruct((T,), F32)]
    outs = pl.pallas_call(
        functools.partial(_rows_kernel, hc=hc, D=D, dc=dc, with_post=with_post,
                          norm_eps=float(norm_eps), interpret=interpret),
        grid=(T,), in_specs=[pl.BlockSpec()] * (1 + len(ins)),
        out_specs=[pl.BlockSpec()] * len(out_shape), out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=ROW_WARPS, num_stages=1),
        interpret=interpret, name="mhc_glue_rows",
    )(at, *ins)
    X = outs[0].reshape(x.shape) if with_post else x
    return X, outs[-2].reshape(*batch, D), outs[-1].reshape(batch)


@functools.partial(jax.jit, static_argnames=("hc", "iters", "hc_eps", "norm_eps", "n",
                                             "interpret"))
def split(mixes, sumsq, scale, base, *, hc: int, iters: int, hc_eps: float, norm_eps: float,
          n: int, layer=None, interpret: bool = False):
    """The split kernel: ``hc_split_sinkhorn(mixes * rsqrt(sumsq / n + norm_eps))`` ->
    ``(pre [*batch, hc], post [*batch, hc], comb [*batch, hc, hc])`` fp32, for ``mixes`` fp32
    ``[*batch, M]`` (the head's dot products, not yet normalised) and ``sumsq`` fp32
    ``[*batch]``; ``scale`` ``[3]`` and ``base`` ``[M]``, or with ``layer`` stacks."""
    *batch, M = mixes.shape
    T = int(np.prod(batch))
    bt = sinkhorn_block_rows(T)
    scale, at = _stack(scale, layer)
    base = _stack(base, layer)[0]
    row = lambda k: pl.BlockSpec((bt, k), lambda t: (t, 0))  # noqa: E731
    pre, post, comb = pl.pallas_call(
        functools.partial(_split_kernel, hc=hc, M=M, rows=T, bt=bt, n=n, iters=iters,
                          hc_eps=float(hc_eps), norm_eps=float(norm_eps), interpret=interpret),
        grid=(pl.cdiv(T, bt),),
        in_specs=[pl.BlockSpec(), row(M), pl.BlockSpec((bt,), lambda t: (t,)),
                  pl.BlockSpec(), pl.BlockSpec()],
        out_specs=[row(hc), row(hc), row(hc * hc)],
        out_shape=[jax.ShapeDtypeStruct((T, hc), F32), jax.ShapeDtypeStruct((T, hc), F32),
                   jax.ShapeDtypeStruct((T, hc * hc), F32)],
        compiler_params=pltr.CompilerParams(num_warps=SPLIT_WARPS, num_stages=1),
        interpret=interpret, name="mhc_glue_split",
    )(at, mixes.reshape(T, M), sumsq.reshape(T), scale, base)
    return (pre.reshape(*batch, hc), post.reshape(*batch, hc),
            comb.reshape(*batch, hc, hc))


@functools.partial(jax.jit, static_argnames=("hc", "iters", "hc_eps", "norm_eps", "interpret"))
def sublayer_glue(streams, pre_prev, fn, scale, base, norm_weight, *, hc: int, iters: int,
                  hc_eps: float, norm_eps: float, layer=None, interpret: bool = False):
    """See :func:`pallas_kernels.mhc.sublayer_glue` (arguments checked there): the row kernel
    (:func:`rows`), the head's dot products as the reference's ``einsum``, and the split
    kernel (:func:`split`)."""
    X, x_in, sumsq = rows(streams, pre_prev, norm_weight, hc=hc, norm_eps=norm_eps,
                          layer=layer, interpret=interpret)
    if layer is not None:
        fn = jax.lax.dynamic_index_in_dim(fn, layer, keepdims=False)
    pre, post, comb = split(reference.head_products(X, fn), sumsq, scale, base, hc=hc,
                            iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, n=hc * X.shape[-1],
                            layer=layer, interpret=interpret)
    return X, x_in, pre, post, comb
