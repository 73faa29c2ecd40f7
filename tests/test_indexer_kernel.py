"""The indexer-scores kernel (pallas_kernels.indexer) against the formula of
docs/architecture.md, "Indexer", in float64, its dispatch and errors, and its GPU build lowered
on CPU for an H200."""

from __future__ import annotations

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import gpu_info

from conftest import annotations_unchecked
from dsv41_jax import quant
from dsv41_jax import state as st
from pallas_kernels import indexer as pidx
from pallas_kernels.indexer import triton as itk

BF16, F32 = jnp.bfloat16, jnp.float32


def _inputs(B, S, I, J, T, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = quant.fp4_qdq(jax.random.normal(ks[0], (B, S, I, J), F32).astype(BF16), 32, "e8m0")
    w = (jax.random.normal(ks[1], (B, S, I), F32) * 0.1).astype(BF16)
    # keys with a spread of magnitudes, so the E8M0 scales vary from row to row and block to block
    k = jax.random.normal(ks[2], (B, T, J), F32) * jnp.exp2(
        jax.random.randint(ks[3], (B, T, J // 32), -6, 7).astype(F32)).repeat(32, -1)
    codes, scale = quant.fp4_quantize(k.astype(BF16), 32, "e8m0")
    return q, w, quant.pack_nibbles(codes), scale


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x.astype(np.float32)).astype(BF16), np.float64)


def _spec_scores(q, w, codes, scale, visible) -> np.ndarray:
    """The indexer scores (docs/architecture.md, "Indexer") in float64: bf16(q.k),
    bf16(relu(.) * w_h), bf16(sum over heads), -inf masked.
    (Every sum is exact in float64 before its one rounding.)"""
    k = np.asarray(st.dequant_index_k(codes, scale), np.float64)
    dot = _bf16(np.einsum("bsij,btj->bsit", np.asarray(q, np.float64), k))
    prod = _bf16(np.maximum(dot, 0) * np.asarray(w, np.float64)[..., None])
    score = _bf16(prod.sum(2))
    t = np.arange(codes.shape[1])
    return np.where(t[None, None] < np.asarray(visible)[..., None], score, -np.inf)


# (The 32-head case uses 32-entry blocks: with larger ones XLA:CPU's YNNPACK fusion of the
# interpret-mode program drops the inner bf16 rounding, a CPU-only deviation documented in
# dsv41_jax/__init__.py and pinned by tests/test_config_quant.py.)
@pytest.mark.parametrize("B, S, I, J, T, tune", [
    (2, 3, 16, 128, 300, {}),                   # a partial last block of entries
    (1, 2, 32, 128, 256, {"block_t": 32}),      # the release head count, 8 blocks
    (2, 1, 4, 64, 70, {"block_t": 16}),         # the small test configs' indexer (interpret only)
])
def test_kernel_matches_spec(B, S, I, J, T, tune):
    q, w, codes, scale = _inputs(B, S, I, J, T)
    visible = jnp.asarray(np.random.default_rng(0).integers(0, T + 1, (B, S)), jnp.int32)
    visible = visible.at[0, 0].set(T).at[-1, -1].set(0)      # all entries, and none
    got = np.asarray(pidx.index_scores(q, w, codes, scale, visible, impl="gpu_interpret",
                                       **tune))
    want = _spec_scores(q, w, codes, scale, visible)
    assert got.shape == want.shape and got.dtype == np.float32
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    assert (got[~fin] == -np.inf).all()
    # only the fp32 order of the head sum and the dot differs from the formula's exact sums:
    # at most one bf16 rounding step, rarely
    d = np.abs(got[fin] - want[fin])
    assert (d <= 2.0 ** -7 * np.abs(want[fin])).all(), d.max()
    assert (d == 0).mean() > 0.99, (d == 0).mean()
    # and the XLA implementation (dequantise all, then score) is the same op: the same masked
    # entries, every score within one bf16 rounding of the kernel's
    ref = np.asarray(pidx.index_scores(q, w, codes, scale, visible, impl="xla"))
    np.testing.assert_array_equal(np.isfinite(ref), fin)
    assert (np.abs(ref[fin] - got[fin]) <= 2.0 ** -7 * np.abs(want[fin])).all()


@pytest.mark.annotations_unchecked   # the functions' own ValueErrors
def test_dispatch_and_errors():
    q, w, codes, scale = _inputs(1, 1, 16, 128, 40)
    vis = jnp.full((1, 1), 40, jnp.int32)
    assert pidx.resolve_impl("auto", 32, 128, backend="cpu") == "xla"
    assert pidx.resolve_impl("auto", 32, 128, backend="gpu") == "gpu"
    assert pidx.resolve_impl("auto", 4, 64, backend="gpu") == "xla"       # not tiled on a GPU
    assert pidx.impl_for_family("xla", 32, 128) == "xla"
    assert pidx.impl_for_family("tpu", 32, 128) == "xla"
    assert pidx.impl_for_family("tpu_interpret", 32, 128) == "xla"
    assert pidx.impl_for_family("gpu", 4, 64) == "xla"
    assert pidx.impl_for_family("gpu", 32, 128) == "gpu"
    assert pidx.impl_for_family("gpu_interpret", 4, 64) == "gpu_interpret"
    assert pidx.impl_for_family("auto", 32, 128, backend="gpu") == "gpu"
    # the top-k selection kernel reads only the scores: any indexer dims
    assert pidx.select_impl_for_family("gpu", backend="gpu") == "gpu"
    assert pidx.select_impl_for_family("auto", backend="gpu") == "gpu"
    assert pidx.select_impl_for_family("auto", backend="cpu") == "xla"
    assert pidx.select_impl_for_family("gpu_interpret") == "gpu_interpret"
    assert pidx.select_impl_for_family("tpu", backend="gpu") == "xla"
    # the names used before raise, naming the new family
    for old, new in (("triton", "gpu"), ("triton_interpret", "gpu_interpret"),
                     ("mosaic_tpu", "tpu"), ("mosaic_gpu", "gpu")):
        with pytest.raises(ValueError, match=f"attn_impl='{old}' is now attn_impl='{new}'"):
            pidx.impl_for_family(old, 32, 128)
        with pytest.raises(ValueError, match=f"attn_impl='{old}' is now attn_impl='{new}'"):
            pidx.select_impl_for_family(old)
        with pytest.raises(ValueError, match=f"impl='{old}' is now impl='{new}'"):
            pidx.index_scores(q, w, codes, scale, vis, impl=old)
        with pytest.raises(ValueError, match=f"impl='{old}' is now impl='{new}'"):
            pidx.select_topk(jnp.zeros((1, 1, 8)), 2, impl=old)
    # no TPU indexer kernel
    with pytest.raises(ValueError, match="no TPU kernel"):
        pidx.index_scores(q, w, codes, scale, vis, impl="tpu_interpret")
    with pytest.raises(ValueError, match="no TPU kernel"):
        pidx.select_topk(jnp.zeros((1, 1, 8)), 2, impl="tpu")
    with pytest.raises(ValueError, match="attn_impl"):
        pidx.select_impl_for_family("cuda")
    s = jnp.zeros((1, 1, 40), F32)
    with pytest.raises(ValueError, match="GPU"):
        pidx.select_topk(s, 8, impl="gpu")                          # this is a CPU run
    with pytest.raises(ValueError, match="impl"):
        pidx.select_topk(s, 8, impl="gpu")
    with pytest.raises(ValueError, match="GPU"):
        pidx.index_scores(q, w, codes, scale, vis, impl="gpu")      # this is a CPU run
    with pytest.raises(ValueError, match="attn_impl"):
        pidx.impl_for_family("cuda", 32, 128)
    with pytest.raises(ValueError, match="impl"):
        pidx.index_scores(q, w, codes, scale, vis, impl="gpu")
    with pytest.raises(ValueError, match="codes"):
        pidx.index_scores(q, w, codes[:, :, :32], scale, vis, impl="xla")
    with pytest.raises(ValueError, match="scale"):
        pidx.index_scores(q, w, codes, scale[:, :, :2], vis, impl="xla")
    with pytest.raises(ValueError, match="visible"):
        pidx.index_scores(q, w, codes, scale, vis[:, :0], impl="xla")
    with pytest.raises(ValueError, match="q"):
        pidx.index_scores(q.astype(F32), w, codes, scale, vis, impl="xla")
    with pytest.raises(ValueError, match="block_t"):
        pidx.index_scores(q, w, codes, scale, vis, impl="gpu_interpret", block_t=48)
    with pytest.raises(ValueError, match="multiple of 128"):
        itk.index_scores(q[..., :64], w, codes[..., :32], scale[..., :2], vis)
    empty = pidx.index_scores(q, w, codes[:, :0], scale[:, :0], vis, impl="gpu_interpret")
    assert empty.shape == (1, 1, 0)


@pytest.mark.parametrize("tune", [{}, {"block_t": 256, "num_warps": 8}])
def test_gpu_kernel_lowers_for_h200(tune):
    args = (jax.ShapeDtypeStruct((8, 1, 32, 128), BF16), jax.ShapeDtypeStruct((8, 1, 32), BF16),
            jax.ShapeDtypeStruct((8, 4000, 64), jnp.uint8),
            jax.ShapeDtypeStruct((8, 4000, 4), jnp.uint8), jax.ShapeDtypeStruct((8, 1), jnp.int32))
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f = jax.jit(functools.partial(itk.index_scores, **tune))
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200):
        exported = jax.export.export(f, platforms=["cuda"], disabled_checks=skip)(*args)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1
    assert [o.shape for o in exported.out_avals] == [(8, 1, 4000)]


def _score_trials(rng, n, B, S, max_T, max_k):
    """``n`` random rows of bf16-representable scores ``(trial, T, k, x fp32 [B, S, T])``, in
    turn: normal, many ties, only signed zeros / +-1 / +-inf / NaN, 60 decades of magnitude;
    each row masked to -inf past a random visible length."""
    for trial in range(n):
        T = int(rng.integers(1, max_T))
        k = int(rng.integers(1, max_k))
        x = [rng.standard_normal((B, S, T)),
             rng.integers(-3, 4, (B, S, T)) * 0.5,                                # many ties
             rng.choice([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan], (B, S, T)),
             rng.standard_normal((B, S, T)) * 10.0 ** rng.integers(-30, 30, (B, S, T)),
             ][trial % 4]
        x = jnp.asarray(x, F32).astype(BF16).astype(F32)
        vis = rng.integers(0, T + 1, (B, S))
        yield trial, T, k, jnp.where(jnp.arange(T)[None, None] < vis[..., None], x, -jnp.inf)


def test_radix_topk_equals_sorting_topk():
    """``select_topk_radix`` (16-way key search, no sort) gives ``select_topk``'s result bit for
    bit: ties at the threshold go to the lower positions, -0 < +0 as in ``lax.top_k``, NaN and
    -inf are never picked (-1 at the end), k larger than T or than the finite entries."""
    from dsv41_jax.layers import indexer
    rng = np.random.default_rng(0)
    sort_k = jax.jit(indexer.select_topk, static_argnums=1)
    radix_k = jax.jit(indexer.select_topk_radix, static_argnums=1)
    for trial, T, k, x in _score_trials(rng, 24, 2, 3, 2000, 600):
        np.testing.assert_array_equal(np.asarray(radix_k(x, k)), np.asarray(sort_k(x, k)),
                                      err_msg=f"trial {trial}: T={T} k={k}")
    empty = jnp.zeros((2, 3, 0), F32)     # an empty KV source (a state of capacity 1)
    assert radix_k(empty, 8).shape == sort_k(empty, 8).shape == (2, 3, 0)


def test_selection_kernel_equals_radix_topk():
    """The Triton selection kernel (interpret mode) picks what ``select_topk_radix`` picks, bit
    for bit, with the row held in registers (one tile), streamed (tiles of 256, the writing
    pass in tiles of up to 256) and in segments (its two-stage selection, segments of 256):
    ties, signed zeros, NaN / -inf, k past T and past the finite entries."""
    from dsv41_jax.layers import indexer
    from pallas_kernels.indexer import topk_triton as ttk
    rng = np.random.default_rng(1)
    radix_k = jax.jit(indexer.select_topk_radix, static_argnums=1)
    for trial, T, k, x in _score_trials(rng, 12, 2, 2, 1200, 400):
        # trials 0-3: the row in registers; 4-7: streamed in tiles of 256; 8-11: in segments
        # of 256 where T > 256 (rows of up to 1200 with k <= 128: two to four stages)
        one = ttk.MAX_TILE   # a segment longer than any row: one stage
        tile, segment = (None, one) if trial < 4 else (256, one) if trial < 8 else (None, 256)
        k = k if trial < 8 else min(k, 128)
        got = ttk.select_topk(x, k, interpret=True, tile=tile, segment=segment)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(radix_k(x, k)),
                                      err_msg=f"trial {trial}: T={T} k={k} tile={tile} "
                                              f"segment={segment}")
    assert ttk.select_topk(jnp.zeros((2, 3, 0), F32), 8, interpret=True).shape == (2, 3, 0)
    assert ttk.select_topk(jnp.zeros((0, 3, 5), F32), 8, interpret=True).shape == (0, 3, 5)
    s = jnp.zeros((1, 1, 4), F32)
    for bad_k in (0, -1, True, 2.0):
        with annotations_unchecked(), pytest.raises(ValueError, match="k must"):
            ttk.select_topk(s, bad_k, interpret=True)
        with annotations_unchecked(), pytest.raises(ValueError, match="k must"):
            pidx.select_topk(s, bad_k, impl="xla")
    with annotations_unchecked(), pytest.raises(ValueError, match="score"):
        ttk.select_topk(jnp.zeros((1, 4), F32), 2, interpret=True)
    with annotations_unchecked(), pytest.raises(ValueError, match="score"):
        pidx.select_topk(s.astype(BF16), 2, impl="xla")
    with pytest.raises(ValueError, match="tile"):
        ttk.select_topk(s, 2, interpret=True, tile=6)
    with pytest.raises(ValueError, match="tile"):
        ttk.select_topk(s, 2, interpret=True, tile=0)
    # the packed scan's 16-bit fields: larger writing tiles would overflow them
    with pytest.raises(ValueError, match="write_tile"):
        ttk.select_topk(s, 2, interpret=True, write_tile=2 * ttk.MAX_WRITE_TILE)
    with pytest.raises(ValueError, match="num_warps"):
        ttk.select_topk(s, 2, interpret=True, num_warps=6)
    with pytest.raises(ValueError, match="segment"):
        ttk.select_topk(s, 2, interpret=True, segment=100)
    # the segment rule (device times, docs/benchmarks.md): the longest segment that still
    # fills the GPU with programs, the shortest at small batches; one with room for 2k picks
    assert [ttk.default_segment(r, T) for r, T in ((1, 32768), (64, 32768), (256, 32768),
                                                   (8, 262144), (64, 65536), (8, 1 << 20))] \
        == [8192, 16384, 32768, 16384, 32768, 32768]
    assert ttk.default_segment(1, 65536, k=5000) == 16384
    assert ttk.default_segment(1, 65536, k=20000) == ttk.MAX_TILE
    # rows it would stream whole (longer than TILE, no segment with room for 2k): the radix
    # selection, measured faster
    assert ttk.preferred(1, 65536, 512) and ttk.preferred(1, 32768, 20000)
    assert not ttk.preferred(1, 65536, 20000)


