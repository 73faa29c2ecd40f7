"""The FP8 stacked GEMV (:mod:`pallas_kernels.gemv`): the Triton kernel in interpret mode
against the jnp reference, its build for an H200, its shape rules, and the model using it
inside the scanned layer groups."""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from gpu_export_util import h200_export
import ptx_emu
from pallas_kernels import gemv
from pallas_kernels.gemv import triton as gemv_triton


def _stack(rng, L, N, K):
    w = jnp.asarray(rng.normal(0, 1, (L, N, K)), jnp.float8_e4m3fn)
    s = jnp.asarray(rng.integers(118, 132, (L, N // 32, K // 32)), jnp.uint8)
    return w, s


@pytest.mark.parametrize("M, G, K, N, L, tune", [
    (1, 1, 256, 96, 3, {}),                                   # one k block, 3 row blocks
    (3, 2, 512, 128, 2, {"block_k": 128, "k_splits": 2}),     # grouped, split K
    (16, 1, 1280, 64, 1, {}),                                 # 16 rows, K = 5 x 256
    (2, 1, 256, 256, 2, {"block_n": 128}),                    # 4 scale rows per program
    (1, 2, 512, 256, 2, {"block_n": 64, "block_k": 128, "k_splits": 2}),   # grouped, split K
    (17, 1, 256, 64, 2, {}),                                  # a 32-row tile, 15 rows cut
    (40, 2, 512, 128, 2, {"block_k": 128, "k_splits": 2}),    # 64-row tile, grouped, split K
    (64, 1, 256, 128, 1, {"block_n": 64}),                    # a full 64-row tile
])
def test_interpret_matches_reference(M, G, K, N, L, tune):
    """Every layer of the stack, read by index: equal to the reference up to summation order
    (the products are exact)."""
    rng = np.random.default_rng(0)
    w, s = _stack(rng, L, N, K)
    x = jnp.asarray(rng.normal(0, 1, (M, G, K)), jnp.bfloat16)
    for layer in range(L):
        want = np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(layer), impl="xla"))
        got = np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(layer), impl="gpu_interpret",
                                       **tune))
        assert got.shape == (M, N)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # another layer's weights give another result: the index is honoured
    assert not np.allclose(np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(0), impl="xla")),
                           np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(L - 1),
                                                    impl="gpu_interpret", **tune))) or L == 1


