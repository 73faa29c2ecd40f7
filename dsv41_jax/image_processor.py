"""Image preprocessing and prompt span expansion, as the reference ``image_processor.py``.

See docs/architecture.md, "Image preprocessing" and "Image spans".

Host-side numpy/Pillow code: an RGB image becomes a padded canvas whose sides are multiples of the
patch size, its normalised bf16 pixels, the ViT patches and the token-type layout of its span in
the prompt. ``expand_image_placeholders`` turns a prompt with one ``image_token_id`` per image into
the model's ``input_ids`` / ``token_types``.

The resize arithmetic is plain Python float64 in the reference's expression order: the binding side
``floor(side * beta / p) * p`` is an exact multiple of ``p`` in exact arithmetic, so the result
depends on float64 rounding (fixtures README, "Preprocessing hazard").
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps

# Token types of an image span (docs/architecture.md, "Image spans"); text positions carry TEXT.
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3

PAD_COLOR = (127, 127, 127)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Span length: START, ``n_llm_h`` rows of ``n_llm_w`` IMAGE slots plus a NEW_LINE, END."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(best_h: int, best_w: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    """``(n_llm_h, n_llm_w)``: the aligner's cell grid for a ``best_h x best_w`` canvas."""
    return (math.ceil((best_h // patch_size) / downsample_ratio),
            math.ceil((best_w // patch_size) / downsample_ratio))


def solve_resize_ratio(height: int, width: int, patch_size: int, downsample_ratio: int,
                       max_n_token: int) -> tuple[int, int]:
    """Largest aspect-preserving canvas ``(best_h, best_w)`` whose span fits ``max_n_token``.

    Float64 in the reference's order (do not simplify: see the module docstring). A very tall
    image collapses to one column of ``(max_n_token - 2) // 2`` cells, a very wide one to one row
    of ``max_n_token - 3`` cells.
    """
    r = height / width
    max_w_float = math.sqrt((max_n_token - 2) / r + 0.25) - 0.5
    max_h_float = max_w_float * r
    cell = patch_size * downsample_ratio
    if max_w_float < 1.0:  # very tall: a single column
        return (max_n_token - 2) // 2 * cell, cell
    if max_h_float < 1.0:  # very wide: a single row
        return cell, (max_n_token - 3) * cell
    beta = min(math.floor(max_w_float) * cell / width, math.floor(max_h_float) * cell / height)
    return (math.floor(height * beta / patch_size) * patch_size,
            math.floor(width * beta / patch_size) * patch_size)


def plan_canvas(width: int, height: int, cfg) -> tuple[int, int, bool]:
    """``(best_w, best_h, stretch)`` for an image of ``width x height`` pixels
    (docs/architecture.md, "Image preprocessing").

    ``stretch`` is True when ``vision_max_wh_ratio`` clamps the width: the reference then uses a
    plain resize instead of ``ImageOps.pad``. Raises ``ValueError`` if the span still exceeds
    ``vision_max_n_token`` after ``solve_resize_ratio``.
    """
    p, ratio, max_n = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    orig_w, orig_h = width, height
    max_wh = cfg.vision_max_wh_ratio
    stretch = False
    if max_wh is not None and width > height * max_wh:
        width = height * max_wh
        stretch = True
    if width * height < cfg.vision_min_pixels:
        s = math.sqrt(cfg.vision_min_pixels / (width * height))
        width, height = int(width * s), int(height * s)
    best_w = math.ceil(width / p) * p
    best_h = math.ceil(height / p) * p
    if num_image_tokens(*llm_grid(best_h, best_w, p, ratio)) > max_n:
        best_h, best_w = solve_resize_ratio(height, width, p, ratio, max_n)
        n = num_image_tokens(*llm_grid(best_h, best_w, p, ratio))
        if n > max_n:
            raise ValueError(f"image {orig_w}x{orig_h} still needs {n} tokens after resizing "
                             f"to {best_w}x{best_h}; vision_max_n_token={max_n}")
    return best_w, best_h, stretch


def span_token_types(n_llm_h: int, n_llm_w: int) -> np.ndarray:
    """int32 ``[n_llm_h*(n_llm_w+1)+2]``.

    Layout ``[START] + ([IMAGE]*n_llm_w + [NEW_LINE])*n_llm_h + [END]`` (docs/architecture.md,
    "Image spans").
    """
    types = [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]
    return np.asarray(types, dtype=np.int32)


def preprocess_image(image: Image.Image, cfg) -> dict:
    """The reference ``load_image`` for one image (docs/architecture.md, "Image preprocessing").

    Returns a dict:
      ``padded_rgb`` uint8 ``[best_h, best_w, 3]`` (``ImageOps.pad``, bicubic, grey 127 borders),
      ``pixels`` bf16 ``[3, best_h, best_w]`` = ``(rgb/255 - 0.5)/0.5``,
      ``patches`` bf16 ``[N, 3*p*p]`` (patches row-major, each flattened in (c, y, x) order),
      ``vit_grid`` ``(n_vit_h, n_vit_w)``, ``llm_grid`` ``(n_llm_h, n_llm_w)``,
      ``token_types`` int32 ``[span_len]``.
    Raises ``ValueError`` if the image cannot fit ``cfg.vision_max_n_token``.
    """
    image = image.convert("RGB")
    best_w, best_h, stretch = plan_canvas(image.width, image.height, cfg)
    if stretch:
        canvas = image.resize((best_w, best_h), Image.Resampling.BICUBIC)
    else:
        canvas = ImageOps.pad(image, (best_w, best_h), color=PAD_COLOR)
    rgb = np.asarray(canvas, dtype=np.uint8)
    x = (rgb.astype(np.float32) / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)
    pixels = np.ascontiguousarray(x.transpose(2, 0, 1)).astype(ml_dtypes.bfloat16)
    p = cfg.vision_patch_size
    n_vit_h, n_vit_w = best_h // p, best_w // p
    patches = (pixels.reshape(3, n_vit_h, p, n_vit_w, p).transpose(1, 3, 0, 2, 4)
               .reshape(n_vit_h * n_vit_w, 3 * p * p))
    grid = llm_grid(best_h, best_w, p, cfg.vision_downsample_ratio)
    return {
        "padded_rgb": rgb,
        "pixels": pixels,
        "patches": np.ascontiguousarray(patches),
        "vit_grid": (n_vit_h, n_vit_w),
        "llm_grid": grid,
        "token_types": span_token_types(*grid),
    }


def expand_image_placeholders(token_ids: list[int], images: list[dict], cfg
                              ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Expand each ``cfg.image_token_id`` of a prompt into its image's span (docs/architecture.md,
    "Image spans").

    ``token_ids``: one prompt row; the k-th placeholder is ``images[k]`` (a
    :func:`preprocess_image` dict). Returns ``input_ids`` int32 ``[S]`` (every span position is
    ``image_token_id``), ``token_types`` int32 ``[S]`` (``-1`` on text), and the spans as
    ``(start, length)`` in prompt order. Raises ``ValueError`` if the number of placeholders
    differs from ``len(images)`` or a span is longer than ``cfg.vision_max_n_token``.
    """
    tok = cfg.image_token_id
    n_ph = sum(1 for t in token_ids if t == tok)
    if n_ph != len(images):
        raise ValueError(f"prompt has {n_ph} image placeholders (id {tok}) but "
                         f"{len(images)} images were given")
    ids: list[np.ndarray] = []
    types: list[np.ndarray] = []
    spans: list[tuple[int, int]] = []
    pos, k = 0, 0
    for t in token_ids:
        if t != tok:
            ids.append(np.asarray([t], np.int32))
            types.append(np.asarray([TEXT], np.int32))
            pos += 1
            continue
        tt = np.asarray(images[k]["token_types"], np.int32)
        if tt.size > cfg.vision_max_n_token:
            raise ValueError(f"image {k} span has {tt.size} tokens > vision_max_n_token="
                             f"{cfg.vision_max_n_token}")
        ids.append(np.full(tt.size, tok, np.int32))
        types.append(tt)
        spans.append((pos, int(tt.size)))
        pos += tt.size
        k += 1
    if not ids:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), spans
    return np.concatenate(ids), np.concatenate(types), spans
