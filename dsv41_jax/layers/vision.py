"""Vision tower: ViT with 2D RoPE, the 3x3 aligner, the image-span embedding rows.

See docs/architecture.md, "Vision transformer and aligner" and
"Image spans".

Pure functions of the nested checkpoint dicts: ``p`` for :func:`vit_forward` is the subtree
under ``vision.`` (``p["blocks"][i]["attn"]["wqkv"]["weight"]``), for :func:`aligner_forward`
the one under ``aligner.``; :func:`image_embeddings` takes the whole nested checkpoint. Weights
stay in their stored bf16; the vision RMSNorm weights are used in fp32.

Numerics follow torch on CPU with bf16 default dtype (checked against the tiny-vl fixtures):

* bf16 ``nn.Linear``: ``bf16(x @ W.T + b)`` with the product accumulated and the bias added in
  fp32, one rounding at the end (adding the bias after rounding misses the fixtures).
* SDPA takes torch's math path, which upcasts bf16 inputs to fp32: ``q`` and ``k`` are each scaled
  by ``sqrt(1/sqrt(head_dim))`` in fp32, softmax and ``P @ V`` in fp32, one bf16 rounding of the
  output.
* Element-wise ops (RoPE rotation, SiLU, GELU, RMSNorm) compute in fp32 and round each result to
  bf16, as torch's bf16 kernels do.

Dimension letters: N patches (``n_vit_h * n_vit_w``), P patch features (``3*p*p``), V vision_dim,
H vision heads, E head dim, R RoPE angles (``E / 2``), F vision_inter_dim, L aligner cells
(``n_llm_h * n_llm_w``), U unfolded features (``V * r * r``), D model dim, T span tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float
from dsv41_jax.dtypes import BF16, F32, HIGHEST

VISION_NORM_EPS = 1e-6

# Token types of an image span (docs/architecture.md, "Image spans"); the same values as
# dsv41_jax.image_processor.
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = 0, 1, 2, 3


# --------------------------------------------------------------------------------- primitives
def _round_bf16(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """Round an fp32 intermediate to bf16, as torch stores every bf16 op result.

    ``reduce_precision`` first: XLA may drop an ``f32 -> bf16 -> f32`` convert pair inside a
    fusion (excess precision is allowed by default), which would skip the rounding under ``jit``.
    """
    return jax.lax.reduce_precision(x.astype(F32), exponent_bits=8, mantissa_bits=7).astype(BF16)


def _add_bf16(a: Float[Array, "..."], b: Float[Array, "..."]) -> Float[Array, "..."]:
    """bf16 residual add ``bf16(a + b)``, rounded even inside a fused ``jit`` region."""
    return _round_bf16(a.astype(F32) + b.astype(F32))


def _linear(x: Float[Array, "... I"], p: dict) -> Float[Array, "... O"]:
    """bf16 ``nn.Linear``: ``bf16(x @ W.T + b)``, fp32 accumulation and bias add.
    See docs/architecture.md, "Vision transformer and aligner".

    The bf16 operands are upcast (their products are exact in fp32) and summed in chunks of 16
    whose fp32 partial sums are added pairwise: the result is then as close to the exact sum as
    the reference's (the recorded ``aligner_out`` is reproduced bit for bit), where XLA:CPU's
    plain fp32 GEMM flips the bf16 rounding of a few outputs.
    """
    w_oi = jnp.asarray(p["weight"]).astype(BF16).astype(F32)
    x_i = x.astype(BF16).astype(F32)
    n_in = x_i.shape[-1]
    c = 16 if n_in % 16 == 0 else n_in
    part = jnp.einsum("...jc,ojc->j...o", x_i.reshape(*x_i.shape[:-1], n_in // c, c),
                      w_oi.reshape(-1, n_in // c, c), precision=HIGHEST)
    while part.shape[0] > 1:   # pairwise sum of the chunk partials
        if part.shape[0] % 2:
            part = jnp.concatenate([part, jnp.zeros_like(part[:1])])
        part = part[0::2] + part[1::2]
    y = part[0]
    if "bias" in p:
        y = y + jnp.asarray(p["bias"]).astype(F32)
    return _round_bf16(y)


def vision_rms_norm(x: Float[Array, "... V"], w: Float[ArrayLike, "V"]) -> Float[Array, "... V"]:
    """Vision RMSNorm: ``bf16(w_f32 * x_f32 * rsqrt(mean(x^2) + 1e-6))``.

    See docs/architecture.md, "Vision transformer and aligner".
    """
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + VISION_NORM_EPS)
    return _round_bf16(jnp.asarray(w).astype(F32) * y)


def vision_rope_table(n_vit_h: int, n_vit_w: int, head_dim: int, theta: float
                      ) -> tuple[Float[Array, "N R"], Float[Array, "N R"]]:
    """fp32 ``(cos, sin)`` ``[N, head_dim/2]`` of the 2D RoPE, patches row-major.
    See docs/architecture.md, "Vision transformer and aligner".

    ``rope_dim = head_dim/2``; ``inv_freq_k = theta^(-2k/rope_dim)`` for ``k < rope_dim/2``; the
    patch at (row, col) gets the angles ``[row * inv_freq, col * inv_freq]``.
    """
    rope_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=F32) / rope_dim))
    rows = jnp.repeat(jnp.arange(n_vit_h, dtype=F32), n_vit_w)
    cols = jnp.tile(jnp.arange(n_vit_w, dtype=F32), n_vit_h)
    phi = jnp.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)
    return jnp.cos(phi), jnp.sin(phi)


def _apply_rope(x: Float[Array, "N H E"], cos: Float[Array, "N R"], sin: Float[Array, "N R"]
                ) -> Float[Array, "N H E"]:
    """Half-split rotation (channel d pairs with d + E/2) in fp32, rounded to bf16.

    See docs/architecture.md, "Vision transformer and aligner".
    """
    xf = x.astype(F32)
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return _round_bf16(jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))


def _attention(p: dict, x: Float[Array, "N V"], cos: Float[Array, "N R"],
               sin: Float[Array, "N R"], n_heads: int) -> Float[Array, "N V"]:
    """Full bidirectional self-attention over one image, scale ``1/sqrt(E)``.

    See docs/architecture.md, "Vision transformer and aligner".
    """
    n, dim = x.shape
    e = dim // n_heads
    qkv_nx = _linear(x, p["wqkv"])
    q_nhe, k_nhe, v_nhe = (t.reshape(n, n_heads, e) for t in jnp.split(qkv_nx, 3, axis=-1))
    q_nhe = _apply_rope(q_nhe, cos, sin)
    k_nhe = _apply_rope(k_nhe, cos, sin)
    # torch's math SDPA: fp32 upcast, q and k each scaled by sqrt(scale).
    sq = np.float32(math.sqrt(1.0 / math.sqrt(e)))
    s_hnm = jnp.einsum("nhe,mhe->hnm", q_nhe.astype(F32) * sq, k_nhe.astype(F32) * sq,
                       precision=HIGHEST)
    s_hnm = jnp.exp(s_hnm - jnp.max(s_hnm, axis=-1, keepdims=True))
    p_hnm = s_hnm / jnp.sum(s_hnm, axis=-1, keepdims=True)
    o_nhe = jnp.einsum("hnm,mhe->nhe", p_hnm, v_nhe.astype(F32), precision=HIGHEST)
    return _linear(_round_bf16(o_nhe).reshape(n, dim), p["wo"])


def _mlp(p: dict, x: Float[Array, "N V"]) -> Float[Array, "N V"]:
    """SwiGLU: ``w1`` (no bias) splits into gate | up, ``w2(silu(gate) * up)``.

    See docs/architecture.md, "Vision transformer and aligner".
    """
    gate_nf, up_nf = jnp.split(_linear(x, p["w1"]), 2, axis=-1)
    act_nf = _round_bf16(jax.nn.silu(gate_nf.astype(F32)))
    h_nf = _round_bf16(act_nf.astype(F32) * up_nf.astype(F32))
    return _linear(h_nf, p["w2"])


# --------------------------------------------------------------------------------- ViT
def vit_forward(p: dict, patches: Float[Array, "N P"], vit_grid: tuple[int, int], cfg,
                return_intermediates: bool = False):
    """ViT over one image's patches.
    See docs/architecture.md, "Vision transformer and aligner".

    ``p``: the ``vision.*`` subtree. ``patches``: bf16 ``[N, 3*p*p]`` (row-major patches, (c, y, x)
    features); ``vit_grid = (n_vit_h, n_vit_w)`` with ``N = n_vit_h * n_vit_w`` (static).
    Returns bf16 ``[N, vision_dim]`` after the final RMSNorm; with ``return_intermediates`` also a
    dict ``{"patch_embed": [N, V], "block_out": [n_blocks, N, V]}`` (residual stream after each
    block). Raises ``ValueError`` if N does not match the grid.
    """
    n_h, n_w = vit_grid
    if patches.shape[0] != n_h * n_w:
        raise ValueError(f"{patches.shape[0]} patches do not match the ViT grid {n_h}x{n_w}")
    with jax.named_scope("vit"):
        x_nv = _linear(jnp.asarray(patches), p["patch_embed"]["proj"])
        patch_embed = x_nv
        head_dim = cfg.vision_dim // cfg.vision_n_heads
        cos, sin = vision_rope_table(n_h, n_w, head_dim, float(cfg.vision_rope_theta))
        block_out = []
        for i in range(cfg.vision_n_layers):
            b = p["blocks"][i]
            with jax.named_scope(f"vit_block_{i}"):
                x_nv = _add_bf16(x_nv, _attention(b["attn"], vision_rms_norm(
                    x_nv, b["norm1"]["weight"]), cos, sin, cfg.vision_n_heads))
                x_nv = _add_bf16(x_nv, _mlp(b["mlp"], vision_rms_norm(x_nv, b["norm2"]["weight"])))
            block_out.append(x_nv)
        out = vision_rms_norm(x_nv, p["norm"]["weight"])
    if return_intermediates:
        return out, {"patch_embed": patch_embed, "block_out": jnp.stack(block_out)}
    return out


# --------------------------------------------------------------------------------- aligner
def aligner_unfold(vit_out: Float[Array, "N V"], vit_grid: tuple[int, int], ratio: int
                   ) -> Float[Array, "L U"]:
    """Zero-pad the patch grid to multiples of ``ratio``, unfold ``ratio x ratio`` cells.
    See docs/architecture.md, "Vision transformer and aligner".

    Returns ``[n_llm_h * n_llm_w, V * ratio^2]`` in row-major cell order, feature index
    ``c * ratio^2 + ki * ratio + kj`` (channel-major), in ``vit_out``'s dtype.
    """
    n_h, n_w = vit_grid
    v = vit_out.shape[-1]
    x_hwv = vit_out.reshape(n_h, n_w, v)
    x_hwv = jnp.pad(x_hwv, ((0, (-n_h) % ratio), (0, (-n_w) % ratio), (0, 0)))
    oh, ow = x_hwv.shape[0] // ratio, x_hwv.shape[1] // ratio
    x = x_hwv.reshape(oh, ratio, ow, ratio, v).transpose(0, 2, 4, 1, 3)  # [oh, ow, V, ki, kj]
    return x.reshape(oh * ow, v * ratio * ratio)


def aligner_forward(p: dict, vit_out: Float[Array, "N V"], vit_grid: tuple[int, int], cfg
                    ) -> Float[Array, "L D"]:
    """Aligner: 3x3 unfold, then ``w2(gelu_exact(w1(.)))``.
    See docs/architecture.md, "Vision transformer and aligner".

    ``p``: the ``aligner.*`` subtree. Returns bf16 ``[n_llm_h * n_llm_w, dim]``, the rows of the
    span's IMAGE slots in reading order.
    """
    with jax.named_scope("aligner"):
        u_lu = aligner_unfold(jnp.asarray(vit_out).astype(BF16), vit_grid,
                              cfg.vision_downsample_ratio)
        h_ld = _linear(u_lu, p["w1"])
        h_ld = _round_bf16(jax.nn.gelu(h_ld.astype(F32), approximate=False))
        return _linear(h_ld, p["w2"])


# --------------------------------------------------------------------------------- span rows
def span_rows(params: dict, image_rows: Float[Array, "L D"], token_types) -> Float[Array, "T D"]:
    """Assemble a span's embedding rows from its aligner rows and the learned delimiters.
    See docs/architecture.md, "Image spans".

    ``token_types``: host int array ``[T]`` of START / IMAGE / NEW_LINE / END; IMAGE slots take
    ``image_rows`` in order. Returns bf16 ``[T, dim]``. Raises ``ValueError`` if the number of
    IMAGE slots differs from the number of rows, or a type is not an image type.
    """
    types = np.asarray(token_types)
    if not np.isin(types, (IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END)).all():
        raise ValueError(f"span token types must be in 0..3, got {sorted(set(types.tolist()))}")
    is_img = types == IMAGE
    if int(is_img.sum()) != image_rows.shape[0]:
        raise ValueError(f"span has {int(is_img.sum())} IMAGE slots but the aligner gave "
                         f"{image_rows.shape[0]} rows")
    # One table: aligner rows, then start / newline / end; one gather builds the span.
    table = jnp.concatenate([
        jnp.asarray(image_rows).astype(BF16),
        jnp.stack([jnp.asarray(params[k]).astype(BF16)
                   for k in ("image_start", "image_newline", "image_end")])])
    n = image_rows.shape[0]
    idx = np.where(is_img, np.cumsum(is_img) - 1, 0)
    idx = np.where(types == IMAGE_START, n, idx)
    idx = np.where(types == IMAGE_NEW_LINE, n + 1, idx)
    idx = np.where(types == IMAGE_END, n + 2, idx)
    return table[jnp.asarray(idx, jnp.int32)]


def image_embeddings(params: dict, image: dict, cfg) -> Float[Array, "T D"]:
    """The embedding rows that replace one image span.

    See docs/architecture.md, "Vision transformer and aligner" and "Image spans".

    ``params``: the whole nested checkpoint (``vision``, ``aligner``, ``image_start``,
    ``image_end``, ``image_newline``). ``image``: a ``preprocess_image`` dict (``patches``,
    ``vit_grid``, ``llm_grid``, ``token_types``). Returns bf16 ``[span_len, dim]``: START ->
    ``image_start``, IMAGE -> aligner rows in reading order, NEW_LINE -> ``image_newline``,
    END -> ``image_end``.
    """
    with jax.named_scope("image_embeddings"):
        vit_out = vit_forward(params["vision"], jnp.asarray(image["patches"]), image["vit_grid"],
                              cfg)
        rows = aligner_forward(params["aligner"], vit_out, image["vit_grid"], cfg)
        return span_rows(params, rows, image["token_types"])
