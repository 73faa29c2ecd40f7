"""The Pallas Mosaic GPU (Hopper) sparse attention prototype: Mosaic GPU interpret mode on CPU
against the jnp/XLA reference, and its CUDA lowering (layout inference, SMEM budget, TMA
constraints) through ``jax.export`` on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import mosaic_gpu as mg
from pallas_kernels.sparse_attention.reference import sparse_attention_xla
from test_sparse_attention import make_inputs

H, K = 64, 512
SCALE = K ** -0.5


def _f32(a):
    return np.asarray(a, np.float32)


def _reset_interpreter():
    """After an exception in GPU interpret mode its state must be reset (InterpretGPUParams)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _run(args, topk_none=False):
    q, wkv, wsc, widx, main, msc, topk, sink = args
    if topk_none:
        main = msc = topk = None
    try:
        o1, l1 = mg.sparse_attention(q, wkv, wsc, widx, main, msc, topk, sink, SCALE,
                                     interpret=True)
        o1, l1 = _f32(o1), np.asarray(l1)
    except Exception:
        _reset_interpreter()
        raise
    o0, l0 = sparse_attention_xla(q, wkv, wsc, widx, main, msc, topk, sink, SCALE)
    return o1, l1, _f32(o0), np.asarray(l0)


def _compare(o1, l1, o0, l0, bitwise_frac=0.99):
    assert not np.isnan(o1).any()
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-5)
    # fp32 summation order may move a bf16(P) rounding: <= 1 ulp of the output plus 2^-8 of
    # the rows' size (as tests/test_sparse_attention.py); nearly every value is bitwise equal
    tol = 2 * np.abs(o0) * 2.0 ** -8 + 2.0 ** -8 * 6.0
    assert (np.abs(o0 - o1) <= tol).all()
    assert (o0 == o1).mean() > bitwise_frac


