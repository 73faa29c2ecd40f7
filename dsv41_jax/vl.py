"""Vision-language prompts: images -> span embeddings, image mask and padded prompt rows.

Each placeholder (``cfg.image_token_id``) expands into its image's span (docs/architecture.md,
"Image spans"); every span position carries the placeholder id, its embedding is replaced
(START/END/NEW_LINE learned vectors, IMAGE aligner rows), and ``image_mask``
(``token_types >= 0``) selects the MoE ``bias_vl`` and marks the positions DEAD for Engram. Spans
must lie in the first prefill chunk.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.image_processor import expand_image_placeholders, preprocess_image
from dsv41_jax.layers.vision import image_embeddings


def prepare_vl_inputs(params: dict, cfg: ModelConfig, rows: list[list[int]],
                      images: list[list]) -> dict:
    """Batch of prompts with images -> prefill inputs.

    Args:
      rows: token ids per row, each image as one ``cfg.image_token_id`` placeholder.
      images: per row, the PIL images (or :func:`preprocess_image` dicts) in placeholder order.

    Returns ``{"tokens" int32 [B, S], "lengths" int32 [B], "embeds_override" bf16 [B, S, D],
    "image_mask" bool [B, S], "token_types" int32 [B, S]}`` (right-padded), the inputs
    :func:`dsv41_jax.model.prefill` takes (``embeds_override`` and ``image_mask`` together).
    Raises ``ValueError`` when there is no row, a row is empty, ``rows`` and ``images`` have
    different lengths, a row's placeholders and images disagree, a token id is outside
    [0, vocab_size) or vision is off in the config.
    """
    if not rows:
        raise ValueError("rows: at least one prompt row is needed")
    if len(images) != len(rows):
        raise ValueError(f"images: one list of images per row is needed ({len(rows)} rows), "
                         f"got {len(images)} lists")
    if cfg.vision_n_layers <= 0 and any(images):
        raise ValueError("images given but the config has vision_n_layers = 0")
    for b, ids in enumerate(rows):
        ids = np.asarray(ids)
        if ids.ndim != 1 or not ids.size:
            raise ValueError(f"rows[{b}]: a non-empty list of token ids is needed, got shape "
                             f"{list(ids.shape)}")
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"rows[{b}]: token id {int(bad[0])} is outside [0, vocab_size="
                             f"{cfg.vocab_size})")
    exp = []
    for ids, imgs in zip(rows, images, strict=True):
        pre = [im if isinstance(im, dict) else preprocess_image(im, cfg) for im in imgs]
        toks, types, spans = expand_image_placeholders(list(ids), pre, cfg)
        exp.append((toks, types, spans, pre))
    S = max(len(e[0]) for e in exp)
    B = len(exp)
    tokens = np.zeros((B, S), np.int32)
    types = np.full((B, S), -1, np.int32)
    override = np.zeros((B, S, cfg.dim), np.float32)
    for b, (toks, tt, spans, pre) in enumerate(exp):
        tokens[b, :len(toks)] = toks
        types[b, :len(tt)] = tt
        for (start, length), im in zip(spans, pre):
            override[b, start:start + length] = np.asarray(
                image_embeddings(params, im, cfg), np.float32)
    return {"tokens": tokens, "lengths": np.array([len(e[0]) for e in exp], np.int32),
            "embeds_override": jnp.asarray(override, jnp.bfloat16),
            "image_mask": jnp.asarray(types >= 0), "token_types": types}
