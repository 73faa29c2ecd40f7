"""The sparse attention op: the Triton kernel (Pallas interpret mode on CPU) against the jnp/XLA
reference, dispatch rules, argument errors, and the model with the kernels switched on."""

from __future__ import annotations

import re

import dsv41_jax as dsv
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import annotations_unchecked
from dsv41_jax import quant
from pallas_kernels import sparse_attention as sa
from pallas_kernels.sparse_attention import common


def make_inputs(B=2, S=3, H=8, K=128, Nw=40, T=100, Ww=20, k=70, seed=0):
    """Random packed inputs; query (0, 1) has no entry at all."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, S, H, K)), jnp.bfloat16)
    win_kv, win_scale = quant.fp8_quantize(jnp.asarray(rng.normal(size=(B, Nw, K)) * 2,
                                                       jnp.float32), 32)
    codes, main_scale = quant.fp4_quantize(jnp.asarray(rng.normal(size=(B, T, K)) * 3,
                                                       jnp.float32), 16, "e4m3")
    widx = rng.integers(-1, Nw, size=(B, S, Ww)).astype(np.int32)
    topk = rng.integers(-1, T, size=(B, S, k)).astype(np.int32)   # repeats allowed
    widx[0, 1] = -1
    topk[0, 1] = -1
    sink = jnp.asarray(rng.normal(size=(H,)), jnp.float32)
    return (q, win_kv, win_scale, jnp.asarray(widx), quant.pack_nibbles(codes), main_scale,
            jnp.asarray(topk), sink)


def _f32(a):
    return np.asarray(a, np.float32)


CASES = {
    # name: (make_inputs kwargs, tuning, one split = the reference block order)
    "window 20 + top-k 70 (mixed block)": (dict(), dict(n_splits=1), True),
    "head dim 64, window 8 (tiny layout)": (dict(K=64, Ww=8, k=16), dict(n_splits=1), True),
    "window 128 + top-k 128, 2 blocks each": (dict(K=128, Ww=128, k=128, Nw=130, T=300),
                                              dict(n_splits=1), True),
    "split list, 4 heads per program": (dict(Ww=70, k=130), dict(n_splits=3, block_h=4), False),
    "one chunk of 128 channels, next block's list entries ahead": (
        dict(K=128, Ww=128, k=128, Nw=130, T=300), dict(n_splits=1, n_chunks=1,
                                                        prefetch="index"), True),
    "4 chunks of 32 channels, rows loaded after the scores, splits": (
        dict(Ww=70, k=130), dict(n_splits=3, n_chunks=4, prefetch="late"), False),
    "head dim 64, next block's list entries ahead, splits over a mixed block": (
        dict(K=64, Ww=100, k=200, Nw=120, T=300), dict(n_splits=3, prefetch="index"), False),
    # whole-block lists are read in place (no concatenation); a split starts in each list
    "window 64 + top-k 192 read in place, splits, rows loaded after the scores": (
        dict(K=128, Ww=64, k=192, Nw=80, T=300), dict(n_splits=2, prefetch="late"), False),
    # the softmax's exponentials as exp2(x * log2(e)): on CPU XLA folds that back into exp(x),
    # so these cases check the tuning's plumbing; the GPU's ex2 is checked on the H200
    "exp2 softmax, reference block order": (
        dict(K=128, Ww=128, k=128, Nw=130, T=300), dict(n_splits=1, softmax="exp2"), True),
    "exp2 softmax, splits over a mixed block, merged by the kernel": (
        dict(Ww=70, k=130), dict(n_splits=3, softmax="exp2", merge="triton"), False),
    "splits merged by the kernel": (
        dict(K=128, Ww=64, k=192, Nw=80, T=300), dict(n_splits=4, merge="triton"), False),
    "12 heads in blocks of 4, splits merged by the kernel": (
        dict(H=12, K=64, Ww=20, k=100, Nw=40, T=120), dict(n_splits=2, block_h=4), False),
    # the dequantised rows' kernel (kv="dense"; the default where rows are listed many times)
    "dense rows, reference block order": (dict(), dict(kv="dense", n_splits=1), True),
    "dense rows, whole blocks, 2 chunks, 3 stages": (
        dict(K=128, Ww=128, k=128, Nw=130, T=300),
        dict(kv="dense", n_splits=1, n_chunks=2, num_stages=3), True),
    "dense rows, splits merged by the kernel, 4 heads per program": (
        dict(Ww=70, k=130), dict(kv="dense", n_splits=3, block_h=4), False),
    "dense rows, 12 heads in blocks of 4, splits merged in XLA, exp": (
        dict(H=12, K=64, Ww=20, k=100, Nw=40, T=120),
        dict(kv="dense", n_splits=2, block_h=4, merge="xla", softmax="exp"), False),
    "dense rows by the default rule (40 queries over 50 rows)": (
        dict(S=40, Nw=20, T=30), dict(), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(name):
    kw, tune, bitwise = CASES[name]
    args = make_inputs(**kw)
    o0, l0 = sa.sparse_attention(*args, impl="xla")
    o1, l1 = sa.sparse_attention(*args, impl="gpu_interpret", **tune)
    o0, o1 = _f32(o0), _f32(o1)
    assert (o1[0, 1] == 0).all() and not np.isnan(o1).any()
    np.testing.assert_allclose(np.asarray(l1)[0, 1], np.asarray(args[-1]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-5, atol=1e-5)
    # fp32 summation order may move a bf16(P) rounding: <= 1 ulp of the output plus 2^-8 of
    # the rows' size; in the reference block order nearly every value is bitwise equal
    tol = 2 * np.abs(o0) * 2.0 ** -8 + 2.0 ** -8 * 6.0
    assert (np.abs(o0 - o1) <= tol).all()
    assert (o0 == o1).mean() > (0.99 if bitwise else 0.8)


def test_dense_rows_swa_only_empty_and_rule():
    from pallas_kernels.sparse_attention import triton_dense as td

    q, wkv, wsc, widx, main, msc, topk, sink = make_inputs()
    o0, l0 = sa.sparse_attention(q, wkv, wsc, widx, sink=sink, impl="xla")
    o1, l1 = sa.sparse_attention(q, wkv, wsc, widx, sink=sink, impl="gpu_interpret",
                                 kv="dense", n_splits=1)
    assert (_f32(o0) == _f32(o1)).mean() > 0.99
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-6)
    # no rows at all to decode (empty window rows and main KV) and lists of -1 only: 0, sink
    none = jnp.full_like(widx, -1)
    o2, l2 = sa.sparse_attention(q, wkv[:, :0], wsc[:, :0], none, main[:, :0], msc[:, :0],
                                 jnp.full_like(topk, -1), sink, impl="gpu_interpret",
                                 kv="dense")
    assert (_f32(o2) == 0).all()
    np.testing.assert_allclose(np.asarray(l2), np.broadcast_to(np.asarray(sink), l2.shape),
                               rtol=1e-6)
    # an empty part: its listed entries read zeros (XLA's gather from an empty array), never
    # a row of the other part; as the packed kernel
    for part in ("window", "main"):
        args = [q, wkv, wsc, widx, main, msc, topk, sink]
        if part == "window":
            args[1:3] = wkv[:, :0], wsc[:, :0]
            args[3] = jnp.where(widx >= 0, 0, -1)
        else:
            args[4:6] = main[:, :0], msc[:, :0]
            args[6] = jnp.where(topk >= 0, 0, -1)
        o0, l0 = sa.sparse_attention(*args, impl="xla")
        for kv in ("packed", "dense"):
            o1, l1 = sa.sparse_attention(*args, impl="gpu_interpret", n_splits=1, kv=kv)
            assert (_f32(o0) == _f32(o1)).mean() > 0.99, (part, kv)
            np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-5, atol=1e-5)
    # nothing listed at all (a zero-width window list, no top-k), few programs: 0 and the sink
    o3, l3 = sa.sparse_attention(q, wkv, wsc, widx[..., :0], sink=sink,
                                 impl="gpu_interpret", kv="dense")
    assert (_f32(o3) == 0).all() and o3.shape == q.shape
    np.testing.assert_allclose(np.asarray(l3), np.broadcast_to(np.asarray(sink), l3.shape))
    # the joint list: window rows first, main entries offset past them, -1 kept, padded
    lst = np.asarray(common.joint_list(widx, topk, wkv.shape[1], main.shape[1]))
    assert lst.shape[-1] == 128
    np.testing.assert_array_equal(lst[..., :20], np.asarray(widx))
    want = np.where(np.asarray(topk) >= 0, np.asarray(topk) + 40, -1)
    np.testing.assert_array_equal(lst[..., 20:90], want)
    assert (lst[..., 90:] == -1).all()
    # the rule: rows listed >= MIN_REUSE times on average (prefill), not decode
    assert td.worth_it(4096, 640, 4096 + 4224)               # prefill 4096: ~300 times each
    assert not td.worth_it(256, 640, 256 * (4096 + 129))     # decode B=256: 0.15 times
    assert not td.worth_it(128, 640, 65536 + 256)            # replay of 128 over 64K entries

    def kernels(*a, **kw):
        text = str(jax.make_jaxpr(lambda *x: sa.sparse_attention(*x, **kw))(*a))
        return sorted(set(re.findall(r"csa2_[a-z_]+", text)))
    prefill = make_inputs(S=40, Nw=20, T=30)                 # 40 x 90 entries over 50 rows
    assert kernels(*prefill, impl="gpu_interpret") == ["csa2_merge_splits",
                                                          "csa2_sparse_attention_rows"]
    assert kernels(*prefill, impl="gpu_interpret", kv="packed", n_splits=1) == [
        "csa2_sparse_attention"]
    assert kernels(*make_inputs(), impl="gpu_interpret", n_splits=1) == [
        "csa2_sparse_attention"]
    with pytest.raises(ValueError, match="kv must be one of"):
        sa.sparse_attention(*prefill, impl="gpu_interpret", kv="bf16")
    with pytest.raises(ValueError, match="not with kv='dense'"):
        sa.sparse_attention(*prefill, impl="gpu_interpret", kv="dense", prefetch="index")
    with pytest.raises(ValueError, match="n_chunks"):
        sa.sparse_attention(*prefill, impl="gpu_interpret", kv="dense", n_chunks=3)
    with pytest.raises(ValueError, match="block_h"):
        sa.sparse_attention(*prefill, impl="gpu_interpret", kv="dense", block_h=3)
    kv = td.dense_rows(*prefill[1:3], *prefill[4:6])
    assert kv.shape == (2, 50, 128) and kv.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="power-of-two head dim"):
        td.sparse_attention_rows(jnp.zeros((2, 40, 8, 96), jnp.bfloat16),
                                 jnp.zeros((2, 50, 96), jnp.bfloat16),
                                 jnp.zeros((2, 40, 64), jnp.int32), prefill[7], 0.1)
    with pytest.raises(ValueError, match="whole number of 64-entry blocks"):
        td.sparse_attention_rows(prefill[0], kv, jnp.zeros((2, 40, 70), jnp.int32),
                                 prefill[7], 0.1, interpret=True)


def test_triton_kernel_swa_only_and_empty():
    q, wkv, wsc, widx, *_, sink = make_inputs()
    o0, l0 = sa.sparse_attention(q, wkv, wsc, widx, sink=sink, impl="xla")
    o1, l1 = sa.sparse_attention(q, wkv, wsc, widx, sink=sink, impl="gpu_interpret",
                                 n_splits=1)
    assert (_f32(o0) == _f32(o1)).mean() > 0.99
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-6)
    # an empty main KV (no rows at all) with an unfilled top-k list: the window alone
    main, msc, topk = make_inputs()[4:7]
    o3, l3 = sa.sparse_attention(q, wkv, wsc, widx, main[:, :0], msc[:, :0],
                                 jnp.full_like(topk, -1), sink, impl="gpu_interpret",
                                 n_splits=1)
    assert (_f32(o0) == _f32(o3)).mean() > 0.99
    np.testing.assert_allclose(np.asarray(l3), np.asarray(l0), rtol=1e-6)
    # a whole-block window list (read in place, no top-k list at all), over two splits
    q4, wkv4, wsc4, widx4, *_, sink4 = make_inputs(Ww=128, Nw=140)
    o4, l4 = sa.sparse_attention(q4, wkv4, wsc4, widx4, sink=sink4, impl="xla")
    o5, l5 = sa.sparse_attention(q4, wkv4, wsc4, widx4, sink=sink4, impl="gpu_interpret",
                                 n_splits=2)
    assert (np.abs(_f32(o4) - _f32(o5)) <= 2 * np.abs(_f32(o4)) * 2.0 ** -8 + 2.0 ** -6).all()
    np.testing.assert_allclose(np.asarray(l5), np.asarray(l4), rtol=1e-5, atol=1e-5)
    # a list of -1 only: exactly 0, lse = sink
    o2, l2 = sa.sparse_attention(q, wkv, wsc, jnp.full_like(widx, -1), sink=sink,
                                 impl="gpu_interpret")
    assert (_f32(o2) == 0).all()
    np.testing.assert_allclose(np.asarray(l2), np.broadcast_to(np.asarray(sink), l2.shape),
                               rtol=1e-6)


def test_reference_is_the_spec_formula():
    """o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}), duplicates attended twice (3.8)."""
    args = make_inputs(B=1, S=2, H=4, K=64, Ww=8, k=12, seed=3)
    q, wkv, wsc, widx, main, msc, topk, sink = args
    o, lse = sa.sparse_attention(*args, impl="xla")
    rows = np.concatenate([_f32(sa.dequant_window(wkv, wsc))[0][np.asarray(widx)[0, 1]],
                           _f32(sa.dequant_main(main, msc))[0][np.asarray(topk)[0, 1]]])
    valid = np.concatenate([np.asarray(widx)[0, 1], np.asarray(topk)[0, 1]]) >= 0
    s = _f32(q)[0, 1] @ rows.T * 64 ** -0.5                  # [H, N]
    e = np.where(valid[None], np.exp(s.astype(np.float64)), 0)
    den = e.sum(-1) + np.exp(np.asarray(sink, np.float64))
    want = (e @ rows) / den[:, None]
    np.testing.assert_allclose(_f32(o)[0, 1], want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse)[0, 1], np.log(den), rtol=1e-5)


def test_dispatch_and_errors():
    assert sa.resolve_impl("auto", "cpu") == "xla"
    assert sa.resolve_impl("auto", "gpu") == "gpu"   # every batch size, decode and prefill
    assert sa.resolve_impl("auto", "gpu", heads=64, head_dim=512) == "gpu"
    # shapes the kernel does not tile stay on XLA (8 heads are padded to the 16-row tile)
    assert sa.resolve_impl("auto", "gpu", heads=8, head_dim=64) == "gpu"
    assert sa.resolve_impl("auto", "gpu", heads=24, head_dim=64) == "xla"
    assert sa.resolve_impl("auto", "gpu", heads=64, head_dim=96) == "xla"
    assert sa.resolve_impl("auto", "tpu") == "xla"     # the Mosaic TPU kernel is opt-in
    assert sa.resolve_impl("gpu_interpret", "cpu") == "gpu_interpret"
    assert sa.IMPLS == ("auto", "xla", "gpu", "tpu", "gpu_interpret", "tpu_interpret")
    assert not hasattr(sa, "TRITON_MIN_ROWS")
    args = make_inputs()
    # the names used before raise, naming the family that replaces them
    for old, new in (("triton", "gpu"), ("triton_interpret", "gpu_interpret"),
                     ("mosaic_tpu", "tpu"), ("mosaic_tpu_interpret", "tpu_interpret"),
                     ("mosaic_gpu", "gpu"), ("mosaic_gpu_interpret", "gpu_interpret")):
        with pytest.raises(ValueError, match=f"impl='{old}' is now impl='{new}'"):
            sa.sparse_attention(*args, impl=old)
        with pytest.raises(ValueError, match=f"impl='{old}' is now impl='{new}'"):
            sa.resolve_impl(old)
    with pytest.raises(ValueError, match="kernel / kv choose among the GPU kernels"):
        sa.sparse_attention(*args, impl="tpu_interpret", kernel="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        sa.sparse_attention(*args, impl="cuda")
    if jax.default_backend() == "cpu":   # (no GPU: a clear error, not Pallas' own)
        with pytest.raises(ValueError, match="needs a GPU backend"):
            sa.sparse_attention(*args, impl="gpu")
    with pytest.raises(ValueError, match="win_idx"):
        sa.sparse_attention(*args[:3], args[3].astype(jnp.int16), *args[4:], impl="xla")
    with pytest.raises(ValueError, match="main_scale"):
        sa.sparse_attention(*args[:5], args[5][:, :, :4], *args[6:], impl="xla")
    with pytest.raises(ValueError, match="q"):
        sa.sparse_attention(args[0].astype(jnp.float32), *args[1:], impl="xla")
    with pytest.raises(ValueError, match="block_h"):
        sa.sparse_attention(*args, impl="gpu_interpret", block_h=3)
    with pytest.raises(ValueError, match="n_chunks"):
        sa.sparse_attention(*args, impl="gpu_interpret", n_chunks=3)
    with pytest.raises(ValueError, match="n_chunks"):   # chunks of 16 channels: K=128 / 8
        sa.sparse_attention(*args, impl="gpu_interpret", n_chunks=8)
    with pytest.raises(ValueError, match="dequant"):
        sa.sparse_attention(*args, impl="gpu_interpret", dequant="lut")
    with pytest.raises(ValueError, match="prefetch"):
        sa.sparse_attention(*args, impl="gpu_interpret", prefetch="early")
    with pytest.raises(ValueError, match="softmax"):
        sa.sparse_attention(*args, impl="gpu_interpret", softmax="exp10")
    with pytest.raises(ValueError, match="merge"):
        sa.sparse_attention(*args, impl="gpu_interpret", n_splits=2, merge="tree")
    with pytest.raises(ValueError, match="tuning"):
        sa.sparse_attention(*args, impl="xla", n_splits=2)
    # a bad tuning name is refused even when the lists are empty (the kernel's early return)
    empty = (*args[:3], jnp.full_like(args[3][..., :0], -1), *args[4:6], None, args[7])
    with pytest.raises(ValueError, match="softmax"):
        sa.sparse_attention(*empty, impl="gpu_interpret", softmax="exp10")


def test_model_with_kernels_matches_xla_path(tiny_a, monkeypatch):
    """prefill + decode with the Triton kernels (sparse attention and FP4 state writes) in
    interpret mode: the FP4 caches bitwise equal, the logits within bf16 reordering noise.
    Twice: with the rule's choice (the packed rows' kernel at these sizes: each row is listed
    about 4 times), and with the dequantised rows' kernel forced on every call
    (``MIN_REUSE = 0``; a capacity of its own, so that no earlier trace is reused)."""
    from pallas_kernels.sparse_attention import triton_dense as td

    cfg, params, _ = tiny_a
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 24)).astype(np.int32)
    lengths = np.array([24, 17])
    dense_calls = []
    rows_kernel = td.sparse_attention_rows

    def counted(*a, **kw):
        dense_calls.append(1)
        return rows_kernel(*a, **kw)
    monkeypatch.setattr(td, "sparse_attention_rows", counted)

    def run(impl, capacity, min_reuse):
        monkeypatch.setattr(td, "MIN_REUSE", min_reuse)
        state = dsv.init_state(cfg, 2, capacity)
        out, state = dsv.prefill(params, cfg, tokens, state, lengths, mode="exact",
                                 attn_impl=impl)
        logits = [np.asarray(out.logits)]
        kv_after_prefill = {k: np.asarray(v.main) for k, v in state.sources.items()}
        nxt = logits[-1].argmax(-1)
        lg, state = dsv.decode_step(params, cfg, state, nxt, attn_impl=impl)
        logits.append(np.asarray(lg))
        return logits, kv_after_prefill

    la, kva = run("xla", 32, 8)
    first = min(kva)
    for capacity, min_reuse, dense in ((32, 8, False), (40, 0, True)):
        dense_calls.clear()
        lb, kvb = run("gpu_interpret", capacity, min_reuse)
        assert bool(dense_calls) == dense
        assert np.array_equal(kva[first][:, :kvb[first].shape[1]],
                              kvb[first][:, :kva[first].shape[1]])   # identical inputs
        for a, b in zip(la, lb):
            scale = np.abs(a).max()
            assert np.abs(a - b).max() <= 0.05 * scale
            assert (a.argmax(-1) == b.argmax(-1)).all()


def test_triton_kernel_clamps_indices_past_the_end():
    """An index past the end reads the last row, as the XLA path's gather does."""
    q, wkv, wsc, widx, main, msc, topk, sink = make_inputs()
    widx = widx.at[:, :, 3].set(wkv.shape[1] + 5)
    topk = topk.at[:, :, 7].set(main.shape[1] + 9)
    args = (q, wkv, wsc, widx, main, msc, topk, sink)
    o0, _ = sa.sparse_attention(*args, impl="xla")
    for kv in ("packed", "dense"):
        o1, _ = sa.sparse_attention(*args, impl="gpu_interpret", n_splits=1, kv=kv)
        assert (_f32(o0) == _f32(o1)).mean() > 0.99
        np.testing.assert_allclose(_f32(o1), _f32(o0), atol=0.07)


