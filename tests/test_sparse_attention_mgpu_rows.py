"""The warp-specialised Mosaic GPU rows' kernel (``mosaic_gpu_rows``): Mosaic GPU interpret mode
on CPU against the XLA reference (its consumers, barriers and tiles; the producer copies rows by
TMA there), the ``cp.async`` producer's swizzled addresses against Mosaic GPU's own swizzle, the
CUDA lowering of the GPU build (``jax.export``: layouts, wgmma operands, the shared-memory
budget) and how ``sparse_attention`` picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import common
from pallas_kernels.sparse_attention import gpu
from pallas_kernels.sparse_attention import mosaic_gpu_rows as mr
from pallas_kernels.sparse_attention import triton as tk
from pallas_kernels.sparse_attention import triton_dense as td
from pallas_kernels.sparse_attention.reference import sparse_attention_xla
from test_sparse_attention import make_inputs

H, K = 64, 512
SCALE = K ** -0.5


def _reset_interpreter():
    """After an exception in GPU interpret mode its state must be reset (InterpretGPUParams)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _compare(o1, l1, o0, l0, bitwise_frac=0.99):
    assert not np.isnan(o1).any()
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-5)
    # fp32 summation order may move a bf16(P) rounding: <= 1 ulp of the output plus 2^-8 of
    # the rows' size (as tests/test_sparse_attention.py); nearly every value is bitwise equal
    tol = 2 * np.abs(o0) * 2.0 ** -8 + 2.0 ** -8 * 6.0
    assert (np.abs(o0 - o1) <= tol).all()
    assert (o0 == o1).mean() > bitwise_frac


def _rows_and_list(args, topk_none=False):
    q, wkv, wsc, widx, main, msc, topk, sink = args
    if topk_none:
        main = msc = topk = None
    kv = td.dense_rows(wkv, wsc, main, msc)
    return kv, common.joint_list(widx, topk, wkv.shape[1], 0 if main is None else main.shape[1])


def _run(args, topk_none=False, **kw):
    kv, rows = _rows_and_list(args, topk_none)
    try:
        o1, l1 = mr.sparse_attention_rows(args[0], kv, rows, args[-1], SCALE, interpret=True,
                                          **kw)
    except Exception:
        _reset_interpreter()
        raise
    ref = list(args)
    if topk_none:
        ref[4:7] = [None, None, None]
    o0, l0 = sparse_attention_xla(*ref, SCALE)
    return (np.asarray(o1, np.float32), np.asarray(l1), np.asarray(o0, np.float32),
            np.asarray(l0))


