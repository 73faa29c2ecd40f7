"""Seeded random weights in the reference checkpoint format (names, dtypes, FP8/FP4 packing).

For demos and tests without a real checkpoint: the tensors go through the same loader
(:func:`dsv41_jax.checkpoint.params_from_tensors`) as a real checkpoint. Scales follow the
fixtures' recipe (linear weights N(0, 1/fan_in), norms 1 + N(0, 0.1), ...), so activations stay
O(1) through the stack. They are not trained: generated text is noise.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dsv41_jax.checkpoint import expected_tensors
from dsv41_jax.config import ModelConfig

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _pow2_ceil(x):
    return np.exp2(np.ceil(np.log2(np.maximum(x, 1e-30)))).astype(np.float32)


def _fp8_blocks(w: np.ndarray):
    """[out, in] fp32 -> (e4m3 [out, in], e8m0 bytes [ceil(out/32), ceil(in/32)])."""
    o, i = w.shape
    go, gi = -(-o // 32), -(-i // 32)
    pad = np.zeros((go * 32, gi * 32), np.float32)
    pad[:o, :i] = w
    amax = np.abs(pad.reshape(go, 32, gi, 32)).max(axis=(1, 3))
    s = _pow2_ceil(np.maximum(amax, 1e-12) / 448.0)
    q = (pad.reshape(go, 32, gi, 32) / s[:, None, :, None]).reshape(go * 32, gi * 32)[:o, :i]
    e = (np.log2(s) + 127).astype(np.uint8)
    return np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn), e


def _fp4_rows(w: np.ndarray):
    """[out, in] fp32 -> (packed e2m1 uint8 [out, in/2], e8m0 bytes [out, in/32])."""
    o, i = w.shape
    b = w.reshape(o, i // 32, 32)
    s = _pow2_ceil(np.maximum(np.abs(b).max(-1), 1e-12) / 6.0)
    v = np.clip(b / s[..., None], -6, 6).reshape(o, i)
    idx = np.abs(np.abs(v)[..., None] - _E2M1).argmin(-1).astype(np.uint8)
    code = idx | ((v < 0).astype(np.uint8) << 3)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.astype(np.uint8), (np.log2(s) + 127).astype(np.uint8)


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor :func:`expected_tensors` lists, filled with seeded random values."""
    rng = np.random.default_rng(seed)
    exp = expected_tensors(cfg)
    out: dict[str, np.ndarray] = {}
    done = set()
    for name, (shape, dtypes) in exp.items():
        if name in done:
            continue
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{base}.scale" in exp:
            sshape = exp[f"{base}.scale"][0]
            if name.endswith("engram.embed.weight"):   # fp8 rows, one scale per 32 of a row
                v = rng.standard_normal(shape).astype(np.float32)
                b = v.reshape(shape[0], -1, 32)
                sc = _pow2_ceil(np.maximum(np.abs(b).max(-1), 1e-12) / 448.0)
                out[name] = (b / sc[..., None]).reshape(shape).astype(ml_dtypes.float8_e4m3fn)
                out[f"{base}.scale"] = (np.log2(sc) + 127).astype(np.uint8)
            elif dtypes == ("uint8",):          # packed FP4 expert
                o, i = shape[0], shape[1] * 2
                gain = 1.0 if ".w2." not in name else 0.5
                w = rng.standard_normal((o, i)).astype(np.float32) * gain / np.sqrt(i)
                out[name], out[f"{base}.scale"] = _fp4_rows(w)
            else:
                o, i = shape
                gain = 2.5 if name.endswith("wo_b.weight") else 1.0
                w = rng.standard_normal((o, i)).astype(np.float32) * gain / np.sqrt(i)
                out[name], out[f"{base}.scale"] = _fp8_blocks(w)
                assert out[f"{base}.scale"].shape == tuple(sshape)
            done |= {name, f"{base}.scale"}
            continue
        if "norm" in name and name.endswith(".weight"):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("attn_sink"):
            v = 0.5 * rng.standard_normal(shape)
        elif "hc_" in name and name.endswith("_fn"):
            v = rng.standard_normal(shape) / np.sqrt(4 * shape[1])
        elif "hc_" in name and name.endswith("_base"):
            v = 0.5 * rng.standard_normal(shape)
        elif "hc_" in name and name.endswith("_scale"):
            v = np.abs(1.0 + 0.25 * rng.standard_normal(shape))
        elif name.endswith("gate.bias"):
            v = 0.1 * rng.standard_normal(shape)
        elif name in ("embed.weight",) or name.endswith(("q_weight", "k_weight")):
            v = rng.standard_normal(shape)
        else:  # plain linear weights [out, in] (head, gate, indexer, compressor)
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        dt = np.float32 if dtypes[0] == "float32" else ml_dtypes.bfloat16
        out[name] = np.asarray(v, np.float32).astype(dt)
        done.add(name)
    return out