def test_selection_kernel_segments_at_the_edges():
    """The staged selection (segments of 256, interpret mode) at fixed edges: the winner alone
    in a one-score last segment, a run of equal scores across a segment boundary with the
    threshold inside it (three stages), every score equal (-0 and +0 alternating) with k half
    a segment."""
    from dsv41_jax.layers import indexer
    from pallas_kernels.indexer import topk_triton as ttk
    rng = np.random.default_rng(3)
    base = jnp.asarray(rng.standard_normal((2, 1, 1024)), F32).astype(BF16).astype(F32)
    last = base[..., :257].at[:, :, 256].set(100.0)
    run = base.at[:, :, 200:320].set(5.0).at[:, :, :100].set(7.0)
    zeros = jnp.where(jnp.arange(512) % 2 == 0, -0.0, 0.0)[None, None].repeat(2, 0)
    for name, x, k in (("last", last, 128), ("run", run, 128), ("zeros", zeros, 128)):
        got = ttk.select_topk(x, k, interpret=True, segment=256)
        np.testing.assert_array_equal(np.asarray(got),
                                      np.asarray(indexer.select_topk_radix(x, k)),
                                      err_msg=name)


def test_candidate_pool_with_the_selection_kernel():
    """The block-max candidate pool keeps the same blocks with the selection kernel (interpret
    mode) as with ``lax.top_k``: ties between block scores, the pinned newest block (+inf),
    -inf and NaN blocks, more blocks asked for than there are."""
    from dsv41_jax.layers import indexer
    from pallas_kernels.indexer import topk_triton as ttk
    rng = np.random.default_rng(2)
    select = functools.partial(ttk.select_topk, interpret=True)
    for trial, T, _, x in _score_trials(rng, 4, 2, 2, 400, 2):   # one of each kind
        vis = jnp.asarray(rng.integers(1, T + 1, (2, 2)), jnp.int32)
        block, n_blocks = int(rng.choice([2, 8])), int(rng.integers(1, 40))
        want = indexer.candidate_pool(x, vis, n_blocks, block)
        got = indexer.candidate_pool(x, vis, n_blocks, block, select=select)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w),
                                          err_msg=f"trial {trial}: T={T} block={block} "
                                                  f"n_blocks={n_blocks}")