@pytest.mark.parametrize("softmax", ["exp", "exp2"])
def test_merge_kernel_matches_xla_merge(softmax):
    """The split merge kernel vs its XLA reference: a split with no entries (m = -1e30, l = 0)
    adds nothing, a row whose splits are all empty gives o = 0 and lse = sink."""
    from pallas_kernels.sparse_attention import triton as tk
    R, P, H, K = 3, 5, 16, 256
    rng = np.random.default_rng(1)
    acc = rng.normal(size=(R, P, H, K)).astype(np.float32)
    m = (rng.normal(size=(R, P, H)) * 3).astype(np.float32)
    l = rng.uniform(1, 5, size=(R, P, H)).astype(np.float32)
    acc[0, 2], m[0, 2], l[0, 2] = 0, -1e30, 0
    acc[1], m[1], l[1] = 0, -1e30, 0
    sink = rng.normal(size=(H,)).astype(np.float32)
    args = [jnp.asarray(a) for a in (acc, m, l, sink)]
    o0, l0 = tk.merge_splits_xla(*args, softmax=softmax)
    o1, l1 = tk.merge_splits(*args, softmax=softmax, interpret=True)
    o0, o1 = _f32(o0), _f32(o1)
    assert (o1[1] == 0).all()
    np.testing.assert_allclose(np.asarray(l1)[1], sink, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-6, atol=1e-6)
    # the fp32 sums of the splits may round differently: within one bf16 ulp
    assert (np.abs(o1 - o0) <= np.abs(o0) * 2.0 ** -7 + 1e-6).all()
    assert (o1 == o0).mean() > 0.99
    with pytest.raises(ValueError, match="block_k"):
        tk.merge_splits(*args, block_k=96, interpret=True)
    with pytest.raises(ValueError, match="block_h"):
        tk.merge_splits(*args, block_h=0, interpret=True)
    with annotations_unchecked(), pytest.raises(ValueError, match="sink"):
        tk.merge_splits(*args[:3], args[3][:4], interpret=True)