def test_swapped_operands(monkeypatch):
    """:data:`triton.SWAP_MIN_ROWS`: 17-64 input rows multiplied with the weight tile of 64 or
    128 rows as the first operand equal the reference to summation order: a grouped input
    with act-quant and split K, a 32-row tile holding 20 rows, a pair of weights, the RoPE
    of the input and of the output, the SwiGLU of a pair's partial sums."""
    monkeypatch.setattr(gemv_triton, "SWAP_MIN_ROWS", 17)
    assert gemv_triton.default_block_n(128, 64, rows=17) == 64
    assert gemv_triton.default_block_n(128, 64, rows=16) == 32
    rng = np.random.default_rng(11)
    w, s = _stack(rng, 2, 256, 512)
    at = jnp.int32(1)

    def close(got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    for M, G, kw in ((40, 2, {"act_quant": True, "block_k": 128, "k_splits": 2}),
                     (20, 1, {"block_n": 128}), (64, 1, {})):
        x = jnp.asarray(rng.normal(0, 1, (M, G, 512)), jnp.bfloat16)
        close(gemv.fp8_gemv(x, w, s, at, impl="gpu_interpret", **kw),
              gemv.fp8_gemv(x, w, s, at, impl="xla", act_quant=kw.get("act_quant", False)))
    x = jnp.asarray(rng.normal(0, 1, (24, 1, 512)), jnp.bfloat16)
    w1, s1 = _stack(rng, 2, 128, 512)
    for g, want in zip(gemv.fp8_gemv_pair(x, w, s, w1, s1, at, act_quant=True,
                                          impl="gpu_interpret"),
                       gemv.fp8_gemv_pair(x, w, s, w1, s1, at, act_quant=True, impl="xla")):
        close(g, want)
    for M, key in ((20, "rope_out"), (40, "rope_in")):
        x = jnp.asarray(rng.normal(0, 1, (M, 1, 512)), jnp.bfloat16)
        rope = _rope_args(rng, M, 16, 128, key == "rope_in")
        close(gemv.fp8_gemv(x, w, s, at, impl="gpu_interpret", out_dtype=jnp.bfloat16,
                            **{key: rope}),
              gemv.fp8_gemv(x, w, s, at, impl="xla", out_dtype=jnp.bfloat16, **{key: rope}))
    wd, sd = _stack(rng, 2, 128, 128)
    wu, su = _stack(rng, 2, 256, 512)        # gate and up, 128 rows each: [S, P, 256] sums
    x = jnp.asarray(rng.normal(0, 1, (20, 1, 512)), jnp.bfloat16)
    parts = gemv.fp8_gemv_pair(x, wu[:, :128], su[:, :4], wu[:, 128:], su[:, 4:], at,
                               impl="gpu_interpret", partials=True, k_splits=2)[-1]
    got = gemv.fp8_gemv_swiglu(parts, wd, sd, at, rows=20, limit=1.5, impl="gpu_interpret")
    monkeypatch.setattr(gemv_triton, "SWAP_MIN_ROWS", 65)
    close(got, gemv.fp8_gemv_swiglu(parts, wd, sd, at, rows=20, limit=1.5,
                                    impl="gpu_interpret"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_act_quant_in_the_kernel(dtype):
    """``act_quant=True``: the interpret-mode kernel equals the FP8 QDQ of the input followed
    by the GEMV (the reference's order), to summation order, for bf16 and fp32 inputs with
    blocks of every magnitude (tiny, zero, large, saturating), and the QDQ changes the result."""
    from dsv41_jax import quant
    rng = np.random.default_rng(3)
    M, G, K, N, L = 5, 1, 256, 64, 2
    w, s = _stack(rng, L, N, K)
    mag = 2.0 ** rng.integers(-30, 20, (M, G, K // 32, 1))
    x = rng.normal(0, 1, (M, G, K // 32, 32)) * mag
    x[0, 0, 1] = 0.0                                   # a zero block (the amax floor)
    x[1, 0, 2, :3] = [1e30, -3e29, 5.0]                # a block led by a huge value
    x = jnp.asarray(x.reshape(M, G, K), dtype)
    want = np.asarray(gemv.fp8_gemv(quant.act_quant_qdq(x, 32), w, s, jnp.int32(1), impl="xla"))
    for impl in ("xla", "gpu_interpret"):
        got = np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(1), act_quant=True, impl=impl))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=impl)
    plain = np.asarray(gemv.fp8_gemv(x.astype(jnp.bfloat16), w, s, jnp.int32(1), impl="xla"))
    assert not np.allclose(plain, want, rtol=1e-3, atol=0)


@pytest.mark.parametrize("M, fma_rows", [(1, 1), (1, 0), (3, 4), (4, 4)])
@pytest.mark.parametrize("act_quant, G, tune", [
    (True, 1, {}), (False, 2, {"block_k": 128, "k_splits": 2}),
    (True, 1, {"block_n": 64}), (False, 1, {"block_k": 64, "k_splits": 4})])
def test_few_rows_on_either_core(monkeypatch, M, fma_rows, act_quant, G, tune):
    """Inputs of up to :data:`triton.FMA_MAX_ROWS` rows on the CUDA cores (one row by default:
    each row's products added into a ``[32, block_k]`` accumulator, summed at the end), or in a
    16-row tensor-core tile, equal the reference to summation order, with and without the
    act-quant, grouped, split K and programs of 64 rows; a pair of weights too."""
    rng = np.random.default_rng(7)
    K, N, L = 512, 256, 2
    w, s = _stack(rng, L, N, K)
    x = jnp.asarray(rng.normal(0, 1, (M, G, K)) * 3.0,
                    jnp.float32 if act_quant else jnp.bfloat16)
    monkeypatch.setattr(gemv_triton, "FMA_MAX_ROWS", fma_rows)
    jax.clear_caches()
    try:
        for layer in range(L):
            want = np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(layer), act_quant=act_quant,
                                            impl="xla"))
            got = np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(layer), act_quant=act_quant,
                                           impl="gpu_interpret", **tune))
            assert got.shape == (M, N)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        if G == 1:
            w1, s1 = _stack(rng, L, 128, K)
            y0, y1 = gemv.fp8_gemv_pair(x, w, s, w1, s1, jnp.int32(1), act_quant=act_quant,
                                        impl="gpu_interpret")
            for y, (ww, ss) in ((y0, (w, s)), (y1, (w1, s1))):
                want = np.asarray(gemv.fp8_gemv(x, ww, ss, jnp.int32(1), act_quant=act_quant,
                                                impl="xla"))
                np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5,
                                           atol=1e-5 * np.abs(want).max())
    finally:
        jax.clear_caches()