def test_kernel_impls_per_call(tiny_a):
    """prefill / decode_step / parity take their three implementations from the family, at
    every batch size: a small GPU decode batch gets the Triton attention and the selection
    kernel (whatever the indexer dims; the scores kernel needs the release's)."""
    from dsv41_jax import model
    cfg = tiny_a[0]
    assert model.kernel_impls(cfg, "auto", backend="gpu") == ("gpu", "xla", "gpu")
    assert model.kernel_impls(cfg, "auto", backend="cpu") == ("xla", "xla", "xla")
    assert model.kernel_impls(cfg, "xla", backend="gpu") == ("xla", "xla", "xla")
    assert model.kernel_impls(cfg, "gpu_interpret") == ("gpu_interpret",) * 3
    assert model.kernel_impls(cfg, "tpu_interpret") == ("tpu_interpret", "xla", "xla")
    with pytest.raises(ValueError, match="attn_impl"):
        model.kernel_impls(cfg, "cuda")
    with pytest.raises(ValueError, match="attn_impl='triton' is now attn_impl='gpu'"):
        model.kernel_impls(cfg, "triton")


@pytest.mark.parametrize("T, segment, kernels", [(8192, None, 1), (40000, None, 2),
                                                 (40000, 1 << 20, 1)])
def test_selection_kernel_lowers_for_h200(T, segment, kernels):
    """The GPU build of the selection kernel lowers for an H200 on CPU: a row held in
    registers, a longer one in segments (two kernels: the segments, then their candidates)
    and streamed in tiles."""
    from pallas_kernels.indexer import topk_triton as ttk
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f = jax.jit(functools.partial(ttk.select_topk, k=512, segment=segment))
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200):
        exported = jax.export.export(f, platforms=["cuda"], disabled_checks=skip)(
            jax.ShapeDtypeStruct((8, 1, T), F32))
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == kernels
    assert [o.shape for o in exported.out_avals] == [(8, 1, 512)]
