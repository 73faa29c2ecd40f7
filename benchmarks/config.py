"""Benchmark configs: the release attention and layer layout with a cheaper MoE and vocabulary.

:func:`bench_config` starts from ``configs/flash.json`` and keeps every attention and layout key
(dim, the 40 layers, heads, head_dim, window, LoRA ranks, ``compress_ratios``, KV / index
sources, indexer heads and top-k, candidate pool, mHC, RoPE) while it reduces what only costs
memory or dense-MoE time in a prefill benchmark:

* ``n_routed_experts`` (384 -> 8 by default; our MoE runs every expert densely, so the routed
  expert count is a pure cost knob; ``n_activated_experts`` stays <= it),
* ``vocab_size`` (129,280 -> 4096; only the embedding gather and the last-position head),
* DSpark (MTP) and vision off (they are not part of text prefill),
* Engram: ``"shrink"`` keeps both Engram layers (1 and 14), their heads, head dim, n-gram size
  and the ``wkv`` projection, so the per-token compute is the release one, but hashes into
  tables of ~0.4 M rows instead of ~384 M (a gather's cost does not depend on the table size);
  the compressed token map is the identity over the reduced vocabulary. ``"drop"`` removes
  Engram altogether.

:func:`tiny_config` is a few-layer version with small dims for CPU smoke tests that still has
every layer role (SWA-only, ratio-2 source + Reuse, ratio-1 source = decoder start + candidate
pool, Reuse, Reindex) and an Engram layer.

:func:`reductions` lists every key that differs from the release config (``release`` vs
``bench`` value), for the benchmark's printed and JSON output.

:func:`e2e_config` gives the end-to-end benchmark's configs (``mid``, ``release-fit``,
``tiny``), and :func:`loaded_tensor_bytes` / :func:`param_bytes_by_group` the bytes of the
parameters as the loader holds them, from which ``release-fit`` picks its expert count.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from dsv41_jax.checkpoint import expected_tensors
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.engram import _next_prime

FLASH_JSON = os.path.join(os.path.dirname(__file__), "..", "configs", "flash.json")

# Keys the bench config must keep from the release config (checked by bench_config).
ATTENTION_LAYOUT_KEYS = (
    "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "window_size", "q_lora_rank",
    "o_groups", "o_lora_rank", "compress_ratios", "kv_source_layers", "index_source_layers",
    "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "rope_theta", "compress_rope_theta", "rope_factor", "original_seq_len", "beta_fast",
    "beta_slow", "norm_eps", "moe_inter_dim", "dtype", "expert_dtype", "score_func",
    "route_scale", "swiglu_limit", "n_shared_experts")


def load_release_dict(path: str | None = None) -> dict:
    """The release config (``configs/flash.json``, or ``path``) as a dict."""
    with open(path or FLASH_JSON) as f:
        return json.load(f)


def engram_table_rows(n_layers: int, vocab_size: int, max_ngram: int, n_heads: int) -> list[int]:
    """``engram_num_embeddings`` consistent with :func:`engram.engram_constants`: the sums of
    consecutive primes above ``vocab_size - 1``, ``(max_ngram - 1) * n_heads`` per layer."""
    last = vocab_size - 1
    rows = []
    for _ in range(n_layers):
        s = 0
        for _ in range((max_ngram - 1) * n_heads):
            last = _next_prime(last)
            s += last
        rows.append(s)
    return rows


def identity_token_map(vocab_size: int) -> np.ndarray:
    """Compressed token map for a reduced vocabulary: every id is its own compressed id."""
    return np.arange(vocab_size, dtype=np.int32)


def _shrink_engram(d: dict, engram: str, engram_vocab_size: int) -> dict:
    d = dict(d)
    if engram == "drop" or not d.get("engram_layer_ids"):
        d.update(engram_layer_ids=[], engram_num_embeddings=[])
        return d
    if engram != "shrink":
        raise ValueError(f"engram must be 'shrink' or 'drop', got {engram!r}")
    d["engram_vocab_size"] = engram_vocab_size
    d["engram_compressed_vocab_size"] = d["vocab_size"]     # identity map over the vocab
    d["engram_num_embeddings"] = engram_table_rows(
        len(d["engram_layer_ids"]), engram_vocab_size, d["engram_max_ngram_size"],
        d["engram_n_heads"])
    return d


def _no_extras(d: dict) -> dict:
    """DSpark (MTP) and vision off; placeholder ids inside the (reduced) vocabulary."""
    d = dict(d)
    d.update(n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
             dspark_n_routed_experts=0, dspark_n_activated_experts=0, vision_n_layers=0)
    v = d["vocab_size"]
    d["image_token_id"] = min(d.get("image_token_id", v - 1), v - 1)
    d["dspark_noise_token_id"] = min(d.get("dspark_noise_token_id", 0), v - 1)
    return d


def bench_config(n_routed_experts: int = 8, n_activated_experts: int = 6,
                 vocab_size: int = 4096, engram: str = "shrink",
                 engram_vocab_size: int = 16384, release_path: str | None = None
                 ) -> tuple[ModelConfig, dict]:
    """``(cfg, release_dict)``: the release config with the reductions of the module docstring.

    Raises ``ValueError`` if the result would change an attention / layout key.
    """
    rel = load_release_dict(release_path)
    d = dict(rel)
    d["n_routed_experts"] = n_routed_experts
    d["n_activated_experts"] = min(n_activated_experts, n_routed_experts)
    d["vocab_size"] = vocab_size
    d = _no_extras(d)
    d = _shrink_engram(d, engram, engram_vocab_size)
    cfg = ModelConfig.from_dict(d)
    ref = ModelConfig.from_dict(rel)
    for k in ATTENTION_LAYOUT_KEYS:
        if getattr(cfg, k) != getattr(ref, k):
            raise ValueError(f"bench config changed the attention/layout key {k}")
    return cfg, rel


def tiny_config(engram: str = "shrink") -> tuple[ModelConfig, dict]:
    """A 6-layer, dim-64 config with every layer role, for CPU smoke tests.

    Layers: 0 SWA-only; 1 ratio-2 KV + index source (Full) with Engram; 2 ratio-2 Reuse;
    3 ratio-1 KV + index source = CED decoder start and candidate-pool source; 4 ratio-1 Reuse;
    5 ratio-1 Reindex over the candidate pool. Returns ``(cfg, release_dict)``.
    """
    rel = load_release_dict()
    d = dict(rel)
    d.update(
        vocab_size=512, dim=64, moe_inter_dim=64, n_layers=6, n_heads=4, n_routed_experts=4,
        n_activated_experts=2, q_lora_rank=64, head_dim=64, rope_head_dim=32, o_groups=2,
        o_lora_rank=64, window_size=16, compress_ratios=[0, 2, 2, 1, 1, 1],
        kv_source_layers=[1, 3], index_source_layers=[1, 3, 5], original_seq_len=256,
        rope_factor=4, index_n_heads=4, index_head_dim=64, index_topk=8,
        candidate_source_layer=3, candidate_topk_blocks=4, candidate_block_size=4,
        engram_layer_ids=[1], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32)
    d = _no_extras(d)
    d = _shrink_engram(d, engram, 97)
    return ModelConfig.from_dict(d), rel


def reductions(cfg: ModelConfig, release: dict) -> dict:
    """``{key: {"release": value, "bench": value}}`` for every key that differs."""
    ref = ModelConfig.from_dict(release).to_dict()
    cur = cfg.to_dict()
    return {k: {"release": ref[k], "bench": cur[k]} for k in cur if cur[k] != ref[k]}


# ----------------------------------------------------------------------------- end to end

#: The end-to-end benchmark's configs (:func:`e2e_config`).
E2E_CONFIGS = ("mid", "release-fit", "release-384", "release", "tiny")

#: ``mid``: the release attention, indexer, candidate pool and 40-layer layout at width 2048
#: with 16 small experts; the PyTorch peer's ``mid`` preset (``shared/bench/peer_nemo.py``).
MID_OVERRIDES = dict(dim=2048, n_routed_experts=16, n_activated_experts=6, moe_inter_dim=512)

#: ``release-fit``: the memory of one H200 as the benchmark budgets it (141 GB), and what stays
#: free beside the weights (activations, the state, XLA's workspace).
GPU_BYTES = 141e9
HEADROOM_BYTES = 16e9

_DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}


def loaded_tensor_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes of every text-model tensor of :func:`dsv41_jax.checkpoint.expected_tensors` as the
    loader holds it (:func:`dsv41_jax.checkpoint.params_from_tensors`): the first allowed dtype,
    with the load-time conversions applied: the head in fp32, ``wo_a`` dequantised to bf16 (its
    scale dropped), the ratio-2 compressors' ``wkv`` / ``wgate`` in fp32. Engram's hashing
    constants and token map (a few KB) are not tensors of the checkpoint and not counted."""
    out = {}
    for name, (shape, dtypes) in expected_tensors(cfg).items():
        size = math.prod(shape) * _DTYPE_BYTES[dtypes[0]]
        if name == "head.weight":
            size = math.prod(shape) * 4
        elif ".attn.wo_a." in name:
            size = 0 if name.endswith(".scale") else math.prod(shape) * 2
        elif ".attn.compressor.w" in name:
            layer = int(re.match(r"layers\.(\d+)\.", name).group(1))
            if cfg.compress_ratios[layer] > 1:
                size = math.prod(shape) * 4
        out[name] = size
    return out