def test_qdq_template_is_the_reference_convert():
    """:data:`triton.QDQ_PTX` (the hardware's RNE satfinite e4m3 convert and back) on the PTX
    emulator equals ``clip(y, +-448).astype(e4m3)`` for every bf16 value and for fp32 values
    between e4m3 neighbours (ties included), NaN aside."""
    bits = np.arange(0, 1 << 16, dtype=np.uint32) << 16            # every bf16 pattern
    y = bits.view(np.float32)
    rng = np.random.default_rng(0)
    extra = np.concatenate([rng.uniform(-500, 500, 20000), rng.uniform(-2.0 ** -6, 2.0 ** -6,
                                                                      5000)]).astype(np.float32)
    y = np.concatenate([y[~np.isnan(y)], extra]).astype(np.float32)
    asm = gemv_triton.QDQ_PTX.replace("$0", "out").replace("$1", "y")
    got = ptx_emu.run_ptx(asm, {"y": y.view(np.uint32)})["out"].view(np.float32)
    want = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_act_quant_kernel_lowers_for_h200():
    """Built for an H200, the act-quant GEMV is one Triton call and no reduction of its own
    (only the split-K partial sums, when there are several), and the input goes to it as it
    is (its missing rows masked in the kernel: no pad or scatter first)."""
    rng = np.random.default_rng(0)
    w, s = _stack(rng, 2, 1024, 2048)
    x = jnp.zeros((1, 1, 2048), jnp.bfloat16)
    for ks, bn in ((1, 32), (4, 32), (1, 128)):
        ex = h200_export(lambda x, w, s, l: gemv_triton.fp8_gemv(x, w, s, l, act_quant=True,
                                                                 k_splits=ks, block_n=bn),
                         x, w, s, jnp.int32(1))
        text = ex.mlir_module()
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert text.count("stablehlo.reduce") == (ks > 1), ks
        for op in ("stablehlo.pad", "dynamic_update_slice", "scatter", "stablehlo.convert"):
            assert op not in text, (ks, op)


def test_reference_is_the_dequantised_product():
    rng = np.random.default_rng(1)
    w, s = _stack(rng, 2, 64, 64)
    x = jnp.asarray(rng.normal(0, 1, (2, 1, 64)), jnp.bfloat16)
    wf = np.asarray(w[1], np.float32) * 2.0 ** (
        np.asarray(s[1], np.float32).repeat(32, 0).repeat(32, 1) - 127)
    np.testing.assert_allclose(np.asarray(gemv.fp8_gemv(x, w, s, jnp.int32(1), impl="xla")),
                               np.asarray(x[:, 0], np.float32) @ wf.T, rtol=1e-6, atol=1e-4)