CASES = {
    # name: make_inputs kwargs (B=1, S=2; query (0, 1) has no entry at all)
    "window 20 + top-k 70: one list of 2 blocks": dict(Ww=20, k=70),
    "window 128 + top-k 200: 6 blocks, both tiles reused, > 256 list entries": dict(
        Ww=128, k=200, Nw=130),
    "one block (window 20 + top-k 8)": dict(Ww=20, k=8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rows_kernel_interpret_matches_reference(name):
    args = make_inputs(**{"B": 1, "S": 2, "H": H, "K": K, "Nw": 70, "T": 150, "seed": 1,
                          **CASES[name]})
    o1, l1, o0, l0 = _run(args)
    assert (o1[0, 1] == 0).all()                        # no valid entry: o = 0, lse = sink
    np.testing.assert_allclose(l1[0, 1], np.asarray(args[-1]), rtol=1e-6)
    _compare(o1, l1, o0, l0)


def test_rows_kernel_swa_only_clamped_and_exp():
    """A SWA-only list, entries past the end (they read the last row, as XLA's gather) and the
    ``exp`` softmax; a batch of 2 (each query gathers from its own batch row)."""
    args = list(make_inputs(B=2, S=2, H=H, K=K, Nw=70, T=150, Ww=40, k=8, seed=2))
    args[3] = args[3].at[:, :, 3].set(args[1].shape[1] + 5)
    _compare(*_run(tuple(args), topk_none=True, softmax="exp"))


@pytest.mark.parametrize("kw, n_splits", [
    (dict(Ww=20, k=150), 2),     # 3 blocks: splits of 2 and 1 (the last padded with -1)
    (dict(Ww=20, k=70), 4),      # cut to one split per block
])
def test_rows_kernel_list_splits(kw, n_splits):
    """List splits: one CTA per (query row, split) writes its fp32 partial state straight
    from registers, merged by ``triton.merge_splits``; the query without entries stays 0."""
    assert mr.balanced_splits(2, 3) == 2 and mr.balanced_splits(4, 10) == 4
    assert mr.balanced_splits(3, 10) == 3 and mr.balanced_splits(7, 10) == 5
    args = make_inputs(B=1, S=2, H=H, K=K, Nw=70, T=150, seed=1, **kw)
    o1, l1, o0, l0 = _run(args, n_splits=n_splits)
    assert (o1[0, 1] == 0).all()
    np.testing.assert_allclose(l1[0, 1], np.asarray(args[-1]), rtol=1e-6)
    _compare(o1, l1, o0, l0, bitwise_frac=0.8)    # (a different summation order)


@pytest.mark.annotations_unchecked   # the functions' own ValueErrors
def test_rows_kernel_rejects_bad_input():
    args = make_inputs(B=1, S=2, H=H, K=K, Nw=70, T=150, Ww=8, k=8)
    kv, rows = _rows_and_list(args)
    q, sink = args[0], args[-1]
    with pytest.raises(ValueError, match="q: "):
        mr.sparse_attention_rows(q[:, :, :32], kv, rows, sink[:32], SCALE)
    with pytest.raises(ValueError, match="whole number"):
        mr.sparse_attention_rows(q, kv, rows[..., :60], sink, SCALE)
    with pytest.raises(ValueError, match="at most"):
        long = jnp.zeros((1, 2, mr.MAX_LIST + 64), jnp.int32)
        mr.sparse_attention_rows(q, kv, long, sink, SCALE)
    with pytest.raises(ValueError, match="kv: "):
        mr.sparse_attention_rows(q, kv[:, :0], rows, sink, SCALE)
    with pytest.raises(ValueError, match="softmax"):
        mr.sparse_attention_rows(q, kv, rows, sink, SCALE, softmax="exp3")


def test_tile_byte_offset_is_mosaic_swizzle():
    """The producer's address of every 16-byte chunk of a [64, 512] bf16 tile equals the one
    Mosaic GPU's transfers compute for the same (8, SWIZZLE / 2) tiling and swizzle: the
    unswizzled tiled offset, its 16-byte chunk index XORed with ``(offset // 128) mod
    (SWIZZLE / 16)`` (fragmented_array's swizzle), and each chunk lands once."""
    sw = mr.SWIZZLE
    r, c = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    col = c * 8                                         # first bf16 column of the chunk
    plain = (((r // 8) * (1024 // sw) + col // (sw // 2)) * 8 * sw + (r % 8) * sw
             + (col % (sw // 2)) * 2)
    want = plain ^ (((plain // 128) % (sw // 16)) * 16)
    got = mr.tile_byte_offset(r, c)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) == 64 * 64 and got.max() < 64 * 1024 and (got % 16 == 0).all()


@pytest.mark.parametrize("L, n_splits", [(128, 1), (640, 1), (mr.MAX_LIST, 1), (640, 10),
                                         (mr.MAX_LIST, 3)])
def test_rows_kernel_lowers_for_cuda(L, n_splits):
    """The GPU build (the cp.async producer, wgmma operands from shared memory, in-place PV
    accumulation, 3 warp groups) goes through Mosaic GPU's lowering and shared-memory budget:
    the release list (640) and the longest that fits."""
    structs = [jax.ShapeDtypeStruct((2, 3, H, K), jnp.bfloat16),
               jax.ShapeDtypeStruct((2, 1000, K), jnp.bfloat16),
               jax.ShapeDtypeStruct((2, 3, L), jnp.int32), jax.ShapeDtypeStruct((H,), jnp.float32)]
    f = jax.jit(lambda *a: mr.sparse_attention_rows(*a, SCALE, n_splits=n_splits))
    text = _export_h200(f, structs).mlir_module()
    assert "mosaic_gpu" in text
    assert ("csa2_merge_splits" in text) == (n_splits > 1)


def _export_h200(f, structs):
    """``jax.export`` of ``f`` for an H200 on CPU (the split merge is a Triton kernel: an H200
    target and its custom call allowed)."""
    from unittest import mock
    from jax._src.pallas.triton import gpu_info
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200):
        return jax.export.export(f, platforms=["cuda"], disabled_checks=skip)(*structs)


def test_rule_and_dispatch():
    """``gpu.rows_kernel`` picks the Mosaic GPU kernel for the release's 64 x 512
    heads when one program per query fills the GPU and the list fits; Triton otherwise, and
    whenever Triton tunings are given; the keyword's errors."""
    assert gpu.rows_kernel(4096, 64, 10, 512) == "mosaic_gpu"
    assert gpu.rows_kernel(8, 64, 10, 512) == "triton"          # list splits
    assert gpu.rows_kernel(4096, 8, 10, 64) == "triton"          # tiny heads
    assert gpu.rows_kernel(4096, 64, mr.MAX_LIST // 64 + 1, 512) == "triton"
    args = make_inputs(B=1, S=2, H=H, K=K, Nw=70, T=150, Ww=24, k=16, seed=3)
    o1, l1 = gpu.sparse_attention(*args, SCALE, interpret=True, kv="dense", kernel="mosaic_gpu")
    kv, rows = _rows_and_list(args)
    o2, l2 = mr.sparse_attention_rows(args[0], kv, rows, args[-1], SCALE, interpret=True)
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    with pytest.raises(ValueError, match="GPU only"):
        gpu.sparse_attention(*args, SCALE, interpret=True, kv="packed", kernel="mosaic_gpu")
    with pytest.raises(ValueError, match="softmax and n_splits only"):
        gpu.sparse_attention(*args, SCALE, kv="packed", kernel="mosaic_gpu", n_chunks=2)
    with pytest.raises(ValueError, match="not with kernel='mosaic_gpu'"):
        gpu.sparse_attention(*args, SCALE, interpret=True, kv="dense", kernel="mosaic_gpu",
                            num_stages=2)
    with pytest.raises(ValueError, match="n_splits must be"):
        mr.sparse_attention_rows(args[0], kv, rows, args[-1], SCALE, interpret=True, n_splits=0)
    with pytest.raises(ValueError, match="n_splits must be"):   # (not the default instead)
        gpu.sparse_attention(*args, SCALE, kv="packed", kernel="mosaic_gpu", n_splits=0)
    with pytest.raises(ValueError, match="kernel must be"):
        gpu.sparse_attention(*args, SCALE, interpret=True, kv="dense", kernel="cuda")


def test_rule_needs_hopper(monkeypatch):
    """Not on another GPU generation (no sm_90 wgmma / register split there): Triton."""
    class FakeGPU:
        platform = "gpu"

        def __init__(self, cc):
            self.compute_capability = cc
    for cc, kernel in (("8.0", "triton"), ("10.0", "triton"), ("9.0", "mosaic_gpu")):
        monkeypatch.setattr(jax, "devices", lambda cc=cc: [FakeGPU(cc)])
        assert gpu.rows_kernel(4096, 64, 10, 512) == kernel


# ----------------------------------------------------------------------------- packed producer


def _pair(fmt, a: int, b: int, scale_bits: int) -> tuple[float, float]:
    """The packed producer's decode of one channel pair: ``triton.decode_ptx(fmt, 0, 0)`` on
    the words ``a`` and ``b`` (each pair's code in byte 0) and one scale, CPU-emulated."""
    import ptx_emu
    out = int(ptx_emu.run_ptx(common.decode_ptx(fmt, 0, 0).replace("$0", "out").replace(
        "$1", "a").replace("$2", "b").replace("$3", "s").replace("$4", "s"),
        {"a": a & 0xFFFFFFFF, "b": b & 0xFFFFFFFF, "s": scale_bits, "out": 0})["out"])
    return (float(ptx_emu.bf16_values(out & 0xFFFF)), float(ptx_emu.bf16_values(out >> 16)))


def test_packed_producer_pairs_are_channel_order():
    """The producer's shifts put adjacent channels in each bf16 pair: a main-KV word (8 e2m1
    codes, channel 2k in byte k's low nibble) as (byte k, byte k >> 4), a window word (4 e4m3
    codes) as (w, w >> 8) and (w >> 16, w >> 24); exact for every byte value."""
    import ml_dtypes
    from pallas_kernels.sparse_attention.reference import E2M1_LUT
    s = int(np.array([0.375], ml_dtypes.bfloat16).view(np.uint16)[0])
    words = [b * 0x01010101 ^ 0x0F1E2D3C for b in range(256)] + [0x12345678, 0xFEDCBA98]
    for w in words:
        for k in range(4):
            byte = w >> (8 * k)
            got = _pair("e2m1", byte, byte >> 4, s)
            want = tuple(float(E2M1_LUT[(w >> (8 * k + 4 * h)) & 15]) * 0.375 for h in (0, 1))
            assert got == want
        codes = [(w >> (8 * k)) & 0xFF for k in range(4)]
        if any(c & 0x7F == 0x7F for c in codes):        # the NaN code: never in the state
            continue
        vals = np.array(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        u = 130                                          # E8M0 scale 2^3: bits u << 7
        got = _pair("e4m3", w, w >> 8, u << 7) + _pair("e4m3", w >> 16, w >> 24, u << 7)
        assert got == tuple(float(v) * 8.0 for v in vals)


@pytest.mark.parametrize("ww, k, swa_only, n_splits", [
    (128, 512, False, 1), (128, 512, False, 10), (128, 512, False, 3), (20, 70, False, 1),
    (20, 70, False, 2), (128, 0, True, 1)])
def test_packed_kernel_lowers_for_cuda(ww, k, swa_only, n_splits):
    """The decoding producer's GPU build (its PTX loads, L2 prefetches, decode and swizzled
    stores per kind of block, the window / main choice per row of a mixed block) goes through
    Mosaic GPU's lowering: the release decode list (read as two lists, block by block, also
    with splits; 3 splits do not divide its 10 blocks: the joint list), a mixed block and a
    SWA-only layer. (ptxas runs on the GPU only: the H200 check covers it.)"""
    B, S, Nw, T = 2, 3, 129, 1000
    structs = [jax.ShapeDtypeStruct(sh, d) for sh, d in [
        ((B, S, H, K), jnp.bfloat16), ((B, Nw, K), jnp.float8_e4m3fn),
        ((B, Nw, K // 32), jnp.uint8),
        ((B, S, ww), jnp.int32), ((B, T, K // 2), jnp.uint8), ((B, T, K // 16), jnp.float8_e4m3fn),
        ((B, S, max(k, 1)), jnp.int32), ((H,), jnp.float32)]]
    if swa_only:
        f = lambda q, a, b, c, m, ms, t, s: mr.sparse_attention_packed(  # noqa: E731
            q, a, b, c, None, None, None, s, SCALE, n_splits=n_splits)
    else:
        f = lambda *a: mr.sparse_attention_packed(*a, SCALE, n_splits=n_splits)  # noqa: E731
    text = _export_h200(jax.jit(f), structs).mlir_module()
    assert "csa2_sparse_attention_packed_mgpu" in text
    assert ("csa2_merge_splits" in text) == (n_splits > 1)
    assert ("concatenate" in text) == (ww % 64 != 0 or n_splits == 3)   # the joint list


def test_block_kinds():
    """The producer's kind of each block of the joint list, by position."""
    assert [mr.block_kind(j, 128) for j in range(4)] == ["window", "window", "main", "main"]
    assert [mr.block_kind(j, 20) for j in range(3)] == ["mixed", "main", "main"]
    assert [mr.block_kind(j, 100) for j in range(3)] == ["window", "mixed", "main"]


def test_packed_producer_scales_e4m3x2():
    """The main-KV scale pair (two E4M3 bytes read as one 16-bit word) -> two bf16 values,
    exactly, for every pair of byte values but the NaN code."""
    import ml_dtypes
    import ptx_emu
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint32)
    lo, hi = np.meshgrid(codes, codes)
    lo, hi = lo.ravel(), hi.ravel()
    asm = mr._E4M3X2_TO_BF16.replace("$0", "o0").replace("$1", "o1").replace("$2", "w")
    r = ptx_emu.run_ptx(asm, {"w": lo | hi << 8, "o0": 0, "o1": 0})
    for out, c in ((r["o0"], lo), (r["o1"], hi)):
        want = c.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        np.testing.assert_array_equal(ptx_emu.bf16_values(out), want)


@pytest.mark.annotations_unchecked   # the functions' own ValueErrors
def test_packed_kernel_rejects_long_lists():
    args = list(make_inputs(B=1, S=2, H=H, K=K, Nw=70, T=150, Ww=8, k=8))
    args[6] = jnp.zeros((1, 2, mr.MAX_LIST), jnp.int32)
    with pytest.raises(ValueError, match="win_idx \\+ topk"):
        mr.sparse_attention_packed(*args, SCALE)
    args[6] = jnp.zeros((1, 2, 8), jnp.int32)
    with pytest.raises(ValueError, match="H == 64"):
        mr.sparse_attention_packed(args[0][:, :, :32], *args[1:7], args[7][:32], SCALE)


def test_packed_rule():
    """``gpu.packed_kernel`` picks the decoding Mosaic GPU kernel for 64 x 512 heads from
    8 query rows on (with list splits below 128: one block each at B=8, two halves at B=64),
    Triton's packed kernel for B=1 and for other heads."""
    for rows, n_splits in ((256, 1), (128, 1), (64, 2), (8, 10), (12, 10)):
        tune = tk.default_tuning(rows, 64, 10, 512)
        assert (gpu.packed_kernel(rows, 64, 10, 512), tune["n_splits"], tune["block_h"]) == (
            "mosaic_gpu", n_splits, 64)
    assert gpu.packed_kernel(1, 64, 10, 512) == "triton"
    assert gpu.packed_kernel(1, 64, 1, 512) == "triton"        # one block, one CTA
    assert gpu.rows_kernel(1, 64, 1, 512) == "triton"
    assert gpu.packed_kernel(256, 16, 10, 128) == "triton"
