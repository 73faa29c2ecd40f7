"""FP4 codec kernels (pallas_kernels.fp4) against the jnp reference, bit for bit
(docs/architecture.md, "Number formats").

Both Pallas kernels run in interpret mode on CPU; on a GPU machine the compiled Triton kernels
run as well. Every comparison is on the raw bytes.
"""

import functools

import dsv41_jax  # noqa: F401  (XLA numerics flag before JAX starts)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tools_util import load_tool

from dsv41_jax import quant
from pallas_kernels import fp4

BF16 = ml_dtypes.bfloat16
FMTS = ("main", "index")
# on a GPU machine (the H200 runs of this file) the compiled Triton kernels are tested too
IMPLS = ("gpu_interpret", "tpu_interpret") + (
    ("gpu",) if jax.default_backend() == "gpu" else ())
SCALE_FMT = {"main": "e4m3", "index": "e8m0"}
E2M1 = quant.E2M1_VALUES
BOUNDS = np.array([b for b, _ in quant._E2M1_BOUNDS], np.float32)
E4M3_POS = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _bytes(a) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)


def _assert_same(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype,
                                                                  want.shape, want.dtype)
    g, w = _bytes(got), _bytes(want)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{what}: {bad.size} bytes differ, first at byte {bad[:8]}"