def test_shape_rules_and_refusals():
    assert gemv.kernel_fits((1, 1, 2048), (15, 32768, 2048))
    assert gemv.kernel_fits((16, 8, 4096), (15, 8192, 4096))
    assert gemv.kernel_fits((64, 1, 2048), (1, 512, 2048))            # a 64-row tile
    assert not gemv.kernel_fits((65, 1, 2048), (1, 512, 2048))        # too many rows
    # impl="auto" and the model's linears: every tile the kernel takes (AUTO_MAX_ROWS)
    assert gemv.AUTO_MAX_ROWS == gemv.MAX_ROWS == 64
    assert gemv.auto_fits((64, 1, 2048), (1, 512, 2048))
    assert not gemv.auto_fits((65, 1, 2048), (1, 512, 2048))
    assert not gemv.kernel_fits((1, 1, 2048), (1, 500, 2048))         # N not a multiple of 32
    assert not gemv.kernel_fits((1, 1, 1 << 16), (1 << 6, 1 << 10, 1 << 16))   # >= 2**31 B
    for K in (32, 96, 160):             # a tile of one scale column would be needed
        assert not gemv.kernel_fits((1, 1, K), (1, 64, K)), K
    for K in (64, 128, 192):
        assert gemv.kernel_fits((1, 1, K), (1, 64, K)), K
    x = jnp.zeros((65, 1, 64), jnp.bfloat16)
    w, s = jnp.zeros((1, 64, 64), jnp.float8_e4m3fn), jnp.zeros((1, 2, 2), jnp.uint8)
    with pytest.raises(ValueError, match="does not take"):
        gemv.fp8_gemv(x, w, s, jnp.int32(0), impl="gpu_interpret")
    with pytest.raises(ValueError, match="impl must be one of"):
        gemv.fp8_gemv(x, w, s, jnp.int32(0), impl="cuda")
    for bn in (48, 16, 256):
        with pytest.raises(ValueError, match=f"block_n={bn} must be a power of two >= 32"):
            gemv_triton.config(128, 1024, block_n=bn)
    with pytest.raises(ValueError, match="block_n=128 must divide the rows of a group"):
        gemv.fp8_gemv(jnp.zeros((1, 2, 64), jnp.bfloat16), jnp.zeros((1, 128, 64),
                      jnp.float8_e4m3fn), jnp.zeros((1, 4, 2), jnp.uint8), jnp.int32(0),
                      impl="gpu_interpret", block_n=128)
    for bk in (48, 32, 96):
        with pytest.raises(ValueError, match=f"block_k={bk} must be a power of two >= 64"):
            gemv_triton.config(64, 1024, block_k=bk)
    assert gemv_triton.config(32768, 1280) == (256, 1)
    assert gemv_triton.config(32768, 1280, block_n=64) == (256, 1)
    assert gemv_triton.config(512, 2048) == (512, 4)          # one 512 block per program
    assert gemv_triton.config(2048, 8192) == (512, 16)
    assert gemv_triton.config(8192, 4096) == (256, 1)         # 256 row blocks: no split
    assert gemv_triton.config(4096, 4096) == (512, 8)         # one 512 block per program
    assert gemv_triton.config(4096, 8192) == (256, 8)         # 512 would leave two per program
    assert gemv_triton.config(2048, 8192, max_block_k=128) == (128, 16)   # a 64-row tile
    assert gemv_triton.default_block_n(32768, 32768) == 64
    assert gemv_triton.default_block_n(32768, 32768 // 8) == 64
    assert gemv_triton.default_block_n(8192, 1024) == 32      # too few programs at 64
    assert gemv_triton.default_block_n(16 * 3104, 3104) == 32  # a group's rows: 97 x 32


@pytest.mark.parametrize("M", [1, 3, 16, 40, 64])
def test_kernel_lowers_for_h200(M):
    """The grouped output projection's shapes at the mid config (8 groups, 15 layers), for a
    row count that is not a power of two too: up to 16 rows only the input's rows are stored,
    a 64-row tile is stored whole and cut to the input's rows after the call."""
    x = jnp.zeros((M, 8, 4096), jnp.bfloat16)
    w, s = jnp.zeros((15, 8192, 4096), jnp.float8_e4m3fn), jnp.zeros((15, 256, 128), jnp.uint8)
    ex = h200_export(lambda x, w, s, l: gemv_triton.fp8_gemv(x, w, s, l), x, w, s,
                      jnp.int32(3))
    text = ex.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1
    cut = M not in (1, 3, 16, 64)                 # a 64-row tile holding fewer rows
    assert ("stablehlo.slice" in text) == cut
    assert [a.shape for a in ex.out_avals] == [(M, 8192)]


@pytest.mark.parametrize("M, K, N0, N1, L, act_quant, tune", [
    (1, 256, 96, 64, 3, True, {}),                                # 3 + 2 row blocks
    (48, 256, 64, 32, 2, True, {}),                               # a 64-row tile
    (3, 512, 64, 128, 2, False, {"block_k": 128, "k_splits": 2}),  # split K
    (16, 256, 128, 128, 2, True, {"block_n": 64}),                # 2 + 2 blocks of 64 rows
])
def test_pair_matches_two_calls(M, K, N0, N1, L, act_quant, tune):
    """Two weight stacks on one input in one launch: each output equals that weight's own
    GEMV (the reference) up to summation order, for every layer of the stacks; the second
    weight's rows are not the first's (each row block ran on its own weight)."""
    rng = np.random.default_rng(5)
    w0, s0 = _stack(rng, L, N0, K)
    w1, s1 = _stack(rng, L, N1, K)
    x = jnp.asarray(rng.normal(0, 1, (M, 1, K)), jnp.bfloat16)
    for layer in range(L):
        at = jnp.int32(layer)
        want = gemv.fp8_gemv_pair(x, w0, s0, w1, s1, at, act_quant=act_quant, impl="xla")
        got = gemv.fp8_gemv_pair(x, w0, s0, w1, s1, at, act_quant=act_quant,
                                 impl="gpu_interpret", **tune)
        for g, w_, n in zip(got, want, (N0, N1)):
            assert g.shape == (M, n)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=1e-5,
                                       atol=1e-5 * np.abs(np.asarray(w_)).max())
        np.testing.assert_allclose(  # the reference pair is the single GEMV twice
            np.asarray(want[1]), np.asarray(gemv.fp8_gemv(x, w1, s1, at, act_quant=act_quant,
                                                          impl="xla")), rtol=0, atol=0)
        # with partials: the same outputs and the kernel's output before the reduction of
        # its K splits, whose sum from 0 in order is both outputs side by side
        for impl in ("xla", "gpu_interpret"):
            kw = tune if impl == "gpu_interpret" else {}
            y0, y1, parts = gemv.fp8_gemv_pair(x, w0, s0, w1, s1, at, act_quant=act_quant,
                                               out_dtype=jnp.bfloat16, impl=impl,
                                               partials=True, **kw)
            plain = gemv.fp8_gemv_pair(x, w0, s0, w1, s1, at, act_quant=act_quant,
                                       out_dtype=jnp.bfloat16, impl=impl, **kw)
            S = parts.shape[0]                    # the kernel's K splits (1 in XLA's form)
            assert S == (kw.get("k_splits", S) if impl == "gpu_interpret" else 1)
            assert parts.shape[1] >= M and parts.shape[2] == N0 + N1
            assert parts.dtype == (jnp.float32 if S > 1 else jnp.bfloat16)
            total = jnp.zeros(parts.shape[1:], jnp.float32)
            for s in range(S):
                total = total + parts[s].astype(jnp.float32)
            total = np.asarray(total.astype(jnp.bfloat16))[:M]
            for a, b in ((y0, plain[0]), (y1, plain[1])):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(total, np.concatenate(
                [np.asarray(y0), np.asarray(y1)], axis=-1))
    assert not gemv.pair_fits((1, 2, 256), (1, 64, 256), (1, 64, 256))   # grouped input
    assert not gemv.pair_fits((1, 1, 256), (2, 64, 256), (1, 64, 256))   # stack depths differ
    w, sc = jnp.zeros((1, 64, 96), jnp.float8_e4m3fn), jnp.zeros((1, 2, 3), jnp.uint8)
    with pytest.raises(ValueError, match="does not take"):                   # K = 96
        gemv.fp8_gemv_pair(jnp.zeros((1, 1, 96), jnp.bfloat16), w, sc, w, sc, jnp.int32(0),
                           impl="gpu_interpret")
    with pytest.raises(ValueError, match="block_n=64 must divide both weights' rows, 96"):
        gemv.fp8_gemv_pair(x[:, :, :256], *_stack(rng, 1, 96, 256), *_stack(rng, 1, 64, 256),
                           jnp.int32(0), impl="gpu_interpret", block_n=64)


