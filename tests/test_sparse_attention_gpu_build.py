"""The GPU build of the Triton kernel, checked on CPU: it lowers to Triton IR for an H200
(Python-side errors of the non-interpret path surface here, not only on the device), and the
PTX of the ``dequant="asm"`` decode (the default) gives the exact e2m1/e4m3 values (the
templates' instructions are emulated bit by bit)."""

from __future__ import annotations

import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import ptx_emu
import pytest
from tools_util import load_tool
from jax._src.pallas.triton import gpu_info

from pallas_kernels.sparse_attention import common
from pallas_kernels.sparse_attention import gpu
from pallas_kernels.sparse_attention.reference import E2M1_LUT


def _release_inputs(B, S, T, Nw, Ww, k, H=64, K=512):
    """Release dimensions (64 heads x 512), zero-filled: only shapes and dtypes matter here."""
    return (jnp.zeros((B, S, H, K), jnp.bfloat16), jnp.zeros((B, Nw, K), jnp.float8_e4m3fn),
            jnp.zeros((B, Nw, K // 32), jnp.uint8), jnp.zeros((B, S, Ww), jnp.int32),
            jnp.zeros((B, T, K // 2), jnp.uint8), jnp.zeros((B, T, K // 16), jnp.float8_e4m3fn),
            jnp.zeros((B, S, k), jnp.int32), jnp.zeros((H,), jnp.float32))


@pytest.mark.parametrize("rows, tune, kernels", [
    # default: the Mosaic GPU kernel with its decoding producer, 10 list splits,
    # merged by the split merge kernel; Triton's: 64 heads, 10 splits, PTX decode
    ("decode B=8", {}, ["mosaic_gpu:packed", "csa2_merge_splits"]),
    ("decode B=8", {"kernel": "triton"}, ["csa2_sparse_attention", "csa2_merge_splits"]),
    ("decode B=8", {"dequant": "jnp", "softmax": "exp", "merge": "xla"},
     ["csa2_sparse_attention"]),
    # prefill: the rows are listed ~100 times each, so the default decodes them once and runs
    # a dequantised rows' kernel (kv="dense"): at 64 heads x 512 the warp-specialised Mosaic
    # GPU one, the Triton one on request or when Triton tunings are given; the
    # packed rows' kernel on request
    ("prefill 256", {}, ["mosaic_gpu:rows"]),
    ("prefill 256", {"kv": "dense", "kernel": "triton"}, ["csa2_sparse_attention_rows"]),
    ("prefill 256", {"kv": "dense", "n_chunks": 2, "num_stages": 3},
     ["csa2_sparse_attention_rows"]),
    ("decode B=8", {"kv": "dense"}, ["csa2_sparse_attention_rows", "csa2_merge_splits"]),
    # the packed rows with >= 128 programs of 64 x 512 heads: the Mosaic GPU kernel with the
    # decoding producer; Triton's packed kernel on request or with its tunings
    ("prefill 256", {"kv": "packed"}, ["mosaic_gpu:packed"]),
    ("prefill 256", {"kv": "packed", "kernel": "triton"}, ["csa2_sparse_attention"]),
    ("decode B=4 S=3", {"kv": "packed", "kernel": "mosaic_gpu"},
     ["mosaic_gpu:packed", "csa2_merge_splits"]),
    ("decode B=4 S=3", {"kv": "packed", "kernel": "mosaic_gpu", "n_splits": 1},
     ["mosaic_gpu:packed"]),
    ("prefill 256", {"kv": "packed", "n_chunks": 2, "prefetch": "late"},
     ["csa2_sparse_attention"]),
    ("prefill 256", {"kv": "packed", "n_chunks": 1, "prefetch": "index", "num_stages": 2},
     ["csa2_sparse_attention"]),
    ("decode B=4 S=3", {"n_splits": 1, "dequant": "asm", "block_h": 64},
     ["csa2_sparse_attention"]),
    # heads padded to the 16-row tile; one list block, so no splits
    ("tiny-a shapes, 8 heads x 64", {"kv": "packed"}, ["csa2_sparse_attention"]),
    ("tiny-a shapes, 8 heads x 64", {}, ["csa2_sparse_attention_rows"]),
])
def test_gpu_kernel_lowers_for_h200(rows, tune, kernels):
    shapes = {"decode B=8": (8, 1, 1024, 129, 128, 512),
              "prefill 256": (1, 256, 1024, 384, 128, 512),
              "decode B=4 S=3": (4, 3, 1024, 131, 128, 512),
              "tiny-a shapes, 8 heads x 64": (2, 24, 32, 56, 24, 16, 8, 64)}[rows]
    args = _release_inputs(*shapes)
    f = jax.jit(functools.partial(gpu.sparse_attention, scale=512 ** -0.5, **tune))
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200):
        exported = jax.export.export(f, platforms=["cuda"], disabled_checks=skip)(*args)
    text = exported.mlir_module()
    triton = [k for k in kernels if not k.startswith("mosaic_gpu")]
    assert text.count("__gpu$xla.gpu.triton") == len(triton)
    assert re.findall(r'name = "(csa2_[a-z_]+)"', text) == triton
    mosaic = [k.split(":")[1] for k in kernels if k.startswith("mosaic_gpu")]
    assert text.count("@mosaic_gpu_v2") == len(mosaic)   # (by name in the serialised module)
    for kind in ("rows", "packed"):
        assert (f"csa2_sparse_attention_{kind}_mgpu" in text) == (kind in mosaic)
    assert [o.shape for o in exported.out_avals] == [args[0].shape, args[0].shape[:3]]


# ----------------------------------------------------------------------------- PTX emulation


def _bf16_value(bits) -> float:
    """Exact value of bf16 bits, subnormals included."""
    return float(ptx_emu.bf16_values(bits))


def _bf16_bits(x: float) -> int:
    return int(ptx_emu.bf16_bits(x))


def _run_ptx(asm: str, regs: dict) -> dict:
    return {k: int(v) for k, v in ptx_emu.run_ptx(asm, regs).items()}


def _template(fmt, byte, shift):
    return (common.decode_ptx(fmt, byte, shift).replace("$0", "out").replace("$1", "w0")
            .replace("$2", "w1").replace("$3", "s0").replace("$4", "s1"))


def test_asm_e2m1_decode_is_exact():
    rng = np.random.default_rng(0)
    scales = [0.001953125, 0.375, 1.0, 448.0]                     # e4m3 values, incl. 2^-9
    # random words, then every byte value in every byte of both words (all nibble pairs)
    words = [tuple(int(x) for x in rng.integers(0, 2 ** 32, 2, dtype=np.uint64))
             for _ in range(40)]
    words += [(b * 0x01010101, ((37 * b + 11) & 255) * 0x01010101) for b in range(256)]
    for w0, w1 in words:
        s0, s1 = (_bf16_bits(float(x)) for x in rng.choice(scales, 2))
        for c in range(8):        # nibble c of each word (as the kernel's main_chunk calls it)
            out = _run_ptx(_template("e2m1", c // 2, 4 * (c % 2)),
                           {"w0": w0, "w1": w1, "s0": s0, "s1": s1})["out"]
            for half, w, s in ((out & 0xFFFF, w0, s0), (out >> 16, w1, s1)):
                want = float(E2M1_LUT[(w >> 4 * c) & 15]) * _bf16_value(s)
                assert _bf16_value(half) == want


def test_asm_e4m3_decode_is_exact():
    rng = np.random.default_rng(1)
    words = [tuple(int(x) for x in rng.integers(0, 2 ** 32, 2, dtype=np.uint64))
             for _ in range(40)]
    words += [(b * 0x01010101, ((37 * b + 11) & 255) * 0x01010101) for b in range(256)]
    for w0, w1 in words:
        u0, u1 = (int(x) for x in rng.integers(100, 150, 2))       # E8M0 scale bytes
        for k in range(4):        # byte k of each word
            out = _run_ptx(_template("e4m3", k, 0),
                           {"w0": w0, "w1": w1, "s0": u0 << 7, "s1": u1 << 7})["out"]
            for half, w, u in ((out & 0xFFFF, w0, u0), (out >> 16, w1, u1)):
                code = (w >> 8 * k) & 0xFF
                if code & 0x7F == 0x7F:      # the NaN code: the state never holds it
                    continue
                e4m3 = float(np.array([code], np.uint8).view(ml_dtypes.float8_e4m3fn)[0])
                assert _bf16_value(half) == e4m3 * 2.0 ** (u - 127)


# ----------------------------------------------------------------------------- resource report


def test_triton_report_lowers_the_chunked_kernel():
    """tools/triton_report.py's lowering (the part that needs no standalone triton): the
    kernel's Triton IR has a score and a PV product per chunk and phase (2 phases x 8 chunks x
    2 at the release dims). Each chunk's decode is emitted for both; Triton's CSE merges them
    (with triton 3.6: 96 of the 192 inline-asm decodes remain after the TTIR passes, and one
    shared-memory tile per chunk and phase feeds both products)."""
    report = load_tool("triton_report")
    packed = {"kv": "packed"}
    ttir = report.lower_to_ttir("prefill", packed)
    assert ttir.count("tt.dot ") == 2 * 8 * 2
    assert report.lower_to_ttir("prefill", {**packed, "n_chunks": 2}).count("tt.dot ") == 2 * 2 * 2
    assert report.num_warps_of("prefill", packed) == (8, 1)
    # the prefill row's default is the dequantised rows' kernel: one score and one PV product
    # per block over the whole 512-channel tile, the rows staged one block ahead
    dense = report.lower_to_ttir("prefill", {})
    assert "@csa2_sparse_attention_rows" in dense and dense.count("tt.dot ") == 2
    assert report.is_dense("prefill", {}) and not report.is_dense("decode B=8", {})
    assert report.num_warps_of("prefill", {}) == (8, 2)
    # with list splits the row also runs the split merge kernel: the report is the attention's
    split = report.lower_to_ttir("decode B=8", {})
    assert "@csa2_sparse_attention" in split and "@csa2_merge_splits" not in split
    # the GPU build's exponentials: exp2f by default, libdevice expf with softmax="exp" (on CPU
    # XLA folds exp2(x log2 e) into exp(x), so only the GPU build shows the difference)
    assert split.count("__nv_exp2f") > 0 and "__nv_expf" not in split
    libdevice = report.lower_to_ttir("decode B=8", {"softmax": "exp"})
    assert libdevice.count("__nv_expf") > 0 and "__nv_exp2f" not in libdevice
    with pytest.raises(ValueError, match="n_chunks"):
        report.lower_to_ttir("decode B=8", {"n_chunks": 32})