def _bf(x) -> np.ndarray:
    """Round to bf16 and back to fp32."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def _bf16_neighbours(v: np.ndarray) -> np.ndarray:
    """v (exact in bf16, > 0) and the bf16 values one ulp below and above."""
    b = v.astype(BF16).view(np.uint16)
    return np.concatenate([v, (b - 1).view(BF16).astype(np.float32),
                           (b + 1).view(BF16).astype(np.float32)])


def _adversarial_blocks(fmt: str, rng: np.random.Generator) -> np.ndarray:
    """fp32 [n, block] blocks, every value exact in bf16, aimed at the decision points."""
    block = fp4.block_size(fmt)
    blocks = []

    def add(amax_values, s_values, fill):
        for amax, s in zip(amax_values, s_values):
            blk = _bf(fill(s))
            blk[rng.integers(block)] = _bf(amax * rng.choice([-1.0, 1.0]))
            blocks.append(blk)

    def ties(s):  # boundaries and e2m1 values times s, their bf16 neighbours, signed zeros
        cand = np.concatenate([_bf16_neighbours(BOUNDS * s), E2M1 * s, [0.0]]).astype(np.float32)
        assert np.array_equal(_bf(cand), cand)  # the ties are exact in bf16
        return rng.choice(cand, block) * rng.choice([-1.0, 1.0], block)

    if fmt == "main":
        scales = E4M3_POS[rng.choice(E4M3_POS.size, 96, replace=False)]
        scales = np.concatenate([scales, E4M3_POS[:4], E4M3_POS[-4:]])
        add(6 * scales, scales, ties)  # amax / 6 is exactly the scale
        # amax / 6 at and beside an e4m3 rounding tie (and at 432 = tie between 416 and 448)
        mids = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2
        mids = np.concatenate([mids[rng.choice(mids.size, 48, replace=False)], mids[:3],
                               mids[-3:]])
        add(_bf16_neighbours(6 * mids), np.tile(mids, 3), ties)
    else:
        scales = 2.0 ** rng.integers(-126, 120, 96).astype(np.float32)
        scales = np.concatenate([scales, 2.0 ** np.array([-126, -125, -124, 0, 125],
                                                         np.float32)])
        add(6 * scales, scales, ties)
        add(_bf16_neighbours(6 * scales), np.tile(scales, 3), ties)
    # amax above 448 * 6 (the e4m3 scale saturates), up to the largest bf16 and inf
    huge = np.array([2688, 2696, 2704, 3000, 1e5, 3e38, float(ml_dtypes.finfo(BF16).max),
                     np.inf], np.float32)
    add(huge, np.full(huge.shape, 448.0, np.float32), ties)
    # tiny: around and below the amax floors, bf16 subnormals (flushed on CPU, both sides)
    floor = np.float32(6 * 2.0 ** -9 if fmt == "main" else 6 * 2.0 ** -126)
    tiny = np.concatenate([_bf16_neighbours(np.array([floor], np.float32)),
                           floor * np.array([0.5, 0.25, 1e-3], np.float32),
                           np.array([2.0 ** -127, 2.0 ** -133, 1e-30], np.float32)])
    add(tiny, tiny / 6, lambda s: (rng.uniform(-1, 1, block) * 6 * s).astype(np.float32))
    # zero and negative-zero blocks, a plain random block
    blocks.append(np.zeros(block, np.float32))
    blocks.append(np.full(block, -0.0, np.float32))
    blocks.append(_bf(rng.standard_normal(block)))
    return np.stack(blocks)


def _random_rows(shape, rng: np.random.Generator) -> np.ndarray:
    """Random normal rows, each with its own magnitude 1e-6..1e6, a few zero rows."""
    mag = 10.0 ** rng.uniform(-6, 6, shape[:-1] + (1,))
    x = rng.standard_normal(shape) * mag
    x.reshape(-1, shape[-1])[::5] = 0.0
    return x.astype(np.float32)


def _rows(blocks: np.ndarray, k: int, rng: np.random.Generator, lead: int = 1) -> np.ndarray:
    """Blocks shuffled into [lead, n, k] rows (random blocks fill up the last rows)."""
    per_row = k // blocks.shape[1]
    n = -(-blocks.shape[0] // (per_row * lead)) * per_row * lead
    pad = _bf(rng.standard_normal((n - blocks.shape[0], blocks.shape[1])))
    rows = np.concatenate([blocks, pad])[rng.permutation(n)]
    return rows.reshape(lead, -1, k)


@functools.partial(jax.jit, static_argnums=(1,))
def _reference(x, fmt):
    """(packed, scale, qdq bf16) of dsv41_jax.quant."""
    block, scale_fmt = fp4.block_size(fmt), SCALE_FMT[fmt]
    codes, scale = quant.fp4_quantize(x, block, scale_fmt)
    return quant.pack_nibbles(codes), scale, quant.fp4_qdq(x, block, scale_fmt)


def _check(x, fmt, impl, **tuning):
    """quantize_pack and the bf16 round trip against the reference, bit for bit."""
    x = jnp.asarray(x, jnp.bfloat16)
    packed, scale = fp4.quantize_pack(x, fmt, impl=impl, **tuning)
    ref_packed, ref_scale, qdq = _reference(x, fmt)
    what = f"{fmt} {impl} {tuple(x.shape)}"
    _assert_same(packed, ref_packed, f"{what} packed")
    _assert_same(scale, ref_scale, f"{what} scale")
    _assert_same(fp4.unpack_dequantize(packed, scale, fmt, impl=impl, **tuning), qdq,
                 f"{what} round trip")
    return packed, scale


def _inf_blocks(block: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks holding +-inf (NaN: :func:`test_nan_in_a_block_dequantises_to_nan`)."""
    blocks = _bf(rng.standard_normal((3, block)))
    blocks[0, 3], blocks[1, 5], blocks[2, 7], blocks[2, 8] = np.inf, -np.inf, np.inf, -np.inf
    return blocks


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
def test_adversarial_and_random(fmt, impl):
    """Ties, saturation, floors, signed zeros, inf and random rows of magnitude 1e-6..1e6,
    in leading shapes [3, n, 512] and [n, 128]; small blocks so that there are several programs
    and a partial last block (masked in Triton, padded by Mosaic)."""
    rng = np.random.default_rng(1 if fmt == "main" else 2)
    block = fp4.block_size(fmt)
    blocks = np.concatenate([_adversarial_blocks(fmt, rng), _inf_blocks(block, rng)])
    # random rows up to ~19k values: 38 rows of 512 and 150 of 128, > 32 Mosaic lines each
    blocks = np.concatenate([blocks, _bf(_random_rows((19200 // block - len(blocks), block),
                                                      rng))])
    tuning = dict(block_rows=8 if impl.startswith("gpu") else 32)
    scales, ties = [], 0
    for k, lead in ((512, 3), (128, 1)):
        x = _rows(blocks, k, rng, lead)
        x = x[0] if lead == 1 else x
        lines = x.size // k  # rows; Mosaic puts two rows of K = 128 in one line
        lines = -(-lines // 2) if k == 128 and impl.startswith("tpu") else lines
        assert lines > tuning["block_rows"] and lines % tuning["block_rows"], lines
        scale = _check(x, fmt, impl, **tuning)[1]
        scales.append(_bytes(scale))
        s = np.repeat(np.asarray(quant.fp4_scale_to_f32(scale)), block, axis=-1)
        with np.errstate(over="ignore"):  # b * s past fp32 max for the largest E8M0 scales
            ties += sum(int(np.sum(np.abs(x) == b * s)) for b in BOUNDS)
    # the constructed cases are really hit: exact e2m1 ties, floored and saturated scales
    assert ties > 500, ties
    sb = set(np.concatenate(scales).tolist())
    assert ({1, 126} if fmt == "main" else {1, 255}) <= sb


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
def test_shapes(fmt, impl):
    """Default blocks; K = 96 (not a power of two: Triton pads the words, Mosaic uses lines of
    lcm(K/2, 128) words and pads an odd row count)."""
    rng = np.random.default_rng(3)
    for shape in ((7, 128), (3, 96)):
        packed, scale = _check(_random_rows(shape, rng), fmt, impl)
        assert packed.shape == shape[:-1] + (shape[-1] // 2,)
        assert scale.shape == shape[:-1] + (shape[-1] // fp4.block_size(fmt),)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
def test_scale_exhaustive_over_bf16_amax(fmt, impl):
    """Every non-negative bf16 value (inf included) as a block amax, once per sign."""
    rng = np.random.default_rng(5)
    v = np.arange(0, 0x7F81, dtype=np.uint16).view(BF16).astype(np.float32)
    x = v[:, None] * rng.random((v.size, 32)).astype(np.float32)
    x[np.arange(v.size), np.arange(v.size) % 32] = v
    x[:, 16:] *= -1
    x = jnp.asarray(x, jnp.bfloat16)
    packed, scale = fp4.quantize_pack(x, fmt, impl=impl, block_rows=2048)
    ref_packed, ref_scale, _ = _reference(x, fmt)
    _assert_same(packed, ref_packed, f"{fmt} {impl} packed")
    _assert_same(scale, ref_scale, f"{fmt} {impl} scale")
    assert len(set(_bytes(scale).tolist())) > (120 if fmt == "main" else 250)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FMTS)
def test_unpack_every_byte(fmt, impl):
    """Every packed byte under every scale byte (negative / NaN e4m3, E8M0 0 and 255 too)."""
    k, block = 512, fp4.block_size(fmt)
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # row r: every byte, scale r
    sbytes = np.repeat(np.arange(256, dtype=np.uint8)[:, None], k // block, axis=1)
    scale = sbytes.view(ml_dtypes.float8_e4m3fn) if fmt == "main" else sbytes
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    for dtype in (jnp.bfloat16, jnp.float32):
        got = fp4.unpack_dequantize(packed, scale, fmt, impl=impl, dtype=dtype)
        want = quant.fp4_dequantize(quant.unpack_nibbles(packed), scale, block, dtype)
        _assert_same(got, want, f"{fmt} {impl} {jnp.dtype(dtype).name}")


def test_codec_scales_exhaustive():
    """The in-kernel scale arithmetic alone, on every bf16 amax, against the reference."""
    from pallas_kernels.fp4 import common as codec
    v = np.arange(0, 0x7F81, dtype=np.uint16).view(BF16)
    amax_bits = jnp.asarray(v.astype(np.float32).view(np.int32))
    x = jnp.zeros((v.size, 32), jnp.bfloat16).at[:, 5].set(jnp.asarray(v))
    ref_main = quant.fp4_quantize(x[:, :16], 16, "e4m3")[1]
    code, s = jax.jit(codec.e4m3_scale)(amax_bits)
    _assert_same(code.astype(jnp.uint8), jax.lax.bitcast_convert_type(ref_main, jnp.uint8)[:, 0])
    _assert_same(s, ref_main[:, 0].astype(jnp.float32))
    ref_index = quant.fp4_quantize(x, 32, "e8m0")[1][:, 0]
    byte, s = jax.jit(codec.e8m0_scale)(amax_bits)
    _assert_same(byte.astype(jnp.uint8), ref_index)
    _assert_same(s, quant.e8m0_to_f32(ref_index))


@pytest.mark.annotations_unchecked   # the functions' own ValueErrors
def test_errors_and_dispatch():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl"):
        fp4.quantize_pack(x, "main", impl="cuda")
    with pytest.raises(ValueError, match="fmt"):
        fp4.quantize_pack(x, "e4m3")
    with pytest.raises(ValueError, match="K"):
        fp4.quantize_pack(jnp.zeros((2, 48), jnp.bfloat16), "index", impl="xla")
    with pytest.raises(ValueError, match="x"):
        fp4.quantize_pack(x.astype(jnp.float32), "main", impl="xla")
    with pytest.raises(ValueError, match="tuning"):
        fp4.quantize_pack(x, "main", impl="xla", block_size=8)
    packed, scale = fp4.quantize_pack(x, "main", impl="xla")
    with pytest.raises(ValueError, match="impl"):
        fp4.unpack_dequantize(packed, scale, "main", impl="gpu")
    with pytest.raises(ValueError, match="fmt"):
        fp4.unpack_dequantize(packed, scale, "mxfp4")
    with pytest.raises(ValueError, match="K"):
        fp4.unpack_dequantize(packed[:, :24], scale, "main", impl="xla")
    with pytest.raises(ValueError, match="scale"):
        fp4.unpack_dequantize(packed, scale, "index", impl="xla")
    assert fp4.resolve_impl("auto", "gpu") == "gpu"
    assert fp4.resolve_impl("auto", "tpu") == "xla"   # the Mosaic kernels are opt-in
    assert fp4.resolve_impl("auto", "cpu") == "xla"
    assert fp4.resolve_impl("auto") == "xla"  # CPU here
    # empty leading dims, and jit over the public functions
    for impl in IMPLS:
        p, s = fp4.quantize_pack(jnp.zeros((0, 3, 128), jnp.bfloat16), "index", impl=impl)
        assert p.shape == (0, 3, 64) and s.shape == (0, 3, 4)
        assert fp4.unpack_dequantize(p, s, "index", impl=impl).shape == (0, 3, 128)
    f = jax.jit(functools.partial(fp4.quantize_pack, fmt="main", impl="gpu_interpret"))
    _assert_same(f(x)[1], scale)


@pytest.mark.parametrize("fmt", FMTS)
def test_mosaic_lowering_for_tpu(fmt):
    """The Mosaic kernels lower for a TPU target (Pallas -> Mosaic MLIR, no TPU compile here)."""
    block = fp4.block_size(fmt)
    scale_dtype = jnp.float8_e4m3fn if fmt == "main" else jnp.uint8
    for k in (512, 128):
        x = jax.ShapeDtypeStruct((300, k), jnp.bfloat16)
        q = jax.jit(functools.partial(fp4.quantize_pack, fmt=fmt, impl="tpu"))
        assert "tpu_custom_call" in jax.export.export(q, platforms=("tpu",))(x).mlir_module()
        p = jax.ShapeDtypeStruct((300, k // 2), jnp.uint8)
        s = jax.ShapeDtypeStruct((300, k // block), scale_dtype)
        d = jax.jit(functools.partial(fp4.unpack_dequantize, fmt=fmt, impl="tpu"))
        assert "tpu_custom_call" in jax.export.export(d, platforms=("tpu",))(p, s).mlir_module()


# ----------------------------------------------------------------------------- GPU build


def _encode_emulated(words: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The Triton kernel's PTX encode (``encode="asm"``), emulated: uint32 words of bf16 pairs
    and their fp32 block scales -> the packed bytes. The boundaries are built as the kernel's
    ``_boundary_pairs`` builds them, in numpy (no flush of the subnormal ones, as on a GPU)."""
    import ptx_emu
    from pallas_kernels.fp4 import triton as ftk
    regs = {"w": words.astype(np.uint32)}
    with np.errstate(over="ignore"):
        for i, (b, _) in enumerate(quant._E2M1_BOUNDS):
            bits = (s.astype(np.float32) * np.float32(b)).view(np.uint32)
            pair = (bits & np.uint32(0xFFFF0000)) | (bits >> np.uint32(16))
            regs[f"t{i}"] = np.where(s == np.inf, np.uint32(ftk._INF_SCALE_PAIRS[i]), pair)
    asm = ftk._ENCODE_PTX.replace("$0", "out").replace("$1", "w")
    for i in range(7):
        asm = asm.replace(f"${i + 2};", f"t{i};")
    return ptx_emu.run_ptx(asm, regs)["out"] & np.uint32(0xFF)


def _e2m1_codes_exact(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """quant._e2m1_code in numpy (fp32, subnormals kept): the boundaries passed, the sign."""
    a = np.abs(x)
    with np.errstate(over="ignore", invalid="ignore"):
        n = sum(((a >= np.float32(b) * s) if up else (a > np.float32(b) * s)).astype(np.uint32)
                for b, up in quant._E2M1_BOUNDS)
    return n | (np.signbit(x).astype(np.uint32) << 3)


def test_asm_encode_is_exact_for_every_bf16_value():
    """The PTX encode against the e2m1 decision rule: every bf16 bit pattern (NaN, inf,
    subnormals, both zeros) in the low half, random ones in the high half, under every
    positive e4m3 scale (2^-9 .. 448), the NaN scale of a main block holding a NaN, and every
    E8M0 scale (2^-126, whose
    boundaries are bf16 subnormals, .. 2^127 and +inf, whose stand-in boundaries must count
    like the seven tests). Left out: +-inf under a finite scale whose boundaries overflow
    (2^127), which no block produces (an infinite amax makes the scale +inf)."""
    rng = np.random.default_rng(7)
    lo = np.arange(1 << 16, dtype=np.uint32)
    hi = rng.integers(0, 1 << 16, lo.size, dtype=np.uint32)
    words = lo | hi << np.uint32(16)
    scales = np.concatenate([E4M3_POS, [np.nan], 2.0 ** np.arange(-126, 128, dtype=np.float32),
                             [np.inf]]).astype(np.float32)
    for s in scales:
        got = _encode_emulated(words, np.full(words.shape, s, np.float32))
        x_lo, x_hi = ((h << np.uint32(16)).view(np.float32) for h in (lo, hi))
        want = (_e2m1_codes_exact(x_lo, s) | _e2m1_codes_exact(x_hi, s) << np.uint32(4))
        with np.errstate(over="ignore"):
            overflow = np.isfinite(s) and not np.isfinite(np.float32(5.0) * s)
        possible = ~(overflow & (np.isinf(x_lo) | np.isinf(x_hi)))
        assert possible.mean() > 0.99
        bad = np.flatnonzero((got != want) & possible)
        assert bad.size == 0, (s, hex(int(words[bad[0]])), int(got[bad[0]]), int(want[bad[0]]))


@pytest.mark.parametrize("encode", ["asm", "jnp"])
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_kernels_lower_for_h200(fmt, encode):
    """The GPU build of quantize_pack (both encodes) lowers to Triton IR for an H200 on CPU,
    with the PTX of the asm encode in the IR."""
    report = load_tool("triton_report")
    q = jax.jit(functools.partial(fp4.quantize_pack, fmt=fmt, impl="gpu", encode=encode))
    [ttir] = report.capture_ttir(q, jax.ShapeDtypeStruct((300, 512), jnp.bfloat16))
    assert ttir.count("set.gt.u32.bf16x2") == (4 if encode == "asm" else 0)
    with pytest.raises(ValueError, match="encode"):
        fp4.quantize_pack(jnp.zeros((2, 64), jnp.bfloat16), fmt, impl="gpu_interpret",
                          encode="ptx")


def test_asm_e4m3_scale_is_exact_for_every_bf16_amax():
    """The PTX main-KV scale (``encode="asm"``): for every non-negative bf16 amax (subnormals,
    inf, NaN), the scale byte equals the codec's (itself checked against the reference above)
    and the seven boundary pairs are ``b * s`` exactly, in both halves."""
    import ptx_emu
    from pallas_kernels.fp4 import common as codec
    from pallas_kernels.fp4 import triton as ftk
    bits = np.concatenate([np.arange(0, 0x7F81), [0x7FC0, 0x7F81]]).astype(np.uint32) << 16
    run = lambda ptx, x: ptx_emu.run_ptx(ptx.replace("$0", "out").replace("$1", "x"),  # noqa
                                         {"x": x})["out"]
    codes = run(ftk._E4M3_SCALE_PTX, bits)
    want, s = jax.jit(codec.e4m3_scale)(jnp.asarray(bits.view(np.int32)))
    np.testing.assert_array_equal(codes & 0xFF, np.asarray(want))
    np.testing.assert_array_equal(codes >> 8 & 0xFF, np.asarray(want))
    pair = run(ftk._E4M3_PAIR_PTX, codes)
    s = np.asarray(s, np.float32)
    for b, _ in quant._E2M1_BOUNDS:
        got = run(ftk._BOUND_PTX.replace("PAIR", ftk._bf16_pair(b)), pair)
        exact = ptx_emu.bf16_bits(np.float32(b) * s)
        np.testing.assert_array_equal(got & 0xFFFF, exact)
        np.testing.assert_array_equal(got >> 16, exact)


# ----------------------------------------------------------------------------- NaN


@pytest.mark.parametrize("fmt", FMTS)
def test_nan_in_a_block_dequantises_to_nan(fmt):
    """Both formats propagate a NaN the same way: the block holding it gets the NaN scale
    (E4M3's NaN code, the E8M0 byte 255) and dequantises to NaN in every position, eager and
    jitted, in the jnp reference and in the kernels; the other blocks keep their values."""
    block = fp4.block_size(fmt)
    scale_fmt = SCALE_FMT[fmt]
    rng = np.random.default_rng(11)
    x = _bf(rng.standard_normal((4, 128)) * 3)
    nan_at = [(1, block + 3), (3, 0)]          # the second block of row 1, the first of row 3
    x_nan = x.copy()
    for r, c in nan_at:
        x_nan[r, c] = np.nan
    in_nan_block = np.zeros(x.shape, bool)
    for r, c in nan_at:
        in_nan_block[r, c // block * block:(c // block + 1) * block] = True
    clean = np.asarray(quant.fp4_qdq(jnp.asarray(x, jnp.bfloat16), block, scale_fmt), np.float32)

    def check(deq, what):
        deq = np.asarray(deq, np.float32)
        assert np.isnan(deq[in_nan_block]).all(), what
        np.testing.assert_array_equal(deq[~in_nan_block], clean[~in_nan_block], what)

    xj = jnp.asarray(x_nan, jnp.bfloat16)
    for name, qdq in (("eager", quant.fp4_qdq),
                      ("jit", jax.jit(quant.fp4_qdq, static_argnums=(1, 2)))):
        check(qdq(xj, block, scale_fmt), f"{fmt} reference {name}")
    codes, scale = quant.fp4_quantize(xj, block, scale_fmt)
    sbytes = np.asarray(jax.lax.bitcast_convert_type(scale, jnp.uint8)) if fmt == "main" else \
        np.asarray(scale)
    nan_byte = 0x7F if fmt == "main" else 0xFF
    assert [int(sbytes[r, c // block]) & 0x7F if fmt == "main" else int(sbytes[r, c // block])
            for r, c in nan_at] == [nan_byte] * 2
    for impl in ("xla",) + IMPLS:
        packed, scale = fp4.quantize_pack(xj, fmt, impl=impl)
        check(fp4.unpack_dequantize(packed, scale, fmt, impl=impl), f"{fmt} {impl}")
        _assert_same(packed, quant.pack_nibbles(codes), f"{fmt} {impl} packed")
    # the in-kernel scale of a NaN amax
    from pallas_kernels.fp4 import common as codec
    nan_bits = jnp.asarray([0x7FC00000, 0x7F800001], jnp.int32)
    byte, s = codec.scale_from_amax(nan_bits, fmt)
    assert (np.asarray(byte) == nan_byte).all() and np.isnan(np.asarray(s)).all()