@pytest.mark.parametrize("M, tune", [(1, {}), (3, {"block_k": 128, "k_splits": 2}),
                                     (16, {"block_n": 64})])
def test_bf16_out_is_the_fp32_sums_rounded_once(M, tune):
    """``out_dtype=bfloat16``: the kernel stores its fp32 sums rounded once (in the store
    without a K split, after the partial sums' reduction with one), bitwise equal to the fp32
    result converted, for one GEMV and a pair; the XLA path the same way; another dtype is
    refused."""
    rng = np.random.default_rng(11)
    w, s = _stack(rng, 2, 128, 256)
    w1, s1 = _stack(rng, 2, 64, 256)
    x = jnp.asarray(rng.normal(0, 1, (M, 1, 256)), jnp.bfloat16)
    at = jnp.int32(1)
    for impl in ("gpu_interpret", "xla"):
        kw = tune if impl == "gpu_interpret" else {}
        y32 = gemv.fp8_gemv(x, w, s, at, act_quant=True, impl=impl, **kw)
        y16 = gemv.fp8_gemv(x, w, s, at, act_quant=True, out_dtype=jnp.bfloat16, impl=impl,
                            **kw)
        assert y32.dtype == jnp.float32 and y16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y16).view(np.uint16),
                                      np.asarray(y32.astype(jnp.bfloat16)).view(np.uint16))
        p32 = gemv.fp8_gemv_pair(x, w, s, w1, s1, at, impl=impl, **kw)
        p16 = gemv.fp8_gemv_pair(x, w, s, w1, s1, at, out_dtype=jnp.bfloat16, impl=impl, **kw)
        for a, b in zip(p16, p32):
            assert a.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                          np.asarray(b.astype(jnp.bfloat16)).view(np.uint16))
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        gemv.fp8_gemv(x, w, s, at, out_dtype=jnp.float16, impl="gpu_interpret")


def test_pair_lowers_for_h200():
    """The mid config's ``wq_a`` and ``wkv`` (2048 -> 1280 and 512, 15 layers) as one Triton
    kernel built for an H200."""
    x = jnp.zeros((1, 1, 2048), jnp.bfloat16)
    w0, s0 = jnp.zeros((15, 1280, 2048), jnp.float8_e4m3fn), jnp.zeros((15, 40, 64), jnp.uint8)
    w1, s1 = jnp.zeros((15, 512, 2048), jnp.float8_e4m3fn), jnp.zeros((15, 16, 64), jnp.uint8)
    ex = h200_export(lambda *a: gemv_triton.fp8_gemv_pair(*a, act_quant=True), x, w0, s0, w1,
                     s1, jnp.int32(3))
    assert ex.mlir_module().count("__gpu$xla.gpu.triton") == 1
    assert [a.shape for a in ex.out_avals] == [(1, 1280), (1, 512)]


def test_decode_step_reads_stacked_weights_in_place_on_a_gpu():
    """Built for an H200, a decode step with the stored form runs its FP8 linears through the
    kernel (the layer index passed, the stack whole); on CPU the same parameters give the
    stored form's own results (tests/test_linear_forms.py)."""
    from benchmarks.config import e2e_config
    from dsv41_jax import model, state as st
    from dsv41_jax.layers import linear as lin
    from dsv41_jax.random_weights import random_params_device
    cfg, _ = e2e_config("tiny")
    p = model.prepare_params(random_params_device(cfg, 0), cfg, linears="stored")
    state = st.init_state(cfg, 1, 64)
    with mock.patch.object(lin, "on_gpu", lambda: True):
        ex = h200_export(model.decode_fn(cfg, attn_impl="xla"), p, state,
                          jnp.zeros((1,), jnp.int32))
    names = re.findall(r'name = "([a-z0-9_]+)"', ex.mlir_module())
    assert names and set(names) == {"fp8_stacked_gemv"}


