"""Vision preprocessing, ViT, aligner and span rows against the tiny-vl fixtures
(docs/architecture.md, "Vision")."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from dsv41_jax.checkpoint import nest, read_safetensors
from dsv41_jax.config import ModelConfig
from dsv41_jax.image_processor import (
    IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, expand_image_placeholders, preprocess_image,
    solve_resize_ratio)
from dsv41_jax.layers import vision
from dsv41_jax.testing.fixtures import fixture_dir

FIX = Path(fixture_dir("tiny-vl"))   # collection needs the manifest (the parametrised cases)
REAL_IMAGE_TOKEN_ID = 129264


@functools.cache
def _manifest() -> dict:
    return json.loads((FIX / "manifest.json").read_text())


@functools.cache
def _cfg() -> ModelConfig:
    return ModelConfig.from_json(FIX / "config.json")


@functools.cache
def _params() -> dict:
    return nest(read_safetensors(FIX / "weights.safetensors"))


@functools.cache
def _npz(name: str) -> dict:
    with np.load(FIX / name) as z:
        return {k: z[k] for k in z.files}


@functools.cache
def _image(file: str) -> dict:
    return preprocess_image(Image.open(FIX / file), _cfg())


@functools.cache
def _vit_fn(grid: tuple[int, int]):
    cfg = _cfg()
    return jax.jit(lambda p, x: vision.vit_forward(p, x, grid, cfg, return_intermediates=True))


@functools.cache
def _vit(file: str):
    """(vit_out, intermediates) of one image as fp32 numpy, computed once per file."""
    d = _image(file)
    out, inter = _vit_fn(d["vit_grid"])(_params()["vision"], jnp.asarray(d["patches"]))
    return _f32(out), {k: _f32(v) for k, v in inter.items()}


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _bf16_ulp(ref: np.ndarray) -> np.ndarray:
    """bf16 ulp at each reference value, floored at the ulp of the array's RMS.

    Values near zero carry absolute (not relative) error from the sums that produced them, so
    they are judged on the array's scale, as the fixture README does ("on values of RMS 1").
    """
    rms = np.sqrt(np.mean(np.square(ref.astype(np.float64))))
    a = np.maximum(np.abs(ref.astype(np.float64)), max(rms, 2.0 ** -126))
    return np.exp2(np.floor(np.log2(a)) - 7)


def _assert_within_ulps(got, ref, n_ulp: float, what: str, max_frac: float = 0.1) -> float:
    """Max abs error; fails beyond ``n_ulp`` bf16 ulps (see ``_bf16_ulp``) or if more than
    ``max_frac`` of the elements differ at all."""
    got, ref = _f32(got), np.asarray(ref, np.float32)
    chex.assert_equal_shape([got, ref])
    err = np.abs(got.astype(np.float64) - ref)
    ulps = err / _bf16_ulp(ref)
    n_diff = int((err > 0).sum())
    msg = (f"{what}: max error {err.max():.3g} = {ulps.max():.1f} bf16 ulps "
           f"({n_diff} of {err.size} differ)")
    assert ulps.max() <= n_ulp and n_diff <= max_frac * err.size, msg
    return float(err.max())


_IMAGES = [(c["name"], c["file"], im["index"], im["file"])
           for c in _manifest()["cases"] for im in c["images"]]
_IMAGE_IDS = [f"{case}-I{k}" for case, _, k, _ in _IMAGES]


# ------------------------------- preprocessing (docs/architecture.md, "Image preprocessing")
@pytest.mark.parametrize("case,npz,k,file", _IMAGES, ids=_IMAGE_IDS)
def test_preprocess_exact(case, npz, k, file):
    z, d = _npz(npz), _image(file)
    meta = next(im for c in _manifest()["cases"] if c["name"] == case
                for im in c["images"] if im["index"] == k)
    assert d["vit_grid"] == tuple(meta["n_vit_hw"])
    assert d["llm_grid"] == tuple(meta["n_llm_hw"])
    assert d["padded_rgb"].shape[1::-1] == tuple(meta["canvas_wh"])
    np.testing.assert_array_equal(d["padded_rgb"], z[f"image.padded_rgb.I{k}"])
    np.testing.assert_array_equal(_f32(d["pixels"]), z[f"image.pixels.I{k}"])
    ref_patches = z[f"image.patches.I{k}"]
    np.testing.assert_array_equal(_f32(d["patches"]), ref_patches.reshape(ref_patches.shape[0], -1))
    np.testing.assert_array_equal(d["token_types"], z[f"image.types.I{k}"])
    assert d["token_types"].size == meta["span_len"]


def test_solve_resize_ratio_float64_hazard():
    # 420 * 0.8 / 14 = 24.000000000000004 in float64: the width keeps 24 patches (README).
    assert solve_resize_ratio(300, 420, 14, 3, 64) == (238, 336)
    # Degenerate shapes collapse to one column / one row of cells.
    assert solve_resize_ratio(4000, 50, 14, 3, 64) == ((64 - 2) // 2 * 42, 42)
    assert solve_resize_ratio(50, 4000, 14, 3, 64) == (42, (64 - 3) * 42)


def test_preprocess_large_and_extreme_images_fit_budget():
    cfg = _cfg()
    for w, h in [(2000, 1500), (3000, 40), (40, 3000), (700, 700)]:
        d = preprocess_image(Image.new("RGB", (w, h), (10, 200, 30)), cfg)
        nh, nw = d["llm_grid"]
        assert d["token_types"].size == nh * (nw + 1) + 2 <= cfg.vision_max_n_token
        chex.assert_shape(d["patches"], (d["vit_grid"][0] * d["vit_grid"][1], 3 * 14 * 14))


# ------------------------------------------------------------------ ViT
# 0.047 / 2**-7 = 6 ulps (the fixture README's bound for an fp32 re-implementation of the ViT);
# at most 60% of the elements may differ (a bug, e.g. a wrong RoPE half, moves nearly all).
VIT_ULPS, VIT_FRAC = 6, 0.6


@pytest.mark.parametrize("case,npz,k,file", _IMAGES, ids=_IMAGE_IDS)
def test_vit(case, npz, k, file):
    z = _npz(npz)
    out, inter = _vit(file)
    # The patch embedding is one Linear: within an ulp. Past it, XLA:CPU's fp32 attention
    # (scores, softmax sums, P @ V) rounds differently from the reference's; the first flipped
    # bf16 roundings spread through the bidirectional attention to many elements, by an ulp or
    # a few. The fixture README bounds an independent fp32 re-implementation of the ViT at
    # "max 0.047 on values of RMS 1", i.e. VIT_ULPS bf16 ulps of the RMS scale: the bound here.
    e_pe = _assert_within_ulps(inter["patch_embed"], z[f"image.vit_patch_embed.I{k}"], 1,
                               "vit_patch_embed", max_frac=0.01)
    e_blk = _assert_within_ulps(inter["block_out"], z[f"image.vit_block_out.I{k}"], VIT_ULPS,
                                "vit_block_out", max_frac=VIT_FRAC)
    e_out = _assert_within_ulps(out, z[f"image.vit_out.I{k}"], VIT_ULPS, "vit_out",
                                max_frac=VIT_FRAC)
    print(f"{case} I{k}: max abs err patch_embed {e_pe:.3g} block_out {e_blk:.3g} "
          f"vit_out {e_out:.3g}")


# ------------------------------------------------------------------ aligner
@pytest.mark.parametrize("case,npz,k,file", _IMAGES, ids=_IMAGE_IDS)
def test_aligner_from_recorded_vit_out(case, npz, k, file):
    z, d, cfg = _npz(npz), _image(file), _cfg()
    vit_out = jnp.asarray(z[f"image.vit_out.I{k}"]).astype(jnp.bfloat16)
    unfold = vision.aligner_unfold(vit_out, d["vit_grid"], cfg.vision_downsample_ratio)
    np.testing.assert_array_equal(_f32(unfold), z[f"image.aligner_unfold.I{k}"])
    out = vision.aligner_forward(_params()["aligner"], vit_out, d["vit_grid"], cfg)
    chex.assert_type(out, jnp.bfloat16)
    np.testing.assert_array_equal(_f32(out), z[f"image.aligner_out.I{k}"])


# ------------------------------------------------------------------ span rows
@pytest.mark.parametrize("case,npz,k,file", _IMAGES, ids=_IMAGE_IDS)
def test_span_rows_match_embed_out(case, npz, k, file):
    z, d, cfg, params = _npz(npz), _image(file), _cfg(), _params()
    b, start, length = (int(v) for v in z["prefill.image_spans"][k])
    ref = z["prefill.embed_out"][b, start:start + length]
    types = z["prefill.token_types"][b, start:start + length]
    np.testing.assert_array_equal(types, d["token_types"])
    # End to end from the image (inherits the ViT's few-ulp differences, see test_vit).
    rows = vision.span_rows(params, vision.aligner_forward(
        params["aligner"], jnp.asarray(_vit(file)[0]), d["vit_grid"], cfg), d["token_types"])
    e = _assert_within_ulps(rows, ref, VIT_ULPS, "span rows", max_frac=VIT_FRAC)
    print(f"{case} I{k}: span rows max abs err {e:.3g}")
    # From the recorded aligner output the merge is exact, delimiters included.
    rows = vision.span_rows(params, jnp.asarray(z[f"image.aligner_out.I{k}"]), d["token_types"])
    np.testing.assert_array_equal(_f32(rows), ref)
    for t, name in [(IMAGE_START, "image_start"), (IMAGE_NEW_LINE, "image_newline"),
                    (IMAGE_END, "image_end")]:
        np.testing.assert_array_equal(ref[types == t], np.broadcast_to(
            _f32(params[name]), ref[types == t].shape))


def test_image_embeddings_end_to_end():
    """The public entry point on the smallest image (within the ViT's bound, see test_vit)."""
    z, d = _npz("vl_grad.npz"), _image("grad_56x42.png")
    rows = vision.image_embeddings(_params(), d, _cfg())
    chex.assert_type(rows, jnp.bfloat16)
    chex.assert_shape(rows, (10, _cfg().dim))
    b, start, length = (int(v) for v in z["prefill.image_spans"][0])
    _assert_within_ulps(rows, z["prefill.embed_out"][b, start:start + length], VIT_ULPS,
                        "image rows", max_frac=VIT_FRAC)


# ------------------------------------------------------------------ placeholder expansion
def _raw_to_model_ids(raw: list[int], cfg) -> list[int]:
    """Manifest raw ids -> fixture ids: the image token becomes image_token_id, others mod vocab."""
    return [cfg.image_token_id if t == REAL_IMAGE_TOKEN_ID else t % cfg.vocab_size for t in raw]


@pytest.mark.parametrize("case", [c["name"] for c in _manifest()["cases"]])
def test_expand_image_placeholders(case):
    cfg = _cfg()
    c = next(c for c in _manifest()["cases"] if c["name"] == case)
    z = _npz(c["file"])
    spans_ref = [tuple(int(v) for v in s) for s in z["prefill.image_spans"]]
    for b, row in enumerate(c["rows"]):
        images = [_image(f) for f in row["images"]]
        ids, types, spans = expand_image_placeholders(
            _raw_to_model_ids(row["raw_token_ids"], cfg), images, cfg)
        chex.assert_type([ids, types], np.int32)
        np.testing.assert_array_equal(ids, z["input_ids"][b])
        np.testing.assert_array_equal(types, z["prefill.token_types"][b])
        assert [(b, s, n) for s, n in spans] == [s for s in spans_ref if s[0] == b]
        np.testing.assert_array_equal(types >= 0, z["prefill.image_mask"][b])


def test_expand_image_placeholders_errors():
    cfg = _cfg()
    img = _image("grad_56x42.png")
    tok = cfg.image_token_id
    with pytest.raises(ValueError, match="placeholders"):
        expand_image_placeholders([0, tok, 5, tok], [img], cfg)
    with pytest.raises(ValueError, match="placeholders"):
        expand_image_placeholders([0, 5], [img], cfg)
    long_img = dict(img, token_types=np.asarray(
        [IMAGE_START] + [IMAGE] * cfg.vision_max_n_token + [IMAGE_END], np.int32))
    with pytest.raises(ValueError, match="vision_max_n_token"):
        expand_image_placeholders([0, tok], [long_img], cfg)
    ids, types, spans = expand_image_placeholders([1, 2, 3], [], cfg)
    assert ids.tolist() == [1, 2, 3] and types.tolist() == [-1, -1, -1] and spans == []


def test_span_rows_rejects_mismatched_slots():
    params = _params()
    with pytest.raises(ValueError, match="IMAGE slots"):
        vision.span_rows(params, jnp.zeros((5, _cfg().dim), jnp.bfloat16),
                         _image("grad_56x42.png")["token_types"])


def test_rope_table_layout():
    """First half of the angles is row-based, second half column-based."""
    cos, sin = vision.vision_rope_table(2, 3, 16, 10000.0)
    chex.assert_shape(cos, (6, 8))
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    phi = np.arctan2(_f32(sin), _f32(cos))
    np.testing.assert_allclose(phi[5, :4], 1 * inv, rtol=1e-6)   # row 1
    np.testing.assert_allclose(phi[5, 4:], np.angle(np.exp(2j * inv)), rtol=1e-6)  # col 2
    assert math.isclose(float(phi[0].max()), 0.0, abs_tol=0.0)
