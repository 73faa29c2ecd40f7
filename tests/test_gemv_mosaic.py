"""The FP8 stacked GEMV's Mosaic GPU kernel (:mod:`pallas_kernels.gemv.mosaic_gpu`): interpret
mode against the jnp reference (row tiles, groups, a pair of weights, split K, every layer of
a stack, extreme scales), the switch that sends the GEMV's larger inputs to it, its shape
rules, and its build for an H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from gpu_export_util import h200_export
from pallas_kernels import gemv
from pallas_kernels.fp4.reference import act_quant_qdq
from pallas_kernels.gemv import mosaic_gpu as mg
from pallas_kernels.gemv import triton as gemv_triton


def _stack(rng, L, N, K, lo=118, hi=132):
    w = jnp.asarray(rng.normal(0, 1, (L, N, K)), jnp.float8_e4m3fn)
    s = jnp.asarray(rng.integers(lo, hi, (L, N // 32, K // 32)), jnp.uint8)
    return w, s


def _reference(x, ws, ss, layer, act_quant=False):
    return np.concatenate([np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(layer),
                                                    act_quant=act_quant, impl="xla"))
                           for w, s in zip(ws, ss)], axis=-1)


def _close(got, want):
    """Equal up to the fp32 summation order of exact products."""
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("M, G, ns, K, L, splits", [
    (5, 1, (128,), 128, 2, 1),            # an 8-row tile, 3 rows padded; two K steps
    (64, 1, (256,), 256, 2, 2),           # a full 64-row tile, split K (fp32 planes)
    (9, 2, (256,), 256, 1, 1),            # grouped: each 128-row block reads its group
    (20, 1, (128, 256), 256, 2, 2),       # a pair in one launch, split K
])
def test_interpret_matches_reference(M, G, ns, K, L, splits):
    """Every layer of the stack, read by its index: the reference up to summation order;
    another layer's weights give another result."""
    rng = np.random.default_rng(0)
    ws, ss = zip(*[_stack(rng, L, n, K) for n in ns])
    x = jnp.asarray(rng.normal(0, 1, (M, G, K)), jnp.bfloat16)
    for layer in range(L):
        got = np.asarray(mg.fp8_gemm(x, ws, ss, jnp.int32(layer), k_splits=splits,
                                     interpret=True))
        assert got.shape == (M, sum(ns)) and got.dtype == np.float32
        _close(got, _reference(x, ws, ss, layer))
    if L > 1:
        assert not np.allclose(got, _reference(x, ws, ss, 0))


def test_extreme_scales_and_bf16_out():
    """E8M0 scales far from 1 (0: ``2**-127``; 200: ``2**73``, on inputs that keep the
    products finite) as the reference takes them; ``out_dtype=bfloat16`` is the fp32 sums rounded once,
    with and without split K."""
    rng = np.random.default_rng(1)
    L, N, K, M = 1, 128, 256, 8
    w = jnp.asarray(rng.normal(0, 1, (L, N, K)), jnp.float8_e4m3fn)
    s = np.full((L, N // 32, K // 32), 127, np.uint8)
    s[0, 0, 0], s[0, 1, 1], s[0, 2, 2] = 0, 200, 100
    s = jnp.asarray(s)
    x = np.asarray(rng.normal(0, 1, (M, 1, K)), np.float32)
    x[:, :, 32:64] *= 2.0 ** -40             # the 2**73 block's products about 2**33
    x = jnp.asarray(x, jnp.bfloat16)
    want = _reference(x, (w,), (s,), 0)
    assert np.isfinite(want).all() and np.abs(want).max() > 1e9
    for splits in (1, 2):
        got = np.asarray(mg.fp8_gemm(x, (w,), (s,), jnp.int32(0), k_splits=splits,
                                     interpret=True))
        _close(got, want)
        got16 = mg.fp8_gemm(x, (w,), (s,), jnp.int32(0), k_splits=splits,
                            out_dtype=jnp.bfloat16, interpret=True)
        assert got16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got16), np.asarray(
            jnp.asarray(got).astype(jnp.bfloat16)))


