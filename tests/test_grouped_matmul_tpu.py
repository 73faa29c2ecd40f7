"""The Mosaic TPU FP4 grouped matmul in TPU interpret mode against the jnp reference
(docs/architecture.md, "Mixture of experts").

Every product ``x * w`` is exact in fp32 (bf16 inputs, weights exact in bf16), so the kernel and
the reference differ only in the fp32 summation order: the kernel's fp32 accumulator (the
``out_dtype=float32`` variant) is checked against the exact float64 result with a bound of a few
fp32 roundings of the sum of |terms|, and the bf16 output against the reference's within one
bf16 ulp, nearly all elements bitwise equal. Rows past ``sum(group_sizes)`` must be exactly 0.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp4.reference import E2M1_LUT
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul import tpu

U32 = 2.0 ** -24     # fp32 unit roundoff


def _inputs(seed, *, E, P, K, N):
    """x bf16 [P, K] of order 1, random codes, E8M0 scales around 2**0."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((P, K), np.float32), jnp.bfloat16)
    codes = jnp.asarray(rng.integers(0, 256, (E, N, K // 2)), jnp.uint8)
    scale = jnp.asarray(rng.integers(122, 130, (E, N, K // 32)), jnp.uint8)
    return x, codes, scale


def _exact(x, codes, scale, group_sizes):
    """float64 ``(y, sum_k |x w|)`` per row from the exact weights; 0 for rows past the end."""
    c = np.asarray(codes)
    v = E2M1_LUT[np.stack([c & 15, c >> 4], -1).reshape(*c.shape[:-1], -1)].astype(np.float64)
    s = np.ldexp(1.0, np.asarray(scale, np.int64) - 127)
    w = (v.reshape(*s.shape, 32) * s[..., None]).reshape(v.shape)       # [E, N, K]
    xf = np.asarray(x, np.float64)
    y = np.zeros((xf.shape[0], w.shape[1]))
    mag = np.zeros_like(y)
    start = 0
    for e, n in enumerate(np.asarray(group_sizes)):
        rows = slice(start, start + n)
        y[rows] = xf[rows] @ w[e].T
        mag[rows] = np.abs(xf[rows]) @ np.abs(w[e]).T
        start += n
    return y, mag


def _ordered(a):
    """bf16 values -> ints in the order of the values (adjacent bf16 values differ by 1)."""
    u = np.asarray(a).view(np.uint16).astype(np.int32)
    return np.where(u & 0x8000, -(u & 0x7FFF), u & 0x7FFF)


def _run(group_sizes, *, E=4, P, K, N, seed=0, **blocks):
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    x, codes, scale = _inputs(seed, E=E, P=P, K=K, N=N)
    call = functools.partial(tpu.grouped_matmul_kernel, interpret=True, **blocks)
    f32 = jax.jit(functools.partial(call, out_dtype=jnp.float32))(x, codes, scale, group_sizes)
    bf16 = jax.jit(call)(x, codes, scale, group_sizes)
    want = jax.jit(reference.fp4_grouped_matmul)(x, codes, scale, group_sizes)
    assert f32.shape == bf16.shape == want.shape == (P, N)
    assert f32.dtype == jnp.float32 and bf16.dtype == jnp.bfloat16 == want.dtype

    y, mag = _exact(x, codes, scale, group_sizes)
    f32 = np.asarray(f32, np.float64)
    total = int(np.sum(group_sizes))
    if total:      # values of order 10..100, not all tiny: the bounds below mean something
        assert 1.0 < np.abs(y[:total]).mean() < 1e3
    # within 4 fp32 roundings of the sum of |terms| (the worst case is K of them; observed: < 1)
    np.testing.assert_array_less(np.abs(f32 - y), 4 * U32 * mag + 1e-30)
    # the fp32 result rounds to the reference's bf16 or to its neighbour
    got, ref = np.asarray(bf16), np.asarray(want)
    np.testing.assert_array_equal(got, f32.astype(np.float32).astype(ml_dtypes.bfloat16))
    assert np.abs(_ordered(got) - _ordered(ref)).max() <= 1
    assert (got == ref).mean() > 0.99
    assert (got[total:].view(np.uint16) == 0).all()          # +0 past the end
    assert (f32[total:] == 0).all()
    return got


@pytest.mark.parametrize("group_sizes, P, K, N, blocks", [
    # uneven groups, an empty one, boundaries inside 16-row tiles, P not a multiple of the
    # tile, rows past the end (62..69) in a straddled tile and a whole zero tile; 4 k tiles,
    # 2 n tiles
    ([10, 0, 37, 15], 70, 1024, 256, dict(block_m=16, block_k=256)),
    # the middle group holds every row; empty groups before and after
    ([0, 40, 0, 0], 40, 512, 128, dict(block_m=16, block_k=256)),
    # empty first and last groups, groups smaller than a tile, default blocks (K in one tile,
    # one 128-row tile straddled by three groups)
    ([0, 3, 1, 100], 120, 256, 128, {}),
    # several row tiles of the default size, the last partial and past the end
    ([100, 150, 0, 30], 300, 512, 256, dict(block_k=256)),
    # group sizes summing past P (55 > 40): the ends are clipped to P, as the reference's
    ([30, 20, 5, 0], 40, 256, 128, dict(block_m=16)),
])
def test_matches_reference(group_sizes, P, K, N, blocks):
    _run(group_sizes, P=P, K=K, N=N, **blocks)


def test_no_rows_routed():
    """Every group empty: all output rows are zero tiles."""
    got = _run([0, 0, 0, 0], P=40, K=256, N=128, block_m=16)
    assert not got.any()


def test_visit_table():
    """Visits of ``[10, 0, 37, 15]`` over 70 rows in 16-row tiles (tiles 0..4)."""
    (tile, lo, hi, first, ftile, fgroup), n = tpu.visit_table(
        jnp.asarray([10, 0, 37, 15], jnp.int32), 70, 16)
    n = int(n)
    assert n == 7 and tile.shape == (5 + 4 - 1,)
    np.testing.assert_array_equal(tile[:n], [0, 0, 1, 2, 2, 3, 4])
    np.testing.assert_array_equal(lo[:n], [0, 10, 10, 10, 47, 47, 0])
    np.testing.assert_array_equal(hi[:n], [10, 47, 47, 47, 62, 62, 0])
    np.testing.assert_array_equal(first[:n], [1, 0, 1, 1, 0, 1, 1])
    np.testing.assert_array_equal(ftile[:n], [0, 0, 1, 2, 2, 3, 3])   # zero tile: no new fetch
    np.testing.assert_array_equal(fgroup[:n], [0, 2, 2, 2, 3, 3, 3])


@pytest.mark.annotations_unchecked
def test_value_errors():
    x, codes, scale = _inputs(0, E=2, P=8, K=256, N=128)
    gs = jnp.asarray([4, 4], jnp.int32)
    f = functools.partial(tpu.fp4_grouped_matmul_tpu, interpret=True)
    cases = [
        ((x.astype(jnp.float32), codes, scale, gs), {}, "x must be bf16"),
        ((x, codes.astype(jnp.int32), scale, gs), {}, "codes must be uint8"),
        ((x, codes, scale[..., :4], gs), {}, "scale must be"),
        ((x, codes, scale, gs.astype(jnp.float32)), {}, "group_sizes must be an integer"),
        ((x, codes, scale, gs[:1]), {}, "group_sizes must have E=2"),
        ((x, codes[..., :64], scale, gs), {}, "codes must be"),
        ((x[:, :48], codes[..., :24], scale[..., :1], gs), {}, "multiple of 32"),
        ((x, codes, scale, gs), dict(block_m=24), "block_m"),
        ((x, codes, scale, gs), dict(block_n=64), "block_n"),
        ((x, codes, scale, gs), dict(block_k=128), "block_k"),
    ]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            f(*args, **kw)
    x, codes, scale = _inputs(0, E=2, P=8, K=768, N=384)
    with pytest.raises(ValueError, match="K .* multiple of block_k=512"):
        f(x, codes, scale, gs)
    with pytest.raises(ValueError, match="N .* multiple of block_n=256"):
        f(x, codes, scale, gs, block_n=256, block_k=256)