def param_group(name: str) -> str:
    """The group of a tensor name for the byte counts: ``embed`` (the token embedding), ``head``,
    ``experts`` (routed experts), ``engram_tables`` (Engram's hashed embedding tables),
    ``attn_fp8`` (FP8 linears of the attention sublayers, indexer included), else ``dense``."""
    if name == "embed.weight":
        return "embed"
    if name == "head.weight":
        return "head"
    if ".ffn.experts." in name:
        return "experts"
    if ".engram.embed." in name:
        return "engram_tables"
    return "dense"


def param_bytes_by_group(cfg: ModelConfig) -> dict[str, int]:
    """Loaded parameter bytes (:func:`loaded_tensor_bytes`) per :func:`param_group`, and
    ``attn_fp8_elements``: the elements of the FP8 attention weights (``layers.*.attn.*``,
    indexer included; ``wo_a`` is bf16 already), whose bf16 copy a prepared layout may hold."""
    exp = expected_tensors(cfg)
    out = dict.fromkeys(("embed", "head", "experts", "engram_tables", "dense"), 0)
    fp8_attn = 0
    for name, size in loaded_tensor_bytes(cfg).items():
        out[param_group(name)] += size
        shape, dtypes = exp[name]
        if (".attn." in name and name.endswith(".weight") and dtypes[0] == "float8_e4m3fn"
                and ".wo_a." not in name):
            fp8_attn += math.prod(shape)
    out["attn_fp8_elements"] = fp8_attn
    return out