def test_decode_through_the_kernel_matches_the_stored_form():
    """The kernel (interpret mode) inside the scanned groups, reading each layer by its index
    in the stack (units x Reuse runs both above 1), gives the decode logits of the stored
    form's sliced weights."""
    import types
    from configs_util import scanned_tiny_config
    from dsv41_jax import model, state as st
    from dsv41_jax.layers import linear as lin
    from dsv41_jax.random_weights import random_params_device
    cfg = scanned_tiny_config()
    p = model.prepare_params(random_params_device(cfg, 0), cfg, linears="stored")
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 12)).astype(np.int32)
    out, state0 = model.prefill(p, cfg, ids, st.init_state(cfg, 2, 20))
    tok = np.asarray(out.logits).argmax(-1).astype(np.int32)
    step = model.decode_fn(cfg, attn_impl="xla")
    want, _ = jax.jit(lambda *a: step(*a))(p, state0, jnp.asarray(tok))
    calls = []

    def interpret_gemv(*a, impl, **kw):
        calls.append(a[1].shape)
        return gemv.fp8_gemv(*a, impl="gpu_interpret", **kw)

    def interpret_pair(*a, impl, **kw):
        calls.append(("pair", a[1].shape, a[3].shape))
        return gemv.fp8_gemv_pair(*a, impl="gpu_interpret", **kw)

    fake = types.SimpleNamespace(fp8_gemv=interpret_gemv, auto_fits=gemv.auto_fits,
                                 fp8_gemv_pair=interpret_pair, pair_fits=gemv.pair_fits,
                                 AUTO_MAX_ROWS=gemv.AUTO_MAX_ROWS)
    from dsv41_jax.layers import moe
    # first with XLA's rotations and SwiGLU around the kernel (the switches off)
    with mock.patch.object(lin, "on_gpu", lambda: True), mock.patch.object(lin, "gemv", fake), \
            mock.patch.object(lin, "ROPE_IN_KERNEL", False), \
            mock.patch.object(moe, "SWIGLU_IN_KERNEL", False):
        got, _ = jax.jit(lambda *a: step(*a))(p, state0, jnp.asarray(tok))
    assert calls, "the kernel was not used"
    assert any(c[0] == 4 for c in calls)     # the [2 units x 2 layers] stack
    assert any(c[0] == "pair" for c in calls)   # wq_a and wkv (and the shared expert) paired
    want, got = np.asarray(want), np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    # the query's RoPE and the output's inverse one inside the kernel (lin.ROPE_IN_KERNEL),
    # the shared expert's SwiGLU made by its w2 GEMV from the w1 / w3 pair's partial sums
    # (moe.SWIGLU_IN_KERNEL; both the defaults): the same bits as XLA's rotations and
    # activation around them
    seen = []

    def rope_gemv(*a, impl, **kw):
        seen.extend(k for k in ("rope_in", "rope_out") if kw.get(k) is not None)
        return gemv.fp8_gemv(*a, impl="gpu_interpret", **kw)

    def swiglu_gemv(*a, impl, **kw):
        seen.append("swiglu")
        return gemv.fp8_gemv_swiglu(*a, impl="gpu_interpret", **kw)

    fake.fp8_gemv, fake.fp8_gemv_swiglu = rope_gemv, swiglu_gemv
    with mock.patch.object(lin, "on_gpu", lambda: True), mock.patch.object(lin, "gemv", fake), \
            mock.patch.object(lin, "ROPE_IN_KERNEL", True), \
            mock.patch.object(moe, "SWIGLU_IN_KERNEL", True), \
            mock.patch.object(lin, "PROLOGUE_MAX_ROWS", 2):        # this step's two rows
        fused, _ = jax.jit(lambda *a: step(*a))(p, state0, jnp.asarray(tok))
    assert {"rope_in", "rope_out", "swiglu"} <= set(seen)
    np.testing.assert_array_equal(np.asarray(fused), got)
    # by default only a one-row input takes them (lin.PROLOGUE_MAX_ROWS): two rows do not
    seen.clear()
    assert lin.PROLOGUE_MAX_ROWS == 1
    with mock.patch.object(lin, "on_gpu", lambda: True), mock.patch.object(lin, "gemv", fake):
        jax.jit(lambda *a: step(*a))(p, state0, jnp.asarray(tok))
    assert not seen


def _rope_args(rng, M, pairs, head, inverse):
    positions = jnp.asarray(rng.integers(0, 70_000, M), jnp.int32)
    freqs = jnp.asarray(1.0 / 10_000.0 ** (np.arange(pairs) / pairs), jnp.float32)
    return positions, freqs, head, inverse


