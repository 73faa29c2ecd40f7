"""Pallas Triton (NVIDIA GPU) kernels of the gathered FP4 experts; see
:mod:`pallas_kernels.gathered_experts`.

Two launches for a MoE sublayer's routed experts at a few tokens, on the CUDA cores (a few
input rows waste a tensor-core tile, as the FP8 GEMV's one-row path found), each program's
loads issued in a few large steps (a decode step's pairs read a few MB: latency, not
arithmetic, bounds them):

* **up** (grid: pairs x ``I / block_n``): a program takes one (token, expert) pair and
  ``block_n`` rows of that expert's ``w1`` and ``w3``, read in place in the stack (the expert's
  index an operand: no gathered copy of the weights). In steps of ``block_k`` inputs it loads
  the token's even and odd inputs (two strided loads), FP8-quantises and dequantises them per
  32 inputs in registers, decodes the weight bytes (low nibble: input ``2j``, high: ``2j + 1``;
  two's complement codes -7..7 to e2m1 values by arithmetic), multiplies them by the input
  halves, sums each row's products over a 32-input group and multiplies the sum by the row's
  E8M0 scale of the group, into an fp32 ``[block_n, block_k / 32]`` accumulator per weight.
  Then the row sums rounded to bf16 (as a linear's output is), the clamps,
  ``silu(g) * u * route_w`` and one bf16 rounding: the pair's activation ``a``.
* **down** (grid: pairs x ``D / block_n``): the same loop over the pair's ``a`` (QDQ'd per 32
  in registers) and its expert's ``w2``; the rows' sums rounded to bf16: the pair's output.
  The fp32 sum over a token's pairs in increasing expert id is XLA's, which fuses it with
  the shared expert's addition and the one bf16 rounding after it.

The products are exact in fp32 (FP8 values times e2m1 values times powers of two); the sums
differ from the XLA path's only in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.fp4.common import exp2_int
from pallas_kernels.fp4.reference import FP8_MAX, _pow2_ceil_exponent
from pallas_kernels.gemv.triton import _pow2_divisor, e4m3_nearest

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
#: Programs a launch aims for: ``block_n`` is the widest of :data:`BLOCK_NS` that still gives
#: this many (a decode step's few pairs want every SM reading at once).
TARGET_PROGRAMS = 1024
BLOCK_NS = (64, 32, 16)
#: Warps per program (both kernels) where the call does not say.
NUM_WARPS = 4
#: The largest default ``block_k`` (inputs per loop step): a step's products are
#: ``block_n x block_k / 2`` values in registers.
MAX_BLOCK_K = 512


def _qdq_halves(xe, xo, interpret: bool):
    """FP8 QDQ per 32 inputs of an input held as its even and odd halves ``[C / 2]`` (fp32):
    group ``g`` is ``xe[16 g : 16 g + 16]`` with ``xo[16 g : 16 g + 16]``; bit for bit
    :func:`pallas_kernels.fp4.reference.act_quant_qdq` of the whole."""
    G = xe.shape[0] // 16
    be, bo = xe.reshape(G, 16), xo.reshape(G, 16)
    amax = jnp.maximum(jnp.maximum(jnp.max(jnp.abs(be), axis=1), jnp.max(jnp.abs(bo), axis=1)),
                       1e-4)
    e = _pow2_ceil_exponent(amax * np.float32(1.0 / FP8_MAX))
    inv, s = exp2_int(-e)[:, None], exp2_int(e)[:, None]
    return tuple((e4m3_nearest(b * inv, interpret) * s).reshape(-1)    # of b / 2**e (exact)
                 for b in (be, bo))


def _e2m1(v):
    """e2m1 value of a two's complement code ``v`` in -7..7 (int32 -> fp32, exact), as
    :func:`pallas_kernels.grouped_matmul.mosaic_gpu.e2m1_from_i4`."""
    f = v.astype(F32)
    return 2.0 * f - 0.5 * jnp.clip(f, -4.0, 4.0) - jnp.clip(f, -6.0, 6.0)


def _load(w_ref, s_ref, e, n0, i, *, block_n, block_k):
    """Step ``i``'s tile of rows ``n0..`` of expert ``e``: the bytes ``[block_n, block_k / 2]``
    and the scales ``[block_k / 32, block_n]`` (offsets as multiples of the step, so that
    Triton sees them aligned and loads 16 bytes at a time)."""
    b = w_ref[e, pl.ds(n0, block_n), pl.ds(i * (block_k // 2), block_k // 2)]
    st = s_ref[e, pl.ds(i * (block_k // 32), block_k // 32), pl.ds(n0, block_n)]
    return b, st


def _group_sums(b, st, xe, xo):
    """A tile (:func:`_load`) times the input's halves: even inputs times the low nibbles
    plus odd times the high ones, summed over each 32-input group's 16 bytes, times the row's
    E8M0 scale of the group (a power of two: exact) -> fp32 ``[block_n, block_k / 32]``."""
    n, h = b.shape
    b = b.astype(I32)
    lo = _e2m1((b << 28) >> 28)                       # input 2j of the step
    hi = _e2m1((b << 24) >> 28)                       # input 2j + 1
    prod = lo * xe[None, :] + hi * xo[None, :]        # exact
    return jnp.sum(prod.reshape(n, h // 16, 16), axis=2) * st.astype(F32).T


def _halves(ref, row, i, block_k, interpret):
    """Step ``i``'s even and odd inputs of ``ref``'s row ``row``, FP8 QDQ'd per 32."""
    xe = ref[row, pl.ds(i * block_k, block_k // 2, stride=2)].astype(F32)
    xo = ref[row, pl.ds(i * block_k + 1, block_k // 2, stride=2)].astype(F32)
    return _qdq_halves(xe, xo, interpret)


def _row_sums(x_ref, row, weights, e, n0, *, block_n, block_k, n_k, interpret):
    """The fp32 sums ``[block_n]`` of rows ``n0..`` of expert ``e`` of each of ``weights``
    (``((w_ref, s_ref), ...)``) times ``x_ref``'s row ``row`` (QDQ'd), over ``n_k`` steps of
    ``block_k`` inputs. The next step's tiles are loaded before this step's products
    (carried in registers), so a program keeps one step's loads in flight while it computes."""
    kw = dict(block_n=block_n, block_k=block_k)

    def step(i, carry):
        accs, tiles = carry
        nxt = jnp.minimum(i + 1, n_k - 1)             # the last step reloads its own tile
        ahead = tuple(_load(w, s, e, n0, nxt, **kw) for w, s in weights)
        xe, xo = _halves(x_ref, row, i, block_k, interpret)
        accs = tuple(acc + _group_sums(*t, xe, xo) for acc, t in zip(accs, tiles))
        return accs, ahead

    zero = jnp.zeros((block_n, block_k // 32), F32)
    first = tuple(_load(w, s, e, n0, 0, **kw) for w, s in weights)
    accs, _ = jax.lax.fori_loop(0, n_k, step, ((zero,) * len(weights), first))
    return tuple(jnp.sum(acc, axis=1) for acc in accs)


def _up_kernel(pair_ref, rw_ref, x_ref, w1_ref, s1_ref, w3_ref, s3_ref, a_ref, *, k, block_n,
               block_k, n_k, limit, interpret):
    p, nb = pl.program_id(0), pl.program_id(1)
    e, n0 = pair_ref[p], nb * block_n
    g, u = _row_sums(x_ref, p // k, ((w1_ref, s1_ref), (w3_ref, s3_ref)), e, n0,
                     block_n=block_n, block_k=block_k, n_k=n_k, interpret=interpret)
    a_ref[p, pl.ds(n0, block_n)] = _swiglu(g, u, rw_ref[p], limit).astype(a_ref.dtype)


def _swiglu(g, u, route_w, limit: float):
    """A pair's activation from its rows' fp32 sums of ``w1`` (``g``) and ``w3`` (``u``):
    each rounded to bf16 (a linear's output), the clamps (``limit > 0``: ``u`` to
    ``[-limit, limit]``, ``g`` from above), ``silu(g) * u * route_w`` in fp32."""
    g = g.astype(BF16).astype(F32)
    u = u.astype(BF16).astype(F32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return g * jax.nn.sigmoid(g) * u * route_w


def route(scores, keys, k: int, j, *, route_scale: float, normalize: bool):
    """Token routing in registers: ``scores`` fp32 ``[Ep]`` the router's scores, ``keys``
    ``[Ep]`` the selection keys (the scores plus the selection bias; ``-inf`` on lanes past
    the experts) -> the ``j``-th smallest id of the ``k`` experts of largest key (equal keys:
    the lower id first, as ``lax.top_k``) and its weight: its score, over the chosen scores'
    sum ``+ 1e-20`` where ``normalize`` (and ``k > 1``), times ``route_scale``. ``j`` may be
    traced."""
    Ep = scores.shape[0]
    lanes = jax.lax.broadcasted_iota(I32, (Ep,), 0)
    chosen = lanes < 0
    for _ in range(k):                                  # the largest key not yet chosen
        m = jnp.max(jnp.where(chosen, -jnp.inf, keys))
        first = jnp.min(jnp.where(chosen | (keys != m), Ep, lanes))
        chosen = chosen | (lanes == first)
    rest, e = chosen, jnp.int32(0)
    for jj in range(k):                                 # the chosen ids, smallest first
        lo = jnp.min(jnp.where(rest, lanes, Ep))
        rest = rest & (lanes != lo)
        e = jnp.where(j == jj, lo, e)
    w = jnp.sum(jnp.where(lanes == e, scores, 0.0))
    if normalize and k > 1:
        w = w / (jnp.sum(jnp.where(chosen, scores, 0.0)) + np.float32(1e-20))
    return e, w * np.float32(route_scale)


def _routed_up_kernel(scores_ref, keys_ref, at_ref, x_ref, w1_ref, s1_ref, w3_ref, s3_ref,
                      a_ref, ids_ref, *, k, E, block_n, block_k, n_k, limit, route_scale,
                      normalize, interpret):
    p, nb = pl.program_id(0), pl.program_id(1)
    t, n0 = p // k, nb * block_n
    e, rw = route(scores_ref[t, :], keys_ref[t, :], k, p % k, route_scale=route_scale,
                  normalize=normalize)
    g, u = _row_sums(x_ref, t, ((w1_ref, s1_ref), (w3_ref, s3_ref)), e + at_ref[0] * E, n0,
                     block_n=block_n, block_k=block_k, n_k=n_k, interpret=interpret)
    a_ref[p, pl.ds(n0, block_n)] = _swiglu(g, u, rw, limit).astype(a_ref.dtype)

    @pl.when(nb == 0)
    def _():
        ids_ref[p] = e


def _down_kernel(pair_ref, at_ref, a_ref, w2_ref, s2_ref, y_ref, *, E, block_n, block_k, n_k,
                 interpret):
    p, nb = pl.program_id(0), pl.program_id(1)
    e, n0 = pair_ref[p] + at_ref[0] * E, nb * block_n
    [y] = _row_sums(a_ref, p, ((w2_ref, s2_ref),), e, n0, block_n=block_n, block_k=block_k,
                    n_k=n_k, interpret=interpret)
    y_ref[p, pl.ds(n0, block_n)] = y.astype(y_ref.dtype)


def pick_blocks(rows: int, N: int, K: int, block_n: int | None = None,
                block_k: int | None = None) -> tuple[int, int]:
    """``(block_n, block_k)`` of a launch over ``rows`` pairs and ``N`` outputs of ``K``
    inputs: the widest of :data:`BLOCK_NS` dividing ``N`` that still gives
    :data:`TARGET_PROGRAMS` programs (else 16), and the largest power of two dividing ``K`` up
    to :data:`MAX_BLOCK_K`. Raises ``ValueError`` for blocks that do not tile the shapes
    (``block_n`` a power of two >= 16 dividing ``N``; ``block_k`` a power of two >= 64
    dividing ``K``)."""
    if block_n is None:
        fits = [b for b in BLOCK_NS if N % b == 0]
        block_n = next((b for b in fits if rows * (N // b) >= TARGET_PROGRAMS),
                       fits[-1] if fits else 16)
    if block_k is None:
        block_k = _pow2_divisor(K, MAX_BLOCK_K)
    if block_n < 16 or block_n & (block_n - 1) or N % block_n:
        raise ValueError(f"block_n={block_n} must be a power of two >= 16 dividing N={N}")
    if block_k < 64 or block_k & (block_k - 1) or K % block_k:
        raise ValueError(f"block_k={block_k} must be a power of two >= 64 dividing K={K}")
    return block_n, block_k


def as_bytes(w: dict) -> tuple[jax.Array, jax.Array]:
    """A kernel-form stack (``"i4"`` int4 ``[..., E, N, K]``, ``"scale_t"`` bf16 ``[..., E,
    K / 32, N]``) as the kernels read it: the codes' bytes ``uint8 [L * E, N, K / 2]`` (a
    bitcast of the packed int4: no copy) and the scales ``[L * E, K / 32, N]``."""
    i4, st = w["i4"], w["scale_t"]
    N, K = i4.shape[-2:]
    b = jax.lax.bitcast_convert_type(i4.reshape(-1, N, K // 2, 2), jnp.uint8)
    return b, st.reshape(-1, *st.shape[-2:])


def _launch(kernel, grid, out_shape, name, num_warps, num_stages, interpret):
    """``pallas_call`` of ``kernel`` on whole operands (it indexes them itself), a bf16
    output of ``out_shape`` (a shape; or a list of ``jax.ShapeDtypeStruct``)."""
    many = isinstance(out_shape, list)
    return pl.pallas_call(
        kernel, grid=grid, out_specs=[pl.BlockSpec()] * len(out_shape) if many else pl.BlockSpec(),
        out_shape=out_shape if many else jax.ShapeDtypeStruct(out_shape, BF16),
        compiler_params=pltr.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                            num_stages=num_stages),
        interpret=interpret, name=name)


@functools.partial(jax.jit, static_argnames=("k", "limit", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def up(x, w1, s1, w3, s3, pair_expert, route_w, *, k, limit, block_n=None, block_k=None,
       num_warps=None, num_stages=3, interpret=False):
    """The up kernel: ``x [T, D]``, ``w1``/``w3`` bytes ``[EL, I, D / 2]`` with their scales
    ``[EL, D / 32, I]``, ``pair_expert [T * k]`` (the stack's expert index of each pair, a
    token's pairs together), ``route_w [T * k]`` fp32 -> ``a`` bf16 ``[T * k, I]``."""
    T, D = x.shape
    P = pair_expert.shape[0]
    I = w1.shape[1]
    block_n, block_k = pick_blocks(P, I, D, block_n, block_k)
    kernel = functools.partial(_up_kernel, k=k, block_n=block_n, block_k=block_k,
                               n_k=D // block_k, limit=limit, interpret=interpret)
    return _launch(kernel, (P, I // block_n), (P, I), "gathered_experts_up", num_warps,
                   num_stages, interpret)(pair_expert.astype(I32), route_w.astype(F32), x, w1,
                                          s1, w3, s3)


@functools.partial(jax.jit, static_argnames=("E", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def down(a, w2, s2, pair_expert, at=None, *, E=0, block_n=None, block_k=None,
         num_warps=None, num_stages=3, interpret=False):
    """The down kernel: ``a [P, I]`` bf16, ``w2`` bytes ``[EL, D, I / 2]`` with scales
    ``[EL, I / 32, D]``, ``pair_expert [P]`` (plus ``at * E``: ``at`` int32 ``[1]``, a layer's
    index in a stack of ``E`` experts a layer; None: 0) -> each pair's output
    ``bf16(QDQ(a) @ w2^T)`` ``[P, D]``."""
    P, I = a.shape
    D = w2.shape[1]
    block_n, block_k = pick_blocks(P, D, I, block_n, block_k)
    kernel = functools.partial(_down_kernel, E=E, block_n=block_n, block_k=block_k,
                               n_k=I // block_k, interpret=interpret)
    at = jnp.zeros((1,), I32) if at is None else jnp.reshape(at, (1,)).astype(I32)
    return _launch(kernel, (P, D // block_n), (P, D), "gathered_experts_down", num_warps,
                   num_stages, interpret)(pair_expert.astype(I32), at, a, w2, s2)


@functools.partial(jax.jit, static_argnames=("k", "E", "limit", "route_scale", "normalize",
                                             "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def routed_up(scores, keys, at, x, w1, s1, w3, s3, *, k, E, limit, route_scale, normalize,
              block_n=None, block_k=None, num_warps=None, num_stages=3, interpret=False):
    """The up kernel routing its own pairs (:func:`route`): ``scores`` and ``keys`` fp32
    ``[T, Ep]`` (``Ep`` a power of two >= ``E``; keys ``-inf`` past ``E``), ``at`` int32 ``[1]``
    (the layer's index in ``w1``'s stack of ``E`` experts a layer), ``x [T, D]`` and the
    weights as :func:`up` -> ``(a`` bf16 ``[T * k, I]``, the pairs' expert ids int32
    ``[T * k]``: each token's ``k`` in increasing id``)``."""
    T, D = x.shape
    P = T * k
    I = w1.shape[1]
    block_n, block_k = pick_blocks(P, I, D, block_n, block_k)
    kernel = functools.partial(_routed_up_kernel, k=k, E=E, block_n=block_n, block_k=block_k,
                               n_k=D // block_k, limit=limit, route_scale=route_scale,
                               normalize=normalize, interpret=interpret)
    out = [jax.ShapeDtypeStruct((P, I), BF16), jax.ShapeDtypeStruct((P,), I32)]
    return _launch(kernel, (P, I // block_n), out, "gathered_experts_up", num_warps,
                   num_stages, interpret)(scores.astype(F32), keys.astype(F32),
                                          jnp.reshape(at, (1,)).astype(I32), x, w1, s1, w3, s3)