def fit_bytes(cfg: ModelConfig) -> int:
    """What ``release-fit`` budgets for a config: the loaded parameters plus a bf16 copy of the
    FP8 attention weights (:func:`param_bytes_by_group`)."""
    g = param_bytes_by_group(cfg)
    return sum(v for k, v in g.items() if k != "attn_fp8_elements") + 2 * g["attn_fp8_elements"]


def _release_fit_dict(n_routed_experts: int) -> dict:
    d = _no_extras(load_release_dict())
    d.update(n_routed_experts=n_routed_experts, n_activated_experts=min(6, n_routed_experts))
    return _shrink_engram(d, "drop", 0)


def release_fit_experts(gpu_bytes: float = GPU_BYTES, headroom: float = HEADROOM_BYTES,
                        multiple: int = 8) -> tuple[int, dict]:
    """The largest routed-expert count (a multiple of ``multiple``, at most the release's 384,
    at least 6 + 2 so that 6 are activated) whose :func:`fit_bytes` plus ``headroom`` fit
    ``gpu_bytes``, at the release dimensions with Engram, DSpark and vision off. Returns
    ``(experts, {"fit_bytes", "per_expert_bytes", "gpu_bytes", "headroom_bytes"})``. Raises
    ``ValueError`` when not even ``multiple`` experts fit."""
    def size(e):
        return fit_bytes(ModelConfig.from_dict(_release_fit_dict(e)))
    a, b = size(multiple), size(2 * multiple)          # bytes are linear in the expert count
    per = (b - a) / multiple
    top = load_release_dict()["n_routed_experts"]
    e = min(top, multiple * int((gpu_bytes - headroom - (a - multiple * per)) // (per * multiple)))
    while e >= multiple and size(e) + headroom > gpu_bytes:
        e -= multiple
    if e < multiple:
        raise ValueError(f"not even {multiple} routed experts fit {gpu_bytes / 1e9:.0f} GB")
    return e, {"fit_bytes": size(e), "per_expert_bytes": per, "gpu_bytes": gpu_bytes,
               "headroom_bytes": headroom}


#: ``release-384``: the release dimensions with all 384 routed experts (7.6 GB of FP4 experts per
#: layer in the grouped matmul's form) on the tiny config's layout, every layer role once:
#: SWA-only, ratio-2 KV + index source, a Reuse of it, ratio-1 KV + index source (the CED
#: decoder start and candidate-pool source), a Reuse of it, Reindex. Six layers (50 GB of
#: weights, prepared with ``donate=True``: the peak is about one layer more), so that an 80 GB
#: H100 runs it as well as a 141 GB H200.
RELEASE_384_LAYOUT = dict(n_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1],
                          kv_source_layers=[1, 3], index_source_layers=[1, 3, 5],
                          candidate_source_layer=3)


def e2e_config(name: str) -> tuple[ModelConfig, dict]:
    """``(cfg, release_dict)`` of an end-to-end benchmark config (:data:`E2E_CONFIGS`).

    * ``mid``: ``configs/flash.json`` with :data:`MID_OVERRIDES` (dim 2048, 16 routed experts of
      which 6 activated, expert width 512); Engram, DSpark and vision off; the 40 layers, the
      attention, indexer and candidate pool and the 129,280-token vocabulary as released.
    * ``release-fit``: the release dimensions (dim 5120, expert width 2304, 40 layers, the
      vocabulary) with Engram, DSpark and vision off and as many routed experts as fit one
      141 GB GPU (:func:`release_fit_experts`; 6 activated).
    * ``release-384``: the release dimensions and all 384 routed experts (the routed MoE's
      config) on :data:`RELEASE_384_LAYOUT`'s 6 layers; Engram, DSpark and vision off.
    * ``release``: ``configs/flash.json`` as released (Engram and the DSpark head included),
      the vision encoder off (the rows are text); for a mesh of several GPUs (its weights
      exceed one GPU's memory: ``scripts/plan_memory.py``).
    * ``tiny``: :func:`tiny_config` without Engram (CPU smoke tests).

    Raises ``ValueError`` for another name.
    """
    if name == "mid":
        d = _no_extras(load_release_dict())
        d.update(MID_OVERRIDES)
        d = _shrink_engram(d, "drop", 0)
    elif name == "release-fit":
        d = _release_fit_dict(release_fit_experts()[0])
    elif name == "release-384":
        d = _release_fit_dict(load_release_dict()["n_routed_experts"])
        d.update(RELEASE_384_LAYOUT)
    elif name == "release":
        d = dict(load_release_dict(), vision_n_layers=0)
    elif name == "tiny":
        return tiny_config("drop")
    else:
        raise ValueError(f"unknown end-to-end config {name!r}: expected one of "
                         f"{', '.join(E2E_CONFIGS)}")
    return ModelConfig.from_dict(d), load_release_dict()