def test_the_switch_sends_larger_inputs_to_it(monkeypatch):
    """``gemv.MOSAIC_MIN_ROWS``: ``fp8_gemv`` / ``fp8_gemv_pair`` of at least that many rows run
    the Mosaic GPU kernel on the act-quantised input (the same values as the Triton kernel's
    up to summation order; a pair's ``partials`` are its bf16 outputs side by side, one
    "split"); fewer rows, a RoPE or a Triton tuning stay on the Triton kernel."""
    rng = np.random.default_rng(2)
    w0, s0 = _stack(rng, 2, 128, 256)
    w1, s1 = _stack(rng, 2, 256, 256)
    x = jnp.asarray(rng.normal(0, 1, (20, 1, 256)), jnp.bfloat16)
    at = jnp.int32(1)
    calls = []
    real = mg.fp8_gemm_rows
    monkeypatch.setattr(mg, "fp8_gemm_rows",
                        lambda *a, **k: calls.append((a[0].shape, a[1])) or real(*a, **k))
    monkeypatch.setattr(gemv, "MOSAIC_MIN_ROWS", 17)
    y = gemv.fp8_gemv(x, w0, s0, at, act_quant=True, out_dtype=jnp.bfloat16,
                      impl="gpu_interpret")
    assert calls == [((32, 256), 20)] and y.dtype == jnp.bfloat16
    _close(np.asarray(y, np.float32), np.asarray(
        gemv.fp8_gemv(x, w0, s0, at, act_quant=True, impl="xla").astype(jnp.bfloat16),
        np.float32))
    y0, y1, parts = gemv.fp8_gemv_pair(x, w0, s0, w1, s1, at, act_quant=True,
                                       out_dtype=jnp.bfloat16, impl="gpu_interpret",
                                       partials=True)
    assert len(calls) == 2 and parts.shape == (1, 20, 384) and parts.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(parts[0]), np.concatenate(
        [np.asarray(y0), np.asarray(y1)], axis=-1))
    _close(np.asarray(jnp.concatenate([y0, y1], -1), np.float32),
           np.asarray(_reference(x, (w0, w1), (s0, s1), 1, act_quant=True)
                      .astype(jnp.bfloat16), np.float32))
    # the Triton kernel's: fewer rows, a tuning, a RoPE
    gemv.fp8_gemv(x[:16], w0, s0, at, impl="gpu_interpret")
    gemv.fp8_gemv(x, w0, s0, at, impl="gpu_interpret", block_k=128)
    rope = (jnp.arange(20, dtype=jnp.int32), jnp.ones((16,), jnp.float32), 64, False)
    gemv.fp8_gemv(x, w0, s0, at, impl="gpu_interpret", rope_out=rope)
    gemv.fp8_gemv(x, w0, s0, at, impl="gpu_interpret", kernel="triton")
    assert len(calls) == 2
    # kernel="mosaic" below the switch's rows, with its own tuning; refusals name the limits
    monkeypatch.setattr(gemv, "MOSAIC_MIN_ROWS", 65)
    y = gemv.fp8_gemv(x[:3], w0, s0, at, impl="gpu_interpret", kernel="mosaic", k_splits=2)
    assert calls[-1] == ((16, 256), 3) and y.shape == (3, 128)
    _close(np.asarray(y), np.asarray(gemv.fp8_gemv(x[:3], w0, s0, at, impl="xla")))
    for bad in ({"block_k": 128}, {"rope_out": rope}):
        with pytest.raises(ValueError, match="kernel='mosaic' takes no RoPE"):
            gemv.fp8_gemv(x, w0, s0, at, impl="gpu_interpret", kernel="mosaic", **bad)
    with pytest.raises(ValueError, match="kernel must be one of"):
        gemv.fp8_gemv(x, w0, s0, at, impl="gpu_interpret", kernel="cutlass")


