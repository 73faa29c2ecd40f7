"""Model configuration (the reference's ``inference/config.json``) and derived layer roles.

``ModelConfig`` reads the reference keys verbatim (docs/architecture.md, "Configuration") or the
nested Hugging Face layout; absent keys take the reference defaults. ``LayerPlan`` derives each
layer's role (docs/architecture.md, "Layer schedule"): SWA-only / Full / Reindex / Reuse, the
layers whose main KV and top-k it reads, the candidate pool, Engram, the RoPE table kind, and the
encoder/decoder (CED) split.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any

# Defaults of the reference ModelArgs dataclass, for keys absent from config.json
# (docs/architecture.md, "Configuration").
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, dim=1024, moe_inter_dim=1024, n_layers=5, n_mtp_layers=1, n_heads=16,
    n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus",
    gate_temp=1.0, norm_topk_prob=True, route_scale=1.0, swiglu_limit=0.0, q_lora_rank=256,
    head_dim=128, rope_head_dim=32, norm_eps=1e-20, o_groups=8, o_lora_rank=256,
    window_size=128, compress_ratios=(0, 2, 2, 1, 1, 0), kv_source_layers=(1, 3),
    index_source_layers=(1, 3), compress_rope_theta=40000.0, original_seq_len=0,
    rope_theta=10000.0, rope_factor=40.0, beta_fast=32, beta_slow=1, index_n_heads=16,
    index_head_dim=64, index_topk=64, candidate_source_layer=-1, candidate_topk_blocks=0,
    candidate_block_size=0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=(), engram_num_embeddings=(), engram_max_ngram_size=1,
    engram_vocab_size=0, engram_n_heads=0, engram_head_dim=0, engram_pad_id=2,
    engram_compressed_vocab_size=0, vision_n_layers=0, vision_dim=1024, vision_n_heads=16,
    vision_inter_dim=2816, vision_patch_size=14, vision_rope_theta=10000.0,
    vision_downsample_ratio=3, vision_max_n_token=1024, vision_min_pixels=544 * 544,
    vision_max_wh_ratio=None, image_token_id=129264, dspark_block_size=0,
    dspark_noise_token_id=0, dspark_target_layer_ids=(), dspark_markov_rank=256,
    dspark_n_routed_experts=0, dspark_n_activated_experts=0, dtype="fp8", expert_dtype="fp4",
    max_batch_size=4, max_seq_len=4096, temperature=1.0,
)

# Nested Hugging Face config.json names -> reference names (docs/architecture.md, "Configuration").
_HF_NAMES = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer", "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers", "rms_norm_eps": "norm_eps",
    "routed_scaling_factor": "route_scale", "scoring_func": "score_func",
    "n_routed_experts": "n_routed_experts", "num_experts_per_tok": "n_activated_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim", "index_topk": "index_topk",
}

# Keys that Hugging Face and reference config.json files carry as bookkeeping: accepted and not
# read (they do not describe the computation, or describe the one this model always runs).
_METADATA_KEYS = frozenset({
    "_name_or_path", "architectures", "auto_map", "model_type", "torch_dtype",
    "transformers_version", "quantization_config", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "use_cache", "initializer_range", "hidden_act",
    "attention_bias", "attention_dropout", "max_position_embeddings", "topk_method",
})
# Top level of the nested layout: its sections, and the storage dtype of the safetensors files.
_NESTED_SECTIONS = frozenset({"text_config", "vision_config", "quantization_config", "dtype"})

_TUPLE_KEYS = ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
               "engram_num_embeddings", "dspark_target_layer_ids")


def _check_keys(d: dict, known: set | frozenset, where: str) -> None:
    """Raise ``ValueError`` naming the first key of ``d`` not in ``known`` (``where``: the part of
    the file it is in) and the closest known key."""
    for k in d:
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config key {k!r} in {where}{hint}")


def _check_types(vals: dict, types: dict) -> None:
    """Raise ``ValueError`` naming the first value whose JSON type does not fit its field:
    ``int`` (not a bool or a float), ``float`` (an int or a float), ``str``, ``bool``, ``tuple``
    (a list of integers); ``Any`` fields take anything."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    ok = {"int": is_int, "float": lambda v: is_int(v) or isinstance(v, float),
          "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
          "tuple": lambda v: isinstance(v, (list, tuple)) and all(is_int(x) for x in v)}
    want = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
            "tuple": "a list of integers"}
    for k, v in vals.items():
        t = str(types[k])
        if t in ok and not ok[t](v):
            raise ValueError(f"config key {k!r} must be {want[t]}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Frozen model hyper-parameters in the reference's key names (docs/architecture.md,
    "Configuration").

    Build with :meth:`from_dict` / :meth:`from_json`; invalid values raise ``ValueError``.
    """

    vocab_size: int; dim: int; moe_inter_dim: int; n_layers: int; n_mtp_layers: int
    n_heads: int; n_routed_experts: int; n_shared_experts: int; n_activated_experts: int
    score_func: str; gate_temp: float; norm_topk_prob: bool; route_scale: float
    swiglu_limit: float; q_lora_rank: int; head_dim: int; rope_head_dim: int; norm_eps: float
    o_groups: int; o_lora_rank: int; window_size: int; compress_ratios: tuple
    kv_source_layers: tuple; index_source_layers: tuple; compress_rope_theta: float
    original_seq_len: int; rope_theta: float; rope_factor: float; beta_fast: int
    beta_slow: int; index_n_heads: int; index_head_dim: int; index_topk: int
    candidate_source_layer: int; candidate_topk_blocks: int; candidate_block_size: int
    hc_mult: int; hc_sinkhorn_iters: int; hc_eps: float; engram_layer_ids: tuple
    engram_num_embeddings: tuple; engram_max_ngram_size: int; engram_vocab_size: int
    engram_n_heads: int; engram_head_dim: int; engram_pad_id: int
    engram_compressed_vocab_size: int; vision_n_layers: int; vision_dim: int
    vision_n_heads: int; vision_inter_dim: int; vision_patch_size: int
    vision_rope_theta: float; vision_downsample_ratio: int; vision_max_n_token: int
    vision_min_pixels: int; vision_max_wh_ratio: Any; image_token_id: int
    dspark_block_size: int; dspark_noise_token_id: int; dspark_target_layer_ids: tuple
    dspark_markov_rank: int; dspark_n_routed_experts: int; dspark_n_activated_experts: int
    dtype: str; expert_dtype: Any; max_batch_size: int; max_seq_len: int; temperature: float

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Any) -> "ModelConfig":
        """From a flat reference ``config.json`` dict or the nested Hugging Face layout.

        ``d`` is a dict (anything else, e.g. a JSON list, raises ``ValueError``). Absent keys take
        the reference defaults. Raises ``ValueError`` for a value of the wrong type (naming the
        key), for a key that is neither a config key nor Hugging Face bookkeeping
        (``architectures``, ``model_type``, ...), naming it and the closest known key, and for
        inconsistent values (:meth:`validate`).
        """
        if not isinstance(d, dict):
            raise ValueError(f"a config must be a JSON object (dict), got {type(d).__name__}")
        d = dict(d)
        if "text_config" in d:  # nested Hugging Face layout
            _check_keys(d, _NESTED_SECTIONS | _METADATA_KEYS, "the top level")
            text = d["text_config"]
            _check_keys(text, set(_DEFAULTS) | set(_HF_NAMES) | _METADATA_KEYS | {"rope_scaling"},
                        "text_config")
            flat = {_HF_NAMES.get(k, k): v for k, v in text.items() if k not in _METADATA_KEYS}
            rs = flat.pop("rope_scaling", None) or {}
            for key, hf_key in (("rope_factor", "factor"), ("beta_fast", "beta_fast"),
                                ("original_seq_len", "original_max_position_embeddings"),
                                ("beta_slow", "beta_slow")):
                if rs.get(hf_key) is not None:
                    flat.setdefault(key, rs[hf_key])
            vc = {k if k.startswith("vision_") else f"vision_{k}": v
                  for k, v in (d.get("vision_config") or {}).items() if k not in _METADATA_KEYS}
            _check_keys(vc, {k for k in _DEFAULTS if k.startswith("vision_")}, "vision_config")
            for k, v in vc.items():
                flat.setdefault(k, v)
            qc = d.get("quantization_config") or {}
            if qc:
                flat.setdefault("dtype", "fp8" if qc.get("quant_method") == "fp8" else "bf16")
                flat.setdefault("expert_dtype", qc.get("expert_dtype"))
            d = flat
        else:
            _check_keys(d, set(_DEFAULTS) | _METADATA_KEYS, "the config")
        vals = {k: d.get(k, v) for k, v in _DEFAULTS.items()}
        _check_types(vals, {f.name: f.type for f in dataclasses.fields(cls)})
        for k in _TUPLE_KEYS:
            vals[k] = tuple(vals[k])
        cfg = cls(**vals)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        """:meth:`from_dict` of a JSON file; its ``ValueError`` messages start with the path."""
        try:
            with open(path) as f:
                d = json.load(f)
            return cls.from_dict(d)
        except ValueError as e:   # json.JSONDecodeError is a ValueError too
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def replace(self, **kw) -> "ModelConfig":
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent key."""
        def need(cond, msg):
            if not cond:
                raise ValueError(f"invalid ModelConfig: {msg}")

        n_all = self.n_layers + self.n_mtp_layers
        need(self.n_layers > 0, f"n_layers must be > 0, got {self.n_layers}")
        need(len(self.compress_ratios) >= self.n_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries, need >= n_layers="
             f"{self.n_layers} (n_layers + n_mtp_layers = {n_all})")
        need(all(r in (0, 1, 2, 4, 8, 128) for r in self.compress_ratios),
             f"compress_ratios entries must be 0 or a supported ratio, got {self.compress_ratios}")
        need(self.n_shared_experts == 1, "n_shared_experts must be 1 (asserted by the reference)")
        need(self.score_func in ("sqrtsoftplus", "softmax", "sigmoid"),
             f"score_func {self.score_func!r} is not one of sqrtsoftplus/softmax/sigmoid")
        need(self.n_activated_experts <= self.n_routed_experts,
             f"n_activated_experts={self.n_activated_experts} > n_routed_experts")
        need(self.rope_head_dim <= self.head_dim and self.rope_head_dim % 2 == 0,
             f"rope_head_dim={self.rope_head_dim} must be even and <= head_dim={self.head_dim}")
        need(self.head_dim % 32 == 0, f"head_dim={self.head_dim} must be a multiple of 32 "
             "(FP8 window KV scales per 32, FP4 main KV scales per 16)")
        need(self.index_head_dim % 32 == 0,
             f"index_head_dim={self.index_head_dim} must be a multiple of 32 (MXFP4 blocks)")
        need(self.dim % 32 == 0, f"dim={self.dim} must be a multiple of 32 (FP8 act blocks)")
        need((self.n_heads * self.head_dim) % self.o_groups == 0,
             f"n_heads*head_dim must divide into o_groups={self.o_groups}")
        need(self.n_heads % self.o_groups == 0, f"n_heads={self.n_heads} not divisible by "
             f"o_groups={self.o_groups}")
        need(self.window_size > 0, f"window_size must be > 0, got {self.window_size}")
        need(self.index_topk > 0, f"index_topk must be > 0, got {self.index_topk}")
        for i in self.kv_source_layers:
            need(0 <= i < self.n_layers and self.compress_ratios[i] > 0,
                 f"kv_source_layers entry {i} must be a backbone layer with compress_ratio > 0")
        for i in self.index_source_layers:
            need(0 <= i < self.n_layers and self.compress_ratios[i] > 0,
                 f"index_source_layers entry {i} must be a backbone layer with ratio > 0")
        for i in range(self.n_layers):
            r = self.compress_ratios[i]
            if r == 0:
                continue
            srcs = [j for j in self.kv_source_layers if j <= i]
            need(srcs, f"layer {i} has compress_ratio {r} but no KV source at or below it")
            need(self.compress_ratios[srcs[-1]] == r,
                 f"layer {i} (ratio {r}) reads KV source {srcs[-1]} of ratio "
                 f"{self.compress_ratios[srcs[-1]]}")
            isrc = [j for j in self.index_source_layers if j <= i]
            need(isrc, f"layer {i} has compress_ratio {r} but no index source at or below it")
            need(self.compress_ratios[isrc[-1]] == r,
                 f"layer {i} (ratio {r}) reads index source {isrc[-1]} of another ratio")
        if self.candidate_source_layer >= 0:
            c = self.candidate_source_layer
            need(c in self.kv_source_layers and c in self.index_source_layers,
                 f"candidate_source_layer {c} must be a KV and index source")
            need(self.candidate_block_size > 0 and self.candidate_topk_blocks > 0,
                 "candidate_block_size and candidate_topk_blocks must be > 0 when the "
                 "candidate pool is on")
            need(self.candidate_topk_blocks * self.candidate_block_size >= self.index_topk,
                 f"candidate pool of {self.candidate_topk_blocks} blocks x "
                 f"{self.candidate_block_size} cannot hold index_topk={self.index_topk} entries")
        need(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
             "engram_num_embeddings must have one entry per engram_layer_ids entry")
        if self.engram_layer_ids:
            need(self.engram_max_ngram_size >= 2, "Engram needs engram_max_ngram_size >= 2")
            need(self.engram_head_dim % 32 == 0, "engram_head_dim must be a multiple of 32")
        need(self.dtype in ("fp8", "bf16"), f"dtype must be 'fp8' or 'bf16', got {self.dtype!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def n_all_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    @property
    def dspark_on(self) -> bool:
        """Whether the DSpark draft head is built (``dspark_block_size > 0`` and at least one
        stage), as the reference decides."""
        return self.dspark_block_size > 0 and self.n_mtp_layers > 0

    @property
    def dspark_experts(self) -> tuple[int, int]:
        """``(routed, activated)`` experts of the DSpark stages: the ``dspark_*`` values, each
        falling back to the backbone's when 0 (the reference's ``get_moe_config``)."""
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def kv_bytes_per_entry(self) -> dict:
        """Packed bytes of one global entry: main KV and indexer K (docs/architecture.md,
        "Bytes per token")."""
        k, j = self.head_dim, self.index_head_dim
        return {"main_kv": k // 2 + k // 16, "index_k": j // 2 + j // 32}


@dataclasses.dataclass(frozen=True)
class LayerRole:
    """What one backbone layer does (docs/architecture.md, "Layer schedule")."""

    layer: int
    mode: str            # "swa" | "full" | "reindex" | "reuse"
    ratio: int           # 0 for SWA-only
    kv_layer: int        # layer whose main KV it reads (-1 for SWA-only)
    index_layer: int     # layer whose top-k it reads / publishes (-1 for SWA-only)
    owns_kv: bool        # KV source: compressor + indexer K
    owns_index: bool     # index source: indexer wq_b + weights_proj
    uses_candidates: bool
    is_candidate_source: bool
    engram: bool
    rope: str            # "base" (rope_theta, no YaRN) | "compress" (compress theta + YaRN)
    is_decoder: bool     # CED: runs on the bounded replay in prefill


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Per-layer roles of a config, and the CED split (docs/architecture.md, "Layer schedule"
    and "CED prefill and bounded replay")."""

    roles: tuple
    decoder_start: int   # first decoder layer (the ratio-1 KV source); n_layers if none

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "LayerPlan":
        roles = []
        ratio1 = [i for i in cfg.kv_source_layers if cfg.compress_ratios[i] == 1]
        dec = ratio1[0] if ratio1 else cfg.n_layers
        for i in range(cfg.n_layers):
            r = cfg.compress_ratios[i]
            owns_kv = i in cfg.kv_source_layers
            owns_index = i in cfg.index_source_layers
            if r == 0:
                mode, kvl, idxl = "swa", -1, -1
            else:
                kvl = max(j for j in cfg.kv_source_layers if j <= i)
                idxl = max(j for j in cfg.index_source_layers if j <= i)
                mode = "full" if owns_kv else ("reindex" if owns_index else "reuse")
            cand_src = i == cfg.candidate_source_layer
            uses_cand = owns_index and 0 <= cfg.candidate_source_layer < i
            roles.append(LayerRole(
                layer=i, mode=mode, ratio=r, kv_layer=kvl, index_layer=idxl, owns_kv=owns_kv,
                owns_index=owns_index, uses_candidates=uses_cand, is_candidate_source=cand_src,
                engram=i in cfg.engram_layer_ids, rope="compress" if r > 0 else "base",
                is_decoder=i >= dec))
        return cls(tuple(roles), dec)

    @property
    def kv_sources(self) -> tuple:
        return tuple(r.layer for r in self.roles if r.owns_kv)

    @property
    def groups(self) -> tuple:
        """The layers as :class:`LayerGroup` s, in order (docs/architecture.md, "Scanned layer
        groups")."""
        return layer_groups(self)

    def __getitem__(self, i: int) -> LayerRole:
        return self.roles[i]

    def __len__(self) -> int:
        return len(self.roles)


def yarn_correction_range(cfg: ModelConfig) -> tuple[int, int]:
    """YaRN ``(low, high)`` pair indices for the compress RoPE table (docs/architecture.md,
    "Rotary embedding")."""
    dim, base = cfg.rope_head_dim, cfg.compress_rope_theta

    def cd(rho):
        return dim * math.log(cfg.original_seq_len / (rho * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(cd(cfg.beta_fast)), 0)
    high = min(math.ceil(cd(cfg.beta_slow)), dim - 1)
    return low, high


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Consecutive *units* of identical structure, run as one ``lax.scan`` over parameters and
    state slices stacked along the units (docs/architecture.md, "Scanned layer groups").

    A unit is a layer that is not Reuse (SWA-only, Full, Reindex) and the Reuse layers after
    it; inside a unit, a *run* of consecutive layers of the same role is one inner scan.
    """

    units: tuple         # layer ids, [U][unit length]
    runs: tuple          # (start, length) of each run inside a unit

    @property
    def layers(self) -> tuple:
        return tuple(i for u in self.units for i in u)

    @property
    def head(self) -> int:
        """The first layer of the first unit."""
        return self.units[0][0]


def _layer_signature(role: LayerRole, unit: tuple) -> tuple:
    """What must agree for two layers to share one compiled body: the role without the layer
    ids, with the KV source it reads as an offset inside its unit (or the absolute layer when
    the source is outside the unit: every unit then reads that same source)."""
    kv = ("unit", role.kv_layer - unit[0]) if role.kv_layer in unit else ("layer", role.kv_layer)
    return (role.mode, role.ratio, kv, role.owns_kv, role.owns_index, role.uses_candidates,
            role.is_candidate_source, role.engram, role.rope, role.is_decoder)


def layer_groups(plan: "LayerPlan") -> tuple:
    """Split the layers into units and merge consecutive units of the same structure into
    :class:`LayerGroup` s. A unit holding an Engram layer or the candidate source stays alone
    (it differs from every other one)."""
    units: list[list[int]] = []
    for role in plan.roles:
        if role.mode != "reuse" or not units or role.layer == plan.decoder_start:
            units.append([role.layer])
        else:
            units[-1].append(role.layer)

    def structure(unit):
        sig = tuple(_layer_signature(plan[i], tuple(unit)) for i in unit)
        alone = any(plan[i].engram or plan[i].is_candidate_source for i in unit)
        return (sig, unit[0] if alone else None)

    def runs_of(sig):
        runs, start = [], 0
        for j in range(1, len(sig) + 1):
            if j == len(sig) or sig[j] != sig[start] or start == 0:
                # the unit head is always a run of its own
                runs.append((start, j - start))
                start = j
        return tuple(runs)

    groups: list[LayerGroup] = []
    prev = None
    for unit in units:
        st = structure(unit)
        if prev is not None and st == prev:
            g = groups[-1]
            groups[-1] = LayerGroup(g.units + (tuple(unit),), g.runs)
        else:
            groups.append(LayerGroup((tuple(unit),), runs_of(st[0])))
        prev = st
    return tuple(groups)
