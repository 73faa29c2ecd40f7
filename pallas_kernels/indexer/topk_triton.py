"""Pallas Triton kernel of the indexer's top-k selection (NVIDIA GPUs; docs/architecture.md,
"Top-k selection").

One program per query row: the ``k`` largest of the row's ``T`` scores, as positions in
ascending order, ``-1`` after the last pick. The result is the same, bit for bit, as
:func:`.reference.select_topk_radix` (its reference: XLA, no sort) and so as
:func:`.reference.select_topk` (``lax.top_k`` + sort) on the indexer's
bf16-representable fp32 scores: ties go to the lower position, ``-inf`` and NaN are never
picked, ``-0 < +0`` (IEEE total order on the 16-bit order keys).

* The k-th largest order key ``v`` is found by a binary search over its 16 bits, most
  significant first: bit b is set when at least ``k`` keys are ``>= v | 2**b``. Each step is
  one compare-and-count reduction over the program's threads.
* Long rows are selected in stages: every segment of a row gets its own program (its top-k),
  then the top-k of those candidates is selected the same way (their scores gathered in XLA;
  in segments again while they are many: a row of 1M scores takes three stages at k = 512).
  Every pick of a row's top-k lies in its segment's top-k under the same order (score, then
  the lower position), so the result is unchanged; the segments of a row run in parallel, and
  a segment of 8K scores is 32 keys per thread (8 warps) where a 32K row is 64 (16 warps).
  :func:`default_segment` sets the segment length from the number of rows (8K-32K; rows that
  fit in one segment, or too many picks for one, ``2 k`` above every length, are selected in
  one stage).
* Within a program, segments of up to :data:`TILE` scores are held in registers for all 16
  steps (one load); longer ones (a ``segment`` above :data:`TILE`) are streamed in
  tiles of :data:`TILE` for every step and the count above ``v`` (17 reads of the row, plus
  the writing pass's).
* The picks (every key ``> v``, then the lowest positions with key ``== v`` up to ``k``) are
  written in position order: running counts over the tiles and one inclusive scan inside a
  tile (of the keys above v and the keys equal to v, packed in one int32) give each pick its
  slot, and a masked scatter store writes it. The slots after the
  last pick get ``-1`` (a store disjoint from the picks' slots).

The XLA radix selection runs as many kernels per call (the counting passes, the scans, the
scatter), the sort as more; this is one kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxtyping import Array, Float, Int

from pallas_kernels.indexer.common import F32, I32, bf16_order_key
TILE = 32768      # scores per counting tile: 64 int32 keys per thread with 16 warps
SEGMENTS = (32768, 16384, 8192)   # segment lengths of the two-stage selection, largest first
FULL_WAVE = 128   # programs that keep a GPU of about 128 SMs busy
WRITE_TILE = 8192  # scores per step of the writing pass (one packed scan and a scatter)
MAX_WRITE_TILE = 1 << 14   # the packed scan's 16-bit fields (the upper one signed) stay exact
MAX_TILE = 1 << 20   # Triton's largest tensor
KEY_NEG_INF = 0x7F   # the order key of -inf (NaN is mapped to -inf first)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _order_key(score):
    """fp32 scores (bf16-representable) -> the radix selection's int32 order keys
    (:func:`.common.bf16_order_key`), NaN counted as -inf (never picked)."""
    return bf16_order_key(jnp.where(score != score, -jnp.inf, score))


def _kernel(score_ref, out_ref, *, T, k, tile, n_tiles, k_pad, write_tile, seg_len, n_seg):
    """Program (row r, segment g): the top-k of scores [g seg_len, (g+1) seg_len) of row r
    (the whole row when n_seg = 1), as absolute positions, into output row r n_seg + g."""
    r, g = pl.program_id(0), pl.program_id(1)
    start = g * seg_len
    end = jnp.minimum(start + seg_len, T)
    o = r * n_seg + g

    def keys(i, size=tile):   # past the segment's end: -inf (key KEY_NEG_INF, never picked)
        pos = start + i * size + jnp.arange(size, dtype=I32)
        return _order_key(pltr.load(score_ref.at[r, pl.ds(start + i * size, size)],
                                    mask=pos < end, other=-jnp.inf))

    def count_ge(x):
        """count(key >= x): one reduction over the resident keys, or one streamed pass."""
        if n_tiles == 1:
            return jnp.sum((resident >= x).astype(I32))
        return jax.lax.fori_loop(
            0, n_tiles, lambda i, c: c + jnp.sum((keys(i) >= x).astype(I32)), jnp.int32(0))

    if n_tiles == 1:
        resident = keys(0)
    # the k-th largest key: the largest v with count(key >= v) >= k, bit by bit (one
    # reduction per bit)
    v = jnp.int32(0)
    for bit in range(15, -1, -1):
        cand = v | (1 << bit)
        v = jnp.where(count_ge(cand) >= k, cand, v)
    need_eq = k - count_ge(v + 1)          # picks among the keys equal to v (>= 1)
    # every key >= KEY_NEG_INF, so v >= KEY_NEG_INF; v == KEY_NEG_INF: fewer than k finite
    # scores, and the keys equal to v are -inf, never picked
    eq_ok = v > KEY_NEG_INF
    w_tile = min(tile, write_tile)

    def write(i, carry):
        gt_seen, eq_seen = carry
        key = keys(i, w_tile)       # read again: the resident keys are dead by now
        gt, eq = key > v, (key == v) & eq_ok
        # one scan for both running counts: keys above v in the low 16 bits, keys equal to v
        # in the high 16 (a tile has at most MAX_WRITE_TILE = 2**14 entries: no carry out of
        # the low field, no sign bit reached in the high one)
        packed = gt.astype(I32) + (eq.astype(I32) << 16)
        scan = jnp.cumsum(packed)
        gt_incl, eq_incl = (scan & 0xFFFF) + gt_seen, (scan >> 16) + eq_seen
        pick = gt | (eq & (eq_incl <= need_eq))
        slot = gt_incl + jnp.minimum(eq_incl, need_eq) - 1     # the picks before it, in order
        pos = i * w_tile + jnp.arange(w_tile, dtype=I32)
        # unpicked lanes store nothing; their (masked) slots are past the row, all distinct
        # (interpret mode's scatter would let a duplicate slot clobber a pick)
        pltr.store(out_ref.at[o, jnp.where(pick, slot, k_pad + pos)], start + pos, mask=pick)
        total = jnp.sum(packed)
        return gt_seen + (total & 0xFFFF), eq_seen + (total >> 16)

    n_gt, n_eq = jax.lax.fori_loop(0, -(-seg_len // w_tile), write,
                                   (jnp.int32(0), jnp.int32(0)))
    n_picked = n_gt + jnp.minimum(n_eq, need_eq)
    slots = jnp.arange(k_pad, dtype=I32)
    pltr.store(out_ref.at[o, pl.ds(0, k_pad)], jnp.full((k_pad,), -1, I32),
               mask=slots >= n_picked)


def default_segment(rows: int, T: int, k: int = 1) -> int:
    """The segment length for ``rows`` rows of ``T`` scores and top-``k``: the longest of
    :data:`SEGMENTS` with ``2 k`` or more scores that gives at least :data:`FULL_WAVE`
    programs (``rows * ceil(T / segment)``), else the shortest of those; :data:`MAX_TILE` (one
    stage) if ``2 k`` is above every length. Rows that fit in the segment are selected in one
    stage."""
    fits = [seg for seg in SEGMENTS if 2 * k <= seg]
    for seg in fits:
        if rows * -(-T // seg) >= FULL_WAVE:
            return seg
    return fits[-1] if fits else MAX_TILE


def preferred(rows: int, T: int, k: int) -> bool:
    """Whether the kernel is the selection to use for ``rows`` rows of ``T`` scores and
    top-``k``: yes, except where it would stream the whole row in one program (rows longer
    than :data:`TILE` with ``2 k`` above every segment length), where the XLA radix selection
    is faster."""
    return not (T > TILE and default_segment(rows, T, k) >= T)


def check_inputs(score, k) -> None:
    """The selection's input checks, shared by every implementation: ``ValueError`` for a
    ``score`` that is not fp32 [B, S, T] or a ``k`` that is not an integer >= 1."""
    if score.ndim != 3 or score.dtype != F32:
        raise ValueError(f"score: expected fp32 [B, S, T], got {score.dtype} {score.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")


def _check(score, k, tile, write_tile, num_warps, segment):
    check_inputs(score, k)
    for name, t, top in (("tile", tile, MAX_TILE), ("write_tile", write_tile, MAX_WRITE_TILE),
                         ("num_warps", num_warps, 32), ("segment", segment, MAX_TILE)):
        if t is not None and (t < 1 or t & (t - 1) or t > top):
            raise ValueError(f"{name} must be a power of two <= {top}, got {t}")


@functools.partial(jax.jit, static_argnames=("k", "interpret", "tile", "write_tile",
                                             "num_warps", "segment"))
def select_topk(score: Float[Array, "B S T"], k: int, *, interpret: bool = False,
                tile: int | None = None, write_tile: int = WRITE_TILE,
                num_warps: int | None = None, segment: int | None = None
                ) -> Int[Array, "B S k"]:
    """Top-``k`` positions of each row of ``score`` (fp32 [B, S, T], bf16-representable values,
    ``-inf`` / NaN allowed), ascending, ``-1`` after the last pick: int32 [B, S, min(k, T)].
    Bit for bit :func:`.reference.select_topk_radix` (docs/architecture.md, "Top-k selection").

    Rows longer than ``segment`` scores (a power of two; default :func:`default_segment`;
    :data:`MAX_TILE`: one stage) with ``2 k <= segment`` are selected in stages: each
    segment's top-k in a program of its own (the segments of a row run in parallel), then
    the top-k of those candidates (their scores gathered in XLA; again in segments while they
    are more than a segment). The result is the same: every pick of the row's top-k lies in
    its segment's top-k under the same order (score, then the lower position), and the
    candidates stay in position order, so ties among them still go to the lower position.

    ``tile``: scores per counting step within a segment (a power of two; default: the segment
    padded to a power of two, up to :data:`TILE`; longer segments are streamed),
    ``write_tile``: scores per step of the writing pass (a power of two <=
    :data:`MAX_WRITE_TILE`), ``num_warps``: Triton warps (a power of two; default 16 for
    tiles of 16384 and more, 8 from 4096, else 4), ``interpret``: Pallas interpret mode
    (CPU). Raises ``ValueError`` for a ``k`` that is not an integer >= 1, a non-fp32 or
    non-3-D ``score``, or a tile, writing tile, warp count or segment outside those limits.
    """
    _check(score, k, tile, write_tile, num_warps, segment)
    B, S, T = score.shape
    k = min(int(k), T)
    if T == 0 or B * S == 0:
        return jnp.zeros((B, S, k), I32)
    R = B * S
    flat = score.reshape(R, T)
    seg = segment or default_segment(R, T, k)
    if T > seg and 2 * k <= seg:
        n_seg = -(-T // seg)
        cand = _select(flat, k, seg, n_seg, interpret, tile, write_tile, num_warps)
        cand = cand.reshape(R, 1, n_seg * k)          # absolute positions, ascending, -1 fill
        cand_score = jnp.where(cand >= 0, jnp.take_along_axis(
            flat[:, None], jnp.maximum(cand, 0), axis=-1), -jnp.inf)
        pick = select_topk(cand_score, k, interpret=interpret, tile=tile,
                           write_tile=write_tile, num_warps=num_warps, segment=segment)
        out = jnp.where(pick >= 0, jnp.take_along_axis(cand, jnp.maximum(pick, 0), axis=-1),
                        -1)
        return out.reshape(B, S, k)
    return _select(flat, k, T, 1, interpret, tile, write_tile, num_warps).reshape(B, S, k)


def _select(flat, k, seg_len, n_seg, interpret, tile, write_tile, num_warps):
    """The kernel over fp32 [R, T] in ``n_seg`` segments of ``seg_len`` scores: int32
    [R, n_seg, k], each segment's top-k (absolute positions, ascending, -1 fill)."""
    R, T = flat.shape
    k = min(k, seg_len)
    tile = tile or min(_next_pow2(seg_len), TILE)
    n_tiles = -(-seg_len // tile)
    k_pad = _next_pow2(k)
    warps = num_warps or (16 if tile >= 16384 else 8 if tile >= 4096 else 4)
    out = pl.pallas_call(   # whole arrays: the program indexes its row
        functools.partial(_kernel, T=T, k=k, tile=tile, n_tiles=n_tiles, k_pad=k_pad,
                          write_tile=write_tile, seg_len=seg_len, n_seg=n_seg),
        grid=(R, n_seg),
        in_specs=[pl.BlockSpec()],
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((R * n_seg, k_pad), I32),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1),
        name="indexer_select_topk",
    )(flat)
    return out[:, :k].reshape(R, n_seg, k)