CASES = {
    # name: make_inputs kwargs (B=1, S=2; query (0, 1) has no entry at all)
    "window 20 + top-k 70: a mixed block, then a main block": dict(Ww=20, k=70),
    "window 128 + top-k 200: window blocks, main blocks, a list of > 256 entries": dict(
        Ww=128, k=200, Nw=130),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mgpu_interpret_matches_reference(name):
    args = make_inputs(**{"B": 1, "S": 2, "H": H, "K": K, "Nw": 70, "T": 150, "seed": 1,
                          **CASES[name]})
    o1, l1, o0, l0 = _run(args)
    assert (o1[0, 1] == 0).all()                        # no valid entry: o = 0, lse = sink
    np.testing.assert_allclose(l1[0, 1], np.asarray(args[-1]), rtol=1e-6)
    _compare(o1, l1, o0, l0)


def test_mgpu_interpret_swa_only_and_clamped_indices():
    q, wkv, wsc, widx, main, msc, topk, sink = make_inputs(B=1, S=2, H=H, K=K, Nw=70, T=150,
                                                           Ww=40, k=8, seed=2)
    widx = widx.at[:, :, 3].set(wkv.shape[1] + 5)      # past the end: the last row (XLA gather)
    o1, l1, o0, l0 = _run((q, wkv, wsc, widx, main, msc, topk, sink), topk_none=True)
    _compare(o1, l1, o0, l0)


def test_mgpu_rejects_unsupported_shapes():
    args = make_inputs(B=1, S=2, H=8, K=128, Ww=8, k=8)
    with pytest.raises(ValueError, match="H == 64"):
        mg.sparse_attention(*args, SCALE, interpret=True)
    q, wkv, wsc, widx, main, msc, topk, sink = make_inputs(B=1, S=2, H=H, K=K, Ww=8, k=8)
    long_topk = jnp.zeros((1, 2, mg.MAX_LIST), jnp.int32)
    with pytest.raises(ValueError, match="at most"):
        mg.sparse_attention(q, wkv, wsc, widx, main, msc, long_topk, sink, SCALE)


def test_mgpu_through_the_public_op():
    """``sparse_attention(impl="mosaic_gpu_interpret")`` dispatches to the prototype (bit for
    bit its direct call) and refuses tuning keywords; the FP4 codec does not take the name."""
    from pallas_kernels import fp4
    from pallas_kernels import sparse_attention as sa
    args = make_inputs(B=1, S=2, H=H, K=K, Nw=70, T=150, Ww=24, k=16, seed=3)
    o1, l1 = sa.sparse_attention(*args, scale=SCALE, impl="mosaic_gpu_interpret")
    o2, l2 = mg.sparse_attention(*args, SCALE, interpret=True)
    np.testing.assert_array_equal(_f32(o1), _f32(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    with pytest.raises(ValueError, match="tuning"):
        sa.sparse_attention(*args, impl="mosaic_gpu_interpret", block_h=32)
    with pytest.raises(ValueError, match="impl"):
        fp4.quantize_pack(jnp.zeros((2, 64), jnp.bfloat16), "main", impl="mosaic_gpu")


def test_mgpu_permutation_and_scale_expansion():
    """The two layout tricks in plain numpy: the channel permutation and E (scale expansion)."""
    x = np.arange(2 * K).reshape(2, K)
    np.testing.assert_array_equal(np.asarray(mg.unpermute_channels(mg.permute_channels(x))), x)
    e = mg.scale_expand_matrix()
    rng = np.random.default_rng(0)
    ms, ws = rng.normal(size=(3, 32)), rng.normal(size=(3, 16))
    a = np.concatenate([ms, ws, np.zeros((3, 16))], axis=1)
    ch = np.arange(K // 2)   # tile column i of either half: channels 2i and 2i + 1
    np.testing.assert_array_equal(a[:, :32] @ e[:32], ms[:, (2 * ch) // 16])
    np.testing.assert_array_equal(a[:, 32:] @ e[32:], ws[:, (2 * ch) // 32])


@pytest.mark.parametrize("ww,k", [(20, 70), (128, 512), (64, 0), (0, 64), (128, 1408)])
def test_mgpu_lowers_for_cuda(ww, k):
    """The GPU code path (wgmma A operands in registers, in-place PV accumulation) goes through
    Mosaic GPU's lowering, layout checks, TMA limits and SMEM budget; nothing runs. (128, 512)
    is the release model's list, (128, 1408) the longest list that fits the SMEM."""
    B, S, Nw, T = 2, 3, 130, 1000
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((B, S, H, K), jnp.bfloat16), ((B, Nw, K), jnp.float8_e4m3fn),
        ((B, Nw, K // 32), jnp.uint8), ((B, S, ww), jnp.int32), ((B, T, K // 2), jnp.uint8),
        ((B, T, K // 16), jnp.float8_e4m3fn), ((B, S, k), jnp.int32), ((H,), jnp.float32)]]
    if k == 0:
        structs[4:7] = [None, None, None]
        f = lambda q, a, b, c, s: mg.sparse_attention(q, a, b, c, None, None, None, s, SCALE)
        structs = [x for x in structs if x is not None]
    else:
        f = lambda *a: mg.sparse_attention(*a, SCALE)
    exp = jax.export.export(jax.jit(f), platforms=["cuda"])(*structs)
    assert "mosaic_gpu" in exp.mlir_module()


def test_mgpu_code_decodes_are_exact():
    """The kernel's e4m3 / e2m1 / E8M0 decodes give every code's value (the fp8 NaN codes
    excepted: the state never holds them), signed zeros included."""
    import ml_dtypes
    b = np.arange(256, dtype=np.int32)
    b = b[(b & 0x7F) != 0x7F]
    want = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(mg._e4m3_value(jnp.asarray(b)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    c = np.arange(16, dtype=np.int32)
    want = c.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(mg._e2m1_value(jnp.asarray(c)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    u = np.arange(1, 255, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(mg._e8m0_value(jnp.asarray(u))),
                                  np.ldexp(1.0, u - 127).astype(np.float32))