def test_merge_kernel_small_blocks_and_extreme_sinks():
    """Heads / channels below the block sizes, an odd split count and sinks far above and
    below the scores: the kernel equals its reference, no inf or NaN."""
    from pallas_kernels.sparse_attention import triton as tk
    R, P, H, K = 2, 3, 4, 64
    rng = np.random.default_rng(2)
    acc = jnp.asarray(rng.normal(size=(R, P, H, K)), jnp.float32)
    m = jnp.asarray(rng.normal(size=(R, P, H)) * 5, jnp.float32)
    l = jnp.asarray(rng.uniform(1, 5, size=(R, P, H)), jnp.float32)
    sink = jnp.asarray([200.0, -200.0, 0.0, 3.0], jnp.float32)
    o0, l0 = tk.merge_splits_xla(acc, m, l, sink)
    o1, l1 = tk.merge_splits(acc, m, l, sink, interpret=True)
    assert np.isfinite(_f32(o1)).all() and np.isfinite(np.asarray(l1)).all()
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-6)
    assert (np.abs(_f32(o1) - _f32(o0)) <= np.abs(_f32(o0)) * 2.0 ** -7 + 1e-30).all()
    assert (_f32(o1)[:, 0] == 0).all()   # the sink takes all the weight (e^(sink - m) = inf)
