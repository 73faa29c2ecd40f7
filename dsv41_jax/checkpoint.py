"""Reading reference-format checkpoints (safetensors in the reference's names and dtypes).

The raw reader returns numpy arrays in storage dtypes that JAX understands:
``BF16 -> bfloat16``, ``F32 -> float32``, ``F8_E4M3 -> float8_e4m3fn``,
``F8_E8M0 -> uint8`` (the exponent byte, value ``2**(u-127)``), ``I8 -> uint8`` (packed e2m1,
two codes per byte). See docs/architecture.md, "Quantised linears", "Number formats" and
"Checkpoint format and load-time conversions".
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": np.uint8, "I8": np.uint8, "U8": np.uint8,
    "I32": np.int32, "I64": np.int64,
}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as numpy arrays in their storage dtypes.

    Raises ``ValueError`` for a dtype this model never stores.
    """
    with open(path, "rb") as f:
        entries = safetensors.deserialize(f.read())
    out = {}
    for name, spec in entries:
        dt = _DTYPES.get(spec["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {spec['dtype']}")
        out[name] = np.frombuffer(spec["data"], dtype=dt).reshape(spec["shape"])
    return out


def nest(flat: dict[str, Any]) -> dict:
    """``{"layers.0.attn.wq_a.weight": a}`` -> ``{"layers": {0: {"attn": {"wq_a": {...}}}}}``.

    The leaves are kept as they are (numpy or device arrays). Numeric path components become
    int keys (use :func:`as_list` to turn them into lists).
    """
    root: dict = {}
    for name, arr in flat.items():
        node = root
        parts = [int(p) if p.isdigit() else p for p in name.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = arr
    return root


# ----------------------------------------------------------------------------- expected layout


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_tensors(cfg) -> dict[str, tuple[tuple, tuple]]:
    """Every text-model tensor the reference format holds: name -> (shape, allowed dtypes).

    The reference's names, shapes and dtypes per layer kind (docs/architecture.md,
    "Checkpoint format and load-time conversions"), scaled by ``cfg``. DSpark (``mtp.*``) and
    vision tensors are not listed (they are optional for the text model).
    """
    from dsv41_jax.config import LayerPlan

    plan = LayerPlan.from_config(cfg)
    D, H, K, Q = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    G, O, I, J = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    E, F, C = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.hc_mult
    fp8 = cfg.dtype == "fp8"
    fp4 = cfg.expert_dtype == "fp4"
    bf16, f32, f8, e8, i8 = ("bfloat16",), ("float32",), ("float8_e4m3fn",), ("uint8",), ("uint8",)
    out: dict = {}

    def lin(name, o, i, quantized=fp8):
        if quantized:
            out[f"{name}.weight"] = ((o, i), f8)
            out[f"{name}.scale"] = ((_cdiv(o, 32), _cdiv(i, 32)), e8)
        else:
            out[f"{name}.weight"] = ((o, i), bf16)

    out["embed.weight"] = ((cfg.vocab_size, D), bf16)
    out["norm.weight"] = ((D,), bf16)
    out["head.weight"] = ((cfg.vocab_size, D), bf16 + f32)
    for role in plan.roles:
        p = f"layers.{role.layer}"
        out[f"{p}.attn.attn_sink"] = ((H,), f32)
        lin(f"{p}.attn.wq_a", Q, D)
        out[f"{p}.attn.q_norm.weight"] = ((Q,), bf16)
        lin(f"{p}.attn.wq_b", H * K, Q)
        lin(f"{p}.attn.wkv", K, D)
        out[f"{p}.attn.kv_norm.weight"] = ((K,), bf16)
        lin(f"{p}.attn.wo_a", G * O, H * K // G)
        lin(f"{p}.attn.wo_b", D, G * O)
        out[f"{p}.attn_norm.weight"] = ((D,), bf16)
        out[f"{p}.ffn_norm.weight"] = ((D,), bf16)
        for h in ("attn", "ffn"):
            out[f"{p}.hc_{h}_fn"] = (((2 + C) * C, C * D), f32)
            out[f"{p}.hc_{h}_base"] = (((2 + C) * C,), f32)
            out[f"{p}.hc_{h}_scale"] = ((3,), f32)
        out[f"{p}.ffn.gate.weight"] = ((E, D), bf16)
        out[f"{p}.ffn.gate.bias"] = ((E,), f32)
        for e in range(E):
            for w, (o, i) in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
                n = f"{p}.ffn.experts.{e}.{w}"
                if fp4:
                    out[f"{n}.weight"] = ((o, i // 2), i8)
                    out[f"{n}.scale"] = ((o, i // 32), e8)
                else:
                    lin(n, o, i)
        lin(f"{p}.ffn.shared_experts.w1", F, D)
        lin(f"{p}.ffn.shared_experts.w3", F, D)
        lin(f"{p}.ffn.shared_experts.w2", D, F)
        if role.owns_index:
            lin(f"{p}.attn.indexer.wq_b", I * J, Q)
            out[f"{p}.attn.indexer.weights_proj.weight"] = ((I, D), bf16)
        if role.owns_kv:
            out[f"{p}.attn.compressor.wkv.weight"] = ((K, D), bf16 + f32)
            if role.ratio > 1:
                out[f"{p}.attn.compressor.wgate.weight"] = ((K, D), bf16 + f32)
            out[f"{p}.attn.compressor.norm.weight"] = ((K,), bf16)
            out[f"{p}.attn.indexer.wk.weight"] = ((J, K), bf16)
            out[f"{p}.attn.indexer.k_norm.weight"] = ((J,), bf16)
    for k, layer in enumerate(cfg.engram_layer_ids):
        p = f"layers.{layer}.engram"
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        rows, hd = cfg.engram_num_embeddings[k], cfg.engram_head_dim
        out[f"{p}.embed.weight"] = ((rows, hd), f8)
        out[f"{p}.embed.scale"] = ((rows, hd // 32), e8)
        lin(f"{p}.wkv", (C + 1) * D, cols * hd, quantized=True)
        out[f"{p}.q_weight"] = ((C, D), bf16)
        out[f"{p}.k_weight"] = ((C, D), bf16)
    return out


def validate_tensors(flat: dict[str, np.ndarray], cfg) -> None:
    """Raise ``ValueError`` naming the first missing tensor or wrong shape / dtype."""
    exp = expected_tensors(cfg)
    missing = [n for n in exp if n not in flat]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    for name, (shape, dtypes) in exp.items():
        a = flat[name]
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(a.shape)}, expected "
                             f"{tuple(shape)}")
        if str(a.dtype) not in dtypes:
            raise ValueError(f"checkpoint tensor {name!r} has dtype {a.dtype}, expected one of "
                             f"{dtypes}")


# ----------------------------------------------------------------------------- loading


def read_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (every ``*.safetensors`` in it) or one file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"checkpoint directory {path!r} holds no *.safetensors file")
        flat: dict = {}
        for f in files:
            flat.update(read_safetensors(os.path.join(path, f)))
        return flat
    return read_safetensors(path)


def engram_params(cfg, tokenizer_map=None) -> dict:
    """``engram_token_map`` (int32 [V]) and the hashing constants of the Engram layers
    (docs/architecture.md, "Engram").

    ``tokenizer_map`` defaults to the compressed map built from the real tokenizer. Raises
    ``ValueError`` if its number of ids is not ``cfg.engram_compressed_vocab_size``.
    """
    import jax.numpy as jnp

    from dsv41_jax.layers import engram as engram_layer
    if tokenizer_map is None:
        from dsv41_jax import tokenizer as tok
        tokenizer_map = tok.build_compressed_token_map(tok.load_tokenizer())
    if len(np.unique(tokenizer_map)) != cfg.engram_compressed_vocab_size:
        raise ValueError(f"compressed token map has {len(np.unique(tokenizer_map))} ids, "
                         f"config says engram_compressed_vocab_size="
                         f"{cfg.engram_compressed_vocab_size}")
    consts = engram_layer.engram_constants(cfg, tokenizer_map)
    return {"engram_token_map": jnp.asarray(tokenizer_map, jnp.int32),
            "engram_consts": {k: jnp.asarray(v) for k, v in
                              engram_layer.engram_hash_constants(consts).items()}}


def params_from_tensors(flat: dict[str, np.ndarray], cfg, tokenizer_map=None) -> dict:
    """Reference tensors -> the model's parameter pytree, with the load-time conversions
    (docs/architecture.md, "Checkpoint format and load-time conversions"): experts stacked
    (packed FP4 kept), ``wo_a`` dequantised to bf16, the BF16-stored fp32 tensors upcast (head,
    ratio-2 compressor). Validates names and shapes first.
    """
    import jax.numpy as jnp

    from dsv41_jax import quant
    from dsv41_jax.config import LayerPlan

    validate_tensors(flat, cfg)
    plan = LayerPlan.from_config(cfg)
    tree = nest({k: v for k, v in flat.items() if not k.startswith("mtp.")})

    def conv(x):
        return jnp.asarray(x) if isinstance(x, np.ndarray) else {k: conv(v) for k, v in x.items()}

    params: dict = {"embed": conv(tree["embed"]), "norm": conv(tree["norm"]),
                    "head": {"weight": jnp.asarray(tree["head"]["weight"], jnp.float32)}}
    layers = []
    for role in plan.roles:
        lt = tree["layers"][role.layer]
        lp = {k: conv(v) for k, v in lt.items() if k not in ("ffn",)}
        wo_a = lp["attn"]["wo_a"]
        if "scale" in wo_a:
            lp["attn"]["wo_a"] = {"weight": quant.dequant_fp8_weight(wo_a["weight"], wo_a["scale"])}
        if role.owns_kv and role.ratio > 1:
            comp = lp["attn"]["compressor"]
            for w in ("wkv", "wgate"):
                comp[w] = {"weight": comp[w]["weight"].astype(jnp.float32)}
        ffn = lt["ffn"]
        experts = [ffn["experts"][e] for e in range(cfg.n_routed_experts)]
        stacked = {w: {k: jnp.asarray(np.stack([ex[w][k] for ex in experts]))
                       for k in experts[0][w]} for w in ("w1", "w2", "w3")}
        lp["ffn"] = {"gate": conv(ffn["gate"]), "experts": stacked,
                     "shared_experts": conv(ffn["shared_experts"])}
        layers.append(lp)
    params["layers"] = layers
    if cfg.engram_layer_ids:
        params.update(engram_params(cfg, tokenizer_map))
    for name in ("image_start", "image_end", "image_newline"):
        if name in tree:
            params[name] = jnp.asarray(tree[name])
    if "vision" in tree:
        params["vision"] = conv(tree["vision"])
        params["aligner"] = conv(tree["aligner"])
    return params


def load_params(path: str | os.PathLike, cfg=None):
    """Load a reference-format checkpoint directory (``config.json`` + ``*.safetensors``).

    Returns ``(cfg, params)``. Raises ``ValueError`` naming a missing or mis-shaped tensor.
    """
    from dsv41_jax.config import ModelConfig

    if cfg is None:
        cfg = ModelConfig.from_json(os.path.join(path, "config.json"))
    return cfg, params_from_tensors(read_checkpoint(path), cfg)