@pytest.mark.parametrize("M, G, K, N, side, tune", [
    (1, 1, 512, 256, "out", {}),                                   # CUDA cores, in the store
    (3, 1, 512, 256, "out", {}),                                   # tensor cores
    (3, 1, 512, 256, "out", {"block_k": 128, "k_splits": 2}),      # after the reduction
    (1, 2, 512, 128, "in", {}),                                    # grouped input
    (3, 2, 512, 128, "in", {"block_k": 128, "k_splits": 2}),
    (17, 2, 256, 64, "in", {}),                                    # a 32-row tile
])
def test_rope_in_the_kernel_is_the_rotation_before_or_after(M, G, K, N, side, tune):
    """``rope_out``: bit for bit the kernel's own bf16 output rotated by
    :func:`reference.rope_heads`; ``rope_in``: bit for bit the kernel on the rotated input
    (inverse rotation, act-quant after it); both equal to the XLA path up to summation order,
    each row at its own position, and the rotation changes the result."""
    from pallas_kernels.gemv import reference
    rng = np.random.default_rng(7)
    w, s = _stack(rng, 2, N, K)
    x = jnp.asarray(rng.normal(0, 1, (M, G, K)), jnp.bfloat16)
    at = jnp.int32(1)
    head = 128
    rope = _rope_args(rng, M, 16, head, side == "in")
    kw = dict(out_dtype=jnp.bfloat16, act_quant=side == "out")
    key = "rope_in" if side == "in" else "rope_out"
    got = gemv.fp8_gemv(x, w, s, at, impl="gpu_interpret", **kw, **{key: rope}, **tune)
    if side == "out":
        plain = gemv.fp8_gemv(x, w, s, at, impl="gpu_interpret", **kw, **tune)
        want_bits = reference.rope_heads(plain, *rope)
    else:
        plain = gemv.fp8_gemv(x, w, s, at, impl="gpu_interpret", **kw, **tune)
        want_bits = gemv.fp8_gemv(reference.rope_heads(x, *rope), w, s, at,
                                  impl="gpu_interpret", **kw, **tune)
    assert got.dtype == jnp.bfloat16 and got.shape == (M, N)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want_bits).view(np.uint16))
    xla = np.asarray(gemv.fp8_gemv(x, w, s, at, impl="xla", **kw, **{key: rope}), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), xla, rtol=1e-2,
                               atol=1e-2 * np.abs(xla).max())
    assert not np.array_equal(np.asarray(got), np.asarray(plain))
    # the rotated channels: the last 32 of each head (output) or every output (input)
    changed = np.asarray(got) != np.asarray(plain)
    if side == "out":
        assert not changed.reshape(M, N // head, head)[..., :head - 32].any()


def test_rope_refusals():
    rng = np.random.default_rng(8)
    w, s = _stack(rng, 1, 128, 256)
    x = jnp.asarray(rng.normal(0, 1, (2, 1, 256)), jnp.bfloat16)
    rope = _rope_args(rng, 2, 16, 128, False)
    at = jnp.int32(0)
    with pytest.raises(ValueError, match="rope_in or rope_out, not both"):
        gemv.fp8_gemv(x, w, s, at, impl="gpu_interpret", rope_in=rope, rope_out=rope)
    with pytest.raises(ValueError, match=r"rope_out: positions of shape \(2,\)"):
        gemv.fp8_gemv(x, w, s, at, impl="xla", rope_out=(rope[0][:1], *rope[1:]))
    with pytest.raises(ValueError, match="rope_in: head=96 must be an even divisor of the 256"):
        gemv.fp8_gemv(x, w, s, at, impl="gpu_interpret", rope_in=(*rope[:2], 96, True))
    with pytest.raises(ValueError, match="head=16 must be an even divisor"):   # 32 rotated
        gemv.fp8_gemv(x, w, s, at, impl="xla", rope_out=(*rope[:2], 16, False))
    with pytest.raises(ValueError, match=r"\(positions, freqs, head, inverse\) expected"):
        gemv.fp8_gemv(x, w, s, at, impl="xla", rope_out=rope[:3])


@pytest.mark.parametrize("side", ["in", "out"])
def test_rope_kernel_lowers_for_h200(side):
    """The mid config's ``wq_b`` (1280 -> 64 heads x 512, the query's rotation in the store)
    and ``wo_a`` (8 groups of 4096, the output's inverse rotation on the input tiles) at
    batch 1, built for an H200: one Triton kernel, no XLA rotation around it."""
    rng = np.random.default_rng(9)
    if side == "out":
        x = jnp.zeros((1, 1, 1280), jnp.bfloat16)
        w, s = jnp.zeros((15, 32768, 1280), jnp.float8_e4m3fn), jnp.zeros((15, 1024, 40), jnp.uint8)
    else:
        x = jnp.zeros((1, 8, 4096), jnp.bfloat16)
        w, s = jnp.zeros((15, 8192, 4096), jnp.float8_e4m3fn), jnp.zeros((15, 256, 128), jnp.uint8)
    pos, freqs, _, _ = _rope_args(rng, 1, 32, 512, side == "in")
    rope = ("input" if side == "in" else "output", 512, side == "in")
    ex = h200_export(lambda x, w, s, l, p, f: gemv_triton.fp8_gemv(
        x, w, s, l, p, f, act_quant=side == "out", out_dtype="bfloat16", rope=rope),
        x, w, s, jnp.int32(3), pos, freqs)
    text = ex.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.cosine" not in text and "stablehlo.concatenate" not in text
    assert [a.shape for a in ex.out_avals] == [(x.shape[0], w.shape[1])]


@pytest.mark.parametrize("M, K, I, N, tune", [
    (1, 256, 128, 96, {}),                                  # CUDA cores, pair K split in 4
    (3, 512, 64, 128, {"block_k": 64, "k_splits": 1}),      # tensor cores, masked rows
    (20, 256, 128, 64, {"block_k": 64, "k_splits": 2}),     # a 32-row tile, split K
])
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_swiglu_from_the_pairs_partial_sums(M, K, I, N, tune, limit):
    """``fp8_gemv_swiglu``: the GEMV of the SwiGLU of a pair's output, from that pair's
    partial sums (fp32 with a K split, its bf16 outputs without): in interpret mode bit for
    bit the GEMV of the SwiGLU the model computes from the pair's two outputs (the shared
    expert's formula), and the XLA path equal to it up to summation order; the clamp
    applies."""
    from pallas_kernels.gemv import reference
    rng = np.random.default_rng(12)
    w1, s1 = _stack(rng, 2, I, K)
    w3, s3 = _stack(rng, 2, I, K)
    w2, s2 = _stack(rng, 2, N, I)
    x = jnp.asarray(rng.normal(0, 4, (M, 1, K)), jnp.bfloat16)
    at = jnp.int32(1)
    for pair_tune in ({}, {"k_splits": 1}):
        g, u, parts = gemv.fp8_gemv_pair(x, w1, s1, w3, s3, at, act_quant=True,
                                         out_dtype=jnp.bfloat16, impl="gpu_interpret",
                                         partials=True, **pair_tune)
        gf, uf = g.astype(jnp.float32), u.astype(jnp.float32)
        if limit > 0:
            uf, gf = jnp.clip(uf, -limit, limit), jnp.minimum(gf, limit)
        a = (jax.nn.silu(gf) * uf).astype(jnp.bfloat16)[:, None, :]
        np.testing.assert_array_equal(np.asarray(reference.swiglu_input(parts, M, limit)),
                                      np.asarray(a))
        kw = dict(act_quant=True, out_dtype=jnp.bfloat16)
        want = gemv.fp8_gemv(a, w2, s2, at, impl="gpu_interpret", **kw, **tune)
        got = gemv.fp8_gemv_swiglu(parts, w2, s2, at, rows=M, limit=limit,
                                   impl="gpu_interpret", **kw, **tune)
        assert got.shape == (M, N) and got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                      np.asarray(want).view(np.uint16))
        xla = gemv.fp8_gemv_swiglu(parts, w2, s2, at, rows=M, limit=limit, impl="xla", **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32),
                                   rtol=1e-2, atol=1e-2 * float(np.abs(np.asarray(xla, np.float32)).max()))
    if limit > 0:     # the clamp bites on these inputs
        assert float(jnp.max(jnp.abs(u.astype(jnp.float32)))) > limit
    with pytest.raises(ValueError, match="must be \\[S, P >= rows"):
        gemv.fp8_gemv_swiglu(parts[..., :-1], w2, s2, at, rows=M, limit=limit, impl="xla")


def test_swiglu_kernel_lowers_for_h200():
    """The mid config's shared expert's ``w2`` (512 -> 2048) on the SwiGLU of its ``w1`` /
    ``w3`` pair's four K splits, built for an H200: one Triton kernel, no reduction of the
    pair's splits and no activation around it (only the sum of the kernel's own K splits)."""
    parts = jnp.zeros((4, 1, 1024), jnp.float32)
    w, s = jnp.zeros((15, 2048, 512), jnp.float8_e4m3fn), jnp.zeros((15, 64, 16), jnp.uint8)
    ex = h200_export(lambda p, w, s, l: gemv_triton.fp8_gemv_swiglu(
        p, w, s, l, rows=1, limit=10.0, act_quant=True, out_dtype="bfloat16"),
        parts, w, s, jnp.int32(3))
    text = ex.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.logistic" not in text and "stablehlo.exponential" not in text
    assert "(tensor<4x1x1024xf32>, tensor<f32>)" not in text        # the pair's partial sums
    assert [a.shape for a in ex.out_avals] == [(1, 2048)]
