"""mHC's sublayer glue (:mod:`pallas_kernels.mhc`): the Triton kernels in interpret mode
against the jnp reference, their build for an H200, the refusals, and a decode step running
them."""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
from gpu_export_util import h200_export
from pallas_kernels import impls, mhc
from pallas_kernels.mhc import triton as mhc_triton

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
KW = dict(hc=HC, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
BF16_ULP = 2.0 ** -7          # one bf16 ulp, relative (8 significand bits)


def _inputs(T: int, D: int, seed: int = 0):
    """``(X, (y, res, post, comb), pre_prev, fn, scale, base, w)`` of ``T`` rows as
    ``[T, 1, ...]`` (batch, sequence), with the magnitudes of a trained model's."""
    rng = np.random.default_rng(seed)
    M = (2 + HC) * HC
    X = jnp.asarray(rng.normal(0, 1, (T, 1, HC, D)), jnp.bfloat16)
    y = jnp.asarray(rng.normal(0, 1, (T, 1, D)), jnp.bfloat16)
    post = jnp.asarray(rng.uniform(0, 2, (T, 1, HC)), jnp.float32)
    comb = jnp.asarray(rng.uniform(0, 1, (T, 1, HC, HC)), jnp.float32)
    pre = jnp.asarray(rng.uniform(0, 1, (T, 1, HC)), jnp.float32)
    fn = jnp.asarray(rng.normal(0, 0.05, (M, HC * D)), jnp.float32)
    scale = jnp.asarray([0.9, 1.1, 1.3], jnp.float32)
    base = jnp.asarray(rng.normal(0, 0.5, M), jnp.float32)
    w = jnp.asarray(rng.normal(1, 0.1, D), jnp.bfloat16)
    return X, (y, X, post, comb), pre, fn, scale, base, w


_xla = jax.jit(lambda *a: mhc.sublayer_glue(*a, impl="xla", **KW))


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _bf16_ulps(a) -> np.ndarray:
    """bf16 values as integers in ulp order (adjacent bf16 values differ by 1)."""
    b = np.asarray(jnp.asarray(a).astype(jnp.bfloat16)).view(np.uint16).astype(np.int32)
    return np.where(b & 0x8000, 0x8000 - b, b)


def _assert_bf16_close(got, want, name, scale=4.0):
    """Equal for at least 99.9% of the elements; otherwise one bf16 ulp apart, or (a sum that
    cancels, whose fp32 terms of magnitude ``scale`` were rounded in another order) within a
    few fp32 ulps of ``scale``."""
    d = np.abs(_bf16_ulps(got) - _bf16_ulps(want))
    close = (d <= 1) | (np.abs(_f32(got) - _f32(want)) <= 2.0 ** -21 * scale)
    assert close.all() and (d == 0).mean() >= 0.999, (name, d.max(), (d == 0).mean())


@pytest.mark.parametrize("impl", ["gpu_interpret", "xla"])
@pytest.mark.parametrize("with_post", [False, True])
def test_stacked_parameters_read_at_their_layer(impl, with_post):
    """``layer=``: ``fn``, ``scale``, ``base``, ``norm_weight`` as stacks of 3 layers read at
    the index (the kernels in place, the reference by a slice): bitwise the call on that
    layer's slices, and another layer gives another result."""
    X, st, pre, fn, scale, base, w = _inputs(3, 128, seed=5)
    rng = np.random.default_rng(6)
    fns = jnp.stack([fn, fn * 0.5, jnp.asarray(rng.normal(0, 0.05, fn.shape), jnp.float32)])
    scales = jnp.stack([scale, scale * 1.5, scale * 0.5])
    bases = jnp.stack([base, -base, base + 0.25])
    ws = jnp.stack([w, (w * 2).astype(w.dtype), (w * 0.5).astype(w.dtype)])
    streams = st if with_post else X
    glue = lambda *a, **k: mhc.sublayer_glue(streams, pre, *a, impl=impl, **KW, **k)  # noqa
    outs = []
    for layer in range(3):
        got = glue(fns, scales, bases, ws, layer=jnp.int32(layer))
        want = glue(fns[layer], scales[layer], bases[layer], ws[layer])
        for g, v in zip(got, want):
            np.testing.assert_array_equal(_f32(g), _f32(v))
        outs.append(got)
    assert not np.array_equal(_f32(outs[0][1]), _f32(outs[2][1]))
    assert not np.array_equal(_f32(outs[0][4]), _f32(outs[1][4]))


def test_stacked_parameters_refused_when_inconsistent():
    X, _, pre, fn, scale, base, w = _inputs(2, 64)
    fns, scales, bases, ws = (jnp.stack([a, a]) for a in (fn, scale, base, w))
    glue = lambda *a, **k: mhc.sublayer_glue(X, pre, *a, **{**KW, **k})  # noqa: E731
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        glue(fns, scales, bases, ws, layer=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        glue(fns, scales, bases, ws, layer=jnp.float32(0))
    with pytest.raises(ValueError, match="scale must have shape"):
        glue(fns, scale, bases, ws, layer=jnp.int32(0))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        glue(fns, scales, bases, jnp.stack([w, w, w]), layer=jnp.int32(0))
    with pytest.raises(ValueError, match="fn must have shape"):
        glue(fn, scales, bases, ws, layer=jnp.int32(0))


def test_hc_post_and_pre_in_the_formula_order():
    """With products exact (dyadic inputs) no FMA contraction can change a result: ``X``
    equals the reference bit for bit on 70 rows (the split kernel's one block of 128 ragged),
    ``input`` within one bf16 ulp, and the last row's values processed."""
    T, D = 70, 128
    rng = np.random.default_rng(1)
    X, (y, _, _, _), _, fn, scale, base, w = _inputs(T, D, seed=1)
    post = jnp.asarray(rng.integers(0, 9, (T, 1, HC)) / 4, jnp.float32)
    comb = jnp.asarray(rng.integers(0, 9, (T, 1, HC, HC)) / 8, jnp.float32)
    pre = jnp.asarray(rng.integers(0, 9, (T, 1, HC)) / 8, jnp.float32)
    st = (y, X, post, comb)
    got = mhc.sublayer_glue(st, pre, fn, scale, base, w, impl="gpu_interpret", **KW)
    want = _xla(st, pre, fn, scale, base, w)
    np.testing.assert_array_equal(_f32(got[0]), _f32(want[0]))
    _assert_bf16_close(got[1], want[1], "input")
    np.testing.assert_allclose(_f32(got[4]), _f32(want[4]), rtol=0, atol=2e-5)
    assert np.abs(_f32(got[1])[-1]).sum() > 0 and np.abs(_f32(got[4])[-1]).sum() > 0


def test_chunks():
    """The row kernel's chunks: the largest power of two dividing ``D`` within the tile."""
    assert [mhc_triton.row_chunk(D, 4) for D in (64, 320, 2048, 5120, 7168, 8192)] == [
        64, 64, 2048, 1024, 1024, 2048]


def test_refusals():
    X, (y, res, post, comb), pre, fn, scale, base, w = _inputs(2, 64)
    glue = lambda *a, **k: mhc.sublayer_glue(*a, **{**KW, **k})  # noqa: E731
    cases = [
        ((X.astype(jnp.float32), pre, fn, scale, base, w), "X must be bfloat16"),
        ((X[..., :3, :], pre, fn, scale, base, w), r"X must have shape"),
        ((X[0, 0], pre, fn, scale, base, w), r"X must be \[\*batch, hc, D\]"),
        (((y, res, post), pre, fn, scale, base, w), "streams must be X or"),
        (((y[..., :32], res, post, comb), pre, fn, scale, base, w), "y must have shape"),
        (((y, res, post.astype(jnp.bfloat16), comb), pre, fn, scale, base, w),
         "post must be float32"),
        (((y, res, post, comb[..., :2]), pre, fn, scale, base, w), "comb must have shape"),
        ((X, pre[..., :2], fn, scale, base, w), "pre_prev must have shape"),
        ((X, pre, fn[:20], scale, base, w), "fn must have shape"),
        ((X, pre, fn.astype(jnp.bfloat16), scale, base, w), "fn must be float32"),
        ((X, pre, fn, scale[:2], base, w), "scale must have shape"),
        ((X, pre, fn, scale, base[:5], w), "base must have shape"),
        ((X, pre, fn, scale, base, w[:32]), "norm_weight must have shape"),
        ((X, pre, fn, scale, base, w.astype(jnp.float16)), "norm_weight must be"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            glue(*args)
    with pytest.raises(ValueError, match="impl must be one of"):
        glue(X, pre, fn, scale, base, w, impl="triton_x")
    with pytest.raises(ValueError, match="iters must be >= 1"):
        glue(X, pre, fn, scale, base, w, iters=0)
    X2, _, pre2, fn2, scale2, base2, w2 = _inputs(1, 96)
    with pytest.raises(ValueError, match="D a multiple of 64"):
        glue(X2, pre2, fn2, scale2, base2, w2, impl="gpu")


def test_auto_dispatch():
    """``"auto"``: XLA on a CPU; on a GPU the kernels up to MAX_ROWS rows (64), XLA above."""
    X, _, pre, fn, scale, base, w = _inputs(3, 64)
    assert mhc.MAX_ROWS == 64
    with mock.patch.object(mhc.triton, "sublayer_glue", side_effect=RuntimeError("kernel")):
        mhc.sublayer_glue(X, pre, fn, scale, base, w, **KW)
        with mock.patch.object(impls, "on_gpu", lambda backend=None: True):
            with pytest.raises(RuntimeError, match="kernel"):
                mhc.sublayer_glue(X, pre, fn, scale, base, w, **KW)
            with mock.patch.object(mhc, "MAX_ROWS", 0):                  # off
                mhc.sublayer_glue(X, pre, fn, scale, base, w, **{**KW, "iters": 1})
            X, _, pre, fn, scale, base, w = _inputs(mhc.MAX_ROWS + 1, 64)
            mhc.sublayer_glue(X, pre, fn, scale, base, w, impl="auto", **{**KW, "iters": 1})


def _count(text: str) -> dict:
    return {"triton": text.count("__gpu$xla.gpu.triton"),
            **{op: text.count(op) for op in ("stablehlo.pad", "dynamic_update_slice",
                                              "scatter", "stablehlo.concatenate")}}


@pytest.mark.parametrize("T, D", [(1, 5120), (64, 5120), (40, 2048), (100, 64)])
@pytest.mark.parametrize("with_post", [False, True])
def test_kernels_lower_for_h200(T, D, with_post):
    """The glue is exactly two Triton calls and the mixes' product: no pad, scatter,
    concatenate or dynamic_update_slice around them (ragged row blocks masked in the
    kernels)."""
    X, st, pre, fn, scale, base, w = _inputs(T, D)
    ex = h200_export(lambda *a: mhc_triton.sublayer_glue(*a, **KW),
                     st if with_post else X, pre, fn, scale, base, w)
    text = ex.mlir_module()
    assert _count(text) == {"triton": 2, "stablehlo.pad": 0, "dynamic_update_slice": 0,
                            "scatter": 0, "stablehlo.concatenate": 0}
    assert text.count("stablehlo.dot_general") == 1
    names = re.findall(r'name = "([a-z0-9_]+)"', text)
    assert "mhc_glue_rows" in names and "mhc_glue_split" in names
    assert [a.shape for a in ex.out_avals] == [(T, 1, HC, D), (T, 1, D), (T, 1, HC),
                                               (T, 1, HC), (T, 1, HC, HC)]


def _tiny_decode():
    from benchmarks.config import e2e_config
    from dsv41_jax import model, state as st
    from dsv41_jax.random_weights import random_params_device
    cfg, _ = e2e_config("tiny")
    p = model.prepare_params(random_params_device(cfg, 0), cfg)
    return cfg, p, st.init_state(cfg, 2, 64), model.decode_fn(cfg, attn_impl="xla")


from dsv41_jax import model  # noqa: E402


def test_decode_step_runs_the_kernels_on_a_gpu():
    """Built for an H200, a decode step runs both sublayers' glue of every block in the
    kernels (the op counts are printed for the record)."""
    cfg, p, state, _ = _tiny_decode()
    tokens = jnp.zeros((2,), jnp.int32)
    counts = {}
    for on in (False, True):
        jax.clear_caches()                             # no trace of the other setting reused
        step = model.decode_fn(cfg, attn_impl="xla")
        with mock.patch.object(impls, "on_gpu", lambda backend=None: True), \
                mock.patch.object(mhc, "MAX_ROWS", 64 if on else 0):
            text = h200_export(step, p, state, tokens).mlir_module()
        names = re.findall(r'name = "([a-z0-9_]+)"', text)
        counts[on] = (text.count("__gpu$xla.gpu.triton"), len(re.findall(r"= stablehlo\.", text)),
                      names.count("mhc_glue_rows"), names.count("mhc_glue_split"),
                      names.count("sinkhorn_pairs"))
    print("decode step (triton calls, stablehlo ops, rows, split, sinkhorn):", counts)
    # the row kernel defined once per variant (with / without hc_post), the split kernel once,
    # called from the layers' scan bodies; the Sinkhorn pairs run inside the split kernel
    assert counts[False][2:] == (0, 0, 1)
    assert counts[True][2:] == (2, 1, 0)
    assert counts[True][0] == counts[False][0] - 1 + 3
    assert counts[True][1] < counts[False][1]


def test_decode_step_in_interpret_mode_matches_xla():
    """A decode step with the glue in interpret mode (the GPU path, "gpu" -> "gpu_interpret")
    gives the XLA path's logits within a tight tolerance, the same argmax."""
    cfg, p, state, step = _tiny_decode()
    tokens = jnp.asarray([3, 7], jnp.int32)
    want = np.asarray(jax.jit(step)(p, state, tokens)[0])
    real, spy = mhc.sublayer_glue, mhc.triton._split_kernel

    def interpret(*a, impl="auto", **k):
        return real(*a, impl="gpu_interpret", **k)

    jax.clear_caches()
    calls = []
    with mock.patch.object(mhc, "sublayer_glue", interpret), \
            mock.patch.object(mhc.triton, "_split_kernel",
                              side_effect=lambda *a, **k: calls.append(1) or spy(*a, **k)):
        got = np.asarray(jax.jit(model.decode_fn(cfg, attn_impl="xla"))(p, state, tokens)[0])
    assert calls                                       # the kernels ran
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()