@pytest.mark.parametrize("M, splits", [(64, 1), (20, 2)])
def test_act_quant_in_the_kernel(monkeypatch, M, splits):
    """``gemv.MOSAIC_ACT_QUANT``: the kernel FP8-QDQs its input tiles itself (no input
    launch; the rows padded to 64 below 64): the reference with its act-quant up to summation
    order, for one weight and a pair; without the QDQ the result is another."""
    monkeypatch.setattr(gemv, "MOSAIC_ACT_QUANT", True)
    monkeypatch.setattr(gemv_triton, "input_rows", lambda *a, **k: pytest.fail("input launch"))
    rng = np.random.default_rng(4)
    w0, s0 = _stack(rng, 2, 128, 256)
    w1, s1 = _stack(rng, 2, 256, 256)
    x = np.asarray(rng.normal(0, 3, (M, 1, 256)) * np.exp(rng.normal(0, 2, (M, 1, 256))))
    x = jnp.asarray(x, jnp.bfloat16)
    at = jnp.int32(1)
    got = np.asarray(gemv.fp8_gemv(x, w0, s0, at, act_quant=True, impl="gpu_interpret",
                                   kernel="mosaic", k_splits=splits))
    want = _reference(x, (w0,), (s0,), 1, act_quant=True)
    _close(got, want)
    assert np.abs(got - _reference(x, (w0,), (s0,), 1)).max() > 1e-3 * np.abs(want).max()
    y0, y1 = gemv.fp8_gemv_pair(x, w0, s0, w1, s1, at, act_quant=True, impl="gpu_interpret",
                                kernel="mosaic")
    _close(np.concatenate([np.asarray(y0), np.asarray(y1)], -1),
           _reference(x, (w0, w1), (s0, s1), 1, act_quant=True))
    with pytest.raises(ValueError, match="act_quant: one group of 64 rows"):
        mg.fp8_gemm_rows(jnp.zeros((32, 256), jnp.bfloat16), 20, (w0,), (s0,), at,
                         act_quant=True, interpret=True)


@pytest.mark.parametrize("M, G, tile, act_quant", [(5, 1, 16, True), (20, 3, 32, False),
                                                   (64, 2, 64, True)])
def test_input_rows_is_the_qdq_padded(M, G, tile, act_quant):
    """The kernel's input in one Triton launch (interpret mode): group by group, each padded
    with zero rows to the tile, FP8-QDQ'd with ``act_quant``; bit for bit XLA's."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(0, 3, (M, G, 256)), jnp.bfloat16)
    got = gemv_triton.input_rows(x, tile, act_quant=act_quant, interpret=True)
    want = act_quant_qdq(x, 32) if act_quant else x
    want = jnp.pad(jnp.swapaxes(want, 0, 1), ((0, 0), (0, tile - M), (0, 0)))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.reshape(G * tile, 256)))
    with pytest.raises(ValueError, match="in a tile of 8"):
        gemv_triton.input_rows(x, 8, act_quant=act_quant)


def test_shape_rules_and_refusals():
    """:func:`mg.fits` and the ``ValueError`` naming what the kernel takes."""
    assert mg.fits(64, 1, (32768,), 1280) and mg.fits(1, 8, (8192,), 4096)
    assert mg.fits(64, 1, (1280, 512), 2048)
    assert not mg.fits(65, 1, (128,), 128)                # too many rows
    assert not mg.fits(8, 1, (96,), 128)                  # rows not a multiple of 128
    assert not mg.fits(8, 1, (128,), 96)                  # K not a multiple of 64
    assert not mg.fits(8, 2, (128,), 128)                 # a group of 64 rows
    assert not mg.fits(8, 2, (256, 256), 128)             # groups with a pair
    assert [mg.pick_block_m(m) for m in (1, 8, 16, 17, 64)] == [16, 16, 16, 32, 64]
    # splits: doubled while the CTAs number fewer than the SMs, at least two K steps each, a
    # divisor of the steps
    assert mg.pick_k_splits(256, 1280) == 1 and mg.pick_k_splits(400, 4096) == 1
    assert mg.pick_k_splits(4, 256) == 2 and mg.pick_k_splits(16, 1280) == 4
    assert mg.pick_k_splits(16, 8192) == 16 and mg.pick_k_splits(16, 512) == 4
    assert mg.pick_k_splits(14, 2048) == 16 and mg.pick_k_splits(64, 4096) == 4
    w, s = jnp.zeros((1, 96, 128), jnp.float8_e4m3fn), jnp.zeros((1, 3, 4), jnp.uint8)
    with pytest.raises(ValueError, match="does not take"):
        mg.fp8_gemm(jnp.zeros((8, 1, 128), jnp.bfloat16), (w,), (s,), jnp.int32(0))
    w = jnp.zeros((1, 128, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale \(1, 3, 4\) != \(1, 4, 4\)"):
        mg.fp8_gemm(jnp.zeros((8, 1, 128), jnp.bfloat16), (w,), (s,), jnp.int32(0))
    with pytest.raises(ValueError, match="k_splits=4"):
        mg.fp8_gemm(jnp.zeros((8, 1, 128), jnp.bfloat16), (w,),
                    (jnp.zeros((1, 4, 4), jnp.uint8),), jnp.int32(0), k_splits=4)


@pytest.mark.parametrize("M", [4, 64])
def test_gpu_build_lowers(monkeypatch, M):
    """The mid config's shapes at a decode step of batch 4 and 64, through ``fp8_gemv`` and
    ``fp8_gemv_pair`` with the switch on, go through Mosaic GPU's lowering (the kernel) and
    Triton's (the input's one launch, where it is needed): ``wq_b`` (one weight, act-quant),
    ``wo_a`` (8 groups), ``wq_a`` and ``wkv`` (a pair)."""
    monkeypatch.setattr(gemv, "MOSAIC_MIN_ROWS", 2)
    S = jax.ShapeDtypeStruct
    at = S((), jnp.int32)
    for G, ns, K, aq in ((1, (32768,), 1280, True), (8, (8192,), 4096, False),
                         (1, (1280, 512), 2048, True), (1, (2048,), 8192, False)):
        ws = [S((15, n, K), jnp.float8_e4m3fn) for n in ns]
        ss = [S((15, n // 32, K // 32), jnp.uint8) for n in ns]
        if len(ns) == 2:
            f = lambda x, w0, s0, w1, s1, at: gemv.fp8_gemv_pair(   # noqa: E731
                x, w0, s0, w1, s1, at, act_quant=aq, out_dtype=jnp.bfloat16, impl="gpu")
        else:
            f = lambda x, w, s, at: gemv.fp8_gemv(x, w, s, at, act_quant=aq,  # noqa: E731
                                                  out_dtype=jnp.bfloat16, impl="gpu")
        args = [a for pair in zip(ws, ss) for a in pair]
        text = h200_export(f, S((M, G, K), jnp.bfloat16), *args, at).mlir_module()
        assert "fp8_stacked_gemm" in text
        # the input's launch: for a QDQ, groups or rows short of the tile (not at 64 rows of
        # a bf16 input of one group)
        assert ("fp8_gemm_input_rows" in text) == (aq or G > 1 or M < 64)
        if aq and M == 64:      # the QDQ in the kernel: no input launch
            monkeypatch.setattr(gemv, "MOSAIC_ACT_QUANT", True)
            text = h200_export(lambda *a: f(*a),   # a new function: traced anew
                               S((M, G, K), jnp.bfloat16), *args, at).mlir_module()
            assert "fp8_stacked_gemm" in text and "fp8_gemm_input_rows" not in text
            monkeypatch.setattr(gemv, "MOSAIC_ACT_QUANT", False)
